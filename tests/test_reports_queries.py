"""Each report's numbers on the hand-made dataset (tests/data/reports-handmade-p.txt),
window 2025-03-01 .. 2025-04-01 UTC, worked out by hand below. Every expected value is
exact (dyadic fractions, or the same float operation the code documents)."""

from __future__ import annotations

from zoneinfo import ZoneInfo

import pytest
from reports_helpers import HANDMADE, add_summary, cache_store, utc

from gpuguard.reports.queries import (
    Rates,
    ReportError,
    cost_report,
    efficiency_report,
    failures_report,
    wait_report,
)
from gpuguard.reports.sync import import_file

SINCE, UNTIL = utc("2025-03-01T00:00:00"), utc("2025-04-01T00:00:00")
SYNCED = utc("2025-03-31T12:00:00")
RATES = Rates(gpu_hour_rate=1.0, cpu_hour_rate=0.0625, currency="EUR",
              gpu_hour_rates={"a100": 3.0, "a100@gpu": 2.5, "h100": 4.0, "@debug": 0.5, "a100_3g.20gb": 0.75})


@pytest.fixture
def cstore(tmp_path):
    yield from cache_store(tmp_path)


@pytest.fixture
def data(cstore):
    import_file(cstore, str(HANDMADE), tz=ZoneInfo("UTC"), synced_at=SYNCED)
    return cstore


def by_group(table):
    return {r["group"]: r for r in table.rows}


def test_rates_lookup_order():
    assert RATES.gpu_rate("a100", "gpu") == 2.5  # TYPE@PARTITION
    assert RATES.gpu_rate("a100", "other") == 3.0  # TYPE
    assert RATES.gpu_rate(None, "debug") == 0.5  # @PARTITION
    assert RATES.gpu_rate("a100_3g.20gb", "debug") == 0.75  # a MIG slice is its own type
    assert RATES.gpu_rate(None, "gpu") == 1.0  # default
    assert RATES.gpu_rate("a100,v100", "x") == 1.0  # several types: default unless listed
    with pytest.raises(ReportError, match="reports.gpu_hour_rates.a100 must be a number >= 0, got 'cheap'"):
        Rates(gpu_hour_rates={"a100": "cheap"})


def test_cost_per_account(data):
    rep = cost_report(data, since=SINCE, until=UNTIL, by="account", rates=RATES)
    t = rep.tables[0]
    assert [r["group"] for r in t.rows] == ["physics", "bio", "chem"]  # by GPU-hours
    g = by_group(t)
    # physics: 101 40h a100@gpu 2.5 -> 100, cpu 160h; 102 5h default 1.0, cpu 20h (FAILED);
    # 103 4h a100@gpu -> 10, cpu 16h (TIMEOUT); 111 running 2 GPUs x 2h to the last sync -> 10, cpu 16h;
    # 112 only 2 of its 4 hours fall in the window -> 5, cpu 2h. 109 is pending: no usage.
    assert g["physics"] == {
        "group": "physics", "jobs": 5, "gpu_hours": 55.0, "cpu_hours": 214.0, "gpu_cost": 130.0,
        "cpu_cost": 13.375, "cost": 143.375, "failed_cost": 6.25, "timeout_cost": 11.0, "node_fail_cost": 0.0}
    # bio: 104 MIG 3h x 0.75; 105 h100 8h x 4 (NODE_FAIL); 106 0.5h; 113 0.25h (OUT_OF_MEMORY); 114 3h
    assert g["bio"] == {
        "group": "bio", "jobs": 5, "gpu_hours": 14.75, "cpu_hours": 41.75, "gpu_cost": 38.0,
        "cpu_cost": 2.609375, "cost": 40.609375, "failed_cost": 0.265625, "timeout_cost": 0.0,
        "node_fail_cost": 34.0}
    assert g["chem"] == {
        "group": "chem", "jobs": 2, "gpu_hours": 0.0, "cpu_hours": 8.0, "gpu_cost": 0.0, "cpu_cost": 0.5,
        "cost": 0.5, "failed_cost": 0.0, "timeout_cost": 0.0, "node_fail_cost": 0.0}
    assert t.total == {
        "group": "TOTAL", "jobs": 12, "gpu_hours": 69.75, "cpu_hours": 263.75, "gpu_cost": 168.0,
        "cpu_cost": 16.484375, "cost": 184.484375, "failed_cost": 6.515625, "timeout_cost": 11.0,
        "node_fail_cost": 34.0}
    assert rep.params == {"currency": "EUR"}


def test_cost_by_template_and_gpus(data):
    g = by_group(cost_report(data, since=SINCE, until=UNTIL, by="template", rates=RATES).tables[0])
    assert {k: (v["jobs"], v["gpu_hours"]) for k, v in g.items()} == {
        "llm-70b": (1, 40.0), "llm-7b": (1, 4.0), "(none)": (10, 25.75)}
    t = cost_report(data, since=SINCE, until=UNTIL, by="gpus", rates=RATES).tables[0]
    assert [(r["group"], r["jobs"], r["gpu_hours"]) for r in t.rows] == [
        ("0", 2, 0.0), ("1", 5, 10.75), ("2-4", 4, 51.0), ("5-8", 1, 8.0)]


def test_cost_window_clips_usage(data):
    # only 2025-03-02 00:00-05:00: job 101 contributes 5 of its 10 hours (x 4 GPUs)
    rep = cost_report(data, since=utc("2025-03-02T00:00:00"), until=utc("2025-03-02T05:00:00"), rates=RATES)
    assert [(r["group"], r["jobs"], r["gpu_hours"], r["cpu_hours"]) for r in rep.tables[0].rows] == [
        ("physics", 1, 20.0, 80.0)]


def test_cost_without_rates_says_so(data):
    rep = cost_report(data, since=SINCE, until=UNTIL)
    assert rep.tables[0].total["cost"] == 0.0
    assert any("no rates configured" in n for n in rep.notes)


def test_wait_percentiles_nearest_rank(data):
    rep = wait_report(data, since=SINCE, until=UNTIL, by="account")
    wait, pending, longest = rep.tables
    g = by_group(wait)
    # physics (started in window): 101 1800 s (submit 3600), 102 3600, 103 7200 (held 10 h: submit 43200),
    # 111 3600. 112 started before the window. Sorted 1800, 3600, 3600, 7200:
    # p50 = rank ceil(0.5*4)=2 -> 3600; p90 = rank ceil(3.6)=4 -> 7200; p99 = rank 4 -> 7200.
    assert g["physics"] == {"group": "physics", "jobs": 4, "mean_s": 4050.0, "p50_s": 3600.0, "p90_s": 7200.0,
                            "p99_s": 7200.0, "max_s": 7200.0, "submit_mean_s": 13500.0, "submit_max_s": 43200.0}
    # bio: 0, 60, 600, 3600, 5400 -> p50 rank 3 = 600, p90 rank ceil(4.5)=5 -> 5400
    assert g["bio"] == {"group": "bio", "jobs": 5, "mean_s": 1932.0, "p50_s": 600.0, "p90_s": 5400.0,
                        "p99_s": 5400.0, "max_s": 5400.0, "submit_mean_s": 1932.0, "submit_max_s": 5400.0}
    assert g["chem"]["jobs"] == 2 and g["chem"]["p99_s"] == 0.0
    # all 11: 0,0,0,60,600,1800,3600,3600,3600,5400,7200 -> p50 rank 6, p90 rank 10, p99 rank 11
    assert wait.total == {"group": "TOTAL", "jobs": 11, "mean_s": 25860 / 11, "p50_s": 1800.0, "p90_s": 5400.0,
                          "p99_s": 7200.0, "max_s": 7200.0, "submit_mean_s": (25860 + 1800 + 36000) / 11,
                          "submit_max_s": 43200.0}
    # pending at the last sync (2025-03-31 12:00): 109 eligible 06:00 -> 6 h; 110 held, never eligible:
    # 36 h since submit
    assert by_group(pending) == {
        "physics": {"group": "physics", "jobs": 1, "not_eligible": 0, "mean_current_s": 21600.0,
                    "max_current_s": 21600.0},
        "chem": {"group": "chem", "jobs": 1, "not_eligible": 1, "mean_current_s": 129600.0,
                 "max_current_s": 129600.0}}
    assert [(r["job_id"], r["current_wait_s"]) for r in longest.rows] == [("110", 129600.0), ("109", 21600.0)]


def test_wait_by_gpu_bucket(data):
    t = wait_report(data, since=SINCE, until=UNTIL, by="gpus").tables[0]
    assert [(r["group"], r["jobs"], r["p50_s"]) for r in t.rows] == [
        ("0", 2, 0.0), ("1", 4, 60.0), ("2-4", 4, 3600.0), ("5-8", 1, 3600.0)]


def test_failures_shares_and_lost_gpu_hours(data):
    t = failures_report(data, since=SINCE, until=UNTIL, by="account").tables[0]
    g = by_group(t)
    zero = {f"{s}_share": 0.0 for s in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                                         "PREEMPTED", "OTHER")}
    zgh = {f"{s}_gpu_hours": 0.0 for s in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                           "OUT_OF_MEMORY", "PREEMPTED", "OTHER")}
    # physics ended in window: 101 COMPLETED 40 GPU-h, 112 COMPLETED 4 (whole job), 102 FAILED 5, 103 TIMEOUT 4
    assert g["physics"] == {"group": "physics", "jobs": 4, "gpu_hours": 53.0, "lost_gpu_hours": 9.0,
                            **zero, **zgh, "COMPLETED_share": 0.5, "FAILED_share": 0.25, "TIMEOUT_share": 0.25,
                            "COMPLETED_gpu_hours": 44.0, "FAILED_gpu_hours": 5.0, "TIMEOUT_gpu_hours": 4.0}
    assert g["bio"] == {"group": "bio", "jobs": 5, "gpu_hours": 14.75, "lost_gpu_hours": 11.75, **zero, **zgh,
                        "COMPLETED_share": 0.2, "NODE_FAIL_share": 0.2, "CANCELLED_share": 0.2,
                        "OUT_OF_MEMORY_share": 0.2, "PREEMPTED_share": 0.2,
                        "COMPLETED_gpu_hours": 3.0, "NODE_FAIL_gpu_hours": 8.0, "CANCELLED_gpu_hours": 0.5,
                        "OUT_OF_MEMORY_gpu_hours": 0.25, "PREEMPTED_gpu_hours": 3.0}
    assert g["chem"]["COMPLETED_share"] == 1.0 and g["chem"]["jobs"] == 2
    assert (t.total["jobs"], t.total["COMPLETED_share"], t.total["lost_gpu_hours"]) == (11, 5 / 11, 20.75)


def test_efficiency_counts_jobs_without_summary(data):
    for job, node, utils in [("101", "g01", [100.0, 100.0, 100.0, 20.0]), ("102", "g02", [2.0]),
                             ("104", "g03", [50.0]), ("105", "h01", [60.0, 60.0, 60.0, 60.0]),
                             ("105", "h02", [20.0, 20.0, 0.0, 0.0]), ("111", "g01", [60.0, 60.0]),
                             ("112", "g01", [100.0]), ("113", "g02", [0.0]), ("107", "c01", []),
                             ("106", "g02", [None])]:  # 106: a summary without GPU samples
        add_summary(data, job, node, utils)
    rep = efficiency_report(data, since=SINCE, until=UNTIL, by="account", idle_util_pct=5.0)
    t = rep.tables[0]
    g = by_group(t)
    # physics: 101 40h x mean(100,100,100,20)=80 %; 102 5h x 2 % (its one GPU idle -> 5 idle GPU-h);
    # 103 4h no summary; 111 4h x 60 %; 112 2h x 100 %
    assert g["physics"] == {"group": "physics", "jobs": 5, "gpu_hours": 55.0, "jobs_with_summary": 4,
                            "jobs_no_summary": 1, "measured_gpu_hours": 51.0, "no_summary_gpu_hours": 4.0,
                            "util_weighted_gpu_hours": 36.5, "idle_gpu_hours": 5.0, "jobs_with_idle_gpus": 1,
                            "mean_util_pct": 100.0 * 36.5 / 51.0}
    # bio: 104 3h x 50 %; 105 8h over two nodes, 8 GPUs mean 35 %, 2 of 8 GPUs idle -> 2 idle GPU-h;
    # 113 0.25h, its GPU idle; 106 (no GPU samples) and 114 (nothing stored): no summary
    assert g["bio"] == {"group": "bio", "jobs": 5, "gpu_hours": 14.75, "jobs_with_summary": 3,
                        "jobs_no_summary": 2, "measured_gpu_hours": 11.25, "no_summary_gpu_hours": 3.5,
                        "util_weighted_gpu_hours": 4.3, "idle_gpu_hours": 2.25, "jobs_with_idle_gpus": 2,
                        "mean_util_pct": 100.0 * 4.3 / 11.25}
    assert "chem" not in g  # CPU-only jobs hold no GPU-hours
    assert (t.total["jobs"], t.total["jobs_no_summary"], t.total["no_summary_gpu_hours"], t.total["idle_gpu_hours"],
            t.total["jobs_with_idle_gpus"]) == (10, 3, 7.5, 7.25, 3)


def test_efficiency_survives_a_corrupt_summary(data):
    add_summary(data, "101", "g01", [90.0])
    data.db.conn.execute("INSERT INTO job_summaries (job_id, node, summary) VALUES ('102', 'g02', '{not json')")
    g = by_group(efficiency_report(data, since=SINCE, until=UNTIL).tables[0])
    assert (g["physics"]["jobs_with_summary"], g["physics"]["jobs_no_summary"]) == (1, 4)


def test_efficiency_without_summary_table_counts_every_job(cstore):
    import_file(cstore, str(HANDMADE), tz=ZoneInfo("UTC"), synced_at=SYNCED)
    has_table = bool(cstore.query("SELECT name FROM sqlite_master WHERE name = 'job_summaries'"))
    rep = efficiency_report(cstore, since=SINCE, until=UNTIL)
    t = rep.tables[0]
    assert (t.total["jobs"], t.total["jobs_no_summary"], t.total["no_summary_gpu_hours"],
            t.total["mean_util_pct"]) == (10, 10, 69.75, None)
    if not has_table:
        assert any("table job_summaries absent" in n for n in rep.notes)


def test_bad_parameters(data):
    with pytest.raises(ReportError, match="--by 'host': expected one of account, user"):
        cost_report(data, since=SINCE, until=UNTIL, by="host")
    with pytest.raises(ReportError, match="empty window"):
        wait_report(data, since=UNTIL, until=SINCE)


def test_cluster_filter(data):
    assert cost_report(data, since=SINCE, until=UNTIL, cluster="other").tables[0].rows == []
    assert cost_report(data, since=SINCE, until=UNTIL, cluster="tc").tables[0].total["jobs"] == 12
