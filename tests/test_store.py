import os
import sqlite3

import pytest

from gpuguard.store import NAMED_SETS_VERSION, StoreError, open_store


def test_created_with_mode_wal_and_version(tmp_path):
    p = tmp_path / "sub" / "node.db"
    s = open_store(str(p))
    assert oct(os.stat(p).st_mode & 0o777) == "0o640"
    assert s.db.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert s.db.conn.execute("PRAGMA user_version").fetchone()[0] == NAMED_SETS_VERSION
    assert {"inventory", "inventory_changes", "health_runs", "findings", "events", "cursors",
            "gpu_counters", "samples", "host_samples"} <= set(s.db.table_names())
    s.close()
    # reopening applies nothing and keeps data
    s = open_store(str(p))
    s.set_cursor("kernel_log", "abc")
    s.close()
    assert open_store(str(p)).get_cursor("kernel_log") == "abc"


def test_newer_schema_refused(tmp_path):
    p = tmp_path / "node.db"
    conn = sqlite3.connect(p)
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    with pytest.raises(StoreError, match="schema version 99 is newer than this gpuguard"):
        open_store(str(p))


def test_corrupt_file(tmp_path):
    p = tmp_path / "node.db"
    p.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match=f"store {p}: cannot open: file is not a database"):
        open_store(str(p))


def test_unwritable_directory(tmp_path):
    with pytest.raises(StoreError, match="cannot create"):
        open_store("/proc/gpuguard/node.db")


def test_counters_roundtrip(tmp_path):
    s = open_store(str(tmp_path / "n.db"))
    s.set_counters("n1", {"GPU-a": {"pcie_replay_count": 5}})
    s.set_counters("n1", {"GPU-a": {"pcie_replay_count": 7}})
    assert s.get_counters("n1") == {"GPU-a": {"pcie_replay_count": 7}}
    assert s.get_counters("n2") == {}


def test_failed_transaction_keeps_old_rows(tmp_path):
    s = open_store(str(tmp_path / "n.db"))
    s.insert("cursors", {"name": "a", "value": "1", "updated_at": 1.0})
    with pytest.raises(StoreError, match="insert into cursors failed: UNIQUE constraint"):
        s.insert_many("cursors", [{"name": "b", "value": "2", "updated_at": 1.0},
                                  {"name": "a", "value": "dup", "updated_at": 1.0}])
    assert s.query("select name, value from cursors order by name") == [{"name": "a", "value": "1"}]


def test_concurrent_first_open_migrates_once(tmp_path):
    """Prolog and collector may create the store at the same moment."""
    import multiprocessing

    p = str(tmp_path / "race.db")
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(6) as pool:
        results = pool.map(_open_and_report, [p] * 12)
    assert results == ["ok"] * 12
    assert open_store(p).db.conn.execute("PRAGMA user_version").fetchone()[0] == NAMED_SETS_VERSION


def _open_and_report(path):
    try:
        open_store(path).close()
        return "ok"
    except StoreError as e:
        return str(e)
