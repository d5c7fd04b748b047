"""Two-key grouping, day/week/month buckets, filters, grouping by GPU type, the usage
series, and the honest-input rules (rows in no report, requeued attempts, unknown GPU
counts, jobstats JS1 utilisation), on hand-made and corpus sacct files."""

from __future__ import annotations

from zoneinfo import ZoneInfo

import pytest
from click.testing import CliRunner
from reports_helpers import DATA, HANDMADE, cache_store, utc

from gpuguard.cli import main
from gpuguard.reports.buckets import usage_series, windows
from gpuguard.reports.charts import top_n
from gpuguard.reports.jobstats import Js1Error, decode_js1, gpu_readings
from gpuguard.reports.queries import Filters, ReportError, run_reports
from gpuguard.reports.render import render, split_columns
from gpuguard.reports.sync import import_file, import_text

SINCE, UNTIL = utc("2025-03-01T00:00:00"), utc("2025-04-01T00:00:00")
UTC = ZoneInfo("UTC")


@pytest.fixture
def cstore(tmp_path):
    yield from cache_store(tmp_path)


@pytest.fixture
def data(cstore):
    import_file(cstore, str(HANDMADE), tz=UTC, synced_at=utc("2025-03-31T12:00:00"))
    return cstore


def cost(store, **kw):
    (rep,) = run_reports(store, ["cost"], since=kw.pop("since", SINCE), until=kw.pop("until", UNTIL), tz=UTC, **kw)
    return rep


def test_two_keys_account_user(data):
    t = cost(data, by="account,user").tables[0]
    assert [c.key for c in t.columns[:3]] == ["group", "group2", "jobs"]
    assert [(r["group"], r["group2"], r["gpu_hours"]) for r in t.rows] == [
        ("physics", "alice", 50.0), ("physics", "bob", 5.0), ("bio", "carol", 14.0), ("bio", "dave", 0.75),
        ("chem", "erin", 0.0)]
    assert t.total["gpu_hours"] == 69.75


def test_weeks_are_cut_at_the_bucket_edges(data):
    rep = cost(data, by="account", per="week")
    t = rep.tables[0]
    assert t.columns[0].key == "period" and t.title == "Cost per account, per week"
    got = {(r["period"], r["group"]): r["gpu_hours"] for r in t.rows}
    assert got == {("2025-W09", "physics"): 42.0, ("2025-W10", "physics"): 9.0, ("2025-W10", "bio"): 11.75,
                   ("2025-W10", "chem"): 0.0, ("2025-W11", "bio"): 3.0, ("2025-W14", "physics"): 4.0}
    assert sum(got.values()) == t.total["gpu_hours"] == 69.75  # buckets add up to the window
    text = render([rep], "text", UTC, 0)
    assert "\nTOTAL" in text  # the TOTAL label sits in the first column


def test_bucket_windows_follow_wall_clock_in_the_zone():
    berlin = ZoneInfo("Europe/Berlin")
    w = windows(utc("2025-03-29T23:00:00"), utc("2025-04-01T22:00:00"), "day", berlin)
    # 30 March 2025 has 23 hours in Berlin (DST starts)
    assert [(lab, b - a) for lab, a, b in w] == [("2025-03-30", 82800.0), ("2025-03-31", 86400.0),
                                                 ("2025-04-01", 86400.0)]
    assert [lab for lab, _a, _b in windows(utc("2025-01-15T00:00:00"), utc("2025-03-02T00:00:00"), "month", UTC)] == [
        "2025-01", "2025-02", "2025-03"]
    with pytest.raises(ReportError, match="--per 'year'"):
        windows(0, 1, "year", UTC)


@pytest.mark.parametrize("flt, expect", [
    (Filters(user=("alice",)), {"physics": 50.0}),
    (Filters(state=("failed",)), {"physics": 5.0}),
    (Filters(gpu_type=("a100",)), {"physics": 50.0}),  # a100_3g.20gb is its own type
    (Filters(partition=("debug",)), {"bio": 3.0}),
    (Filters(account=("bio", "chem"), qos=("normal",)), {"bio": 3.75, "chem": 0.0}),
])
def test_filters(data, flt, expect):
    t = cost(data, cluster=flt).tables[0]
    assert {r["group"]: r["gpu_hours"] for r in t.rows} == expect


def test_by_gpu_type(data):
    t = cost(data, by="gpu_type").tables[0]
    assert {r["group"]: r["gpu_hours"] for r in t.rows} == {"a100": 50.0, "(none)": 8.75, "h100": 8.0,
                                                            "a100_3g.20gb": 3.0}


def test_bad_by(data):
    for by, msg in (("account,user,qos", "at most 2 keys"), ("account,account", "repeated"), ("color", "'color'")):
        with pytest.raises(ReportError, match=msg):
            cost(data, by=by)


def test_usage_series_per_day(data):
    s = usage_series(data, SINCE, UNTIL, "account,user", UTC)
    assert s["bucket"] == "day" and len(s["periods"]) == 31
    day = {p: i for i, p in enumerate(s["periods"])}
    assert s["groups"]["physics"][day["2025-03-01"]] == 2.0
    assert s["groups"]["physics"][day["2025-03-02"]] == 40.0
    assert s["groups"]["bio"][day["2025-03-06"]] == 8.0
    assert sum(sum(v) for v in s["groups"].values()) == 69.75


def test_top_n_merges_the_rest_into_other():
    rows = [{"group": f"a{i:02d}", "gpu_hours": float(i), "jobs": 1} for i in range(1, 26)]
    items = top_n(rows, "gpu_hours", ("gpu_hours", "jobs"), n=15)
    assert len(items) == 15 and items[0] == ("a25", rows[24])
    assert items[-1][0] == "other (11 groups)" and items[-1][1] == {"gpu_hours": float(sum(range(1, 12))), "jobs": 11}


def test_wide_tables_split_repeating_the_labels(data):
    (rep,) = run_reports(data, ["failures"], since=SINCE, until=UNTIL, by="account,user")
    cols = rep.tables[0].columns
    parts = split_columns(cols)
    assert len(cols) == 20 and [len(p) for p in parts] == [10, 10, 4]
    assert all(p[:2] == [0, 1] for p in parts) and sorted({i for p in parts for i in p}) == list(range(20))
    html = render([rep], "html", UTC, 0)
    assert html.count("part 1 of 3") == 1 and "@media print" in html


# --- honest inputs ----------------------------------------------------------------------------
def test_rows_without_start_end_are_named(cstore, tmp_path):
    f = tmp_path / "short.txt"
    f.write_text("JobID|User|Account|State|Elapsed\n1|u|a|COMPLETED|01:00:00\n2|u|a|FAILED|00:10:00\n")
    res = import_file(cstore, str(f), tz=UTC)
    assert res.summary() == (f"{f}: 2 job(s) stored; 2 without Start/End: in no report (lines 2 (job 1), 3 (job 2)); "
                             "2 with GPU usage unknown (no field carries their GPU count: lines 2 (job 1), 3 (job 2))")


def test_requeued_attempts_are_each_kept_and_charged(cstore):
    head = "JobIDRaw|JobID|Account|State|Submit|Start|End|ElapsedRaw|AllocTRES\n"
    text = head + ("500|500|a|REQUEUED|2025-03-01T00:00:00|2025-03-01T00:00:00|2025-03-01T01:00:00|3600|gres/gpu=2\n"
                   "500|500|a|COMPLETED|2025-03-01T01:00:05|2025-03-01T01:10:00|2025-03-01T03:10:00|7200|gres/gpu=2\n")
    res = import_text(cstore, text, tz=UTC)
    assert res.summary() == "<text>: 2 job(s) stored (2 attempts of 1 requeued job(s), each charged)"
    assert cost(cstore).tables[0].total["gpu_hours"] == 6.0
    # the same attempts again, and one from a file without Submit: no attempt counted twice
    import_text(cstore, text, tz=UTC)
    import_text(cstore, "JobIDRaw|State|Start|End|ElapsedRaw|AllocTRES\n"
                "500|COMPLETED|2025-03-01T01:10:00|2025-03-01T03:10:00|7200|gres/gpu=2\n", tz=UTC)
    assert [tuple(r.values()) for r in cstore.query("SELECT state, attempt_at FROM sacct_jobs ORDER BY 2")] == [
        ("REQUEUED", utc("2025-03-01T00:00:00")), ("COMPLETED", utc("2025-03-01T01:00:05"))]


def test_gpus_not_in_tres_are_unknown_not_zero(cstore, tmp_path):
    res = import_file(cstore, str(DATA / "sacct-json-23.11-gpus-not-in-tres.json"))
    assert res.gpus_unknown == [(1, "503")]
    j = cstore.query("SELECT gpus, gpu_source FROM sacct_jobs")[0]
    assert j == {"gpus": None, "gpu_source": "unknown: SubmitLine asks for GPUs, AllocTRES has no gres/gpu"}
    reps = run_reports(cstore, ["cost", "efficiency"], since=utc("2025-05-01T00:00:00"),
                       until=utc("2025-06-01T00:00:00"))
    row = reps[0].tables[0].rows[0]
    assert (row["group"], row["jobs"], row["gpu_hours"], row["gpu_cost"], row["gpu_unknown_jobs"]) == (
        "acct01", 1, None, None, 1)
    eff = reps[1].tables[0].rows[0]
    assert (eff["jobs"], eff["gpu_unknown_jobs"], eff["gpu_hours"], eff["mean_util_pct"]) == (0, 1, None, None)
    text = render(reps, "text", UTC, 0)
    line = next(x for x in text.splitlines() if x.startswith("acct01"))
    # jobs, GPU-h, jobs with GPU usage unknown, their job-hours, CPU-h, GPU cost, CPU cost, cost
    assert line.split()[:8] == ["acct01", "1", "unknown", "1", "0.00", "0.00", "unknown", "0.00"]
    assert "GPU usage unknown for 1 job(s)" in text


def test_gpus_from_reqtres_and_gres_fields(cstore):
    head = "JobIDRaw|State|Start|End|ElapsedRaw|AllocTRES|ReqTRES|AllocGRES\n"
    import_text(cstore, head + "1|COMPLETED|2025-03-01T00:00:00|2025-03-01T01:00:00|3600|cpu=1|cpu=1,gres/gpu=3|\n"
                "2|COMPLETED|2025-03-01T00:00:00|2025-03-01T01:00:00|3600|cpu=1|cpu=1|gpu:v100:2(IDX:0-1)\n"
                "3|COMPLETED|2025-03-01T00:00:00|2025-03-01T01:00:00|3600|cpu=1|cpu=1|\n", tz=UTC)
    assert [tuple(r.values()) for r in cstore.query("SELECT job_id_raw, gpus, gpu_type, gpu_source FROM sacct_jobs "
                                                    "ORDER BY 1")] == [
        (1, 3, None, "ReqTRES"), (2, 2, "v100", "AllocGRES"), (3, 0, None, "none: AllocTRES")]


def test_live_sync_marks_untracked_gpus_unknown(cstore):
    # AccountingStorageTRES without gres/gpu (scontrol show config): a TRES without GPUs is not 0 GPUs
    import_text(cstore, "JobIDRaw|State|AllocTRES\n1|COMPLETED|cpu=1,node=1\n", gpus_tracked=False)
    assert cstore.query("SELECT gpus, gpu_source FROM sacct_jobs") == [
        {"gpus": None, "gpu_source": "unknown: AccountingStorageTRES has no gres/gpu"}]


# --- jobstats JS1 ------------------------------------------------------------------------------
JS1_GPU = DATA / "sacct-p-jobstats-simple-gpu-job.txt"


def test_js1_decoding_of_jobstats_test_data():
    comment = JS1_GPU.read_text().splitlines()[1].split("|")[5]
    doc = decode_js1(comment)
    assert doc["gpus"] == 1 and doc["total_time"] == 50944
    (r,) = gpu_readings(doc)
    assert (r.node, r.gpu, r.util_pct, r.mem_used_bytes, r.mem_total_bytes) == (
        "della-l01g13", "1", 98.6, 83314868224, 85899345920)
    assert decode_js1("JS1:Short") is None and decode_js1("JS1:None") is None
    for bad, msg in (("JS1:!!!", "not base64"), ("JS1:aGVsbG8=", "not gzip"), ("xyz", "no JS1: prefix")):
        with pytest.raises(Js1Error, match=msg):
            decode_js1(bad)


def test_js1_gpu_without_utilisation_is_no_reading():
    rows = (DATA / "sacct-p-1-timeout-cancelled-gpu-jobstats.txt").read_text().splitlines()
    doc = decode_js1(rows[1].split("|")[0])
    assert [(r.gpu, r.util_pct) for r in gpu_readings(doc)] == [("2", None), ("3", 9.5)]


def test_js1_feeds_the_efficiency_report(cstore):
    res = import_file(cstore, str(JS1_GPU))
    assert res.summary() == f"{JS1_GPU}: 1 job(s) stored; 1 GPU utilisation reading(s) from jobstats AdminComments"
    (eff,) = run_reports(cstore, ["efficiency"], since=utc("2024-11-01T00:00:00"), until=utc("2024-12-01T00:00:00"))
    r = eff.tables[0].rows[0]
    gh = 50944 / 3600
    assert (r["group"], r["jobs"], r["jobs_with_summary"], r["jobs_no_summary"]) == ("cs", 1, 1, 0)
    assert r["gpu_hours"] == pytest.approx(gh) and r["mean_util_pct"] == pytest.approx(98.6)
    assert r["util_weighted_gpu_hours"] == pytest.approx(gh * 0.986)
    # importing again replaces, never doubles, the readings
    import_file(cstore, str(JS1_GPU))
    assert cstore.query("SELECT COUNT(*) AS n FROM job_gpu_util")[0]["n"] == 1


def test_cli_two_keys_month_and_filters(tmp_path):
    cfg = tmp_path / "g.toml"
    cfg.write_text(f'[paths]\nstore = "{tmp_path}/n.db"\ncluster_store = "{tmp_path}/c.db"\n'
                   '[reports]\ntimezone = "UTC"\n')
    env = {"GPUGUARD_CONFIG": str(cfg), "TZ": "UTC"}
    r = CliRunner().invoke(main, ["report", "sync", "--from-file", str(HANDMADE)], env=env)
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["report", "cost", "--since", "2025-02-01", "--until", "2025-04-01",
                                  "--by", "account,user", "--per", "month", "--format", "csv",
                                  "--account", "physics", "--user", "alice,bob"], env=env)
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].startswith("period,group,group2,jobs,gpu_hours,")
    assert [x.split(",")[:5] for x in lines[1:]] == [
        ["2025-02", "physics", "alice", "1", "2.0"], ["2025-03", "physics", "alice", "4", "50.0"],
        ["2025-03", "physics", "bob", "1", "5.0"], ["", "TOTAL", "", "5", "57.0"]]  # job 112 spans both months
    r = CliRunner().invoke(main, ["report", "cost", "--by", "account,user,qos"], env=env)
    assert r.exit_code == 2 and "at most 2 keys" in r.output


def test_migration_keeps_stored_rows_and_unknowns_their_unproven_zero_gpus():
    import sqlite_utils

    from gpuguard.reports.schema import DDL, INDEXES, migrate_sacct_attempts

    db = sqlite_utils.Database(memory=True)
    db.execute(DDL)
    for sql in INDEXES:
        db.execute(sql)
    for raw, tres, gpus, submit in ((1, "cpu=1,gres/gpu=2", 2, 100.0), (2, "cpu=1", 0, 200.0), (3, None, 0, None)):
        db.execute("INSERT INTO sacct_jobs (cluster, job_id_raw, job_id, state, gpus, alloc_tres, submit_at) "
                   "VALUES ('c', ?, ?, 'COMPLETED', ?, ?, ?)", [raw, str(raw), gpus, tres, submit])
    migrate_sacct_attempts(db)
    assert [tuple(r) for r in db.execute("SELECT job_id_raw, gpus, gpu_source, attempt_at FROM sacct_jobs "
                                         "ORDER BY 1").fetchall()] == [
        (1, 2, "AllocTRES", 100.0), (2, 0, "none: AllocTRES", 200.0),
        (3, None, "unknown: no AllocTRES/ReqTRES/GRES field", 0.0)]


def test_readme_sacct_command_asks_for_every_field_sync_reads():
    import pathlib
    import re

    from gpuguard.reports.sacct import SACCT_FIELDS

    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    (fmt,) = re.findall(r"--format=(\S+) \\\n  > jobs\.txt", readme)
    assert fmt.split(",") == list(SACCT_FIELDS)
    assert "sacct -a -X -D -P -S" in readme


def test_every_index_path_gives_the_same_usage(cstore):
    # 400 one-hour 1-GPU jobs, one every 6 h over 100 days, plus one 3-day job: a window
    # early, in the middle and late in the history takes a different index each
    from gpuguard.reports.queries import _usage_where

    head = "JobIDRaw|Account|State|Start|End|ElapsedRaw|AllocTRES\n"
    t0 = utc("2025-01-01T00:00:00")
    rows = [f"{i}|a|COMPLETED|{int(t0 + i * 21600)}|{int(t0 + i * 21600 + 3600)}|3600|gres/gpu=1\n" for i in range(400)]
    rows.append(f"999|b|COMPLETED|{int(t0 + 40 * 86400)}|{int(t0 + 43 * 86400)}|259200|gres/gpu=2\n")
    import_text(cstore, head + "".join(rows), tz=UTC)
    paths = set()
    for day in (1, 41, 98):
        a, b = t0 + day * 86400, t0 + (day + 1) * 86400
        w = _usage_where(cstore, a, b, None)
        paths.add(w.split(" AND ")[0])
        got = {r["group"]: r["gpu_hours"] for r in cost(cstore, since=a, until=b).tables[0].rows}
        expect = {"a": 4.0, **({"b": 48.0} if day == 41 else {})}
        assert got == expect, (day, w)
    assert len(paths) == 3, paths  # start_at bound, span bound and usage_end_at bound were all used
