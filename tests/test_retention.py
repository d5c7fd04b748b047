"""Tiered retention (gpuguard.retention) and `gpuguard store prune`: exact folded minutes,
what is deleted and what is kept."""

import json

import pytest
from click.testing import CliRunner

from gpuguard.cli import main
from gpuguard.retention import DAY_S, prune
from gpuguard.store import open_store

NOW = 1_764_460_800.0  # 2025-11-30 00:00 UTC, a whole minute
OLD = NOW - 20 * DAY_S  # past raw_days=14


@pytest.fixture
def store(tmp_path):
    s = open_store(str(tmp_path / "node.db"))
    rows = []
    for i in range(120):  # two minutes of 1 s samples, 20 days ago
        rows.append({"job_id": "1", "node": "n1", "at": OLD + i, "gpu_index": 0, "gpu_uuid": "GPU-a",
                     "gpu_util_pct": float(i % 60), "mem_util_pct": 10.0, "mem_used_mib": 1000.0 + i,
                     "power_w": 300.0 + (i % 2) * 0.5, "temp_c": 50.0, "sm_clock_mhz": 1980.0,
                     "clock_event_mask": 0x4 if i in (3, 70) else 0,
                     "ecc_volatile_uncorrected": 0 if i == 0 else None})
    rows += [{"job_id": "2", "node": "n1", "at": NOW - 100 + i, "gpu_index": 0, "gpu_util_pct": 50.0}
             for i in range(10)]  # a recent job: kept raw
    s.insert_many("samples", rows)
    s.insert_many("host_samples", [{"job_id": "1", "node": "n1", "at": OLD, "cpu_pct": 1.0, "rss_mib": 1.0},
                                   {"job_id": "2", "node": "n1", "at": NOW - 50, "cpu_pct": 1.0, "rss_mib": 1.0}])
    s.insert("job_summaries", {"job_id": "1", "node": "n1", "created_at": OLD + 200, "summary": "{}"})
    s.insert("events", {"node": "n1", "at": OLD, "kind": "xid", "code": 79})
    yield s
    s.close()


def test_old_raw_samples_fold_into_minutes(store):
    res = prune(store, now=NOW, raw_days=14, minutes_days=400)
    assert res == {"samples_folded": 120, "series_done": 1, "series_left": 0, "host_samples": 1,
                   "step_records": 0, "minutes": 0, "summaries": 0, "events": 0, "complete": True}
    raw = store.query("select * from gpu_minutes order by minute")
    assert [m["minute"] for m in raw] == [0, 1]  # minutes from the series' first minute
    # util 0..59 -> mean 29.5 rounds to 30 (half away from zero), 30 below it, 29 above
    assert (raw[0]["n"], raw[0]["gpu_util_pct_mean"], raw[0]["gpu_util_pct_dmin"], raw[0]["gpu_util_pct_dmax"]) == (
        60, 30, 30, 29)
    mins = store.query("select * from minutes_view order by minute_at")
    assert [m["minute_at"] for m in mins] == [int(OLD // 60) * 60, int(OLD // 60) * 60 + 60]
    m0 = mins[0]
    assert (m0["n"], m0["gpu_util_pct_min"], m0["gpu_util_pct_mean"], m0["gpu_util_pct_max"]) == (60, 0, 30, 59)
    # power in 0.1 W: 3000 and 3005 alternate -> mean 3002.5 -> 3003; in W through the view
    assert (m0["power_w_min"], m0["power_w_mean"], m0["power_w_max"]) == (300.0, 300.3, 300.5)
    assert (m0["mem_used_mib_min"], m0["mem_used_mib_max"], m0["clock_event_mask_or"]) == (1000, 1059, 4)
    assert (mins[1]["mem_used_mib_max"], mins[1]["clock_event_mask_or"]) == (1119, 4)
    assert store.query("select count(*) n from samples where job_id = '1'")[0]["n"] == 0
    assert store.query("select count(*) n from gpu_slow")[0]["n"] == 0
    assert store.query("select count(*) n from samples where job_id = '2'")[0]["n"] == 10
    assert [r["job_id"] for r in store.query("select job_id from host_samples")] == ["2"]
    # summaries and events stay until asked
    assert store.query("select count(*) n from job_summaries")[0]["n"] == 1
    assert store.query("select count(*) n from events")[0]["n"] == 1


def test_minutes_expire_and_their_series_go(store):
    prune(store, now=NOW, raw_days=14, minutes_days=400)
    res = prune(store, now=NOW, raw_days=14, minutes_days=10, summaries_days=15, events_days=15)
    assert (res["minutes"], res["summaries"], res["events"]) == (2, 1, 1)
    assert [r["job_id"] for r in store.query("select job_id from gpu_series")] == ["2"]


def test_budget_stops_between_series_and_the_next_run_goes_on(store):
    res = prune(store, now=NOW, raw_days=14, minutes_days=400, budget_s=0)
    assert (res["complete"], res["series_done"], res["series_left"]) == (False, 0, 1)
    assert prune(store, now=NOW, raw_days=14, minutes_days=400)["samples_folded"] == 120


def test_negative_age_is_refused(store):
    with pytest.raises(ValueError, match="raw_days must be >= 0"):
        prune(store, now=NOW, raw_days=-1, minutes_days=1)
    with pytest.raises(ValueError, match="summaries_days must be >= 0, got nan"):
        prune(store, now=NOW, raw_days=1, minutes_days=1, summaries_days=float("nan"))
    r = CliRunner().invoke(main, ["store", "prune", "--store", store.path, "--events-days", "nan"])
    assert (r.exit_code, r.output.splitlines()[-1]) == (
        2, "Error: Invalid value for '--events-days': nan is not a number of days")


def test_cli_prune(store, tmp_path):
    r = CliRunner().invoke(main, ["store", "prune", "--store", store.path, "--raw-days", "14", "--json"])
    assert r.exit_code == 0, r.output
    # the command prunes at the current time, long after NOW: both jobs' samples are past 14 days
    assert json.loads(r.output)["samples_folded"] == 130
    r = CliRunner().invoke(main, ["store", "prune", "--store", str(tmp_path / "missing.db")])
    assert r.exit_code == 2 and "does not exist" in r.output


def test_first_minute_layout_converts(tmp_path):
    """gpu_minutes rows of the first layout (absolute minute, min/mean/max) convert to the
    second (minutes from the series' start, distances from the mean), same real values."""
    import sqlite3

    from gpuguard import samples, samples_schema

    conn = sqlite3.connect(str(tmp_path / "m.db"), isolation_level=None)
    conn.execute("begin")
    samples_schema.migrate(conn)
    conn.execute("insert into gpu_series (id, job_id, node, gpu_index, t0) values (1, '1', 'n1', 0, ?)", (OLD,))
    cols = ", ".join(c for m in samples.GPU_SAMPLED for c in (
        [f"{samples.stored_column(m)}_or"] if m.name == "clock_event_mask" else
        [f"{samples.stored_column(m)}_{x}" for x in ("min", "mean", "max")]))
    vals = {"gpu_util_pct": (0, 30.0, 59), "power_w_x10": (3000, 3003.0, 3005)}
    row = []
    for m in samples.GPU_SAMPLED:
        c = samples.stored_column(m)
        row += [4] if m.name == "clock_event_mask" else list(vals.get(c, (None, None, None)))
    conn.execute(f"insert into gpu_minutes (sid, minute, n, {cols}) values (1, ?, 60, {', '.join('?' * len(row))})",
                 (int(OLD // 60) + 2, *row))
    samples_schema.migrate_minutes(conn)
    conn.execute("commit")
    got = conn.execute("select minute, gpu_util_pct_mean, gpu_util_pct_dmin, gpu_util_pct_dmax, power_w_x10_dmax, "
                       "clock_event_mask_or from gpu_minutes").fetchall()
    assert got == [(2, 30, 30, 29, 2, 4)]
    assert conn.execute("select minute_at, power_w_min, power_w_max from minutes_view").fetchall() == [
        ((int(OLD // 60) + 2) * 60, 300.0, 300.5)]


def test_training_records_go_with_their_summary_age_job_by_job(store, monkeypatch):
    """Steps, checkpoints and step sub-windows of a job summarised before raw_days go, in
    bounded deletes that a budget can stop and the next run continues from the cursor; a
    recent job's stay, and so do the records of a job with no summary."""
    import gpuguard.retention as retention

    def steps(job, t0, n):
        return [{"job_id": job, "node": "n1", "rank": r, "step": k, "t": t0 + k, "step_time_s": 1.0}
                for r in (0, 1) for k in range(n)]

    store.insert_many("steps", steps("1", OLD, 50) + steps("2", NOW - 90, 40) + steps("3", OLD, 5))
    store.insert_many("checkpoints", [{"job_id": j, "node": "n1", "rank": 0, "step": 1, "t": t, "duration_s": 1.0}
                                      for j, t in (("1", OLD), ("2", NOW - 50))])
    store.insert("job_summaries", {"job_id": "2", "node": "n1", "created_at": NOW - 10, "summary": "{}"})
    assert store.query("select count(*) n from step_windows where job_id = '1'")[0]["n"] > 0
    monkeypatch.setattr(retention, "RECORD_BATCH", 30)
    ticks = iter([0.0, 1.0, 100.0])  # the budget runs out after two deletes (30 rows each)

    class Clock:
        time = staticmethod(retention.time.time)
        monotonic = staticmethod(lambda: next(ticks))

    monkeypatch.setattr(retention, "time", Clock)
    assert retention._prune_records(store, NOW - 14 * DAY_S, stop_at=50.0) == (60, False)
    assert store.get_cursor(retention.RECORDS_CURSOR) is None  # job 1 not finished: it is taken again
    monkeypatch.undo()
    res = prune(store, now=NOW, raw_days=14, minutes_days=400)
    assert (res["step_records"], res["complete"]) == (40, True)
    left = store.query("select job_id, count(*) n from steps group by job_id order by job_id")
    assert [(r["job_id"], r["n"]) for r in left] == [("2", 80), ("3", 10)]
    assert [r["job_id"] for r in store.query("select job_id from checkpoints")] == ["2"]
    assert store.query("select count(*) n from step_windows where job_id = '1'")[0]["n"] == 0
    assert store.get_cursor(retention.RECORDS_CURSOR) == repr(OLD + 200)
    assert prune(store, now=NOW, raw_days=14, minutes_days=400)["step_records"] == 0


def test_records_of_a_job_never_summarised_go_once_older_than_raw_days(store):
    """A job whose node died before its Epilog has records and the collector's ingest
    bookkeeping but no summary: its records go once the newest one is past raw_days; a
    recent unsummarised job (still running) keeps them, and so does a job without
    bookkeeping rows."""
    def steps(job, t0, n, ranks=(0, 1, None)):
        return [{"job_id": job, "node": "n1", "rank": r, "step": k, "t": t0 + k, "step_time_s": 1.0}
                for r in ranks for k in range(n)]

    # job 5: died 20 days ago; job 6: running, its rank 1 wrote a minute ago; job 7: old, no bookkeeping
    store.insert_many("steps", steps("5", OLD, 30) + steps("6", OLD, 30, (0,)) + steps("6", NOW - 60, 3, (1,))
                      + steps("7", OLD, 4))
    store.insert_many("checkpoints", [{"job_id": j, "node": "n1", "rank": 0, "step": 1, "t": OLD, "duration_s": 1.0}
                                      for j in ("5", "6")])
    store.insert_many("train_offsets", [{"job_id": j, "node": "n1", "name": f"rank{r}.jsonl", "dev": 1, "ino": 2,
                                         "offset": 10, "skipping": 0, "records": 30, "malformed": 0, "nonfinite": 0,
                                         "truncated": 0} for j in ("5", "6") for r in (0, 1)])
    res = prune(store, now=NOW, raw_days=14, minutes_days=400)
    assert (res["step_records"], res["complete"]) == (90, True)
    left = store.query("select job_id, count(*) n from steps group by job_id order by job_id")
    assert [(r["job_id"], r["n"]) for r in left] == [("6", 33), ("7", 12)]
    assert [r["job_id"] for r in store.query("select job_id from checkpoints")] == ["6"]
    assert [r["job_id"] for r in store.query("select distinct job_id from step_windows order by job_id")] == ["6", "7"]
    assert [r["job_id"] for r in store.query("select distinct job_id from train_offsets")] == ["6"]
    assert prune(store, now=NOW, raw_days=14, minutes_days=400)["step_records"] == 0
