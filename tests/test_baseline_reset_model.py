"""A template's baseline is kept per GPU model (step epilog/baseline_gpu_model): `baseline
reset --gpu-model` and a re-learn with [baseline] relearn_forgets = "gpu-model" forget one
model's runs only; the other models' runs and cached rows stay."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from gpuguard import config as config_mod
from gpuguard.cli import main
from gpuguard.epilog import baseline as B
from gpuguard.epilog.relearn import relearn_if_due
from gpuguard.store import open_store

H100, A100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"
T0 = 1_764_000_000.0
CFG = config_mod.from_dict({"baseline": {"runs": 20, "min_runs": 3, "relearn_runs": 3}})


def _run(store, job_id, at, model, *, step_s=1.0, cause="healthy", ok=True):
    row = {"job_id": job_id, "template": "tpl", "at": at, "state": "ready", "cause": cause, "summary": "",
           "evidence": "{}", "also": "[]", "context": "[]", "exit_code": 0, "critical": 0,
           "baseline_ok": int(ok), "nodes": '["n1"]', "start_at": at - 600, "end_at": at, "gpu_model": model}
    comps = [{"job_id": job_id, "template": "tpl", "metric": m, "value": v, "median": None, "mad": None, "n": 0,
              "z": None, "rel_change": None, "flagged": 0, "sustained_s": 0.0, "at": at}
             for m, v in (("step_time_p50_s", step_s), ("throughput_per_s", 32 / step_s))]
    B.record_verdict(store, row, comps, template_source="named", now=at)


@pytest.fixture
def two_models(tmp_path):
    """tpl: 4 healthy runs on H100, 3 on A100, every cached baseline written."""
    path = str(tmp_path / "cluster.db")
    s = open_store(path)
    for i in range(4):
        _run(s, f"h{i}", T0 + 100 * i, H100)
    for i in range(3):
        _run(s, f"a{i}", T0 + 50 + 100 * i, A100, step_s=2.0)
    for m in (H100, A100):
        B.update_baseline(s, "tpl", cfg=CFG, gpu_model=m, now=T0 + 1000)
    yield s, path
    s.close()


def _cached(s):
    return sorted({(r["gpu_model"], r["metric"]) for r in B.cached_baseline(s, "tpl")})


def test_reset_one_model_keeps_the_other(two_models):
    s, _ = two_models
    assert B.model_runs(s, "tpl", 20) == {A100: 3, H100: 4}
    assert B.reset_baseline(s, "tpl", gpu_model=A100, now=T0 + 2000) == 2
    assert B.model_runs(s, "tpl", 20) == {H100: 4}
    assert B.compute_baseline(s, "tpl", cfg=CFG, gpu_model=A100).runs == 0
    h = B.compute_baseline(s, "tpl", cfg=CFG, gpu_model=H100)
    assert (h.state, h.jobs) == ("ready", ["h3", "h2", "h1", "h0"])
    assert _cached(s) == [(H100, "step_time_p50_s"), (H100, "throughput_per_s")]
    assert s.query("select template, gpu_model, reset_at from baseline_resets") == [
        {"template": "tpl", "gpu_model": A100, "reset_at": T0 + 2000}]
    assert s.query("select reset_at from templates") == [{"reset_at": 0.0}]
    assert len(s.query("select 1 from verdicts")) == 7  # the verdicts stay for job show
    # a run on A100 after the reset counts again, on A100 only
    _run(s, "a9", T0 + 3000, A100, step_s=2.0)
    assert B.model_runs(s, "tpl", 20) == {A100: 1, H100: 4}
    # a reset of the whole template covers (and clears) the per-model one
    B.reset_baseline(s, "tpl", now=T0 + 4000)
    assert B.model_runs(s, "tpl", 20) == {}
    assert _cached(s) == [] and s.query("select * from baseline_resets") == []


def test_cli_reset_gpu_model(two_models, tmp_path):
    s, path = two_models
    s.close()
    env = {"GPUGUARD_CONFIG": str(tmp_path / "g.toml")}
    (tmp_path / "g.toml").write_text(f'[paths]\nstore = "{path}"\ncluster_store = "{path}"\n')
    r = CliRunner().invoke(main, ["baseline", "reset", "tpl", "--gpu-model", "NVIDIA L40S", "--yes"], env=env)
    assert (r.exit_code, r.output) == (
        2, f"Error: template 'tpl' has no run on GPU model 'NVIDIA L40S' (its models: '{A100}', '{H100}')\n")
    r = CliRunner().invoke(main, ["baseline", "reset", "tpl", "--gpu-model", A100, "--yes"], env=env)
    assert (r.exit_code, r.output) == (
        0, f"baseline of tpl on {A100} reset; it is learning again there (other GPU models unchanged)\n")
    s2 = open_store(path)
    try:
        assert B.model_runs(s2, "tpl", 20) == {H100: 4}
        assert _cached(s2) == [(H100, "step_time_p50_s"), (H100, "throughput_per_s")]
    finally:
        s2.close()
    r = CliRunner().invoke(main, ["baseline", "reset", "tpl", "--yes"], env=env)
    assert (r.exit_code, r.output) == (0, "baseline of tpl reset; it is learning again\n")


def _job_changed_runs(s, model):
    """3 agreeing job-changed runs on ``model`` (relearn_runs = 3), newest last."""
    for i in range(3):
        _run(s, f"c{i}", T0 + 5000 + 100 * i, model, step_s=1.5, cause="job-changed", ok=False)


@pytest.mark.parametrize("forgets, h100_left", [("all-models", {}), ("gpu-model", {H100: 4})])
def test_relearn_forgets_one_model_or_all(two_models, forgets, h100_left):
    s, _ = two_models
    c = config_mod.from_dict({"baseline": {"runs": 20, "min_runs": 3, "relearn_runs": 3,
                                           "relearn_forgets": forgets}})
    _job_changed_runs(s, A100)
    info = relearn_if_due(s, "tpl", cfg=c, now=T0 + 6000, gpu_model=A100)
    assert info == {"jobs": ["c0", "c1", "c2"], "at": T0 + 6000}
    assert B.compute_baseline(s, "tpl", cfg=c, gpu_model=A100).jobs == ["c2", "c1", "c0"]
    assert B.model_runs(s, "tpl", 20) == {A100: 3, **h100_left}
    t = s.query("select reset_at, relearned_at from templates")[0]
    assert t["relearned_at"] == T0 + 6000
    assert t["reset_at"] == (0.0 if forgets == "gpu-model" else pytest.approx(T0 + 5000 - 1e-3))


def test_relearn_after_a_model_reset_counts_only_later_runs(two_models):
    s, _ = two_models
    _job_changed_runs(s, A100)
    B.reset_baseline(s, "tpl", gpu_model=A100, now=T0 + 5150)  # c0, c1 forgotten
    assert relearn_if_due(s, "tpl", cfg=CFG, now=T0 + 6000, gpu_model=A100) is None


def test_relearn_forgets_is_validated():
    c = config_mod.from_dict({"baseline": {"relearn_forgets": "everything"}})
    with pytest.raises(config_mod.ConfigError) as e:
        B.BaselineSettings.from_config(c)
    assert str(e.value) == ("<config>: baseline.relearn_forgets must be one of all-models, gpu-model, "
                            "got 'everything'")
