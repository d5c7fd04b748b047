"""sacct parsing: every corpus sample with exact values, TRES rules, timezones, ids, states."""

from __future__ import annotations

import io
import json
from zoneinfo import ZoneInfo

import pytest
from reports_helpers import DATA, HANDMADE, utc

from gpuguard.reports.sacct import (
    SACCT_FIELDS,
    RowError,
    SacctParseError,
    TimeConverter,
    iter_json,
    iter_pipe,
    normalize_state,
    parse_elapsed,
    parse_exit_code,
    parse_job_id,
    parse_tres,
    resolve_timezone,
    template_of,
)

UTC = TimeConverter(ZoneInfo("UTC"))


def parse_file(name: str, tz: str = "UTC"):
    path = DATA / name
    text = path.read_text()
    if text.lstrip().startswith("{"):
        return list(iter_json(json.loads(text), source=name))
    return list(iter_pipe(io.StringIO(text, newline=""), conv=TimeConverter(ZoneInfo(tz)), source=name))


def jobs_of(rows):
    return {r.job["job_id_raw"]: r.job for r in rows if r.job}


# --- corpus ---------------------------------------------------------------------------------
def test_corpus_p1_timeout_and_cancelled_by_uid():
    rows = parse_file("sacct-p-1-timeout-cancelled-gpu-jobstats.txt")
    assert [r.error for r in rows if r.error] == []
    assert sum(r.step for r in rows) == 4
    jobs = jobs_of(rows)
    assert sorted(jobs) == [45352405, 46044267]
    t = jobs[46044267]
    assert (t["job_id"], t["state"], t["state_raw"], t["elapsed_s"], t["cpus"], t["nnodes"]) == (
        "46044267", "TIMEOUT", "TIMEOUT", 23 * 3600 + 5 * 60 + 24, 12, 1)
    assert t["admin_comment"].startswith("JS1:H4sIAAAAAAACA1WOwQ6DIBBE")
    assert (t["gpus"], t["gpu_source"], t["start_at"], t["submit_at"], t["exit_code"]) == (2, "JS1", None, None, None)
    c = jobs[45352405]
    assert (c["state"], c["state_raw"], c["elapsed_s"], c["cpus"]) == ("CANCELLED", "CANCELLED by 100001", 27738, 1)


def test_corpus_p2_legacy_multinode_and_failed():
    rows = parse_file("sacct-p-2-legacy-reqmem-failed-steps.txt")
    assert [r.error for r in rows if r.error] == []
    assert sum(r.step for r in rows) == 4
    jobs = jobs_of(rows)
    big = jobs[6196869]
    assert (big["state"], big["elapsed_s"], big["cpus"], big["nnodes"], big["admin_comment"]) == (
        "COMPLETED", 12 * 86400 + 14 * 3600 + 16 * 60 + 39, 720, 20, None)
    short = jobs[8205464]
    assert (short["state"], short["elapsed_s"], short["cpus"], short["admin_comment"]) == ("FAILED", 2, 8, "JS1:Short")


def test_corpus_p3_ntasks_column():
    rows = parse_file("sacct-p-3-ntasks-column.txt")
    assert [r.error for r in rows if r.error] == []
    assert sum(r.step for r in rows) == 3
    (job,) = jobs_of(rows).values()
    assert (job["job_id_raw"], job["state"], job["elapsed_s"], job["cpus"], job["nnodes"]) == (131042, "COMPLETED", 53, 8, 1)


def test_corpus_default_fixed_width_is_refused_with_its_line():
    with pytest.raises(SacctParseError, match=r"^sacct-default-pending-2019.txt:1: fixed-width sacct output"):
        parse_file("sacct-default-pending-2019.txt")


def test_corpus_json_24_11_v0041():
    rows = parse_file("sacct-json-slurmdb-24.11-gpu-job.json")
    assert [r.error for r in rows] == [None]
    j = rows[0].job
    expect = {
        "cluster": "hpc", "job_id_raw": 5980, "job_id": "5980", "array_job_id": None, "array_task_id": None,
        "het_job_id": None, "het_job_offset": None, "job_name": "wrap", "user": "user01", "account": "biology",
        "partition": "gpu", "qos": "normal", "submit_at": 1747751625.0, "eligible_at": 1747751625.0,
        "start_at": 1747751628.0, "end_at": 1747751658.0, "elapsed_s": 30, "usage_end_at": 1747751658.0,
        "state": "COMPLETED", "state_raw": "COMPLETED", "exit_code": 0, "exit_signal": 0,
        # submit_line asked --gpus 4, but neither TRES list holds gres/gpu (the cluster's
        # AccountingStorageTRES does not track GPUs): unknown, not 0
        "gpus": None, "gpu_type": None,
        "gpu_source": "unknown: SubmitLine asks for GPUs, AllocTRES has no gres/gpu", "time_limit_s": 60, "cpus": 1, "alloc_tres": "cpu=1,mem=512,energy=-2,node=1,billing=1",
        "nnodes": 1, "node_list": "gpu1", "comment": None, "admin_comment": None, "template": None,
    }
    assert {k: j[k] for k in expect} == expect


def test_json_22_05_dbv0038_exit_codes_not_trusted():
    rows = parse_file("sacct-json-22.05-dbv0.0.38-constructed.json")
    assert [r.error for r in rows] == [None] * 4
    jobs = jobs_of(rows)
    failed = jobs[301]
    # 22.05 reports exit 3 as SUCCESS/0 (SLURM-FACTS §6d): unknown, not 0
    assert (failed["state"], failed["exit_code"], failed["exit_signal"]) == ("FAILED", None, None)
    assert (failed["gpus"], failed["template"], failed["comment"], failed["cluster"]) == (2, "t1", "gpuguard:template=t1", "tb")
    arr = jobs[302]
    assert (arr["job_id"], arr["array_job_id"], arr["array_task_id"], arr["exit_code"], arr["exit_signal"]) == (
        "300_2", 300, 2, 0, 9)
    het = jobs[303]
    assert (het["job_id"], het["het_job_id"], het["het_job_offset"], het["gpus"], het["cpus"]) == ("303+0", 303, 0, 0, 2)
    pend = jobs[304]
    assert (pend["state"], pend["start_at"], pend["end_at"], pend["eligible_at"], pend["usage_end_at"]) == (
        "PENDING", None, None, 1741000500.0, None)


def test_json_without_jobs_is_refused():
    with pytest.raises(SacctParseError, match='x.json: JSON without a "jobs" list'):
        list(iter_json({"meta": {}}, source="x.json"))


# --- the hand-made -P file ------------------------------------------------------------------
def test_handmade_file_every_field():
    rows = list(iter_pipe(io.StringIO(HANDMADE.read_text(), newline=""), conv=UTC))
    assert [r.error for r in rows] == [None] * 14
    jobs = jobs_of(rows)
    j = jobs[101]
    assert j == {
        "cluster": "tc", "job_id_raw": 101, "job_id": "101", "array_job_id": None, "array_task_id": None,
        "het_job_id": None, "het_job_offset": None, "job_name": "train70b", "user": "alice", "account": "physics",
        "partition": "gpu", "qos": "normal", "submit_at": utc("2025-03-01T23:00:00"),
        "eligible_at": utc("2025-03-01T23:30:00"), "start_at": utc("2025-03-02T00:00:00"),
        "end_at": utc("2025-03-02T10:00:00"), "elapsed_s": 36000, "usage_end_at": utc("2025-03-02T10:00:00"),
        "charge_s": 36000, "wait_s": 1800.0, "submit_wait_s": 3600.0,
        "state": "COMPLETED", "state_raw": "COMPLETED", "exit_code": 0, "exit_signal": 0, "gpus": 4,
        "gpu_type": "a100", "cpus": 16, "alloc_tres": "billing=16,cpu=16,gres/gpu=4,gres/gpu:a100=4,mem=64G,node=1",
        "nnodes": 1, "node_list": "g01", "comment": "gpuguard:template=llm-70b run 3", "admin_comment": None,
        "template": "llm-70b", "synced_at": None, "source": None,
        "attempt_at": utc("2025-03-01T23:00:00"), "gpu_source": "AllocTRES", "time_limit_s": None,
    }
    assert (jobs[106]["job_id"], jobs[106]["array_job_id"], jobs[106]["array_task_id"], jobs[106]["state"]) == (
        "106_7", 106, 7, "CANCELLED")
    assert [(jobs[k]["job_id"], jobs[k]["het_job_id"], jobs[k]["het_job_offset"]) for k in (107, 108)] == [
        ("107+0", 107, 0), ("107+1", 107, 1)]
    pend = jobs[110]
    assert (pend["state"], pend["eligible_at"], pend["start_at"], pend["end_at"], pend["gpus"], pend["alloc_tres"]) == (
        "PENDING", None, None, None, 0, None)
    assert (pend["charge_s"], pend["wait_s"], pend["usage_end_at"]) == (None, None, None)
    run = jobs[111]
    assert (run["end_at"], run["usage_end_at"], run["charge_s"], run["wait_s"]) == (
        None, utc("2025-03-31T12:00:00"), 7200, 3600.0)
    assert (jobs[113]["exit_code"], jobs[113]["exit_signal"]) == (0, 125)


def test_p_with_trailing_delimiter():
    text = "JobIDRaw|JobID|State|AllocTRES|\n7|7|COMPLETED|cpu=2,gres/gpu=1|\n"
    (row,) = list(iter_pipe(io.StringIO(text), conv=UTC))
    assert (row.job["job_id_raw"], row.job["state"], row.job["gpus"], row.job["cpus"]) == (7, "COMPLETED", 1, 2)


def test_header_less_output_with_fields():
    text = "9\x1f9\x1fRUNNING\n"
    (row,) = list(iter_pipe(io.StringIO(text), conv=UTC, fields=["JobIDRaw", "JobID", "State"], delimiter="\x1f"))
    assert (row.job["job_id_raw"], row.job["state"]) == (9, "RUNNING")


def test_pipe_inside_the_only_free_text_field_is_joined_back():
    text = "JobIDRaw|JobID|State|Comment|AdminComment\n1|1|COMPLETED|ok|\n2|2|COMPLETED|a|b|c|adm\n3|3|FAILED||\n"
    rows = list(iter_pipe(io.StringIO(text), conv=UTC))
    assert [(r.line, r.error, r.note) for r in rows] == [(2, None, None), (3, None, None), (4, None, None)]
    assert [(r.job["job_id_raw"], r.job["comment"], r.job["admin_comment"]) for r in rows] == [
        (1, "ok", None), (2, "a|b|c", "adm"), (3, None, None)]


def test_extra_fields_without_a_free_text_column_stay_malformed():
    text = "JobIDRaw|JobID|State|Account\n1|1|COMPLETED|a|b\n2|2|COMPLETED|a\n3|3|COMPLETED|c|\n"
    rows = list(iter_pipe(io.StringIO(text), conv=UTC))
    assert [(r.line, r.error) for r in rows] == [(2, "5 fields, header has 4"), (3, None), (4, None)]
    assert rows[2].job["account"] == "c"  # no free-text column: a trailing '|' can only be -p


FULL = "|".join(SACCT_FIELDS) + "\n"


def _full(raw: int, name: str, comment: str, account: str = "phys", start: str = "2026-11-01T10:05:00",
          end: str = "2026-11-01T12:05:00", tres: str = "cpu=8,gres/gpu=4") -> str:
    vals = {"JobIDRaw": str(raw), "JobID": str(raw), "Cluster": "c1", "JobName": name, "User": "u",
            "Account": account, "Partition": "gpu", "QOS": "normal", "Submit": "2026-11-01T10:00:00",
            "Eligible": "2026-11-01T10:00:00", "Start": start, "End": end, "ElapsedRaw": "7200",
            "State": "COMPLETED", "ExitCode": "0:0", "AllocTRES": tres, "AllocCPUS": "8", "NNodes": "1",
            "NodeList": "n1", "Comment": comment, "AdminComment": "", "ReqTRES": tres, "TimelimitRaw": "120"}
    return "|".join(vals[f] for f in SACCT_FIELDS) + "\n"


def test_pipe_in_jobname_and_comment_with_one_valid_reading_is_rebuilt():
    # JobName and Comment both in the header: each split of the extra '|' is parsed, and
    # only the true one gives valid times, so the row is rebuilt exactly
    text = FULL + _full(1, "=cmd|' /C calc'!A0", "gpuguard:template=a") + _full(2, "n", "a|b|c") + \
        _full(3, "x|y", "gpuguard:template=t1 | z|w")
    rows = list(iter_pipe(io.StringIO(text), conv=UTC))
    assert [(r.line, r.error, r.note) for r in rows] == [(2, None, None), (3, None, None), (4, None, None)]
    assert [(r.job["job_id_raw"], r.job["job_name"], r.job["comment"], r.job["template"], r.job["account"],
             r.job["gpus"], r.job["charge_s"]) for r in rows] == [
        (1, "=cmd|' /C calc'!A0", "gpuguard:template=a", "a", "phys", 4, 7200),
        (2, "n", "a|b|c", None, "phys", 4, 7200),
        (3, "x|y", "gpuguard:template=t1 | z|w", "t1", "phys", 4, 7200)]


AMB_HEAD = "JobIDRaw|JobName|Account|Start|End|State|AllocTRES|Comment\n"
MID = "acct|2026-11-01T10:00:00|2026-11-01T12:00:00|COMPLETED|gres/gpu=2"


def test_ambiguous_pipe_is_kept_with_jobname_and_comment_unknown():
    # JobName "x|MID", Comment "MID|y": the extra fields fit JobName, Comment or both, and
    # all three readings agree on everything else: stored, usage counted, free text unknown
    text = AMB_HEAD + f"7|x|{MID}|{MID}|{MID}|y\n"
    (row,) = list(iter_pipe(io.StringIO(text), conv=UTC))
    assert (row.line, row.error, row.note) == (
        2, None, "the extra '|' may belong to JobName/Comment (3 readings): stored with JobName/Comment unknown")
    j = row.job
    assert (j["job_id_raw"], j["job_name"], j["comment"], j["template"], j["account"], j["gpus"], j["start_at"],
            j["end_at"], j["charge_s"], j["state"]) == (
        7, None, None, None, "acct", 2, utc("2026-11-01T10:00:00"), utc("2026-11-01T12:00:00"), 7200, "COMPLETED")


def test_ambiguous_pipe_whose_readings_disagree_on_usage_is_malformed():
    # a JobName forged to look like fields: two valid readings with different accounts and
    # GPU counts; nothing tells the true one, so the row is reported, not guessed
    forged = "evil|2026-11-01T10:00:00|2026-11-01T10:00:01|COMPLETED|gres/gpu=0"
    text = AMB_HEAD + f"8|x|{forged}|{MID}|y\n" + f"9|n|{MID}|c\n"
    rows = list(iter_pipe(io.StringIO(text), conv=UTC))
    assert [(r.line, r.error) for r in rows] == [
        (2, "13 fields, header has 8; the extra '|' may belong to JobName/Comment, and the 2 readings differ in "
            "account, alloc_tres, charge_s, elapsed_s, end_at: not stored"),
        (3, None)]


def test_long_row_with_no_valid_reading_names_the_reason():
    text = "JobIDRaw|Start|Comment|End\n1|2026-11-01T10:00:00|a|b|bad\n"
    text2 = FULL + _full(2, "x|y", "c|d", start="garbage")
    (row,) = list(iter_pipe(io.StringIO(text), conv=UTC))
    assert (row.line, row.error) == (2, "5 fields, header has 4; with the extra '|' in Comment: "
                                        "time 'bad' is not YYYY-MM-DDTHH:MM:SS")
    (row,) = list(iter_pipe(io.StringIO(text2), conv=UTC))
    assert (row.line, row.error) == (2, "25 fields, header has 23; no way of placing the extra '|' in "
                                        "JobName/Comment gives a valid row")


def test_minus_p_trailing_delimiter_and_a_pipe_in_the_comment():
    # -p (header ends in '|'): the trailing empty field goes, the rest is rebuilt
    text = "JobIDRaw|State|Comment|AdminComment|\n1|COMPLETED|a|b||\n2|COMPLETED|c||\n"
    rows = list(iter_pipe(io.StringIO(text), conv=UTC))
    assert [(r.error, r.job["comment"], r.job["admin_comment"]) for r in rows] == [
        (None, "a|b", None), (None, "c", None)]
    # -P (no trailing '|' in the header): an empty last field is data, not a -p marker
    text = "JobIDRaw|State|Comment|AdminComment\n1|COMPLETED|a|b|\n"
    (row,) = list(iter_pipe(io.StringIO(text), conv=UTC))
    assert (row.error, row.job["comment"], row.job["admin_comment"]) == (None, "a|b", None)


def test_unit_separator_in_a_comment_of_header_less_output():
    text = "\x1f".join(["5", "5", "RUNNING", "a\x1fb", "adm"]) + "\n"
    (row,) = list(iter_pipe(io.StringIO(text), conv=UTC, fields=["JobIDRaw", "JobID", "State", "Comment",
                                                                  "AdminComment"], delimiter="\x1f"))
    assert (row.error, row.job["comment"], row.job["admin_comment"]) == (None, "a\x1fb", "adm")


def test_oversized_and_impossible_values_are_malformed_rows_with_their_line():
    big = "99999999999999999999999"
    text = FULL + "".join([
        _full(1, "ok", ""),
        _full(2, "n", "", tres=f"cpu=8,gres/gpu={big}"),
        _full(3, "n", "").replace("|8|1|n1|", f"|{big}|1|n1|"),
        _full(4, "n", "").replace("|0:0|", "|99999999999999999999:0|"),
        _full(5, "n", "", tres="cpu=8,gres/gpu=-4"),
        _full(6, "n", "", start="9999-12-31T23:59:59"),
        _full(7, "n", "").replace("|0:0|", "|0:99999999999999999999|"),
        _full(8, "n", "", tres="cpu=-8,gres/gpu:a100=1000001"),
        _full(9, "n", "", tres="cpu=8,gres/gpu:a100=1000001"),
        _full(10, "n", "").replace("|8|1|n1|", "|8|-1|n1|"),
        _full(11, "n", "").replace("|7200|", "|" + "9" * 5000 + "|"),
        _full(12, "n", "", end="99999999999999999999"),
        _full(13, "n", "", start="1741000000", end="1740000000"),
        _full(99999999999999999999, "n", ""),
        _full(14, "n", "").replace("|7200|", "|\u00b2|"),
        _full(15, "n", "", tres="cpu=1000000,gres/gpu=1000000"),
    ])
    rows = list(iter_pipe(io.StringIO(text), conv=UTC))
    assert [(r.line, r.error) for r in rows if r.error] == [
        (3, f"AllocTRES gres/gpu={big}: GPU count is more than 1000000"),
        (4, f"AllocCPUS {big} is out of range (at most 1000000)"),
        (5, "ExitCode status 99999999999999999999 is out of range (at most 9223372036854775807)"),
        (6, "AllocTRES gres/gpu=-4: GPU count is negative"),
        (7, "Start 9999-12-31T23:59:59 is after End 2026-11-01T12:05:00"),
        (8, "ExitCode signal 99999999999999999999 is out of range (at most 9223372036854775807)"),
        (9, "AllocTRES cpu=-8: CPU count is negative"),
        (10, "AllocTRES gres/gpu:a100=1000001: GPU count is more than 1000000"),
        (11, "NNodes -1 is negative"),
        (12, "elapsed " + "9" * 32 + "... is out of range (at most 3162240000)"),
        (13, "time '99999999999999999999' is out of range (after 9999-12-31)"),
        (14, "Start 1741000000 is after End 1740000000"),
        (15, "JobIDRaw 99999999999999999999 is out of range (at most 9223372036854775807)"),
        (16, "elapsed '\u00b2' is not [DD-]HH:MM:SS"),
    ]
    assert [(r.job["job_id_raw"], r.job["gpus"], r.job["cpus"]) for r in rows if r.job] == [
        (1, 4, 8), (15, 1000000, 8)]


def test_array_task_without_jobidraw_is_malformed():
    text = "JobID|State\n5_1|COMPLETED\n6|COMPLETED\n"
    rows = list(iter_pipe(io.StringIO(text), conv=UTC))
    assert rows[0].error.startswith("JobID '5_1' is an array task or het component")
    assert rows[1].job["job_id_raw"] == 6


def test_no_header_is_refused():
    with pytest.raises(SacctParseError, match=r"^f:1: no header line"):
        list(iter_pipe(io.StringIO("1|2|3\n"), conv=UTC, source="f"))


# --- units ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("tres", "expect"), [
    ("billing=4,cpu=4,gres/gpu=4,mem=8G,node=1", (4, None, 4)),
    ("cpu=8,gres/gpu:a100=4", (4, "a100", 8)),
    ("cpu=8,gres/gpu=4,gres/gpu:a100=4", (4, "a100", 8)),  # both forms: never 8
    ("gres/gpu:a100=4,gres/gpu=4", (4, "a100", None)),  # order does not matter
    ("cpu=2,gres/gpu=1,gres/gpu:a100_3g.20gb=1", (1, "a100_3g.20gb", 2)),  # MIG slice
    ("gres/gpu:a100_1g.5gb=2,gres/gpu:a100_3g.20gb=1", (3, "a100_1g.5gb,a100_3g.20gb", None)),
    ("gres/gpu=3,gres/gpu:a100=2,gres/gpu:v100=1", (3, "a100,v100", None)),
    ("cpu=1,gres/gpumem=40G,gres/gpuutil=100,gres/gpu=1", (1, None, 1)),  # gpumem/gpuutil are not GPUs
    ("cpu=1,mem=1G,node=1", (0, None, 1)),
    ("", (0, None, None)),
    (None, (0, None, None)),
])
def test_tres(tres, expect):
    assert parse_tres(tres) == expect


def test_tres_bad_gpu_count():
    with pytest.raises(RowError, match="GPU count is not an integer"):
        parse_tres("gres/gpu=lots")


@pytest.mark.parametrize(("zone", "wall", "iso_utc"), [
    ("UTC", "2025-03-01T12:00:00", "2025-03-01T12:00:00"),
    ("America/New_York", "2025-01-15T12:00:00", "2025-01-15T17:00:00"),  # EST -5
    ("America/New_York", "2025-07-15T12:00:00", "2025-07-15T16:00:00"),  # EDT -4
    ("Europe/Berlin", "2025-03-30T01:30:00", "2025-03-30T00:30:00"),  # CET, just before the jump
    ("Europe/Berlin", "2025-03-30T03:30:00", "2025-03-30T01:30:00"),  # CEST, just after
    ("Europe/Berlin", "2025-10-26T02:30:00", "2025-10-26T00:30:00"),  # ambiguous hour: first (CEST)
    ("Europe/Berlin", "2025-10-26T03:30:00", "2025-10-26T02:30:00"),  # CET again
    ("Asia/Kolkata", "2025-03-01T05:30:00", "2025-03-01T00:00:00"),  # +05:30
    ("Australia/Lord_Howe", "2025-01-10T12:00:00", "2025-01-10T01:00:00"),  # +11 (DST) half-hour zone
    ("Australia/Lord_Howe", "2025-07-10T12:00:00", "2025-07-10T01:30:00"),  # +10:30
])
def test_time_conversion(zone, wall, iso_utc):
    conv = TimeConverter(ZoneInfo(zone))
    assert conv(wall) == utc(iso_utc)
    assert conv(wall) == utc(iso_utc)  # second call: cached offset, same answer


@pytest.mark.parametrize("text", ["Unknown", "None", "", None, "  Unknown "])
def test_unset_times(text):
    assert UTC(text) is None


def test_epoch_and_bad_times():
    assert UTC("1741000000") == 1741000000.0
    with pytest.raises(RowError, match="is not YYYY-MM-DDTHH:MM:SS"):
        UTC("03/01 12:00")
    with pytest.raises(RowError, match="is not YYYY-MM-DDTHH:MM:SS"):
        UTC("2025-13-01T00:00:00")


def test_resolve_timezone(monkeypatch):
    assert resolve_timezone("Europe/Berlin").key == "Europe/Berlin"
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    assert resolve_timezone().key == "Asia/Tokyo"
    with pytest.raises(SacctParseError, match="unknown timezone 'Mars/Olympus'"):
        resolve_timezone("Mars/Olympus")


@pytest.mark.parametrize(("text", "secs"), [
    ("53", 53), ("00:00:53", 53), ("23:05:24", 83124), ("12-14:16:39", 1088199), ("1-00:00:00", 86400),
    ("06:57.815", 417), ("", None), ("Unknown", None),
])
def test_elapsed(text, secs):
    assert parse_elapsed(text) == secs


def test_states_ids_exit_template():
    assert normalize_state("CANCELLED by 1234") == "CANCELLED"
    assert normalize_state("CANCELLED by 0") == "CANCELLED"
    assert normalize_state("OUT_OF_MEMORY") == "OUT_OF_MEMORY"
    assert parse_job_id("123_4") == ({"array_job_id": 123, "array_task_id": 4, "het_job_id": None,
                                      "het_job_offset": None}, False)
    assert parse_job_id("123_[1-5%2]")[0]["array_task_id"] is None
    assert parse_job_id("123+1")[0]["het_job_offset"] == 1
    assert parse_job_id("123_4.batch")[1] is True
    assert parse_job_id("123+1.extern")[1] is True
    with pytest.raises(RowError):
        parse_job_id("abc")
    assert parse_exit_code("3:0") == (3, 0)
    assert parse_exit_code("0:9") == (0, 9)
    assert template_of("run 3 gpuguard:template=llm-70b; other") == "llm-70b"
    assert template_of("template=foo") is None
    assert template_of(None) is None


def test_blank_state_is_a_malformed_row_not_a_crash():
    """A State of blanks is "empty State" on its line; the rows around it are stored."""
    assert normalize_state("   ") is None
    text = ("JobID|JobIDRaw|Account|State|Start|End\n"
            "7|7|a|COMPLETED|2025-01-01T00:00:00|2025-01-01T01:00:00\n"
            "8|8|a|   |2025-01-01T00:00:00|2025-01-01T01:00:00\n"
            "9|9|a|FAILED|2025-01-01T00:00:00|2025-01-01T00:30:00\n")
    rows = list(iter_pipe(io.StringIO(text, newline=""), conv=UTC))
    assert [(r.line, r.error) for r in rows if r.error] == [(3, "empty State")]
    assert [(r.job["job_id_raw"], r.job["state"], r.job["elapsed_s"]) for r in rows if r.job] == [
        (7, "COMPLETED", 3600), (9, "FAILED", 1800)]


def test_json_oversized_and_impossible_values_are_malformed_jobs():
    def job(jid, **kw):
        j = {"job_id": jid, "state": {"current": ["COMPLETED"]}, "account": "a",
             "time": {"start": 1762000000, "end": 1762007200, "elapsed": 7200, "submission": 1761990000},
             "tres": {"allocated": [{"type": "gres", "name": "gpu", "count": 2}]}}
        j.update(kw)
        return j
    doc = json.loads(json.dumps({"jobs": [
        job(1),
        job(10 ** 30),
        job(3, tres={"allocated": [{"type": "gres", "name": "gpu", "count": -4}]}),
        job(4, time={"start": 253402300799, "end": 1762007200}),
        job(5, time={"start": 1762000000, "end": 10 ** 400}),
        job(6, allocation_nodes=10 ** 30),
        job(7, time={"start": 1762000000, "end": 1762007200, "elapsed": -5}),
        job(8, tres={"allocated": [{"type": "cpu", "count": 2 ** 64}]}),
    ]}))
    rows = list(iter_json(doc))
    assert [(r.line, r.error) for r in rows if r.error] == [
        (2, "jobs[1]: job_id_raw 1000000000000000000000000000000 is out of range (at most 9223372036854775807)"),
        (3, "jobs[2]: AllocTRES gres/gpu=-4: GPU count is negative"),
        (4, "jobs[3]: Start 9999-12-31T23:59:59+00:00 is after End 2025-11-01T14:26:40+00:00"),
        (5, "jobs[4]: time 10000000000000000000000000000000... is out of range"),
        (6, "jobs[5]: nnodes 1000000000000000000000000000000 is out of range (at most 1000000)"),
        (7, "jobs[6]: elapsed_s -5 is negative"),
        (8, "jobs[7]: AllocTRES cpu=18446744073709551616: CPU count is more than 1000000"),
    ]
    assert [(r.job["job_id_raw"], r.job["gpus"], r.job["charge_s"]) for r in rows if r.job] == [(1, 2, 7200)]


# --- line splitting: str.split where it is exact, csv's own reading elsewhere -----------------
@pytest.mark.parametrize(("line", "fields"), [
    ("1|a b| c |\n", ["1", "a b", " c ", ""]),
    ('1|"q"|x\r\n', ["1", '"q"', "x"]),  # no quoting: quote characters are data
    ("1|old mac\r", ["1", "old mac"]),
    ("1|last line", ["1", "last line"]),
    ("1|n\x00ul\n", ["1", "n\x00ul"]),  # a NUL goes to csv, which keeps it
    ("\n", [""]),
    ("1|" + "x" * 131073 + "\n", None),  # a field over csv's limit: csv's error
])
def test_split_record_reads_each_line_as_the_csv_module_does(line, fields):
    import csv

    from gpuguard.reports.sacct import split_record

    got = split_record(line, "|")
    try:
        want = next(csv.reader([line], delimiter="|", quoting=csv.QUOTE_NONE), [])
    except csv.Error as e:
        assert fields is None and isinstance(got, csv.Error) and str(got) == str(e)
        return
    assert got == want == fields or (fields == [""] and want == [] and got == [""])


def test_a_line_csv_refuses_is_malformed_with_its_line_and_the_rest_is_read():
    """A field over csv's limit is malformed. A stray CR inside a field is text a user wrote
    (sacct prints --comment and --job-name raw, and ends a record with LF): its job is read
    with the CR kept (before, the csv reader refused it and the job was skipped)."""
    from gpuguard.reports.sacct import split_record

    assert split_record("1|cr\rinside\n", "|") == ["1", "cr\rinside"]
    lines = ["JobIDRaw|State|Comment\n", "1|COMPLETED|x\n", "2|FAILED|a\rb\n", "3|FAILED|" + "x" * 131073 + "\n",
             "4|COMPLETED|y\n"]
    rows = list(iter_pipe(lines, conv=UTC))
    assert [(r.line, r.job["job_id_raw"] if r.job else None, r.job["comment"] if r.job else None, r.error)
            for r in rows] == [
        (2, 1, "x", None),
        (3, 2, "a\rb", None),
        (4, None, None, "field larger than field limit (131072)"),
        (5, 4, "y", None)]


def test_json_23_02_v0039_exit_codes_not_trusted():
    # data_parser v0.0.39 (23.02) still prints SUCCESS/0 for every non-signal exit (its
    # JOB_EXIT_CODE dumper tests WIFEXITED only); its meta names the plugin under "plugins"
    rows = parse_file("sacct-json-23.02-v0.0.39-constructed.json")
    assert [r.error for r in rows] == [None] * 4
    jobs = jobs_of(rows)
    assert (jobs[301]["state"], jobs[301]["exit_code"], jobs[301]["exit_signal"]) == ("FAILED", None, None)
    assert (jobs[301]["gpus"], jobs[301]["time_limit_s"]) == (2, 3600)
    assert (jobs[302]["job_id"], jobs[302]["array_task_id"], jobs[302]["exit_code"], jobs[302]["exit_signal"]) == (
        "300_2", 2, 0, 9)
    assert (jobs[303]["job_id"], jobs[303]["het_job_offset"], jobs[303]["exit_code"]) == ("303+0", 0, None)
    assert (jobs[304]["state"], jobs[304]["exit_code"], jobs[304]["start_at"]) == ("PENDING", None, None)


def test_json_string_status_success_is_unknown_whatever_the_meta():
    # the string form of exit_code.status is the pre-v0.0.40 dumper: SUCCESS says "exited", not "0"
    doc = json.loads((DATA / "sacct-json-23.02-v0.0.39-constructed.json").read_text())
    doc["meta"] = {}
    jobs = jobs_of(list(iter_json(doc)))
    assert (jobs[301]["exit_code"], jobs[301]["exit_signal"]) == (None, None)
    assert (jobs[302]["exit_code"], jobs[302]["exit_signal"]) == (0, 9)


@pytest.mark.parametrize("first", ["4242|4242|gpu|train|alice", "123_4|123_4|x", "77+0|x|y"])
def test_header_less_output_is_named_as_such(first):
    # sacct -n (as in UCloud's `sacct --format="elapsed" -s cd -n -X -P -j ...`) prints rows only
    with pytest.raises(SacctParseError, match=r"^f\.txt:1: no header line \(saved with sacct -n\?\)"):
        list(iter_pipe(io.StringIO(first + "\n"), conv=UTC, source="f.txt"))
    with pytest.raises(SacctParseError, match="header has no JobID or JobIDRaw field"):
        list(iter_pipe(io.StringIO("User|Account\nalice|a\n"), conv=UTC, source="f.txt"))


def test_json_with_errors_and_no_jobs_is_refused():
    # data_parser OPENAPI_ERROR objects: error, description, error_number, source
    doc = {"jobs": [], "errors": [{"description": "Unable to query accounting", "error_number": 7000,
                                   "error": "Unable to contact slurm controller (connect failure)",
                                   "source": "slurmdb_jobs_get"}], "warnings": []}
    with pytest.raises(SacctParseError, match=r"^j\.json: sacct reported an error and no jobs: Unable to contact slurm "
                                              r"controller \(connect failure\) Unable to query accounting$"):
        list(iter_json(doc, source="j.json"))
    assert list(iter_json({"jobs": [], "errors": []}, source="j.json")) == []


def test_derived_template_is_read_from_the_judges_admin_comment():
    """A job with no template in its comment was judged under a derived template; the
    report reads it from the AdminComment the judge wrote, as the verdict has it. A
    named template still wins; a foreign or damaged AdminComment gives none."""
    from gpuguard.epilog import admincomment

    judged = admincomment.encode(admincomment.build(
        "8", {"cause": "healthy", "state": "judged", "template": "gpu.h100-80gb-hbm3.x4.n1.train",
              "summary": "ok", "baseline_runs": 3}, {}, []))
    text = "JobIDRaw|JobID|State|Comment|AdminComment\n" \
        f"8|8|COMPLETED||{judged}\n9|9|COMPLETED|gpuguard:template=mine|{judged}\n" \
        "10|10|COMPLETED||gpuguard: config.persistence_off gpu2 persistence mode off\n" \
        "11|11|COMPLETED||gpuguard:v2z:zzzz\n"
    rows = list(iter_pipe(io.StringIO(text), conv=UTC))
    assert [(r.job["job_id_raw"], r.job["template"]) for r in rows] == [
        (8, "gpu.h100-80gb-hbm3.x4.n1.train"), (9, "mine"), (10, None), (11, None)]
    assert template_of(None, "gpuguard:v1:" + '{"t": "a b/c"}') == "a-b-c"


def test_admin_comment_base32_reader_matches_the_library():
    """admincomment._b32decode (int(.., 32), C speed) gives base64.b32decode's bytes for
    every length, either case, and refuses what it refuses."""
    import base64
    import binascii

    from gpuguard.epilog.admincomment import _b32decode

    for n in range(0, 41):
        raw = bytes(range(7, 7 + n))
        text = base64.b32encode(raw).decode().rstrip("=")
        assert _b32decode(text) == raw and _b32decode(text.lower()) == raw
    for bad in ("A", "ABC", "ABCDEF", "AB1", "AB CD", "AB=C"):
        with pytest.raises(ValueError):
            _b32decode(bad)
        with pytest.raises(binascii.Error):
            base64.b32decode(bad + "=" * (-len(bad) % 8))
