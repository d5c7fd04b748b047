"""Store migration 5: ``job_gpu_util`` (per-GPU readings of the job summaries) kept in step
with ``job_summaries`` by triggers, and the efficiency report reading it gives the same
figures as parsing the summaries' JSON."""

from __future__ import annotations

import json
import random

import pytest
from reports_helpers import add_summary, utc

from gpuguard import store as store_mod
from gpuguard.epilog.summary import save_summary, summarize_job
from gpuguard.reports.queries import efficiency_report
from gpuguard.reports.sync import import_text


def readings(store) -> list[tuple]:
    return [tuple(r.values()) for r in store.query(
        "SELECT job_id, node, jid, util FROM job_gpu_util ORDER BY job_id, node, util")]


@pytest.fixture
def st(tmp_path):
    s = store_mod.open_store(str(tmp_path / "c.db"))
    yield s
    s.close()


def test_migration_5_fills_the_table_from_summaries_already_stored(tmp_path):
    path = str(tmp_path / "old.db")
    from gpuguard.reports.schema import MIGRATIONS as REPORTS

    old = store_mod.open_store(path, sets=[s for s in store_mod.registered_sets() if s is not REPORTS])
    assert "job_gpu_util" not in old.db.table_names()
    add_summary(old, "7", "n1", [10.0, None, 90.0])
    add_summary(old, "7", "n2", [4.0])
    old.db.conn.execute("INSERT INTO job_summaries (job_id, node, summary) VALUES ('8', 'n1', '{not json')")
    old.db.conn.execute("INSERT INTO job_summaries (job_id, node, summary) VALUES ('9', 'n1', ?)",
                        [json.dumps({"gpu_util_mean_pct": 33.5, "gpus": []})])
    old.close()
    new = store_mod.open_store(path)
    try:
        assert [m.name for m in REPORTS.applied(new.db)] == ["sacct_jobs", "job_gpu_util", "sacct_attempts",
                                                             "sacct_pending_index"]
        assert readings(new) == [("7", "n1", 7, 10.0), ("7", "n1", 7, 90.0), ("7", "n2", 7, 4.0),
                                 ("9", "n1", 9, 33.5)]
    finally:
        new.close()


def test_triggers_follow_insert_upsert_replace_update_and_delete(st):
    add_summary(st, "5", "n1", [50.0, 70.0])
    assert readings(st) == [("5", "n1", 5, 50.0), ("5", "n1", 5, 70.0)]
    conn = st.db.conn
    conn.execute("INSERT OR REPLACE INTO job_summaries (job_id, node, summary) VALUES ('5', 'n1', ?)",
                 [json.dumps({"gpus": [{"gpu_util_mean_pct": 1.5}]})])
    assert readings(st) == [("5", "n1", 5, 1.5)]
    conn.execute("UPDATE job_summaries SET summary = ? WHERE job_id = '5'",
                 [json.dumps({"gpus": [{"gpu_util_mean_pct": None}, {"gpu_util_mean_pct": 2}]})])
    assert readings(st) == [("5", "n1", 5, 2.0)]
    conn.execute("UPDATE job_summaries SET node = 'n9' WHERE job_id = '5'")
    assert readings(st) == [("5", "n9", 5, 2.0)]
    conn.execute("UPDATE job_summaries SET collector_status = 'ok'")  # other columns: no change
    assert readings(st) == [("5", "n9", 5, 2.0)]
    conn.execute("DELETE FROM job_summaries")
    assert readings(st) == []


def test_the_epilogs_save_summary_feeds_the_table(st):
    s = summarize_job(st, "12", "n1", exit_status_raw=0, collector_status="ok", ended_at=1500.0)
    s.gpus = [{"gpu_index": 0, "gpu_util_mean_pct": 80.0}, {"gpu_index": 1, "gpu_util_mean_pct": 3.0}]
    save_summary(st, s)
    save_summary(st, s)  # the epilog rerun replaces, never duplicates
    assert readings(st) == [("12", "n1", 12, 3.0), ("12", "n1", 12, 80.0)]


def _drop_util(store) -> None:
    conn = store.db.conn
    for name in ("job_summaries_util_insert", "job_summaries_util_update", "job_summaries_util_delete"):
        conn.execute(f"DROP TRIGGER {name}")
    conn.execute("DROP TABLE job_gpu_util")


def test_efficiency_from_the_table_equals_parsing_the_json(tmp_path):
    rnd = random.Random(3)
    head = "JobIDRaw|JobID|Account|State|Submit|Eligible|Start|End|ElapsedRaw|ExitCode|AllocTRES\n"
    lines, t0 = [], utc("2025-03-01T00:00:00")
    from datetime import UTC, datetime

    def fmt(ts):
        return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    for i in range(300):
        g = rnd.choice((0, 1, 1, 2, 4, 8))
        start = t0 + rnd.randrange(0, 86400)
        el = rnd.randrange(1, 20000)
        lines.append(f"{100 + i}|{100 + i}|acct{i % 4}|COMPLETED|{fmt(start - 60)}|{fmt(start - 60)}|{fmt(start)}|"
                     f"{fmt(start + el)}|{el}|0:0|cpu=1" + (f",gres/gpu={g}" if g else ""))
    st = store_mod.open_store(str(tmp_path / "e.db"))
    try:
        import_text(st, head + "\n".join(lines) + "\n")
        for i in range(0, 300, 2):
            n = rnd.choice((1, 2, 4))
            add_summary(st, str(100 + i), "n1", [rnd.choice((None, 0.0, 4.99, 5.0, rnd.uniform(0, 100)))
                                                 for _ in range(n)])
            if i % 6 == 0:
                add_summary(st, str(100 + i), "n2", [rnd.uniform(0, 100)])
        st.db.conn.execute("INSERT INTO job_summaries (job_id, node, summary) VALUES ('104', 'n3', '[broken')")
        st.db.conn.execute("INSERT INTO job_summaries (job_id, node, summary) VALUES ('106', 'n3', ?)",
                           [json.dumps({"gpu_util_mean_pct": 2.0})])
        kw = dict(since=t0 - 3600, until=t0 + 3 * 86400, idle_util_pct=5.0)
        fast = efficiency_report(st, **kw).tables[0]
        for by in ("user", "gpus"):
            efficiency_report(st, **dict(kw, by=by))
        _drop_util(st)
        slow = efficiency_report(st, **kw).tables[0]
    finally:
        st.close()
    assert [r["group"] for r in fast.rows] == [r["group"] for r in slow.rows]
    for a, b in zip([*fast.rows, fast.total], [*slow.rows, slow.total], strict=True):
        assert a.keys() == b.keys()
        for k in a:
            if isinstance(a[k], float):
                assert a[k] == pytest.approx(b[k], rel=1e-12, abs=1e-12), k
            else:
                assert a[k] == b[k], k
    assert fast.total["jobs_with_summary"] > 50 and fast.total["jobs_no_summary"] > 50

