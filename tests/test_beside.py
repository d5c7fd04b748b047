"""gpuguard.beside: a read on a second, read-only connection in a thread, its value or
its error handed back; on the caller's store when no second connection can be opened."""

from __future__ import annotations

import sqlite3
import threading

import pytest

from gpuguard.beside import Beside
from gpuguard.store import open_store


def test_reads_committed_rows_on_another_connection_and_thread(tmp_path):
    s = open_store(str(tmp_path / "n.db"))
    s.insert_many("events", [{"node": "n1", "at": 1.0 + i, "kind": "xid", "code": 79} for i in range(3)])
    seen = {}
    caller_conn = s.db.conn

    def read(reader):
        seen["thread"] = threading.current_thread().name
        seen["same_conn"] = reader.db.conn is caller_conn
        return reader.db.conn.execute("select count(*) from events").fetchone()[0]

    assert Beside(s, read).result() == 3
    assert seen == {"thread": "gpuguard-beside", "same_conn": False}
    with pytest.raises(sqlite3.OperationalError, match="readonly"):  # the reader never writes
        Beside(s, lambda r: r.db.conn.execute("delete from events")).result()
    with pytest.raises(ZeroDivisionError):
        Beside(s, lambda r: 1 / 0).result()
    s.close()


def test_runs_on_the_callers_store_when_no_second_connection_opens(tmp_path):
    class NoFile:
        path = str(tmp_path / "gone.db")  # a store whose file cannot be opened again

    caller = NoFile()
    got = []
    assert Beside(caller, lambda r: got.append(r) or "done").result() == "done"
    assert got == [caller]
