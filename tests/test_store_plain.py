"""The store's recording path on plain sqlite3: inserts, upserts, cursors, counters,
queries and nested transactions give exact rows, and a process that records into an
up-to-date store (the Prolog's healthy path) never imports sqlite-utils (about 86 ms of
its import time, bench/prolog_healthy.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gpuguard.store import StoreError, open_store

SCRIPT = r"""
import sys
import gpuguard.prolog.hook, gpuguard.health, gpuguard.net, gpuguard.ops.schema  # noqa
import gpuguard.collector.schema, gpuguard.epilog.schema  # noqa: every stage's set, registered
from gpuguard.store import open_store
s = open_store(sys.argv[1])
rid = s.insert("health_runs", {"node": "n1", "hook": "prolog", "job_id": "1", "decision": "proceed"})
s.insert_many("findings", [{"run_id": rid, "node": "n1", "code": "x.y", "severity": "info"}])
s.set_cursor("kernel_log", "42")
s.set_counters("n1", {"GPU-0": {"ecc": 1}})
s.upsert_many("inventory", [{"node": "n1", "uuid": "GPU-0", "gpu_index": 0}], pk=("node", "uuid"))
assert s.query("select count(*) as n from health_runs") == [{"n": 1}]
s.close()
print("sqlite_utils" in sys.modules)
"""


def test_recording_into_an_up_to_date_store_does_not_import_sqlite_utils(tmp_path):
    db = str(tmp_path / "node.db")
    # every stage's set registered, as in the subprocess
    import gpuguard.collector.schema
    import gpuguard.epilog.schema
    import gpuguard.net
    import gpuguard.ops.schema  # noqa: F401

    open_store(db).close()  # created and migrated (that imports sqlite-utils, once per store)
    p = subprocess.run([sys.executable, "-c", SCRIPT, db], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ))
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["False"]


def test_plain_rows_exact(tmp_path):
    s = open_store(str(tmp_path / "node.db"))
    s.set_cursor("kernel_log", "10")
    s.set_cursor("kernel_log", "20")  # the same key: updated, not added
    assert [(r["name"], r["value"]) for r in s.query("select * from cursors")] == [("kernel_log", "20")]
    s.upsert_many("inventory", [{"node": "n1", "uuid": "GPU-0", "gpu_index": 0, "first_seen": 1.0, "last_seen": 1.0},
                                {"node": "n1", "uuid": "GPU-1", "gpu_index": 1, "first_seen": 1.0, "last_seen": 1.0}],
                  pk=("node", "uuid"))
    s.upsert_many("inventory", [{"node": "n1", "uuid": "GPU-0", "last_seen": 5.0}], pk=("node", "uuid"))
    assert s.query("select uuid, gpu_index, first_seen, last_seen from inventory order by uuid") == [
        {"uuid": "GPU-0", "gpu_index": 0, "first_seen": 1.0, "last_seen": 5.0},  # columns not given are kept
        {"uuid": "GPU-1", "gpu_index": 1, "first_seen": 1.0, "last_seen": 1.0}]
    # rows with different keys, and a value plain SQL cannot bind (a dict: sqlite-utils stores JSON)
    s.insert_many("events", [{"node": "n1", "kind": "xid", "code": 79}, {"node": "n1", "kind": "sxid"}])
    s.insert("events", {"node": "n1", "kind": "note", "raw": {"a": 1}})
    assert [(r["kind"], r["code"], r["raw"]) for r in s.query("select * from events order by id")] == [
        ("xid", 79, None), ("sxid", None, None), ("note", None, '{"a": 1}')]
    # a failing nested transaction rolls back only itself
    with s.tx():
        s.insert("cursors", {"name": "a", "value": "1"})
        with pytest.raises(StoreError), s.tx():
            s.insert("cursors", {"name": "b", "value": "2"})
            s.insert("cursors", {"name": "a", "value": "3"})  # primary key taken
    assert [r["name"] for r in s.query("select name from cursors order by name")] == ["a", "kernel_log"]
    with pytest.raises(StoreError, match="query failed"):
        s.query("select nope from cursors")
    s.close()
