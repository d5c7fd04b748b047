"""sacct cache: idempotent upsert, re-sync of pending/running jobs, malformed rows,
incremental live sync through a fake sacct, and the `gpuguard report sync` command."""

from __future__ import annotations

import json
import os
import textwrap
from zoneinfo import ZoneInfo

import pytest
from click.testing import CliRunner
from reports_helpers import DATA, HANDMADE, cache_store, open_cache_store, utc

from gpuguard.cli import main
from gpuguard.reports.sacct import SACCT_FIELDS
from gpuguard.reports.sacct_live import RECORD_FIELDS
from gpuguard.reports.sync import CURSOR, import_file, import_text, last_sync, sync_from_slurm
from gpuguard.slurm import SlurmCli

UTC = ZoneInfo("UTC")
HEAD = "JobIDRaw|JobID|Account|State|Submit|Eligible|Start|End|ElapsedRaw|ExitCode|AllocTRES|Comment\n"


@pytest.fixture
def cstore(tmp_path):
    yield from cache_store(tmp_path)


def rows(store, sql="SELECT job_id_raw, state, start_at, end_at, exit_code FROM sacct_jobs ORDER BY job_id_raw"):
    return [tuple(r.values()) for r in store.query(sql)]


def test_migration_creates_the_cache(cstore):
    cols = [r["name"] for r in cstore.query("SELECT name FROM pragma_table_info('sacct_jobs')")]
    assert cols[:3] == ["cluster", "job_id_raw", "job_id"]
    pk = [r["name"] for r in cstore.query("SELECT name FROM pragma_table_info('sacct_jobs') WHERE pk > 0 ORDER BY pk")]
    assert pk == ["cluster", "job_id_raw", "attempt_at"]


def test_import_handmade_twice_is_idempotent(cstore):
    a = import_file(cstore, str(HANDMADE), tz=UTC)
    before = cstore.query("SELECT * FROM sacct_jobs ORDER BY job_id_raw")
    b = import_file(cstore, str(HANDMADE), tz=UTC)
    after = cstore.query("SELECT * FROM sacct_jobs ORDER BY job_id_raw")
    assert (a.jobs, b.jobs, a.malformed, b.malformed) == (14, 14, [], [])
    assert len(after) == 14
    strip = [{k: v for k, v in r.items() if k != "synced_at"} for r in before]
    assert strip == [{k: v for k, v in r.items() if k != "synced_at"} for r in after]


def test_resync_updates_pending_and_running_but_never_reverts_a_final_state(cstore):
    first = HEAD + textwrap.dedent("""\
        1|1|a|RUNNING|2025-03-01T00:00:00|2025-03-01T00:00:00|2025-03-01T01:00:00|Unknown|600|0:0|cpu=1,gres/gpu=1|
        2|2|a|PENDING|2025-03-01T00:00:00|2025-03-01T00:00:00|Unknown|Unknown|0|0:0||
    """)
    later = HEAD + textwrap.dedent("""\
        1|1|a|COMPLETED|2025-03-01T00:00:00|2025-03-01T00:00:00|2025-03-01T01:00:00|2025-03-01T03:00:00|7200|0:0|cpu=1,gres/gpu=1|
        2|2|a|RUNNING|2025-03-01T00:00:00|2025-03-01T00:00:00|2025-03-01T02:00:00|Unknown|3600|0:0|cpu=1,gres/gpu=2|
    """)
    import_text(cstore, first, tz=UTC)
    assert rows(cstore) == [(1, "RUNNING", utc("2025-03-01T01:00:00"), None, 0), (2, "PENDING", None, None, 0)]
    import_text(cstore, later, tz=UTC)
    done = [(1, "COMPLETED", utc("2025-03-01T01:00:00"), utc("2025-03-01T03:00:00"), 0),
            (2, "RUNNING", utc("2025-03-01T02:00:00"), None, 0)]
    assert rows(cstore) == done
    assert rows(cstore, "SELECT gpus, usage_end_at FROM sacct_jobs WHERE job_id_raw = 2") == [
        (2, utc("2025-03-01T03:00:00"))]
    # an old paste replayed after the newer sync: job 1 stays COMPLETED
    import_text(cstore, first, tz=UTC)
    assert rows(cstore)[0] == done[0]
    assert cstore.query("SELECT COUNT(*) AS n FROM sacct_jobs") == [{"n": 2}]


def test_json_import_keeps_the_exit_code_from_p(cstore):
    text = HEAD + "301|301|physics|FAILED|2025-03-03T11:06:40|2025-03-03T11:06:40|2025-03-03T11:07:40|2025-03-03T12:07:40|3600|3:0|cpu=4,gres/gpu=2|\n"
    import_text(cstore, text, tz=UTC, cluster="tb")
    import_file(cstore, str(DATA / "sacct-json-22.05-dbv0.0.38-constructed.json"))
    assert rows(cstore, "SELECT job_id_raw, exit_code, exit_signal, template, cluster FROM sacct_jobs "
                        "WHERE job_id_raw IN (301, 302) ORDER BY 1") == [(301, 3, 0, "t1", "tb"), (302, 0, 9, None, "tb")]


def test_malformed_rows_are_reported_with_their_line_and_skipped(cstore, tmp_path):
    import_text(cstore, HEAD + "50|50|keep|COMPLETED|||||10|0:0||\n", tz=UTC)
    bad = tmp_path / "bad.txt"
    bad.write_text(HEAD + textwrap.dedent("""\
        1|1|a|COMPLETED|2025-03-01T00:00:00|2025-03-01T00:00:00|2025-03-01T00:00:00|2025-03-01T01:00:00|3600|0:0|cpu=1|
        2|2|a|COMPLETED|2025-03-01T00:00:00
        3|3|a|COMPLETED|yesterday|2025-03-01T00:00:00|2025-03-01T00:00:00|2025-03-01T01:00:00|3600|0:0|cpu=1|
        3.batch|3.batch|a|COMPLETED|||||3600|0:0||
        4|4|a|FAILED|2025-03-01T00:00:00|2025-03-01T00:00:00|2025-03-01T00:00:00|2025-03-01T01:00:00|3600|2:0|gres/gpu=x|
        5|5|a|FAILED|2025-03-01T00:00:00|2025-03-01T00:00:00|2025-03-01T00:00:00|2025-03-01T01:00:00|3600|1:0|cpu=1|
    """))
    res = import_file(cstore, str(bad), tz=UTC)
    assert res.malformed == [
        (3, "5 fields, header has 12"),
        (4, "time 'yesterday' is not YYYY-MM-DDTHH:MM:SS"),
        (6, "AllocTRES gres/gpu='x': GPU count is not an integer"),
    ]
    assert (res.jobs, res.steps_skipped) == (2, 1)
    assert [r[0] for r in rows(cstore)] == [1, 5, 50]  # the row stored before survives


FAKE_SACCT = """#!{python}
# Prints the jobs of sacct.records.json (a list of field -> text), else the lines of
# sacct.out (SACCT_FIELDS order), with the --format fields asked, as sacct -P does: free
# text raw; --json prints sacct.json.
import json, os, sys
open({log!r}, "a").write(json.dumps(sys.argv[1:]) + "\\n")
if "--json" in sys.argv:
    sys.stdout.write(open({out!r}[:-4] + ".json").read())
    sys.exit(0)
full = {fields!r}
fmt = next(a for a in sys.argv if a.startswith("--format=")).split("=", 1)[1].split(",")
recs = {out!r}[:-4] + ".records.json"
if os.path.exists(recs):
    jobs = json.load(open(recs))
else:
    jobs = [dict(zip(full, line.split("\\x1f"))) for line in open({out!r}).read().splitlines() if line]
sys.stdout.write("".join("\\x1f".join(j[f] for f in fmt) + "\\n" for j in jobs))
"""


def _fake_sacct(tmp_path, output: str):
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    out = tmp_path / "sacct.out"
    out.write_text(output)
    log = tmp_path / "sacct.log"
    exe = bindir / "sacct"
    exe.write_text(FAKE_SACCT.format(python=os.environ.get("PYTHON", "/usr/bin/env python3"), log=str(log), out=str(out),
                                     fields=list(SACCT_FIELDS)))
    exe.chmod(0o755)
    return str(bindir), log


def _live_line(raw: int, state: str, start: str, end: str, elapsed: int) -> str:
    vals = {"JobIDRaw": str(raw), "JobID": str(raw), "Cluster": "tb", "JobName": "j", "User": "u", "Account": "a|b",
            "Partition": "gpu", "QOS": "normal", "Submit": "2025-03-01T00:00:00", "Eligible": "2025-03-01T00:00:00",
            "Start": start, "End": end, "ElapsedRaw": str(elapsed), "State": state, "ExitCode": "0:0",
            "AllocTRES": "cpu=2,gres/gpu=1", "AllocCPUS": "2", "NNodes": "1", "NodeList": "n1",
            "Comment": "gpuguard:template=x | note", "AdminComment": "", "ReqTRES": "cpu=2,gres/gpu=1",
            "TimelimitRaw": "120"}
    return "\x1f".join(vals[f] for f in SACCT_FIELDS) + "\n"


def test_live_sync_is_incremental_and_reads_the_unit_separator(cstore, tmp_path, monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    out = _live_line(7, "RUNNING", "2025-03-01T01:00:00", "Unknown", 60)
    bindir, log = _fake_sacct(tmp_path, out)
    slurm = SlurmCli(bindir)
    t0 = utc("2025-03-01T01:01:00")
    res = sync_from_slurm(cstore, slurm, now=t0, first_sync_days=2)
    assert (res.jobs, res.malformed, res.since, res.until) == (1, [], t0 - 2 * 86400, t0)
    assert last_sync(cstore) == t0 and cstore.get_cursor(CURSOR) == repr(t0)
    argv = [json.loads(x) for x in log.read_text().splitlines()]
    assert argv[0] == ["-X", "-a", "-D", "-P", "-n", "--delimiter=\x1f", "--format=" + ",".join(SACCT_FIELDS),
                       "-S", "2025-02-27T01:01:00", "-E", "2025-03-01T01:01:00"]
    # then the record list without the free-text fields (one line per job whatever they hold)
    assert argv[1] == ["-X", "-a", "-D", "-P", "-n", "--delimiter=\x1f", "--format=" + ",".join(RECORD_FIELDS),
                       "-S", "2025-02-27T01:01:00", "-E", "2025-03-01T01:01:00"]
    assert len(argv) == 2 and "JobName" not in RECORD_FIELDS and "Comment" not in RECORD_FIELDS
    # second sync: from the last one minus the overlap; the job finished meanwhile
    (tmp_path / "sacct.out").write_text(_live_line(7, "COMPLETED", "2025-03-01T01:00:00", "2025-03-01T02:00:00", 3600))
    sync_from_slurm(cstore, slurm, now=t0 + 7200, overlap_s=300)
    argv = [json.loads(x) for x in log.read_text().splitlines()]
    assert argv[2][-4:] == ["-S", "2025-03-01T00:56:00", "-E", "2025-03-01T03:01:00"]
    assert rows(cstore, "SELECT state, account, comment, template, gpus, end_at FROM sacct_jobs") == [
        ("COMPLETED", "a|b", "gpuguard:template=x | note", "x", 1, utc("2025-03-01T02:00:00"))]


# --- the command ----------------------------------------------------------------------------
def _cfg(tmp_path, extra: str = "") -> dict[str, str]:
    p = tmp_path / "gpuguard.toml"
    p.write_text(f'[paths]\nstore = "{tmp_path}/node.db"\ncluster_store = "{tmp_path}/cluster.db"\n'
                 f'[slurm]\nbin_dir = "{tmp_path}/bin"\n{extra}')
    return {"GPUGUARD_CONFIG": str(p), "TZ": "UTC"}


def test_cli_sync_from_file_and_exit_codes(tmp_path):
    env = _cfg(tmp_path, '[reports]\ntimezone = "UTC"\n')
    r = CliRunner().invoke(main, ["report", "sync", "--from-file", str(HANDMADE)], env=env)
    assert (r.exit_code, r.output) == (0, f"{HANDMADE}: 14 job(s) stored\n")
    bad = tmp_path / "bad.txt"
    bad.write_text("JobIDRaw|State\n1|COMPLETED\nnot-a-job|FAILED\n")
    r = CliRunner().invoke(main, ["report", "sync", "--from-file", str(bad)], env=env)
    assert r.exit_code == 1
    assert f"{bad}:3: skipped malformed row: JobID 'not-a-job' is not NNN, NNN_T, NNN+K or a step of one" in r.output
    r = CliRunner().invoke(main, ["report", "sync", "--from-file", str(DATA / "sacct-default-pending-2019.txt")], env=env)
    assert r.exit_code == 2
    assert r.output.strip() == (f"Error: {DATA / 'sacct-default-pending-2019.txt'}:1: fixed-width sacct output; "
                                "save it with sacct -P (or -p)")
    r = CliRunner().invoke(main, ["report", "sync", "--from-file", str(tmp_path / "nope.txt")], env=env)
    assert (r.exit_code, r.output.strip()) == (2, f"Error: {tmp_path / 'nope.txt'}: no such file")
    broken = tmp_path / "broken.json"
    broken.write_text('{"jobs": [\n{"job_id": 1,\n')
    r = CliRunner().invoke(main, ["report", "sync", "--from-file", str(broken)], env=env)
    assert r.exit_code == 2 and r.output.startswith(f"Error: {broken}:3: invalid JSON")
    r = CliRunner().invoke(main, ["report", "sync", "--from-file", str(HANDMADE), "--timezone", "Nowhere/Land"], env=env)
    assert r.exit_code == 2 and "unknown timezone 'Nowhere/Land'" in r.output


def test_cli_sync_from_a_fifo_or_device_names_what_it_is(tmp_path):
    """A FIFO or a device given as --from-file exits 2 with one line saying what it is
    (not "no such file", which sends the operator looking for a missing path)."""
    import os

    env = _cfg(tmp_path, '[reports]\ntimezone = "UTC"\n')
    fifo = tmp_path / "sacct.fifo"
    os.mkfifo(fifo)
    for path in (str(fifo), "/dev/null"):
        r = CliRunner().invoke(main, ["report", "sync", "--from-file", path], env=env)
        assert (r.exit_code, r.output) == (2, f"Error: {path}: not a regular file\n")


def test_cli_sync_live_failure_is_exit_1(tmp_path):
    env = _cfg(tmp_path)
    r = CliRunner().invoke(main, ["report", "sync"], env=env)
    assert r.exit_code == 1
    assert f"{tmp_path}/bin/sacct: not found" in r.output


# --- hostile input --------------------------------------------------------------------------
FULL_HEAD = "|".join(SACCT_FIELDS) + "\n"


def _full_row(raw: int, *, name: str = "n", comment: str = "", tres: str = "cpu=8,gres/gpu=4", cpus: str = "8",
              exit_code: str = "0:0", start: str = "2026-11-01T10:05:00") -> str:
    return "|".join([str(raw), str(raw), "c1", name, "u", "a", "gpu", "normal", "2026-11-01T10:00:00",
                     "2026-11-01T10:00:00", start, "2026-11-01T12:05:00", "7200", "COMPLETED", exit_code, tres,
                     cpus, "1", "n1", comment, "", tres, "60"]) + "\n"


def test_cli_sync_oversized_and_impossible_rows_are_skipped_the_rest_stored(tmp_path):
    env = _cfg(tmp_path, '[reports]\ntimezone = "UTC"\n')
    big = "99999999999999999999999"
    f = tmp_path / "hostile.txt"
    f.write_text(FULL_HEAD + _full_row(2000) + _full_row(2001, tres=f"cpu=8,gres/gpu={big}")
                 + _full_row(2002, cpus=big) + _full_row(2003, exit_code="99999999999999999999:0")
                 + _full_row(2004, tres="cpu=8,gres/gpu=-4") + _full_row(2005, start="9999-12-31T23:59:59")
                 + _full_row(2006, name="a|b", comment="gpuguard:template=t|x"))
    r = CliRunner().invoke(main, ["report", "sync", "--from-file", str(f)], env=env)
    assert (r.exit_code, r.output) == (1, "".join(f"{f}:{line}: skipped malformed row: {msg}\n" for line, msg in [
        (3, f"AllocTRES gres/gpu={big}: GPU count is more than 1000000"),
        (4, f"AllocCPUS {big} is out of range (at most 1000000)"),
        (5, "ExitCode status 99999999999999999999 is out of range (at most 9223372036854775807)"),
        (6, "AllocTRES gres/gpu=-4: GPU count is negative"),
        (7, "Start 9999-12-31T23:59:59 is after End 2026-11-01T12:05:00"),
    ]) + f"{f}: 2 job(s) stored, 5 malformed row(s) skipped\n")
    from reports_helpers import open_cache_store

    s = open_cache_store(tmp_path / "cluster.db")
    try:
        assert rows(s, "SELECT job_id_raw, job_name, comment, template, gpus, cpus, charge_s FROM sacct_jobs "
                       "ORDER BY 1") == [(2000, "n", None, None, 4, 8, 7200), (2006, "a|b", "gpuguard:template=t|x",
                                                                              "t", 4, 8, 7200)]
    finally:
        s.close()


def test_cli_sync_ambiguous_pipe_is_stored_with_a_note(tmp_path):
    env = _cfg(tmp_path, '[reports]\ntimezone = "UTC"\n')
    mid = "acct|2026-11-01T10:00:00|2026-11-01T12:00:00|COMPLETED|gres/gpu=2"
    f = tmp_path / "amb.txt"
    f.write_text(f"JobIDRaw|JobName|Account|Start|End|State|AllocTRES|Comment\n7|x|{mid}|{mid}|{mid}|y\n")
    r = CliRunner().invoke(main, ["report", "sync", "--from-file", str(f)], env=env)
    assert (r.exit_code, r.output) == (0, f"{f}:2: note: the extra '|' may belong to JobName/Comment "
                                          "(3 readings): stored with JobName/Comment unknown\n"
                                          f"{f}: 1 job(s) stored (1 with JobName/Comment unknown)\n")
    r = CliRunner().invoke(main, ["report", "cost", "--since", "2026-11-01", "--until", "2026-11-02", "--format",
                                  "csv"], env=env)
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[:2] == ["group,jobs,gpu_hours,cpu_hours,gpu_cost,cpu_cost,cost,failed_cost,"
                                         "timeout_cost,node_fail_cost", "acct,1,4.0,0.0,0.0,0.0,0.0,0.0,0.0,0.0"]


# --- bulk load: indexes set aside and rebuilt in one transaction ------------------------------
def _index_sql(store):
    return sorted((r["name"], r["sql"]) for r in store.query(
        "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND tbl_name = 'sacct_jobs' AND sql IS NOT NULL"))


def test_bulk_load_stores_what_the_batched_path_stores_and_keeps_every_index(tmp_path, monkeypatch):
    import gpuguard.reports.sync as sync_mod

    stores = []
    for name, bulk_min in (("batched", 10**9), ("bulk", 1)):
        monkeypatch.setattr(sync_mod, "BULK_MIN_ROWS", bulk_min)
        s = next(cache_store(tmp_path / name))
        indexes = _index_sql(s)
        res = import_file(s, str(HANDMADE), tz=UTC, synced_at=1.0)
        assert (res.jobs, res.malformed) == (14, [])
        assert _index_sql(s) == indexes and len(indexes) == 6
        stores.append(s)
    batched, bulk = (s.query("SELECT * FROM sacct_jobs ORDER BY job_id_raw, attempt_at") for s in stores)
    assert len(bulk) == 14 and bulk == batched
    # the rebuilt indexes answer (and are used by) the reports' range queries
    plan = " ".join(r["detail"] for r in stores[1].query("EXPLAIN QUERY PLAN SELECT COUNT(*) FROM sacct_jobs "
                                                         "WHERE start_at >= 0"))
    assert "sacct_jobs_start" in plan
    assert stores[1].query("PRAGMA integrity_check") == [{"integrity_check": "ok"}]


def test_bulk_load_keeps_the_raw_id_index_current_and_sets_the_others_aside(cstore):
    from gpuguard.reports.sync_bulk import set_indexes_aside

    import_file(cstore, str(HANDMADE), tz=UTC, synced_at=1.0)
    conn = cstore.db.conn
    with pytest.raises(KeyError):  # rolls the drops back
        with cstore.tx():
            aside = set_indexes_aside(conn)
            left = [n for n, _ in _index_sql(cstore)]
            plan = " ".join(r[3] for r in conn.execute("EXPLAIN QUERY PLAN SELECT rowid FROM sacct_jobs "
                                                        "WHERE job_id_raw = 5"))
            raise KeyError
    assert len(_index_sql(cstore)) == 6
    assert sorted(n for n, _ in aside) == ["sacct_jobs_by_account", "sacct_jobs_end", "sacct_jobs_pending",
                                           "sacct_jobs_start", "sacct_jobs_usage_end"]
    assert left == ["sacct_jobs_raw"] and "sacct_jobs_raw" in plan


def test_the_wait_reports_pending_tables_use_the_partial_pending_index(cstore):
    from gpuguard.reports.queries import wait_report

    import_file(cstore, str(HANDMADE), tz=UTC, synced_at=1.0)
    assert [n for n, _ in _index_sql(cstore) if "state" in n or "pending" in n] == ["sacct_jobs_pending"]
    seen: list[str] = []
    cstore.db.conn.set_trace_callback(seen.append)
    try:
        wait_report(cstore, since=0.0, until=2e9)
    finally:
        cstore.db.conn.set_trace_callback(None)
    pending = [q for q in seen if "state = 'PENDING'" in q and not q.startswith("EXPLAIN")]
    assert len(pending) == 2
    for q in pending:
        plan = " ".join(r[3] for r in cstore.db.conn.execute("EXPLAIN QUERY PLAN " + q))
        assert "sacct_jobs_pending" in plan, plan


def test_bulk_load_failing_part_way_leaves_the_store_as_it_was(cstore, monkeypatch):
    import gpuguard.reports.sync as sync_mod
    from gpuguard.reports.sacct import TimeConverter, iter_pipe

    import_file(cstore, str(HANDMADE), tz=UTC, synced_at=1.0)
    before, indexes = cstore.query("SELECT * FROM sacct_jobs ORDER BY job_id_raw"), _index_sql(cstore)
    monkeypatch.setattr(sync_mod, "BULK_MIN_ROWS", 1)
    monkeypatch.setattr(sync_mod, "BATCH", 3)

    def jobs():
        with open(HANDMADE, newline="") as fh:
            for i, r in enumerate(iter_pipe(fh, conv=TimeConverter(UTC))):
                if i == 7:
                    raise OSError("disk gone")
                if r.job is not None:
                    r.job["state"] = "CANCELLED"
                    yield r.job
    with pytest.raises(OSError, match="disk gone"):
        sync_mod.upsert_jobs(cstore, jobs(), synced_at=2.0, expect_rows=100)
    assert cstore.query("SELECT * FROM sacct_jobs ORDER BY job_id_raw") == before
    assert _index_sql(cstore) == indexes


def test_large_import_is_a_bulk_load_and_a_small_one_is_not(cstore, monkeypatch):
    import gpuguard.reports.sync as sync_mod

    seen = []
    real = sync_mod._bulk_load
    monkeypatch.setattr(sync_mod, "_bulk_load", lambda *a: seen.append("bulk") or real(*a))
    monkeypatch.setattr(sync_mod, "BULK_MIN_ROWS", 10)
    import_file(cstore, str(HANDMADE), tz=UTC)  # 14 jobs into an empty store: bulk
    assert seen == ["bulk"]
    small = HEAD + "900|900|a|COMPLETED|2025-03-01T00:00:00|2025-03-01T00:00:00|2025-03-01T01:00:00|" \
                   "2025-03-01T02:00:00|3600|0:0|cpu=1|\n"
    import_text(cstore, small, tz=UTC)  # 1 job: below the threshold, batched
    assert seen == ["bulk"]
    assert cstore.query("SELECT COUNT(*) AS n FROM sacct_jobs")[0]["n"] == 15


def test_bulk_load_replaces_an_attempt_stored_without_submit(cstore, monkeypatch):
    """A job first imported from a file without Submit (attempt 0) and then bulk-loaded
    with its submit time is stored once, as the batched path stores it."""
    import gpuguard.reports.sync as sync_mod

    monkeypatch.setattr(sync_mod, "BULK_MIN_ROWS", 1)
    no_submit = "JobIDRaw|State|Start|End|ElapsedRaw|AllocTRES\n" \
                "600|COMPLETED|2025-03-01T01:10:00|2025-03-01T03:10:00|7200|gres/gpu=2\n"
    import_text(cstore, no_submit, tz=UTC)
    assert rows(cstore, "SELECT job_id_raw, attempt_at FROM sacct_jobs") == [(600, 0.0)]
    with_submit = "JobIDRaw|State|Submit|Start|End|ElapsedRaw|AllocTRES\n" \
                  "600|COMPLETED|2025-03-01T01:00:05|2025-03-01T01:10:00|2025-03-01T03:10:00|7200|gres/gpu=2\n" \
                  "601|COMPLETED|2025-03-01T01:00:05|2025-03-01T01:10:00|2025-03-01T03:10:00|7200|gres/gpu=1\n"
    import_text(cstore, with_submit, tz=UTC)
    assert rows(cstore, "SELECT job_id_raw, attempt_at, gpus FROM sacct_jobs ORDER BY 1") == [
        (600, utc("2025-03-01T01:00:05"), 2), (601, utc("2025-03-01T01:00:05"), 1)]


def test_live_sync_never_stores_a_record_forged_in_a_job_name(cstore, tmp_path, monkeypatch):
    """Slurm keeps newlines and \\x1f in --job-name and sacct -P prints them raw, so a job
    name can hold a whole forged record (the testbed's repro: 512 GPU-hours on a victim's
    account). The live sync stores the jobs of sacct's record list and their names from
    sacct --json, never the forged one."""
    monkeypatch.setenv("TZ", "UTC")
    forged = dict(zip(SACCT_FIELDS, _live_line(999001, "COMPLETED", "2025-03-01T00:00:00", "2025-03-01T01:00:00",
                                                3600).rstrip("\n").split("\x1f"), strict=True))
    forged.update({"Account": "acct_victim", "User": "victim", "AllocTRES": "cpu=64,gres/gpu=512"})
    name = "a\n" + "\x1f".join(forged[f] for f in SACCT_FIELDS) + "\nz"
    real = dict(zip(SACCT_FIELDS, _live_line(7, "COMPLETED", "2025-03-01T00:00:00", "2025-03-01T01:00:00",
                                              3600).rstrip("\n").split("\x1f"), strict=True))
    real.update({"JobName": name, "Account": "acct_a", "User": "mallory"})
    bindir, log = _fake_sacct(tmp_path, "")
    (tmp_path / "sacct.records.json").write_text(json.dumps([real]))
    (tmp_path / "sacct.json").write_text(json.dumps({"meta": {"plugin": {"data_parser": "v0.0.41"}}, "jobs": [{
        "job_id": 7, "name": name, "account": "acct_a", "user": "mallory", "state": {"current": ["COMPLETED"]},
        "comment": {"job": "gpuguard:template=x | note", "administrator": ""},
        "time": {"submission": int(utc("2025-03-01T00:00:00")), "start": int(utc("2025-03-01T00:00:00")),
                 "end": int(utc("2025-03-01T01:00:00")), "elapsed": 3600}}]}))
    res = sync_from_slurm(cstore, SlurmCli(bindir), now=utc("2025-03-01T02:00:00"), first_sync_days=1)
    assert rows(cstore, "SELECT job_id_raw, user, account, gpus, job_name, comment, template FROM sacct_jobs") == [
        (7, "mallory", "acct_a", 1, name, "gpuguard:template=x | note", "x")]
    assert (res.jobs, res.malformed, res.notes) == (1, [], [])
    assert res.summary() == ("sacct: 1 job(s) stored; sacct printed 3 lines for 1 jobs: a JobName or Comment holds "
                             "a newline; jobs read from sacct's record list, JobName/Comment/AdminComment taken "
                             "from sacct --json")
    argv = [json.loads(x) for x in log.read_text().splitlines()]
    assert [a[-5] if "--json" in a else a[6] for a in argv] == [
        "--format=" + ",".join(SACCT_FIELDS), "--format=" + ",".join(RECORD_FIELDS), "--json"]


def _fuzzed_sacct(path, seed: int, n: int = 300) -> None:
    """A ``-P`` file of every shape the two paths must store alike: requeued attempts (one job
    id, several submit times), a job first PENDING then final and then RUNNING again (a
    final state must stay), attempts without Submit, steps, ``|`` in JobName/Comment,
    jobstats AdminComments, and malformed rows (bad time, Start after End, short rows)."""
    import random

    rnd = random.Random(seed)
    states = ["COMPLETED", "FAILED", "TIMEOUT", "CANCELLED by 1000", "RUNNING", "PENDING", "NODE_FAIL",
              "OUT_OF_MEMORY", "REQUEUED"]
    lines = ["|".join(SACCT_FIELDS)]
    for _ in range(n):
        jid = str(5000 + rnd.randrange(n // 3))  # about three records per job id
        sub = rnd.choice(["", f"2026-11-0{rnd.randint(1, 3)}T0{rnd.randint(0, 9)}:00:00"])
        start = rnd.choice(["Unknown", "", f"2026-11-04T0{rnd.randint(0, 9)}:{rnd.randint(10, 59)}:00"])
        end = rnd.choice(["Unknown", f"2026-11-05T0{rnd.randint(0, 9)}:00:00"] * 5 + ["2026-11-04T00:00:00"])
        name = rnd.choice(["train", "a|b", "", "x|y|z"])
        comment = rnd.choice(["", "gpuguard:template=llm", "p|q", "JS1:Short"])
        tres = rnd.choice(["cpu=8,gres/gpu=2", "cpu=4", "", "cpu=8,gres/gpu:a100=4"] * 5 + ["gres/gpu=-1"])
        jobid = jid if rnd.random() > 0.1 else f"{jid}.batch"
        fields = [jid, jobid, rnd.choice(["", "c1"]), name, rnd.choice(["u1", "u2", ""]), rnd.choice(["a1", "a2"]),
                  "gpu", "normal", sub, sub, start, end, rnd.choice(["3600", ""] * 10 + ["-5", "x"]), rnd.choice(states),
                  rnd.choice(["0:0", "1:0", "0:9", ""]), tres, rnd.choice(["8", "", "Unknown"]),
                  rnd.choice(["1", "2", ""]), "n[1-2]", comment, rnd.choice(["", "JS1:None", "admin"]),
                  tres, rnd.choice(["60", "UNLIMITED", ""])]
        if rnd.random() < 0.03:
            fields = fields[:5]
        if rnd.random() < 0.03:
            fields[10] = "2026-13-45T99:00:00"
        lines.append("|".join(fields))
    path.write_text("\n".join(lines) + "\n")


def _corpus_inputs(tmp_path):
    # the fixed-width file is refused as a whole (its own test), the same on both paths
    files = sorted(p for p in DATA.iterdir() if p.name.startswith("sacct-") and "default-pending" not in p.name)
    if HANDMADE not in files:
        files.append(HANDMADE)
    # readings of the extra ``|`` that agree on the usage: stored with JobName/Comment unknown and a note
    mid = "acct|2026-11-01T10:00:00|2026-11-01T12:00:00|COMPLETED|gres/gpu=2"
    amb = tmp_path / "ambiguous.txt"
    amb.write_text(f"JobIDRaw|JobName|Account|Start|End|State|AllocTRES|Comment\n7|x|{mid}|{mid}|{mid}|y\n"
                   f"8|n|{mid}|c\n")
    files.append(amb)
    for seed in (1, 2, 3):
        f = tmp_path / f"fuzzed-{seed}.txt"
        _fuzzed_sacct(f, seed)
        files.append(f)
    return files


def test_bulk_and_batched_paths_store_the_same_rows_and_say_the_same(tmp_path, monkeypatch):
    """Every corpus sacct file (``-P``, ``-p``, JSON) and three fuzzed ``-P`` files, each
    imported twice into one store (the second import meets every stored job): the bulk load,
    the parallel bulk load (:mod:`gpuguard.reports.sync_bulk`) and the batched upsert store
    equal rows (every column) and report the same skipped rows, notes and summary line."""
    import gpuguard.reports.sync as sync_mod
    import gpuguard.reports.sync_bulk as bulk_mod

    files = _corpus_inputs(tmp_path)
    assert len(files) >= 10, files
    noted, parallel = [], []
    real = bulk_mod.import_parallel
    monkeypatch.setattr(bulk_mod, "import_parallel", lambda *a, **k: parallel.append(a[1][0].source) or real(*a, **k))
    for f in files:
        seen = []
        for name, bulk_min, workers in (("batched", 10**9, 0), ("bulk", 1, 0), ("parallel", 1, 2)):
            monkeypatch.setattr(sync_mod, "BULK_MIN_ROWS", bulk_min)
            # parallel: two worker processes, a chunk every few lines (so chunk edges fall
            # inside every kind of row, and line numbers cross many chunks)
            monkeypatch.setattr(bulk_mod, "WORKERS", workers)
            monkeypatch.setattr(bulk_mod, "CHUNK_BYTES", 40)
            monkeypatch.setattr(sync_mod, "BATCH", 7)  # several batches even for a corpus file
            s = next(cache_store(tmp_path / f"{f.name}-{name}"))
            said = []
            for _ in range(2):
                res = import_file(s, str(f), tz=UTC, synced_at=1.0)
                said.append((res.jobs, res.malformed, res.notes, res.unreportable, res.gpus_unknown,
                             res.attempts, res.js1_readings, res.summary()))
            seen.append((said, s.query("SELECT * FROM sacct_jobs ORDER BY cluster, job_id_raw, attempt_at"),
                         s.query("SELECT * FROM job_gpu_util ORDER BY 1, 2")))
        assert seen[0] == seen[1], f.name
        assert seen[0] == seen[2], f.name
        noted += seen[0][0][0][2]
    assert noted  # a row stored with JobName/Comment unknown is among them
    # every -P file took the parallel path, twice (the JSON files have no chunks to cut)
    assert sorted(set(parallel)) == sorted(str(f) for f in files if f.read_text()[:1] != "{")
    assert len(parallel) == 2 * len(set(parallel)) >= 2 * 8
    # the fuzzed files reach the cases they are made for
    s = next(cache_store(tmp_path / "check"))
    res = import_file(s, str(files[-1]), tz=UTC, synced_at=1.0)
    assert res.malformed and res.steps_skipped and any(n > 1 for n in res.attempts.values())
    assert s.query("SELECT COUNT(*) AS n FROM sacct_jobs WHERE attempt_at = 0")[0]["n"] > 0


def test_bulk_load_cache_grows_with_the_expected_jobs_up_to_its_cap_and_is_restored(cstore, monkeypatch):
    import gpuguard.reports.sync as sync_mod

    seen = []
    real = sync_mod._bulk_load

    def spy(store, *a):
        seen.append(store.db.conn.execute("pragma cache_size").fetchone()[0])
        return real(store, *a)
    monkeypatch.setattr(sync_mod, "_bulk_load", spy)
    before = cstore.db.conn.execute("pragma cache_size").fetchone()[0]
    for expect in (20_000, 600_000, 10**8):
        sync_mod.upsert_jobs(cstore, [], expect_rows=expect)
    # KiB as a negative cache_size: 64 MiB floor, 256 B per expected job, 256 MiB cap
    assert seen == [-65536, -150000, -262144]
    assert cstore.db.conn.execute("pragma cache_size").fetchone()[0] == before


def _edge_rows_file(path, seed: int) -> None:
    """A ``-P`` file of the live sync's field list with rows of every common and odd shape: DST gaps and
    repeated hours, half-hour zones' changes, the ends of the time range, unset and epoch
    times, leading zeros, array/het/step ids, AdminComments, TRES without a GPU (ReqTRES
    then counts), counts at and past their limits, Start after End, CR and NUL in a line."""
    import random

    rnd = random.Random(seed)

    def pick(common: list[str], odd: list[str], p: float = 0.03) -> str:
        return rnd.choice(odd if odd and rnd.random() < p else common)
    times = ["2026-03-29T01:59:59", "2026-03-29T02:00:00", "2026-03-29T02:30:00", "2026-03-29T03:00:00",
             "2026-10-25T01:59:59", "2026-10-25T02:00:00", "2026-10-25T02:30:00", "2026-10-25T03:00:00",
             "2026-03-08T02:30:00", "2026-11-01T01:30:00", "2026-04-05T01:30:00", "2026-10-04T02:15:00",
             "2026-04-05T02:00:00", "2026-10-04T01:45:00", "Unknown", "Unknown", ""]
    odd_times = ["2026-11-04T10:59:60", "2026-11-04T10:60:00", "2026-11-04T24:00:00", "2026-02-30T10:00:00",
                 "0001-01-01T00:00:00", "0001-01-01T05:00:00", "9999-12-31T23:59:59", "9999-12-31T20:00:00",
                 "None", "N/A", "0", "1767225600", " 2026-11-04T10:00:00", "2026-11-04T10:00:00Z",
                 "2026-11-04 10:00:00", "2026-11-04T10:00", "\uff12026-11-04T10:00:00"]
    tres = ["billing=8,cpu=8,gres/gpu=2,mem=8G,node=1", "cpu=4,mem=4G", "", "cpu=8,gres/gpu:a100=4",
            "gres/gpumem=8G,cpu=1"]
    lines = ["|".join(SACCT_FIELDS)]
    for _ in range(400):
        jid = str(rnd.randrange(1, 300))
        raw = pick([jid], [f"0{jid}", "-4", "9" * 19, "12a", "9" * 18])
        jobid = pick([raw], [f"{raw}_3", f"{raw}+1", f"{raw}.batch", "", f"{raw}_[1-3]"], 0.08)
        sub, elig, start, end = (pick(times, odd_times) for _ in range(4))
        if rnd.random() < 0.5:
            elig = sub
        if start[:1] == end[:1] == "2" and start > end and rnd.random() < 0.9:
            start, end = end, start  # mostly Start before End
        al = pick(tres, ["gres/gpu=x", "cpu=2000000"])
        req = rnd.choice([al, al, "cpu=4,gres/gpu=1", ""])
        fields = [raw, jobid, rnd.choice(["", "c1"]), rnd.choice(["train", ""]), "u1", rnd.choice(["a1", ""]),
                  "gpu", "normal", sub, elig, start, end,
                  pick(["3600", "0", "120"], ["", "05", "3660000000", "99999999999", "-1"]),
                  pick(["COMPLETED", "FAILED", "CANCELLED by 1000", "RUNNING", "PENDING"], ["", "completed", "TIMEOUT+"]),
                  pick(["0:0", "1:0", "0:9", ""], ["x:1", "2"]), al, pick(["8", ""], ["Unknown", "01", "1000001"]),
                  pick(["1", ""], ["1000000", "1000001"]), rnd.choice(["n[1-2]", ""]),
                  pick(["", "gpuguard:template=llm"], ["JS1:Short", "gpuguard:template="], 0.1),
                  pick([""], ["admin", "JS1:None"], 0.05), req, pick(["60", "UNLIMITED", ""], ["x"])]
        line = "|".join(fields)
        if rnd.random() < 0.02:
            line = line.replace("|", "\r|", 1)
        if rnd.random() < 0.02:
            line += "\0"
        lines.append(line)
    path.write_text("\n".join(lines) + "\n", newline="")


@pytest.mark.parametrize("zone", ["UTC", "Europe/Berlin", "America/New_York", "Australia/Lord_Howe"])
def test_parallel_and_batched_paths_agree_on_dst_and_edge_rows(tmp_path, monkeypatch, zone):
    """The parallel bulk path (chunks parsed in worker processes) against the batched path,
    on rows of every common and odd shape, in zones with DST gaps, repeated hours and
    half-hour changes: every stored column, the skipped rows, notes, attempts and summary
    line are equal, twice over (the second import meets every stored job), with GPUs
    tracked and not."""
    import gpuguard.reports.sync as sync_mod
    import gpuguard.reports.sync_bulk as bulk_mod

    parallel = []
    real = bulk_mod.import_parallel
    monkeypatch.setattr(bulk_mod, "import_parallel", lambda *a, **k: parallel.append(1) or real(*a, **k))
    tz = ZoneInfo(zone)
    for seed in (1, 2):
        f = tmp_path / f"shape-{seed}.txt"
        _edge_rows_file(f, seed)
        for tracked in (None, False):
            seen = []
            for name, bulk_min, workers in (("batched", 10**9, 0), ("parallel", 1, 2)):
                monkeypatch.setattr(sync_mod, "BULK_MIN_ROWS", bulk_min)
                monkeypatch.setattr(bulk_mod, "WORKERS", workers)
                monkeypatch.setattr(bulk_mod, "CHUNK_BYTES", 4000)
                s = next(cache_store(tmp_path / f"{seed}-{tracked}-{name}"))
                said = []
                for _ in range(2):
                    text = f.read_text()
                    res = (import_file(s, str(f), tz=tz, synced_at=1.0) if tracked is None else
                           import_text(s, text, tz=tz, synced_at=1.0, source=str(f), gpus_tracked=tracked))
                    said.append((res.jobs, res.malformed, res.notes, res.unreportable, res.gpus_unknown,
                                 res.attempts, res.js1_readings, res.summary()))
                seen.append((said, s.query("SELECT * FROM sacct_jobs ORDER BY cluster, job_id_raw, attempt_at")))
            assert seen[0] == seen[1], (zone, seed, tracked)
            assert seen[0][0][0][1] and seen[0][0][0][0] > 150  # malformed rows among many stored
    assert len(parallel) >= 4  # the first import of each file, both ways of reading it


@pytest.mark.parametrize("big", [False, True], ids=["batched", "bulk"])
def test_cli_sync_a_carriage_return_in_a_comment_is_part_of_it(tmp_path, monkeypatch, big):
    """sacct -P ends a record with ``\\n`` only; a lone ``\\r`` is text a user put in
    ``sbatch --comment`` (or --job-name). Before, the file was split on universal newlines:
    the job was read as two malformed rows, left out of every report, and the sync exited 1
    (a user could hide a job's GPU hours so)."""
    from gpuguard.reports import sync as sync_mod

    if big:
        monkeypatch.setattr(sync_mod, "BULK_MIN_BYTES", 0, raising=False)
    env = _cfg(tmp_path, '[reports]\ntimezone = "UTC"\n')
    f = tmp_path / "cr.txt"
    f.write_bytes(b"JobIDRaw|JobName|Account|Start|End|State|AllocTRES|Comment|TimelimitRaw\r\n"
                  b"7|x\ry|acct|2026-11-01T10:00:00|2026-11-01T12:00:00|COMPLETED|gres/gpu=2|a\rb|60\r\n"
                  b"8|z|acct|2026-11-01T10:00:00|2026-11-01T11:00:00|FAILED|gres/gpu=1||60\n")
    r = CliRunner().invoke(main, ["report", "sync", "--from-file", str(f)], env=env)
    assert (r.exit_code, r.output) == (0, f"{f}: 2 job(s) stored\n")
    store = open_cache_store(tmp_path / "cluster.db")
    try:
        assert rows(store, "SELECT job_id_raw, job_name, comment, state, gpus FROM sacct_jobs ORDER BY job_id_raw") == [
            (7, "x\ry", "a\rb", "COMPLETED", 2), (8, "z", None, "FAILED", 1)]
    finally:
        store.close()


def test_cli_sync_extra_fields_are_a_malformed_row_never_a_shifted_job(tmp_path):
    """A row with two fields more than the header and no ``|`` in its JobName or Comment
    (a hand-edited file, a line from another field list). Before, the extra fields were
    taken for two ``|`` in the Comment: the job was stored with Comment
    ``||cpu=8,gres/gpu=1``, AdminComment ``120`` and its time limit lost (TimelimitRaw
    ``extra2`` read as unknown), exit 0. A TimelimitRaw that is no number of minutes,
    UNLIMITED or Partition_Limit refuses that reading; the job stored before stays."""
    env = _cfg(tmp_path, '[reports]\ntimezone = "UTC"\n')
    vals = {"JobIDRaw": "3", "JobID": "3", "Cluster": "c1", "JobName": "train", "User": "alice", "Account": "ml",
            "Partition": "gpu", "QOS": "normal", "Submit": "2026-11-01T10:00:00", "Eligible": "2026-11-01T10:00:00",
            "Start": "2026-11-01T10:05:00", "End": "2026-11-01T11:05:00", "ElapsedRaw": "3600",
            "State": "COMPLETED", "ExitCode": "0:0", "AllocTRES": "cpu=8,gres/gpu=1,node=1", "AllocCPUS": "8",
            "NNodes": "1", "NodeList": "n1", "Comment": "", "AdminComment": "", "ReqTRES": "cpu=8,gres/gpu=1",
            "TimelimitRaw": "120"}
    good = "|".join(vals[f] for f in SACCT_FIELDS)
    f = tmp_path / "ok.txt"
    f.write_text("|".join(SACCT_FIELDS) + "\n" + good + "\n")
    r = CliRunner().invoke(main, ["report", "sync", "--from-file", str(f)], env=env)
    assert (r.exit_code, r.output) == (0, f"{f}: 1 job(s) stored\n")
    g = tmp_path / "extra.txt"
    g.write_text("|".join(SACCT_FIELDS) + "\n" + good + "|extra|extra2\n")
    r = CliRunner().invoke(main, ["report", "sync", "--from-file", str(g)], env=env)
    assert (r.exit_code, r.output) == (1, f"{g}:2: skipped malformed row: 25 fields, header has 23; no way of placing "
                                          "the extra '|' in JobName/Comment gives a valid row\n"
                                          f"{g}: 0 job(s) stored, 1 malformed row(s) skipped\n")
    store = open_cache_store(tmp_path / "cluster.db")
    try:
        assert rows(store, "SELECT job_id_raw, comment, admin_comment, time_limit_s FROM sacct_jobs") == [
            (3, None, None, 7200)]
    finally:
        store.close()
