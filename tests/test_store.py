import os
import sqlite3

import pytest

from gpuguard import store as store_mod
from gpuguard.store import NAMED_SETS_VERSION, StoreError, open_store


def test_created_with_mode_wal_and_version(tmp_path):
    p = tmp_path / "sub" / "node.db"
    s = open_store(str(p))
    assert oct(os.stat(p).st_mode & 0o777) == "0o640"
    assert s.db.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert s.db.conn.execute("PRAGMA user_version").fetchone()[0] == NAMED_SETS_VERSION
    assert {"inventory", "inventory_changes", "health_runs", "findings", "events", "cursors",
            "gpu_counters", "gpu_series", "gpu_samples", "gpu_slow", "gpu_minutes", "host_samples"} <= set(
                s.db.table_names())
    assert "samples" in s.db.view_names()
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


def test_old_samples_table_migrates_to_the_compact_store(tmp_path):
    """The collector set's ``compact_samples`` step (gpuguard.samples_schema.migrate) on a store
    holding the wide ``samples`` table: rows move into the compact tables, values scaled as
    the metric table says, and the old query shape still answers."""
    import sqlite3

    from gpuguard import samples_schema
    from gpuguard.collector import schema as collector_schema

    p = str(tmp_path / "old.db")
    conn = sqlite3.connect(p, isolation_level=None)
    db = store_mod.sqlite_utils.Database(conn)
    collector_schema._samples(db)
    collector_schema._samples_by_gpu(db)
    conn.executemany(
        "insert into samples (job_id, node, at, gpu_index, gpu_uuid, gpu_util_pct, mem_util_pct, mem_used_mib, "
        "power_w, temp_c, sm_clock_mhz, mem_clock_mhz, clock_event_mask, ecc_volatile_uncorrected, "
        "pcie_replay_count) values (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
        [("9", "n1", 1000.25, 0, "GPU-a", 97.0, 41.0, 60000.4, 612.34, 71.0, 1980.0, 2619.0, 4, 0, 3),
         ("9", "n1", 1001.25, 0, "GPU-a", 98.0, 42.0, 60001.0, 600.0, 72.0, 1975.0, 2619.0, 0, None, None)])
    conn.execute("begin")
    samples_schema.migrate(conn)
    conn.execute("commit")
    rows = lambda sql: [dict(zip([c[0] for c in cur.description], r, strict=True))  # noqa: E731
                        for cur in [conn.execute(sql)] for r in cur.fetchall()]
    assert rows("select id, job_id, node, gpu_index, gpu_uuid, t0 from gpu_series") == [
        {"id": 1, "job_id": "9", "node": "n1", "gpu_index": 0, "gpu_uuid": "GPU-a", "t0": 1000.25}]
    assert rows("select at, gpu_util_pct, mem_util_pct, mem_used_mib, power_w, clock_event_mask, "
                "ecc_volatile_uncorrected, pcie_replay_count from samples order by at") == [
        {"at": 1000.25, "gpu_util_pct": 97, "mem_util_pct": 41, "mem_used_mib": 60000, "power_w": 612.3,
         "clock_event_mask": 4, "ecc_volatile_uncorrected": 0, "pcie_replay_count": 3},
        {"at": 1001.25, "gpu_util_pct": 98, "mem_util_pct": 42, "mem_used_mib": 60001, "power_w": 600.0,
         "clock_event_mask": 0, "ecc_volatile_uncorrected": None, "pcie_replay_count": None}]
    assert [r[0] for r in conn.execute("select type from sqlite_master where name = 'samples'")] == ["view"]
    conn.close()


def test_add_missing_columns_follows_the_metric_table(tmp_path, monkeypatch):
    """A metric-table row added later becomes a column (old rows NULL) and a view column."""
    from gpuguard import metrics, samples_schema

    s = open_store(str(tmp_path / "n.db"))
    s.insert_many("samples", [{"job_id": "1", "node": "n1", "at": 1000.0, "gpu_index": 0, "gpu_util_pct": 50.0}])
    new = metrics.Metric("enc_util_pct", "%", "gpu", "nvmlDeviceGetEncoderUtilization", 1, ("mean",), ".1f",
                         "video encoder utilisation")
    monkeypatch.setattr(samples_schema, "GPU_SAMPLED", (*samples_schema.GPU_SAMPLED, new))
    with s.tx():
        assert samples_schema.add_missing_columns(s.db.conn) == [
            "gpu_samples.enc_util_pct", "gpu_minutes.enc_util_pct_mean", "gpu_minutes.enc_util_pct_dmin",
            "gpu_minutes.enc_util_pct_dmax"]
    assert s.query("select gpu_util_pct, enc_util_pct from samples") == [{"gpu_util_pct": 50, "enc_util_pct": None}]
    s.close()
