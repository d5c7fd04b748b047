"""Incremental training-record ingest (gpuguard.collector.ingest_tail): the collector stores
complete lines during the job, the Epilog the tail; offsets are durable and the result is
the same as one read of the whole directory."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

import gpuguard.epilog.schema  # noqa: F401  (steps, checkpoints, train_offsets)
from gpuguard.collector.ingest import read_job_records
from gpuguard.collector.ingest_tail import forget_offsets, ingest_new_records, record_ingest_tick
from gpuguard.store import open_store

T = 1_764_460_800.0
UID = os.getuid()


def step(rank: int, k: int, st: float = 1.0) -> str:
    return json.dumps({"v": 1, "kind": "step", "rank": rank, "t": T + k, "step": k, "step_time_s": st,
                       "samples": 4}) + "\n"


@pytest.fixture
def env(tmp_path):
    jd = tmp_path / "jobs" / "7"
    jd.mkdir(parents=True)
    st = open_store(str(tmp_path / "node.db"))
    yield SimpleNamespace(dir=jd, store=st, rows=lambda: st.db.conn.execute(
        "select rank, step from steps where job_id = '7' and node = 'n1' order by rank, step").fetchall())
    st.close()


def run(env, final, **kw):
    return ingest_new_records(env.store, str(env.dir), "7", "n1", UID, final=final, now=T + 1000, **kw)


def test_partial_line_waits_until_complete_and_the_tail_is_read_once(env):
    f = env.dir / "train.rank0.jsonl"
    f.write_text(step(0, 0) + step(0, 1) + step(0, 2)[:20])
    res = run(env, False)
    assert ([s["step"] for s in res.steps], res.malformed, res.truncated) == ([0, 1], 0, False)
    assert env.store.db.conn.execute("select name, offset, records from train_offsets").fetchall() == [
        ("train.rank0.jsonl", len(step(0, 0) + step(0, 1)), 2)]
    with f.open("a") as fh:
        fh.write(step(0, 2)[20:] + "garbage\n" + step(0, 3)[:-1])  # the last line never ends
    (env.dir / "train.rank1.jsonl").write_text(step(1, 0))
    res = run(env, False)
    assert ([(s["rank"], s["step"]) for s in res.steps], res.malformed) == ([(0, 2), (1, 0)], 1)
    res = run(env, True)  # the Epilog: an unterminated last line counts
    assert ([s["step"] for s in res.steps], res.malformed, res.truncated) == ([3], 1, False)
    again = run(env, True)
    assert (again.steps, again.malformed) == ([], 1)
    assert env.rows() == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0)]
    whole = read_job_records(str(env.dir), UID, now=T + 1000)
    assert sorted((s["rank"], s["step"]) for s in whole.steps) == env.rows() and whole.malformed == 1


def test_per_call_cap_continues_during_the_job_and_truncates_at_the_end(env):
    (env.dir / "train.rank0.jsonl").write_text("".join(step(0, k) for k in range(5)))
    res = run(env, False, max_records=2)
    assert ([s["step"] for s in res.steps], res.truncated) == ([0, 1], False)
    res = run(env, False, max_records=2)
    assert ([s["step"] for s in res.steps], res.truncated) == ([2, 3], False)
    res = run(env, True, max_records=2)
    assert ([s["step"] for s in res.steps], res.truncated) == ([4], False)
    (env.dir / "train.rank0.jsonl").open("a").write("".join(step(0, k) for k in range(5, 9)))
    res = run(env, True, max_records=2)
    assert ([s["step"] for s in res.steps], res.truncated) == ([5, 6], True)


def test_job_cap_truncates_and_is_remembered(env):
    (env.dir / "train.rank0.jsonl").write_text("".join(step(0, k) for k in range(5)))
    res = run(env, False, max_job_records=3)
    assert ([s["step"] for s in res.steps], res.truncated) == ([0, 1, 2], True)
    res = run(env, True, max_job_records=3)
    assert (res.steps, res.truncated) == ([], True)
    assert env.store.db.conn.execute("select truncated from train_offsets").fetchall() == [(1,)]


def test_overlong_line_split_across_calls_is_one_malformed_line(env):
    f = env.dir / "train.rank0.jsonl"
    f.write_text(step(0, 0) + "x" * 500)
    assert run(env, False, max_line_bytes=300).malformed == 1
    f.open("a").write("y" * 500)
    assert run(env, False, max_line_bytes=300).malformed == 1
    f.open("a").write("z\n" + step(0, 1))
    res = run(env, True, max_line_bytes=300)
    assert ([s["step"] for s in res.steps], res.malformed) == ([1], 1)
    assert env.rows() == [(0, 0), (0, 1)]


def test_replaced_file_is_read_from_its_start_and_a_cut_one_from_its_end(env):
    f = env.dir / "train.rank0.jsonl"
    f.write_text(step(0, 0) + step(0, 1))
    run(env, False)
    f.unlink()
    keep = env.dir / "keep"
    keep.write_text("pin the inode")  # so the new file cannot reuse the old inode
    f.write_text(step(0, 5))
    assert [s["step"] for s in run(env, False).steps] == [5]
    os.truncate(f, 0)  # the job-directory cap cut it
    assert run(env, False).steps == []
    f.open("a").write(step(0, 6))
    assert [s["step"] for s in run(env, True).steps] == [6]
    assert env.rows() == [(0, 0), (0, 1), (0, 5), (0, 6)]


def test_first_ingest_of_an_attempt_replaces_the_job_rows_and_forget_starts_afresh(env):
    (env.dir / "train.rank0.jsonl").write_text(step(0, 0) + step(0, 1))
    run(env, True)
    forget_offsets(env.store, "7", "n1")
    assert env.store.db.conn.execute("select count(*) from train_offsets").fetchone() == (0,)
    (env.dir / "train.rank0.jsonl").unlink()
    assert run(env, True).steps == [] and env.rows() == [(0, 0), (0, 1)]  # nothing new never wipes
    (env.dir / "train.rank0.jsonl").write_text(step(0, 9))  # the requeued attempt
    run(env, False)
    assert env.rows() == [(0, 9)]


def test_a_second_caller_that_moved_the_offsets_is_not_stored_twice(env, monkeypatch):
    from gpuguard.collector import ingest_tail

    (env.dir / "train.rank0.jsonl").write_text(step(0, 0) + step(0, 1))
    real = ingest_tail._store_tails
    calls = []

    def racing(store, job_id, node, before, tails, **kw):
        if not calls:  # the collector commits the same lines first
            calls.append(1)
            real(store, job_id, node, before, tails, **kw)
        return real(store, job_id, node, before, tails, **kw)

    monkeypatch.setattr(ingest_tail, "_store_tails", racing)
    res = run(env, True)
    assert res.steps == []  # the retry found nothing new
    assert env.rows() == [(0, 0), (0, 1)]


def test_rejected_directory_and_files(env, tmp_path):
    (env.dir / "train.rank0.jsonl").symlink_to("/etc/passwd")
    os.mkfifo(env.dir / "train.rank1.jsonl")
    res = run(env, True)
    assert sorted(res.rejected_files) == [(str(env.dir / "train.rank0.jsonl"), "symlink"),
                                          (str(env.dir / "train.rank1.jsonl"), "not a regular file")]
    res = ingest_new_records(env.store, str(env.dir), "7", "n1", UID + 1, final=True)
    assert res.rejected_files == [(str(env.dir), f"owned by uid {UID}, expected {UID + 1}")]
    assert env.rows() == []


def test_collector_tick(env, tmp_path):
    cfg = SimpleNamespace(get=lambda section, key: str(tmp_path / "jobs"))
    logged = []
    log = SimpleNamespace(warning=lambda *a: logged.append(a))
    assert record_ingest_tick(cfg, "7", "n1", None, log) is None
    tick = record_ingest_tick(cfg, "7", "n1", UID, log)
    (env.dir / "train.rank0.jsonl").write_text(step(0, 0) + step(0, 1)[:10])
    tick(env.store)
    assert env.rows() == [(0, 0)]
    tick(SimpleNamespace(db=None, path="x"))  # a broken store: logged, never raised
    assert logged and "ingest during the job failed (1 time(s))" in logged[0][0] % logged[0][1:]


def test_the_stored_prefix_is_released_from_the_disk_and_the_cap_counts_the_rest(env, tmp_path):
    """After each tick the ingested prefix of a record file is hole-punched (whole blocks):
    the file keeps its size and what follows the offset, the tail is still ingested by the
    Epilog, and the directory's cap counts the bytes on disk."""
    from gpuguard.collector.jobdir_cap import enforce_cap, release_ingested

    cfg = SimpleNamespace(get=lambda section, key: str(tmp_path / "jobs"))
    tick = record_ingest_tick(cfg, "7", "n1", UID, SimpleNamespace(warning=lambda *a: None))
    f = env.dir / "train.rank0.jsonl"
    f.write_text("".join(step(0, k) for k in range(4000)))  # ~400 KB
    size = f.stat().st_size
    tick(env.store)  # 4 MiB a tick: all of it stored
    assert len(env.rows()) == 4000
    st = f.stat()
    if st.st_blocks * 512 >= size:
        pytest.skip("this filesystem cannot punch holes")
    assert st.st_size == size and st.st_blocks * 512 < 8192  # at most the last partial blocks stay on disk
    with f.open("a") as out:
        out.write("".join(step(0, k) for k in range(4000, 4100)))
    # what the cap counts: the unstored tail (and the partial block), not the 400 KB
    used, cut = enforce_cap(str(env.dir), 64 * 1024)
    assert cut == [] and used < 64 * 1024
    assert run(env, True).steps and len(env.rows()) == 4100  # the Epilog's tail read after the hole
    # a file replaced since (another inode) or shorter than the offset is left alone
    off = env.store.db.conn.execute("select name, dev, ino, offset from train_offsets").fetchall()
    f2 = env.dir / "train.rank1.jsonl"
    f2.write_text(step(1, 0) * 3000)
    fst = f2.stat()
    assert release_ingested(str(env.dir), [("train.rank1.jsonl", fst.st_dev, fst.st_ino + 1, 100_000),
                                           ("train.rank1.jsonl", fst.st_dev, fst.st_ino, 10**9)]) == 0
    assert f2.stat().st_blocks == fst.st_blocks and off[0][0] == "train.rank0.jsonl"
    (env.dir / "link").symlink_to(f2)
    assert release_ingested(str(env.dir), [("link", fst.st_dev, fst.st_ino, 100_000)]) == 0
    assert release_ingested(str(tmp_path / "missing"), off) == 0


def test_the_cap_cuts_after_a_released_prefix(tmp_path):
    """A file whose start was released is cut to its released prefix plus its share."""
    from gpuguard.collector.jobdir_cap import enforce_cap, release_ingested

    d = tmp_path / "9"
    d.mkdir()
    f = d / "train.rank0.jsonl"
    f.write_bytes(b"x" * 409_600)
    st = f.stat()
    if release_ingested(str(d), [(f.name, st.st_dev, st.st_ino, 204_800)]) == 0:
        pytest.skip("this filesystem cannot punch holes")
    used, cut = enforce_cap(str(d), 102_400)
    assert (used, cut) == (204_800, ["train.rank0.jsonl"])
    assert f.stat().st_size == 204_800 + 102_400 and f.read_bytes()[204_800:] == b"x" * 102_400
    assert f.read_bytes()[:4096] == b"\0" * 4096
