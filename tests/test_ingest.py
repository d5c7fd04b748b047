"""gpuguard.collector.ingest: root reading user-written records (we run as root)."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from gpuguard.collector import ingest
from gpuguard.collector.ingest import MIB, read_job_records, validate_record

UID = 1001  # the job user's uid; files are chowned to it


def step(n, **over):
    r = {"v": 1, "kind": "step", "rank": 0, "t": 1764460800.0 + n, "step": n, "step_time_s": 0.5,
         "samples": 32, "tokens": None, "loss": 2.0, "loss_nonfinite": False, "grad_norm": 1.0,
         "phases": {"data_wait_s": 0.1}}
    r.update(over)
    return r


def ckpt(n):
    return {"v": 1, "kind": "checkpoint", "rank": 0, "t": 1764460900.0, "step": n, "duration_s": 4.0}


@pytest.fixture
def job_dir(tmp_path):
    d = tmp_path / "job"
    d.mkdir(mode=0o700)
    os.chown(d, UID, UID)
    return d


def put(d, name, text, uid=UID):
    p = d / name
    p.write_text(text)
    os.chown(p, uid, uid)
    return p


def jl(*recs):
    return "".join(json.dumps(r) + "\n" for r in recs)


def test_exact_counts_and_normalised_records(job_dir):
    good = jl(step(0), step(1), ckpt(1), step(2, phases={"comm_s": 0.2, "bogus_s": 1.0}, extra="dropped"))
    bad = [
        "not json",
        json.dumps(step(3, v=2)),                        # unknown version
        json.dumps(step(3, kind="epoch")),               # unknown kind
        json.dumps(step(3, step_time_s="0.5")),          # wrong type
        json.dumps(step(3, step=True)),                  # bool is not an int
        json.dumps(step(3, step=-1)),                    # negative step
        json.dumps({k: v for k, v in step(3).items() if k != "t"}),  # missing t
        json.dumps(step(3, phases={"comm_s": -1})),      # negative phase
        json.dumps([1, 2]),
        json.dumps(ckpt(4) | {"duration_s": None}),
    ]
    put(job_dir, "train.rank0.jsonl", good + "\n".join(bad) + "\n\n")
    put(job_dir, "train.rank1.jsonl", jl(step(0, rank=1)))
    put(job_dir, "notes.txt", "ignored\n")
    res = read_job_records(str(job_dir), UID)
    assert (len(res.steps), len(res.checkpoints), res.malformed) == (4, 1, len(bad))
    assert res.rejected_files == [] and res.truncated is False and res.nonfinite_loss == 0
    assert res.steps[0] == step(0)
    assert res.steps[2]["phases"] == {"comm_s": 0.2}
    assert "extra" not in res.steps[2]
    assert [r["rank"] for r in res.steps] == [0, 0, 0, 1]
    assert res.checkpoints == [ckpt(1)]


def test_nan_literal_and_flag_become_nonfinite(job_dir):
    text = (
        '{"v":1,"kind":"step","rank":0,"t":1764460800.0,"step":0,"step_time_s":0.5,"loss":NaN}\n'
        '{"v":1,"kind":"step","rank":0,"t":1764460800.0,"step":1,"step_time_s":0.5,"loss":Infinity,"grad_norm":NaN}\n'
        '{"v":1,"kind":"step","rank":0,"t":1764460800.0,"step":2,"step_time_s":0.5,"loss":null,"loss_nonfinite":true}\n'
        '{"v":1,"kind":"step","rank":0,"t":1764460800.0,"step":3,"step_time_s":0.5,"loss":1.5}\n'
        '{"v":1,"kind":"step","rank":0,"t":NaN,"step":4,"step_time_s":0.5}\n'
    )
    put(job_dir, "train.rank0.jsonl", text)
    res = read_job_records(str(job_dir), UID)
    assert [(s["loss"], s["loss_nonfinite"], s["grad_norm"]) for s in res.steps] == [
        (None, True, None), (None, True, None), (None, True, None), (1.5, False, None)]
    assert (res.nonfinite_loss, res.malformed) == (3, 1)
    assert res.steps[3]["samples"] is None and res.steps[3]["phases"] == {}


def test_symlinked_file_is_refused_and_not_read(job_dir, tmp_path):
    secret = tmp_path / "secret.jsonl"
    secret.write_text(jl(step(0)))
    os.chown(secret, UID, UID)  # even a target owned by the user is not followed
    (job_dir / "train.rank0.jsonl").symlink_to(secret)
    put(job_dir, "train.rank1.jsonl", jl(step(0, rank=1)))
    res = read_job_records(str(job_dir), UID)
    assert res.rejected_files == [(str(job_dir / "train.rank0.jsonl"), "symlink")]
    assert [s["rank"] for s in res.steps] == [1]


def test_file_owned_by_someone_else_is_refused(job_dir):
    put(job_dir, "train.rank0.jsonl", jl(step(0)), uid=1)
    res = read_job_records(str(job_dir), UID)
    assert res.rejected_files == [(str(job_dir / "train.rank0.jsonl"), "owned by uid 1, expected 1001")]
    assert res.steps == []


def test_fifo_is_refused_without_blocking(job_dir):
    fifo = job_dir / "train.rank0.jsonl"
    os.mkfifo(fifo)
    os.chown(fifo, UID, UID)
    out = []
    t = threading.Thread(target=lambda: out.append(read_job_records(str(job_dir), UID)), daemon=True)
    t.start()
    t.join(10)
    assert out, "ingest blocked on a FIFO"
    assert out[0].rejected_files == [(str(fifo), "not a regular file")]


def test_directory_checks(tmp_path, job_dir):
    assert read_job_records(str(tmp_path / "missing"), UID) == read_job_records(str(tmp_path / "missing"), 0)
    assert read_job_records(str(tmp_path / "missing"), UID).steps == []
    link = tmp_path / "link"
    link.symlink_to(job_dir)
    put(job_dir, "train.rank0.jsonl", jl(step(0)))
    res = read_job_records(str(link), UID)
    assert (res.rejected_files, res.steps) == ([(str(link), "symlink")], [])
    res = read_job_records(str(job_dir), 4242)
    assert res.rejected_files == [(str(job_dir), "owned by uid 1001, expected 4242")]
    f = put(tmp_path, "plain", "x")
    assert read_job_records(str(f), UID).rejected_files == [(str(f), "not a directory")]


def test_oversized_line_counted_malformed_and_the_rest_read(job_dir):
    long_line = json.dumps(step(1, note="x" * 5000))
    put(job_dir, "train.rank0.jsonl", jl(step(0)) + long_line + "\n" + jl(step(2)))
    res = read_job_records(str(job_dir), UID, max_line_bytes=1024)
    assert ([s["step"] for s in res.steps], res.malformed) == ([0, 2], 1)


def test_oversized_line_across_chunks(job_dir, monkeypatch):
    from gpuguard.collector import ingest

    monkeypatch.setattr(ingest, "_CHUNK", 64)
    long_line = json.dumps(step(1, note="y" * 1000))
    put(job_dir, "train.rank0.jsonl", jl(step(0)) + long_line + "\n" + jl(step(2)) + long_line)
    res = read_job_records(str(job_dir), UID, max_line_bytes=300)
    assert ([s["step"] for s in res.steps], res.malformed) == ([0, 2], 2)


def test_last_line_without_newline_is_read(job_dir):
    put(job_dir, "train.rank0.jsonl", jl(step(0)) + json.dumps(step(1)))
    assert [s["step"] for s in read_job_records(str(job_dir), UID).steps] == [0, 1]
    put(job_dir, "train.rank0.jsonl", jl(step(0)) + json.dumps(step(1))[:20])
    res = read_job_records(str(job_dir), UID)
    assert ([s["step"] for s in res.steps], res.malformed) == ([0], 1)


def test_size_and_file_count_caps(job_dir):
    body = jl(*[step(i) for i in range(100)])
    put(job_dir, "train.rank0.jsonl", body)
    one = len(json.dumps(step(0))) + 1
    res = read_job_records(str(job_dir), UID, max_file_bytes=10 * one + 5)
    assert (len(res.steps), res.malformed, res.truncated) == (10, 0, True)
    for r in range(1, 4):
        put(job_dir, f"train.rank{r}.jsonl", jl(step(0, rank=r)))
    res = read_job_records(str(job_dir), UID, max_files=2)
    assert res.truncated is True
    assert sorted({s["rank"] for s in res.steps}) == [0, 1]
    res = read_job_records(str(job_dir), UID, max_total_bytes=len(body))
    assert (len(res.steps), res.truncated) == (100, True)


def test_validate_record_errors():
    with pytest.raises(ValueError, match="bad or missing v"):
        validate_record(step(0, v=True))
    with pytest.raises(ValueError, match="bad or missing loss_nonfinite"):
        validate_record(step(0, loss_nonfinite="no"))
    assert validate_record(ckpt(None))["step"] is None


# -- out-of-range values: that line only (security review) ----------------------------------
NOW = 1764460800.0 + 3600  # the reader's clock in these tests


@pytest.mark.parametrize("over", [
    {"step": 2**63}, {"step": 10**30}, {"samples": 10**30}, {"samples": 2**63}, {"tokens": 2**64},
    {"rank": 2**63}, {"t": 1.0}, {"t": 0}, {"t": 946684799.0}, {"t": 1e12}, {"t": 1e300}, {"t": -1e300},
    {"t": NOW + 86400.5}, {"t": 10**400}, {"step_time_s": 10**400}, {"loss": 10**400},
    {"phases": {"comm_s": 10**400}}, {"samples": 2**40 + 1}, {"tokens": 2**63 - 1},
    {"step_time_s": 366 * 86400.0 + 1}, {"phases": {"data_wait_s": 1e308}},
])
def test_out_of_range_value_makes_only_its_line_malformed(job_dir, over):
    text = jl(step(0)) + json.dumps(step(1, **over)) + "\n" + jl(step(2), ckpt(2))
    put(job_dir, "train.rank0.jsonl", text)
    res = read_job_records(str(job_dir), UID, now=NOW)
    assert ([s["step"] for s in res.steps], len(res.checkpoints), res.malformed, res.truncated) == ([0, 2], 1, 1, False)


def test_range_edges_are_accepted(job_dir):
    edge = [step(0, step=2**63 - 1, samples=2**40, tokens=0, rank=2**63 - 1, t=946684800.0,
                 step_time_s=366 * 86400.0),
            step(1, t=NOW + 86400.0)]
    put(job_dir, "train.rank0.jsonl", jl(*edge))
    res = read_job_records(str(job_dir), UID, now=NOW)
    assert (res.malformed, [s["t"] for s in res.steps]) == (0, [946684800.0, NOW + 86400.0])
    assert res.steps[0]["step"] == res.steps[0]["rank"] == 2**63 - 1
    assert (res.steps[0]["samples"], res.steps[0]["step_time_s"]) == (2**40, 366 * 86400.0)


def test_validate_record_t_window_defaults_to_the_clock():
    with pytest.raises(ValueError, match="bad or missing t"):
        validate_record(step(0, t=time.time() + 2 * 86400))
    assert validate_record(step(0, t=time.time()))["step"] == 0
    with pytest.raises(ValueError, match="bad or missing t"):
        validate_record(step(0), now=946684800.0)  # t = 2025 is far in that clock's future
    with pytest.raises(ValueError, match="bad or missing step"):
        validate_record(step(0, step=2**63))


def test_record_cap_truncates_exactly(job_dir):
    put(job_dir, "train.rank0.jsonl", jl(step(0), step(1), ckpt(1)) + "\n\n")
    put(job_dir, "train.rank1.jsonl", jl(step(0, rank=1)))
    res = read_job_records(str(job_dir), UID, max_records=4)
    assert (len(res.steps), len(res.checkpoints), res.truncated) == (3, 1, False)  # exactly at the cap
    res = read_job_records(str(job_dir), UID, max_records=3)
    assert ([(s["rank"], s["step"]) for s in res.steps], len(res.checkpoints), res.truncated) == (
        [(0, 0), (0, 1)], 1, True)
    res = read_job_records(str(job_dir), UID, max_records=1)
    assert ([s["step"] for s in res.steps], res.checkpoints, res.truncated) == ([0], [], True)
    # malformed lines count against the cap (a junk line costs more than a record)
    put(job_dir, "train.rank1.jsonl", "x\n{}\n" + jl(step(0, rank=1)))
    res = read_job_records(str(job_dir), UID, max_records=5)
    assert (len(res.steps), len(res.checkpoints), res.malformed, res.truncated) == (2, 1, 2, True)


def test_default_caps_and_the_record_cap_end_to_end(job_dir):
    assert (ingest.MAX_TOTAL_BYTES, ingest.MAX_FILE_BYTES, ingest.MAX_RECORDS) == (32 * MIB, 32 * MIB, 100_000)
    n = ingest.MAX_RECORDS + 1
    line = '{"v":1,"kind":"step","rank":0,"t":1764460800.5,"step":%d,"step_time_s":0.5}\n'
    put(job_dir, "train.rank0.jsonl", "".join(line % i for i in range(n)))
    res = read_job_records(str(job_dir), UID)
    assert (len(res.steps), res.steps[-1]["step"], res.malformed, res.truncated) == (
        ingest.MAX_RECORDS, ingest.MAX_RECORDS - 1, 0, True)
