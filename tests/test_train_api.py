"""gpuguard.collector.train: exact record schema, buffering, no-op mode, safety."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time

import pytest

from gpuguard.collector import train
from gpuguard.collector.ingest import read_job_records
from gpuguard.collector.train import Recorder


def lines(path) -> list[dict]:
    with open(path) as fh:
        return [json.loads(x) for x in fh]


def test_step_record_has_exact_schema_and_values(tmp_path):
    rec = Recorder(str(tmp_path), rank=3)
    t_before = time.time()
    with rec.step(step=7, samples=32, tokens=8192) as s:
        with s.phase("data_wait"):
            time.sleep(0.01)
        with s.phase("fwd_bwd"):
            time.sleep(0.02)
        with s.phase("data_wait"):  # a second visit adds up
            time.sleep(0.01)
        s.loss = 2.5
        s.grad_norm = 1.25
    rec.close()
    [r] = lines(tmp_path / "train.rank3.jsonl")
    assert list(r) == ["v", "kind", "rank", "t", "step", "step_time_s", "samples", "tokens", "loss",
                       "loss_nonfinite", "grad_norm", "phases"]
    assert (r["v"], r["kind"], r["rank"], r["step"], r["samples"], r["tokens"]) == (1, "step", 3, 7, 32, 8192)
    assert (r["loss"], r["loss_nonfinite"], r["grad_norm"]) == (2.5, False, 1.25)
    assert list(r["phases"]) == ["data_wait_s", "fwd_bwd_s"]
    assert 0.02 <= r["phases"]["data_wait_s"] < 0.2
    assert 0.02 <= r["phases"]["fwd_bwd_s"] < 0.2
    assert r["step_time_s"] >= r["phases"]["data_wait_s"] + r["phases"]["fwd_bwd_s"]
    assert t_before <= r["t"] <= time.time()


def test_nonfinite_loss_and_grad_norm_become_null_with_flag(tmp_path):
    rec = Recorder(str(tmp_path), rank=0)
    rec.log_step(1, 0.5, loss=float("nan"), grad_norm=float("inf"))
    rec.log_step(2, 0.5, loss=float("-inf"))
    rec.log_step(3, 0.5, loss=1.0)
    rec.close()
    rs = lines(tmp_path / "train.rank0.jsonl")
    assert [(r["loss"], r["loss_nonfinite"], r["grad_norm"]) for r in rs] == [
        (None, True, None), (None, True, None), (1.0, False, None)]
    raw = (tmp_path / "train.rank0.jsonl").read_text()
    assert "NaN" not in raw and "Infinity" not in raw


def test_log_step_checkpoint_auto_numbering_and_failed_step(tmp_path):
    rec = Recorder(str(tmp_path), rank=0)
    with rec.step():
        pass
    with pytest.raises(RuntimeError), rec.step():
        raise RuntimeError("boom")  # not recorded
    with rec.step():
        pass
    rec.log_step(10, 0.25, samples=4, phases={"comm": 0.1, "optim": 0.05})
    with rec.checkpoint(step=10):
        time.sleep(0.01)
    rec.log_checkpoint(3.5)
    rec.close()
    rs = lines(tmp_path / "train.rank0.jsonl")
    assert [r["step"] for r in rs] == [0, 1, 10, 10, None]
    assert rs[2]["phases"] == {"comm_s": 0.1, "optim_s": 0.05}
    assert (rs[2]["step_time_s"], rs[2]["samples"], rs[2]["tokens"]) == (0.25, 4, None)
    assert list(rs[3]) == ["v", "kind", "rank", "t", "step", "duration_s"]
    assert rs[3]["kind"] == "checkpoint" and rs[3]["duration_s"] >= 0.01
    assert rs[4] == {"v": 1, "kind": "checkpoint", "rank": 0, "t": rs[4]["t"], "step": None, "duration_s": 3.5}


def test_unknown_phase_raises_enabled_or_not(tmp_path):
    for rec in (Recorder(str(tmp_path)), Recorder(None)):
        with pytest.raises(ValueError, match="unknown phase 'forward'"), rec.step() as s:
            s.phase("forward")
        with pytest.raises(ValueError):
            rec.log_step(0, 0.1, phases={"io": 1.0})


def test_disabled_without_job_dir_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("GPUGUARD_JOB_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    rec = Recorder()
    assert rec.enabled is False and rec.path is None
    with rec.step(step=1, samples=2) as s:
        with s.phase("comm"):
            pass
        s.loss = 1.0
    with rec.checkpoint(step=1):
        pass
    rec.log_step(1, 0.1)
    rec.log_checkpoint(1.0)
    rec.close()
    assert os.listdir(tmp_path) == []


def test_rank_and_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUGUARD_JOB_DIR", str(tmp_path))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("SLURM_PROCID", "5")
    assert Recorder().path == str(tmp_path / "train.rank5.jsonl")
    monkeypatch.setenv("RANK", "2")
    assert Recorder().rank == 2
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("SLURM_PROCID")
    assert Recorder().rank == 0


def test_buffered_until_threshold_then_one_write_mode_0600(tmp_path):
    rec = Recorder(str(tmp_path), rank=0, flush_records=3, flush_interval_s=3600)
    path = tmp_path / "train.rank0.jsonl"
    rec.log_step(0, 0.1)
    rec.log_step(1, 0.1)
    assert not path.exists()
    rec.log_step(2, 0.1)
    assert len(lines(path)) == 3
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    rec.log_step(3, 0.1)
    assert len(lines(path)) == 3
    rec.flush()
    assert [r["step"] for r in lines(path)] == [0, 1, 2, 3]


def test_time_based_flush(tmp_path):
    rec = Recorder(str(tmp_path), rank=0, flush_records=1000, flush_interval_s=0.05)
    rec.log_step(0, 0.1)  # the first deadline started at construction
    time.sleep(0.06)
    rec.log_step(1, 0.1)
    assert len(lines(tmp_path / "train.rank0.jsonl")) == 2


def test_symlinked_record_file_is_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    jd = tmp_path / "job"
    jd.mkdir()
    (jd / "train.rank0.jsonl").symlink_to(victim)
    rec = Recorder(str(jd), rank=0, flush_records=1)
    rec.log_step(0, 0.1)  # O_NOFOLLOW: ELOOP -> disabled, training goes on
    rec.log_step(1, 0.1)
    assert rec.enabled is False
    assert victim.read_text() == "keep\n"


def test_atexit_flushes_and_forked_child_does_not_duplicate(tmp_path):
    code = f"""
import os
from gpuguard.collector.train import recorder
os.environ["GPUGUARD_JOB_DIR"] = {str(tmp_path)!r}
os.environ["RANK"] = "1"
rec = recorder()
assert rec is recorder()
rec.log_step(0, 0.1)
pid = os.fork()
if pid == 0:
    rec.log_step(99, 0.1)
    rec.flush()
    os._exit(0)
os.waitpid(pid, 0)
rec.log_step(1, 0.1)
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert [r["step"] for r in lines(tmp_path / "train.rank1.jsonl")] == [0, 1]


def test_import_is_stdlib_only():
    code = ("import sys; import gpuguard.collector.train; "
            "bad = [m for m in ('sqlite3', 'sqlite_utils', 'click', 'jinja2', 'pynvml') if m in sys.modules]; "
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_records_round_trip_through_ingest(tmp_path):
    rec = Recorder(str(tmp_path), rank=0)
    for i in range(5):
        with rec.step(step=i, samples=8) as s:
            with s.phase("comm"):
                pass
            s.loss = float("nan") if i == 3 else 1.0 / (i + 1)
    with rec.checkpoint(step=4):
        pass
    rec.close()
    res = read_job_records(str(tmp_path), os.getuid())
    assert (len(res.steps), len(res.checkpoints), res.malformed, res.nonfinite_loss) == (5, 1, 0, 1)
    assert res.steps == lines(tmp_path / "train.rank0.jsonl")[:5]
    assert train.SCHEMA_VERSION == 1
