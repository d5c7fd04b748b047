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


# -- invalid values never raise into training code (security review) -----------------------
BIG = 2**63


@pytest.mark.parametrize("attr, value, field, written", [
    ("loss", [1.0, 2.0], "loss", None),
    ("loss", "nan?", "loss", None),
    ("loss", True, "loss", None),
    ("loss", "1.5", "loss", 1.5),
    ("grad_norm", "big", "grad_norm", None),
    ("grad_norm", {"a": 1}, "grad_norm", None),
    ("samples", float("inf"), "samples", None),
    ("samples", float("nan"), "samples", None),
    ("samples", -1, "samples", None),
    ("samples", 3.5, "samples", None),
    ("samples", BIG, "samples", None),
    ("samples", 10**30, "samples", None),
    ("samples", 32.0, "samples", 32),
    ("samples", "64", "samples", 64),
    ("tokens", BIG - 1, "tokens", None),
    ("tokens", 2**40, "tokens", 2**40),
    ("tokens", 2**40 + 1, "tokens", None),
    ("tokens", "many", "tokens", None),
    ("tokens", False, "tokens", None),
])
def test_step_bad_value_is_nulled_with_one_stderr_line(tmp_path, capsys, attr, value, field, written):
    rec = Recorder(str(tmp_path), rank=0)
    for _ in range(3):  # reported once per recorder, not once per step
        with rec.step() as s:
            setattr(s, attr, value)
    rec.close()
    rs = lines(tmp_path / "train.rank0.jsonl")
    assert [r["step"] for r in rs] == [0, 1, 2]
    assert [r[field] for r in rs] == [written] * 3
    assert [r["loss_nonfinite"] for r in rs] == [False] * 3
    err = capsys.readouterr().err.splitlines()
    assert len(err) == (0 if written is not None else 1)
    if err:
        assert err[0].startswith(f"gpuguard.collector.train: {field} ")
        assert err[0].endswith("(reported once per recorder)")
    res = read_job_records(str(tmp_path), os.getuid())  # every line survives the ingest
    assert (len(res.steps), res.malformed) == (3, 0)


@pytest.mark.parametrize("value", ["epoch1", -1, BIG, 10**30, 2.5, float("inf"), [3], True])
def test_step_with_unusable_step_number_is_skipped_not_raised(tmp_path, capsys, value):
    rec = Recorder(str(tmp_path), rank=0)
    with rec.step(step=4) as s:
        pass
    with rec.step() as s:
        s.step = value
    with rec.step() as s:
        s.step = value
    with rec.step() as s:
        pass
    rec.close()
    assert [r["step"] for r in lines(tmp_path / "train.rank0.jsonl")] == [4, 5]
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("gpuguard.collector.train: step ") and "not recorded" in err


def test_integral_numbers_and_numpy_like_values_are_coerced(tmp_path):
    class Tensor:  # torch.Tensor.item()-less use: float(t) / operator.index(t)
        def __init__(self, v):
            self.v = v

        def __float__(self):
            return float(self.v)

        def __index__(self):
            return int(self.v)

    rec = Recorder(str(tmp_path), rank=0)
    with rec.step(step=Tensor(7), samples=Tensor(2**40), tokens=8.0) as s:
        s.loss = Tensor(float("inf"))
        s.grad_norm = Tensor(2.5)
    rec.close()
    [r] = lines(tmp_path / "train.rank0.jsonl")
    assert (r["step"], r["samples"], r["tokens"], r["loss"], r["loss_nonfinite"], r["grad_norm"]) == (
        7, 2**40, 8, None, True, 2.5)


def test_log_step_and_checkpoint_bad_values(tmp_path, capsys):
    rec = Recorder(str(tmp_path), rank=0)
    rec.log_step(0, -0.5)                       # negative step time: ingest would drop it
    rec.log_step(1, float("nan"))
    rec.log_step(2, "slow")
    rec.log_step(3, None)
    rec.log_step(4, 0.25, samples=-3, tokens=float("inf"), loss="x", grad_norm=[1],
                 phases={"comm": -1.0, "optim": float("inf"), "data_wait": "?", "fwd_bwd": 0.125})
    rec.log_step(5, 0.25, phases=[("comm", 1.0)])  # not a dict
    rec.log_checkpoint(-1.0, step=5)
    rec.log_checkpoint(float("inf"))
    rec.log_checkpoint(2.0, step="last")
    rec.log_checkpoint(3.0, step=BIG)
    with rec.checkpoint(step=-7):
        pass
    rec.close()
    rs = lines(tmp_path / "train.rank0.jsonl")
    assert [(r["kind"], r["step"]) for r in rs] == [("step", 4), ("step", 5), ("checkpoint", None),
                                                    ("checkpoint", None), ("checkpoint", None)]
    assert {k: rs[0][k] for k in ("step_time_s", "samples", "tokens", "loss", "loss_nonfinite", "grad_norm",
                                  "phases")} == {
        "step_time_s": 0.25, "samples": None, "tokens": None, "loss": None, "loss_nonfinite": False,
        "grad_norm": None, "phases": {"fwd_bwd_s": 0.125}}
    assert rs[1]["phases"] == {}
    assert [r["duration_s"] for r in rs[2:4]] == [2.0, 3.0]
    err = capsys.readouterr().err.splitlines()
    # one line per kind of problem: step_time_s, samples, tokens, loss, grad_norm, 3 phases,
    # phases not a dict, duration_s, checkpoint step
    assert len(err) == 11
    assert err[0] == ("gpuguard.collector.train: step 0 not recorded: step_time_s -0.5 is not a number "
                      "of seconds in 0..366 days (reported once per recorder)")
    res = read_job_records(str(tmp_path), os.getuid())
    assert (len(res.steps), len(res.checkpoints), res.malformed) == (2, 3, 0)


def test_add_phase_bad_seconds_ignored(tmp_path, capsys):
    rec = Recorder(str(tmp_path), rank=0)
    with rec.step() as s:
        s.add_phase("comm", "a while")
        s.add_phase("comm", -2.0)
        s.add_phase("comm", float("nan"))
        s.add_phase("comm", 0.5)
        s.add_phase("optim", 0.25)
        s.add_phase("optim", float("inf"))
    rec.close()
    [r] = lines(tmp_path / "train.rank0.jsonl")
    assert r["phases"] == {"comm_s": 0.5, "optim_s": 0.25}
    assert len(capsys.readouterr().err.splitlines()) == 2  # one per phase name


def test_internal_error_in_emit_never_raises(tmp_path, capsys, monkeypatch):
    rec = Recorder(str(tmp_path), rank=0)

    def broken(line):
        raise RuntimeError("disk on fire")
    monkeypatch.setattr(rec, "_append", broken)
    with rec.step(step=1):
        pass
    rec.log_step(2, 0.1)
    rec.log_checkpoint(1.0)
    assert capsys.readouterr().err == ("gpuguard.collector.train: step not recorded: RuntimeError: disk on fire "
                                       "(reported once per recorder)\n")


def test_huge_rank_env_falls_back_to_0(monkeypatch):
    monkeypatch.setenv("RANK", "99999999999999999999")
    monkeypatch.setenv("SLURM_PROCID", "٣")
    assert train._rank_from_env() == 0
    monkeypatch.setenv("SLURM_PROCID", "3")
    assert train._rank_from_env() == 3
