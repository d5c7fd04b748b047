"""The parallel bulk import (gpuguard.reports.sync_bulk): chunk edges, one transaction
across worker processes, the tally's line numbers. That it stores and says what the
batched path does, on every corpus file, is test_reports_sync's equivalence test."""

from __future__ import annotations

import json
import os
from datetime import UTC

import pytest
from reports_helpers import HANDMADE, cache_store

import gpuguard.reports.sync as sync_mod
import gpuguard.reports.sync_bulk as bulk_mod
from gpuguard.reports.sacct import SacctParseError
from gpuguard.reports.sync import import_file


@pytest.fixture
def cstore(tmp_path):
    yield from cache_store(tmp_path)


@pytest.fixture
def parallel(monkeypatch):
    """Every -P import of two or more jobs takes the parallel path, a chunk every ~120 bytes."""
    monkeypatch.setattr(sync_mod, "BULK_MIN_ROWS", 1)
    monkeypatch.setattr(bulk_mod, "WORKERS", 2)
    monkeypatch.setattr(bulk_mod, "CHUNK_BYTES", 120)


def _indexes(store):
    return sorted((r["name"], r["sql"]) for r in store.query(
        "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND tbl_name = 'sacct_jobs' AND sql IS NOT NULL"))


def test_chunk_ranges_end_just_after_a_newline_and_cover_the_file(tmp_path):
    f = tmp_path / "t.txt"
    # CRLF lines, a lone CR inside a line, a two-byte character, no newline at the end
    data = "JobIDRaw|State\r\n1|COMPLETED\r\n2|FAIL\rED\n3|é\n4|x".encode()
    f.write_bytes(data)
    assert len(data) == 47
    assert bulk_mod.chunk_ranges(str(f), 0, len(data), 5) == [(0, 16), (16, 29), (29, 39), (39, 47)]
    assert bulk_mod.chunk_ranges(str(f), 16, len(data), 100) == [(16, 47)]
    assert bulk_mod.chunk_ranges(str(f), 0, len(data), 10**6) == [(0, 47)]
    for _lo, hi in bulk_mod.chunk_ranges(str(f), 0, len(data), 1):
        assert data[hi - 1:hi] == b"\n" or hi == len(data)


def test_header_line_keeps_its_terminator_and_says_where_the_body_starts(tmp_path):
    f = tmp_path / "t.txt"
    f.write_bytes("JobIDRaw|JobName|Stäte\r\n1|a|COMPLETED\n".encode())
    assert bulk_mod.header_line(str(f)) == ("JobIDRaw|JobName|Stäte\r\n", 25)


def test_a_worker_failing_part_way_leaves_the_store_as_it_was(cstore, parallel, monkeypatch):
    import_file(cstore, str(HANDMADE), tz=UTC, synced_at=1.0)
    before, indexes = cstore.query("SELECT * FROM sacct_jobs ORDER BY job_id_raw"), _indexes(cstore)
    real = bulk_mod.parse_chunk

    def failing(task):
        if task.lo > 600:
            raise OSError("disk gone")
        return real(task)
    monkeypatch.setattr(bulk_mod, "parse_chunk", failing)  # the forked workers run this one
    with pytest.raises(OSError, match="disk gone"):
        import_file(cstore, str(HANDMADE), tz=UTC, synced_at=2.0)
    assert cstore.query("SELECT * FROM sacct_jobs ORDER BY job_id_raw") == before
    assert _indexes(cstore) == indexes and len(indexes) == 6
    # nothing of the load is left attached, and the next import works
    assert bulk_mod.STAGE not in [r["name"] for r in cstore.query("PRAGMA database_list")]
    monkeypatch.setattr(bulk_mod, "parse_chunk", real)
    assert import_file(cstore, str(HANDMADE), tz=UTC, synced_at=3.0).jobs == 14
    assert {r["synced_at"] for r in cstore.query("SELECT synced_at FROM sacct_jobs")} == {3.0}


def test_line_numbers_of_skipped_rows_count_across_chunks(cstore, parallel, tmp_path):
    head = "JobIDRaw|State|Start|End|AllocTRES\n"
    good = "{}|COMPLETED|2025-03-01T01:00:00|2025-03-01T02:00:00|gres/gpu=1\n"
    lines = [good.format(100 + i) for i in range(40)]
    lines[11] = "111|COMPLETED|2025-03-01T03:00:00|2025-03-01T02:00:00|gres/gpu=1\n"  # Start after End
    lines[30] = "130|COMPLETED\n"  # too few fields
    lines[37] = "137.batch|COMPLETED|2025-03-01T01:00:00|2025-03-01T02:00:00|\n"  # a step
    f = tmp_path / "s.txt"
    f.write_text(head + "".join(lines))
    assert len(bulk_mod.chunk_ranges(str(f), 0, f.stat().st_size, 120)) >= 10
    res = import_file(cstore, str(f), tz=UTC, synced_at=1.0)
    assert res.jobs == 37 and res.steps_skipped == 1
    assert res.malformed == [(13, "Start 2025-03-01T03:00:00 is after End 2025-03-01T02:00:00"),
                             (32, "2 fields, header has 5")]
    assert cstore.query("SELECT COUNT(*) AS n, SUM(gpus) AS g FROM sacct_jobs")[0] == {"n": 37, "g": 37}


def test_requeued_attempts_in_different_chunks_are_counted_once_each(cstore, parallel, tmp_path):
    head = "JobIDRaw|JobID|State|Submit|Start|End|AllocTRES\n"
    row = "{id}|{id}|{st}|2025-03-01T0{h}:00:00|2025-03-01T0{h}:10:00|2025-03-01T0{h}:20:00|gres/gpu=1\n"
    body = [row.format(id=500, st="REQUEUED", h=1)]
    body += [row.format(id=600 + i, st="COMPLETED", h=2) for i in range(20)]
    body += [row.format(id=500, st="REQUEUED", h=3)]
    body += [row.format(id=600 + i, st="COMPLETED", h=2) for i in range(20, 40)]
    body += [row.format(id=500, st="COMPLETED", h=4), row.format(id=500, st="COMPLETED", h=4)]
    f = tmp_path / "r.txt"
    f.write_text(head + "".join(body))
    res = import_file(cstore, str(f), tz=UTC, synced_at=1.0)
    assert res.attempts == {"500": 3}
    assert [tuple(r.values()) for r in cstore.query(
        "SELECT state, submit_at FROM sacct_jobs WHERE job_id_raw = 500 ORDER BY attempt_at")] == [
        ("REQUEUED", 1740790800.0), ("REQUEUED", 1740798000.0), ("COMPLETED", 1740801600.0)]


def test_workers_default_to_the_usable_cpus_and_one_cpu_means_none(monkeypatch):
    monkeypatch.setattr(bulk_mod, "WORKERS", None)
    monkeypatch.setattr(bulk_mod.os, "sched_getaffinity", lambda pid: {0})
    assert bulk_mod.workers() == 0
    monkeypatch.setattr(bulk_mod.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert bulk_mod.workers() == bulk_mod.MAX_WORKERS == 4
    monkeypatch.setattr(bulk_mod.os, "sched_getaffinity", lambda pid: {0, 1})
    assert bulk_mod.workers() == 2
    assert bulk_mod.worth_it(2 * bulk_mod.CHUNK_BYTES) and not bulk_mod.worth_it(2 * bulk_mod.CHUNK_BYTES - 1)


def test_text_ranges_end_just_after_a_newline_and_cover_the_text():
    text = "a|b\r\n1|x\n22|yy\n333|zzz"
    assert bulk_mod.text_ranges(text, 4) == [(0, 5), (5, 9), (9, 15), (15, 22)]
    assert bulk_mod.text_ranges(text, 6) == [(0, 9), (9, 15), (15, 22)]
    assert bulk_mod.text_ranges(text, 100) == [(0, 22)] and bulk_mod.text_ranges("", 4) == []


def test_live_sync_text_in_chunks_stores_and_says_what_the_batched_path_does(tmp_path, monkeypatch):
    """Header-less sacct text with the live sync's delimiter and a cluster without GPU
    accounting (as :func:`gpuguard.reports.sync.sync_from_slurm` imports it), and text with a
    header line: the parallel path stores the same rows and says the same."""
    from gpuguard.reports.sync import import_text

    fields = ["JobIDRaw", "JobID", "JobName", "State", "Submit", "Start", "End", "ElapsedRaw", "AllocTRES", "Comment"]
    row = "\x1f".join(["{i}", "{i}", "j{i}", "{st}", "2025-03-01T01:00:00", "2025-03-01T01:0{m}:00",
                       "2025-03-01T02:00:00", "{el}", "{tres}", "gpuguard:template=t{m}"])
    body = "".join(row.format(i=100 + i, st=("COMPLETED", "FAILED", "CANCELLED by 0")[i % 3], m=i % 10,
                              el="" if i % 7 == 0 else 3000 + i, tres="cpu=2" if i % 4 == 0 else "gres/gpu=2") + "\n"
                   for i in range(60))
    body += "bad\x1fline\n" + row.format(i=100, st="COMPLETED", m=9, el=1, tres="gres/gpu=1") + "\n"
    headed = "|".join(fields) + "\n" + body.replace("\x1f", "|")
    seen = []
    real = bulk_mod.import_parallel
    for name, bulk_min, workers in (("batched", 10**9, 0), ("parallel", 1, 2)):
        monkeypatch.setattr(sync_mod, "BULK_MIN_ROWS", bulk_min)
        monkeypatch.setattr(bulk_mod, "WORKERS", workers)
        monkeypatch.setattr(bulk_mod, "CHUNK_BYTES", 200)
        calls: list[int] = []
        monkeypatch.setattr(bulk_mod, "import_parallel", lambda *a, c=calls, **k: c.append(1) or real(*a, **k))
        s = next(cache_store(tmp_path / name))
        live = import_text(s, body, tz=UTC, fields=fields, delimiter="\x1f", source="sacct", synced_at=5.0,
                           gpus_tracked=False)
        saved = import_text(s, headed, tz=UTC, source="saved", synced_at=6.0)
        said = [(r.jobs, r.malformed, r.unreportable, r.gpus_unknown, r.summary()) for r in (live, saved)]
        seen.append((said, s.query("SELECT * FROM sacct_jobs ORDER BY job_id_raw, attempt_at")))
        assert len(calls) == (0 if name == "batched" else 2)
    assert seen[0] == seen[1]
    (live_said, saved_said), stored = seen[1]
    # no gres/gpu accounting: a job whose TRES hold no GPU has its GPU usage unknown
    assert live_said[:4] == (61, [(61, "2 fields, header has 10")], [],
                             [(4 * k + 1, str(100 + 4 * k)) for k in range(15)])
    assert saved_said[1] == [(62, "2 fields, header has 10")]
    assert len(stored) == 60 and {r["source"] for r in stored} == {"saved"}
    # the live import's unknown GPU count (no gres/gpu accounting) is kept by the saved file's 0
    assert [r["gpus"] for r in stored[:5]] == [1, 2, 2, 2, 0] and stored[0]["job_id_raw"] == 100  # its last row


def test_no_worker_processes_to_be_had_means_the_import_runs_in_this_process(cstore, parallel, monkeypatch, caplog):
    def refuse(*a, **k):
        raise OSError(11, "Resource temporarily unavailable")
    monkeypatch.setattr(bulk_mod.multiprocessing, "get_context", lambda *a: type("C", (), {"Pool": refuse})())
    res = import_file(cstore, str(HANDMADE), tz=UTC, synced_at=1.0)
    assert (res.jobs, res.malformed) == (14, [])
    assert cstore.query("SELECT COUNT(*) AS n FROM sacct_jobs")[0]["n"] == 14
    assert "no worker processes ([Errno 11] Resource temporarily unavailable); parsing in this process" in caplog.text


def test_chunks_whose_tables_sit_on_different_pages_are_each_read_right(cstore):
    """Each chunk is deserialized into the same attached schema; a statement prepared on the
    last chunk's schema (same schema cookie, other root pages) read a wrong page
    ('database disk image is malformed'). Here the second chunk's side table sits elsewhere."""
    import sqlite3

    from gpuguard.reports.sync_result import Tally

    def chunk(first_id: int, n: int, rare_last: bool) -> bulk_mod.Chunk:
        db = sqlite3.connect(":memory:", isolation_level=None)
        db.execute(f"CREATE TABLE staged ({', '.join(bulk_mod.STAGE_COLUMNS)})")
        rare = f"CREATE TABLE staged_rare (row INTEGER PRIMARY KEY, {', '.join(bulk_mod.RARE_COLUMNS)})"
        if not rare_last:
            db.execute(rare)
        rows = []
        for i in range(n):
            job = dict.fromkeys(bulk_mod.STAGE_COLUMNS)
            job.update(cluster="", job_id_raw=first_id + i, job_id=str(first_id + i), state="COMPLETED",
                       submit_at=1.0e9 + i, gpus=1)
            rows.append(tuple(job[c] for c in bulk_mod.STAGE_COLUMNS))
        db.executemany(f"INSERT INTO staged VALUES ({', '.join('?' * len(bulk_mod.STAGE_COLUMNS))})", rows)
        if rare_last:  # created after the rows: its root page is past theirs, the schema cookie the same
            db.execute(rare)
        db.execute("INSERT INTO staged_rare (row, array_job_id, array_task_id) VALUES (2, 77, 3)")
        return bulk_mod.Chunk(data=db.serialize(), lines=n, jobs=n, tally=Tally())

    jobs = bulk_mod.load_chunks(cstore, iter([chunk(100, 300, False), chunk(1000, 300, True)]), 5.0, "t", Tally())
    assert jobs == 600
    got = cstore.query("SELECT COUNT(*) AS n, SUM(gpus) AS g, MIN(job_id_raw) AS lo, MAX(job_id_raw) AS hi "
                       "FROM sacct_jobs")[0]
    assert got == {"n": 600, "g": 600, "lo": 100, "hi": 1299}
    assert [tuple(r.values()) for r in cstore.query(
        "SELECT job_id_raw, array_job_id, array_task_id FROM sacct_jobs WHERE array_job_id IS NOT NULL "
        "ORDER BY 1")] == [(101, 77, 3), (1001, 77, 3)]
    assert cstore.query("PRAGMA integrity_check") == [{"integrity_check": "ok"}]


def test_forked_workers_read_the_file_the_import_opened_even_if_its_path_is_replaced(cstore, parallel, monkeypatch,
                                                                                      tmp_path):
    f = tmp_path / "jobs.txt"
    f.write_bytes(HANDMADE.read_bytes())
    real = bulk_mod.file_tasks

    def then_replace(path, *a):
        tasks = real(path, *a)
        os.rename(path, str(tmp_path / "moved.txt"))  # logrotate, or an editor's save
        f.write_text("JobIDRaw|State\n" + "".join(f"{9000 + i}|FAILED\n" for i in range(60)))
        return tasks
    monkeypatch.setattr(bulk_mod, "file_tasks", then_replace)
    res = import_file(cstore, str(f), tz=UTC, synced_at=1.0)
    assert (res.jobs, res.malformed) == (14, [])
    assert cstore.query("SELECT COUNT(*) AS n, MAX(job_id_raw) < 9000 AS theirs FROM sacct_jobs")[0] == {
        "n": 14, "theirs": 1}


def _live_list_file(tmp_path, header: bool):
    """The handmade jobs in the live sync's field list (SACCT_FIELDS), with or without its header."""
    from gpuguard.reports.sacct import SACCT_FIELDS

    lines = HANDMADE.read_text().splitlines()
    body = [ln + "||60" for ln in lines[1:] if ln]  # + ReqTRES (empty), TimelimitRaw
    f = tmp_path / ("h.txt" if header else "n.txt")
    f.write_text("".join(x + "\n" for x in ([lines[0] + "|ReqTRES|TimelimitRaw"] if header else []) + body))
    assert [*lines[0].split("|"), "ReqTRES", "TimelimitRaw"] == list(SACCT_FIELDS)
    return f


def _parallel(monkeypatch) -> None:
    """A test file this small takes the parallel bulk path: 2 workers, 120-byte chunks."""
    monkeypatch.setattr(sync_mod, "BULK_MIN_ROWS", 1)
    monkeypatch.setattr(bulk_mod, "WORKERS", 2)
    monkeypatch.setattr(bulk_mod, "CHUNK_BYTES", 120)


@pytest.mark.parametrize("bulk", [False, True])
def test_header_less_file_of_the_live_field_list_is_read_like_its_header_version(tmp_path, monkeypatch, bulk):
    # `sacct -a -X -D -P -n --format=<the README's list>`: rows only
    if bulk:
        _parallel(monkeypatch)
    got = {}
    for header in (True, False):
        store = next(cache_store(tmp_path / str(header)))
        res = import_file(store, str(_live_list_file(tmp_path, header)), tz=UTC, synced_at=1.0)
        got[header] = (res.jobs, res.malformed, [tuple(r.values()) for r in store.query(
            "SELECT job_id_raw, gpus, state, start_at, time_limit_s, comment FROM sacct_jobs ORDER BY job_id_raw")])
    assert got[False] == got[True]
    jobs, malformed, rows = got[False]
    assert (jobs, malformed, rows[0]) == (14, [], (101, 4, "COMPLETED", 1740873600.0, 3600, "gpuguard:template=llm-70b run 3"))


@pytest.mark.parametrize("delimiter", ["\t", ";"])
@pytest.mark.parametrize("bulk", [False, True])
def test_file_saved_with_another_delimiter_is_read_like_the_pipe_one(tmp_path, monkeypatch, delimiter, bulk):
    # sacct -P --delimiter=';' or a tab: the same jobs as the | file
    if bulk:
        _parallel(monkeypatch)
    text = HANDMADE.read_text()
    assert delimiter not in text
    got = []
    for name, body in (("p.txt", text), ("d.txt", text.replace("|", delimiter))):
        f = tmp_path / name
        f.write_text(body)
        store = next(cache_store(tmp_path / name.replace(".", "_")))
        res = import_file(store, str(f), tz=UTC, synced_at=1.0)
        got.append((res.jobs, res.malformed, [tuple(r.values()) for r in store.query(
            "SELECT job_id_raw, gpus, gpu_type, state, start_at, comment FROM sacct_jobs ORDER BY job_id_raw")]))
    assert got[1] == got[0] and got[0][0] == 14


def test_header_less_tsv_of_the_live_field_list(tmp_path):
    f = _live_list_file(tmp_path, header=False)
    f.write_text(f.read_text().replace("|", "\t"))
    store = next(cache_store(tmp_path / "s"))
    res = import_file(store, str(f), tz=UTC, synced_at=1.0)
    assert (res.jobs, res.malformed) == (14, [])


def test_comma_delimited_file_is_refused_as_such(tmp_path):
    f = tmp_path / "c.csv"
    f.write_text(HANDMADE.read_text().replace("|", ","))
    store = next(cache_store(tmp_path / "s"))
    with pytest.raises(SacctParseError, match=r"c\.csv:1: fields separated by ','.*AllocTRES and ReqTRES hold commas"):
        import_file(store, str(f), tz=UTC, synced_at=1.0)


@pytest.mark.parametrize("bulk", [False, True])
def test_paste_starting_with_blank_lines(tmp_path, monkeypatch, bulk):
    if bulk:
        _parallel(monkeypatch)
    f = tmp_path / "p.txt"
    f.write_text("\n  \n" + HANDMADE.read_text())
    res = import_file(next(cache_store(tmp_path / "s")), str(f), tz=UTC, synced_at=1.0)
    assert (res.jobs, res.malformed) == (14, [])


def test_admin_comments_are_decoded_once_in_the_workers_never_in_the_importing_process(cstore, parallel,
                                                                                       tmp_path, monkeypatch):
    """A judged job's AdminComment gives its template and its node summaries with ONE
    decode, in the worker that parses its chunk; the importing process only stores the
    decoded summaries (a 1 M-job cluster whose jobs gpuguard judged would otherwise decode
    each one, about 40 us, in the importing process, one after another)."""
    from gpuguard.epilog import admincomment

    judged = {n: admincomment.encode(admincomment.build(
        str(n), {"cause": "healthy", "state": "judged", "template": f"gpu.t{n}", "summary": "ok", "baseline_runs": 3},
        {"n1": {"gpu_util_mean_pct": 50.0 + n, "gpus": [{"gpu_index": 0, "gpu_util_mean_pct": 50.0 + n}]}}, []))
        for n in (7, 8, 9)}
    f = tmp_path / "judged.txt"
    f.write_text("JobIDRaw|JobID|State|Start|End|AllocTRES|Comment|AdminComment\n" + "".join(
        f"{n}|{n}|COMPLETED|2026-11-01T10:00:00|2026-11-01T11:00:00|gres/gpu=1||{judged[n]}\n" for n in (7, 8, 9)))
    decodes = []
    real = admincomment.decode
    monkeypatch.setattr(admincomment, "decode", lambda t: decodes.append(os.getpid()) or real(t))
    admincomment.decode_shared.cache_clear()
    res = import_file(cstore, str(f), tz=UTC, synced_at=5.0)
    assert res.jobs == 3 and not res.malformed
    assert decodes == []  # not one decode in the importing process: the forked workers did them
    assert [(r["job_id_raw"], r["template"]) for r in cstore.query(
        "SELECT job_id_raw, template FROM sacct_jobs ORDER BY 1")] == [(7, "gpu.t7"), (8, "gpu.t8"), (9, "gpu.t9")]
    got = [(r["job_id"], r["node"], r["created_at"], json.loads(r["summary"])["gpu_util_mean_pct"]) for r in cstore.query(
        "SELECT job_id, node, created_at, summary FROM job_summaries ORDER BY job_id")]
    assert got == [("7", "n1", 5.0, 57.0), ("8", "n1", 5.0, 58.0), ("9", "n1", 5.0, 59.0)]
    # and a worker decodes each AdminComment once: template and summaries share it
    chunk = bulk_mod.parse_chunk(bulk_mod.ChunkTask(source=str(f), tz=UTC, path=str(f), lo=0, hi=f.stat().st_size))
    assert decodes == [os.getpid()] * 3
    assert [(jid, node) for jid, node, _s in chunk.admin] == [("7", "n1"), ("8", "n1"), ("9", "n1")]
