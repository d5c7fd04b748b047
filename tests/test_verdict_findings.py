"""Templates from comments and Slurm, verdict findings through the policy table with
escalation, node idle baselines, the template/baseline CLI and the one-call epilog
integration."""

from __future__ import annotations

import json
import pathlib
import random

import click
import pytest
from click.testing import CliRunner
from conftest import node_snapshot

import scenarios as S
from gpuguard import config as config_mod
from gpuguard.epilog import baseline as B
from gpuguard.epilog import template as T
from gpuguard.epilog.verdict import Verdict, act_on_verdict, judge_job, run_verdict, verdict_findings
from gpuguard.store import open_store


@pytest.fixture
def store(tmp_path):
    s = open_store(str(tmp_path / "f.db"))
    yield s
    s.close()


# -- templates --------------------------------------------------------------------------------
@pytest.mark.parametrize("comment, name", [
    ("gpuguard:template=llama-7b", "llama-7b"),
    ("nightly run gpuguard:template=llama-7b ckpt=3", "llama-7b"),
    ("gpuguard:template=a,b;c", "a"),
    ('gpuguard:template="q"', "q"),
    ("gpuguard:template=räksmörgås/../x", "r-ksm-rg-s-..-x"),
    ("template=foo", None),  # not our key (SLURM-FACTS §4 example)
    ("xgpuguard:template=foo", None),
    ("gpuguard:template=", None),
    ("gpuguard:template=---", None),
    ("", None),
    (None, None),
])
def test_template_from_comment(comment, name):
    assert T.from_comment(comment) == name


def test_template_name_limits():
    long = "x" * 100
    a, b = T.sanitize(long), T.sanitize(long + "y")
    assert len(a) == 64 and a != b and T.sanitize(a) == a
    assert all(c.isalnum() or c in "._-" for c in T.sanitize("a b/c:d\n" * 10))


def test_template_derived_from_env_and_scontrol():
    class Slurm:
        def __init__(self):
            self.calls = []

        def show_job(self, job_id):
            self.calls.append(job_id)
            return {"JobName": "train llama", "Partition": "gpu", "NumNodes": "2", "TresPerNode": "gres:gpu:h100:8"}

    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_PARTITION": "gpu", "SLURM_JOB_GPUS": "0,1,2,3,4,5,6,7",
           "SLURM_JOB_NUM_NODES": "2"}
    s = Slurm()
    t = T.job_template(env, slurm=s)
    assert t == T.Template("gpu.h100.x8.n2.train-llama", "derived") and s.calls == ["42"]
    t = T.job_template({**env, "SLURM_JOB_COMMENT": "gpuguard:template=mine"}, slurm=s)
    assert t == T.Template("mine", "comment") and s.calls == ["42"]
    # the comment through scontrol when the environment lacks it
    t = T.job_template({"SLURM_JOB_ID": "7"}, job_info={"Comment": "x gpuguard:template=fromsacct"})
    assert t.name == "fromsacct"


def test_template_derived_when_slurm_fails():
    class Broken:
        def show_job(self, job_id):
            from gpuguard.slurm import SlurmError

            raise SlurmError("scontrol: timed out")

    t = T.job_template({"SLURM_JOB_ID": "1", "SLURM_JOB_GPUS": "0,1", "SLURM_JOB_PARTITION": "debug"},
                       slurm=Broken(), gpu_name="NVIDIA H100 80GB HBM3")
    assert t == T.Template("debug.h100-80gb-hbm3.x2.n_._", "derived")


# -- findings, policy, escalation -----------------------------------------------------------
def straggler_verdict(job_id, uuid="GPU-n1-02", node="n1"):
    return Verdict(job_id=job_id, template="t", cause="straggler-gpu", state="judged", summary="s",
                   evidence={"gpus": [{"node": node, "gpu_index": 2, "gpu_uuid": uuid, "metric": "sm_clock_mhz",
                                       "value": 1000.0, "peer_median": 1800.0, "rel_change": -0.44, "z": -15.0}]},
                   nodes=[node])


def test_findings_of_a_verdict():
    assert verdict_findings(Verdict("1", "t", "healthy", "judged", "")) == []
    assert verdict_findings(Verdict("1", "t", "learning", "learning", "")) == []
    f = verdict_findings(straggler_verdict("1"))
    assert len(f) == 1 and f[0].code == "verdict.straggler_gpu" and f[0].severity == "warning"
    assert f[0].gpu_uuid == "GPU-n1-02" and f[0].evidence["job_id"] == "1"


def test_straggler_three_jobs_in_24h_drains(store):
    cfg = config_mod.from_dict({})
    now = 1767225600.0
    d1 = act_on_verdict(store, straggler_verdict("1"), cfg=cfg, node="n1", now=now)
    assert d1.outcome == "proceed" and d1.actions[0][1] == "alert"
    # same job judged again: still one job
    assert act_on_verdict(store, straggler_verdict("1"), cfg=cfg, node="n1", now=now + 10).outcome == "proceed"
    # another GPU does not count
    assert act_on_verdict(store, straggler_verdict("2", uuid="GPU-n1-05"), cfg=cfg, node="n1",
                          now=now + 20).outcome == "proceed"
    assert act_on_verdict(store, straggler_verdict("3"), cfg=cfg, node="n1", now=now + 3600).outcome == "proceed"
    d = act_on_verdict(store, straggler_verdict("4"), cfg=cfg, node="n1", now=now + 7200)
    assert d.outcome == "drain" and d.reason.startswith("gpuguard: verdict.straggler_gpu")
    assert d.actions[0][0].evidence["escalated"]["jobs"] == ["1", "3", "4"]
    # the decision for another node does not drain this one's GPU
    assert act_on_verdict(store, straggler_verdict("5"), cfg=cfg, node="n2", now=now + 7300).outcome == "proceed"
    # outside the 24 h window: alert again
    d = act_on_verdict(store, straggler_verdict("6"), cfg=cfg, node="n1", now=now + 3 * 86400)
    assert d.outcome == "proceed"
    rows = store.query("select job_id, action from findings where code = 'verdict.straggler_gpu' order by id")
    assert ("4", "drain") in [(r["job_id"], r["action"]) for r in rows]


def test_policy_override_applies_to_verdict_findings(store):
    cfg = config_mod.from_dict({"policy": {"verdict.straggler_gpu": "record"}})
    d = act_on_verdict(store, straggler_verdict("1"), cfg=cfg, node="n1", now=1.0)
    assert d.actions[0][1] == "record"


# -- node idle baselines -----------------------------------------------------------------------
def test_idle_temp_up_after_history(store):
    cfg = config_mod.from_dict({})
    for k in range(5):
        snap = node_snapshot(2, gpu1={"temp_c": 31.0 + (k % 2)})
        assert B.judge_idle(store, "n1", snap, cfg=cfg, now=100.0 + k) == []
    hot = node_snapshot(2, gpu1={"temp_c": 43.5})
    f = B.judge_idle(store, "n1", hot, cfg=cfg, now=200.0)
    assert [x.code for x in f] == ["baseline.idle_temp_up"] and f[0].gpu_index == 1
    assert f[0].evidence["median"] == 31.0 and "12.5" in f[0].message
    # the flagged reading does not move the baseline; a busy GPU is not judged
    hist = {h["gpu_index"]: h for h in B.idle_history(store, "n1")}
    assert hist[1]["temp_c"] == 31.0 and hist[1]["readings"] == 6
    busy = node_snapshot(2, gpu1={"temp_c": 80.0, "gpu_util_pct": 99.0})
    assert B.judge_idle(store, "n1", busy, cfg=cfg, now=300.0) == []


def test_idle_power_up(store):
    for k in range(6):
        B.judge_idle(store, "n1", node_snapshot(1), now=float(k))
    f = B.judge_idle(store, "n1", node_snapshot(1, gpu0={"power_w": 120.0}), now=10.0, record=False)
    assert [x.code for x in f] == ["baseline.idle_power_up"]


# -- CLI ------------------------------------------------------------------------------------------
@pytest.fixture
def cli(make_config):
    from gpuguard.cli import _Obj
    from gpuguard.epilog.baseline_cli import baseline, template

    path, cfg = make_config("[verdict]\nwarmup_s = 0.0\n")

    @click.group()
    @click.pass_context
    def root(ctx):
        ctx.obj = _Obj(path)

    root.add_command(template)
    root.add_command(baseline)
    return root, cfg


def test_cli_template_list_and_baseline(cli):
    root, cfg = cli
    store = open_store(cfg.store_path)
    p = S.random_profile(random.Random(1), "clitpl", nodes=1)
    p.duration_s = 900
    t = S.T0
    for k in range(3):
        rows = S.generate(p, "healthy", seed=k, job_id=f"c{k}", start=t)
        S.write(store, rows)
        judge_job(store, rows.job_id, cfg=cfg, template=p.name, exit_code=0, now=rows.end)
        t = rows.end + 60
    store.close()
    before = pathlib.Path(cfg.store_path).read_bytes()
    r = CliRunner()
    out = r.invoke(root, ["template", "list"])
    assert out.exit_code == 0, out.output
    assert "clitpl" in out.output and "ready" in out.output
    out = r.invoke(root, ["template", "list", "--format", "json"])
    assert json.loads(out.output)[0]["baseline_runs"] == 3
    out = r.invoke(root, ["baseline", "show", "clitpl"])
    assert out.exit_code == 0 and "step_time_p50_s" in out.output and "3 baseline run(s)" in out.output
    out = r.invoke(root, ["baseline", "show", "clitpl", "--format", "json"])
    assert json.loads(out.output)["metrics"]["step_time_p50_s"]["n"] == 3
    out = r.invoke(root, ["baseline", "show", "nope"])
    assert out.exit_code != 0 and "unknown template" in out.output
    # the listings read the store read-only: not a byte written, no -wal/-shm beside it
    assert pathlib.Path(cfg.store_path).read_bytes() == before
    assert not pathlib.Path(cfg.store_path + "-wal").exists() and not pathlib.Path(cfg.store_path + "-shm").exists()
    out = r.invoke(root, ["baseline", "reset", "clitpl", "--yes"])
    assert out.exit_code == 0
    out = r.invoke(root, ["template", "list", "--format", "csv"])
    assert "clitpl,derived,3,0,0,learning" in out.output


# -- the epilog's one call --------------------------------------------------------------------------
def test_run_verdict_one_call(make_config):
    _, cfg = make_config("[verdict]\nwarmup_s = 0.0\n")
    store = open_store(cfg.store_path)
    p = S.random_profile(random.Random(2), "x", nodes=1)
    p.gpus_per_node = 4
    env = {"SLURM_JOB_COMMENT": "gpuguard:template=onecall", "SLURM_JOB_EXIT_CODE": "0"}
    t = S.T0
    for k in range(3):
        rows = S.generate(p, "healthy", seed=k, job_id=f"o{k}", start=t)
        S.write(store, rows)
        v, d = run_verdict(store, rows.job_id, cfg=cfg, env=env, node=p.node_names[0], now=rows.end)
        assert v.template == "onecall" and v.cause == "learning" and d.outcome == "proceed"
        t = rows.end + 60
    rows = S.generate(p, "straggler-gpu", seed=9, job_id="o9", start=t)
    S.write(store, rows)
    v, d = run_verdict(store, "o9", cfg=cfg, env=env, node=p.node_names[0], now=rows.end)
    assert v.cause == "straggler-gpu" and d.outcome == "proceed" and d.actions[0][1] == "alert"
    assert store.query("select count(*) as n from findings where job_id = 'o9'")[0]["n"] == 1
    # a failed job (exit 1<<8) is judged but kept out of the baseline
    rows = S.generate(p, "healthy", seed=10, job_id="o10", start=rows.end + 60)
    S.write(store, rows)
    v, _ = run_verdict(store, "o10", cfg=cfg, env={**env, "SLURM_JOB_EXIT_CODE": "256"}, node=p.node_names[0],
                       now=rows.end)
    assert v.cause == "healthy" and "o10" not in B.compute_baseline(store, "onecall", cfg=cfg).jobs
    store.close()


def test_format_verdict_for_job_show(store):
    from gpuguard.epilog.verdict import format_verdict, load_verdict

    p = S.random_profile(random.Random(4), "show", nodes=1)
    p.gpus_per_node = 4
    t = S.T0
    S.write_inventory(store, p, t)
    for k in range(3):
        rows = S.generate(p, "healthy", seed=k, job_id=f"w{k}", start=t)
        S.write(store, rows)
        judge_job(store, rows.job_id, cfg=None, template="show", exit_code=0, now=rows.end)
        t = rows.end + 60
    store.insert("inventory_changes", {"at": t, "node": p.node_names[0], "uuid": "GPU-x", "gpu_index": 0,
                                       "field": "driver_version", "old": "535.183.01", "new": "550.54.15"})
    rows = S.generate(p, "gpu-throttling", seed=3, job_id="w9", start=t + 10)
    S.write(store, rows)
    judge_job(store, "w9", cfg=None, template="show", exit_code=0, now=rows.end)
    d = load_verdict(store, "w9")
    assert d["cause"] == "gpu-throttling" and d["baseline_runs"] == 3
    assert d["context"][0]["new"] == "550.54.15"
    text = format_verdict(d)
    assert text.startswith("verdict: gpu-throttling — SM clock down")
    assert "sm_clock_mhz" in text and "FLAG" in text and "active reasons:" in text
    assert "driver_version: 535.183.01 -> 550.54.15" in text
    json.dumps(d)  # --json gives the same, JSON-ready
    assert load_verdict(store, "nope") is None


def test_reads_steps_as_the_epilog_stores_them(store):
    """Step records through the epilog's own writer (gpuguard.epilog.hook) and the
    training API's record shape are what the verdict reads."""
    from gpuguard.collector.ingest import IngestResult
    from gpuguard.epilog.hook import save_training_records
    from gpuguard.epilog.jobdata import load_job

    recs = [{"v": 1, "kind": "step", "rank": 0, "t": 1000.0 + i, "step": i, "step_time_s": 1.0, "samples": 8,
             "tokens": None, "loss": 1.0, "loss_nonfinite": False, "grad_norm": 1.0,
             "phases": {"data_wait_s": 0.1, "fwd_bwd_s": 0.7, "comm_s": 0.15, "optim_s": 0.05}} for i in range(1, 11)]
    ck = [{"v": 1, "kind": "checkpoint", "rank": 0, "t": 1011.0, "step": 10, "duration_s": 3.5}]
    save_training_records(store, "77", "n1", IngestResult(steps=recs, checkpoints=ck))
    data = load_job(store, "77")
    assert len(data.steps) == 10 and data.steps[0].data_wait_s == 0.1 and data.steps[0].comm_s == 0.15
    assert data.checkpoint_s == [3.5] and data.start == 1000.0 and data.end == 1010.0
    v = judge_job(store, "77", cfg=None, template="t", record=False)
    assert v.comparison("step_time_p50_s").value == 1.0
    assert v.comparison("data_wait_share").value == pytest.approx(0.1)
    assert v.comparison("throughput_per_s").value == pytest.approx(8.0)


def test_an_unused_gpu_is_not_a_straggler_and_never_drains(tmp_path):
    """Review finding: a job that allocates 4 GPUs and computes on 3 looked like a
    straggling GPU 3; three such jobs drained a healthy node."""
    import scenarios as S

    from gpuguard import config as config_mod
    from gpuguard.epilog.verdict import run_verdict
    from gpuguard.store import open_store

    store = open_store(str(tmp_path / "n.db"))
    cfg = config_mod.from_dict({})
    p = S.Profile(name="lopsided", gpus_per_node=4, duration_s=1800)
    t = S.T0
    outcomes = []
    for k in range(3):
        rows = S.generate(p, "healthy", seed=100 + k, job_id=f"j{k}", start=t)
        for r in rows.tables["samples"]:
            if r["gpu_index"] == 3:
                r.update(gpu_util_pct=0.0, power_w=70.0, sm_clock_mhz=345, mem_used_mib=500.0)
        S.write(store, rows)
        env = {"SLURM_JOB_ID": f"j{k}", "SLURM_JOB_COMMENT": f"gpuguard:template=u{k}"}
        v, dec = run_verdict(store, f"j{k}", cfg=cfg, env=env, node=p.node_names[0], now=rows.end)
        outcomes.append((v.cause, dec.outcome))
        t = rows.end + 60
    assert outcomes == [("learning", "proceed")] * 3
    assert store.query("select count(*) n from findings where code = 'verdict.straggler_gpu'") == [{"n": 0}]


@pytest.mark.parametrize("raw,expected", [("768", 768), ("0", 0), ("", None), ("-1", None), ("٣", None),
                                          ("99999999999999999999999", None), ("4294967296", None)])
def test_exit_code_from_env_is_range_checked(raw, expected):
    from gpuguard.epilog.verdict import exit_code_from_env

    assert exit_code_from_env({"SLURM_JOB_EXIT_CODE": raw}) == expected


def rank_straggler_verdict(job_id, uuid="GPU-n1-02", node="n1"):
    """A straggler named from the job's own training records (per-rank fwd_bwd time)."""
    return Verdict(job_id=job_id, template="t", cause="straggler-gpu", state="judged", summary="s",
                   evidence={"gpus": [{"node": node, "gpu_index": 2, "gpu_uuid": uuid, "rank": 2,
                                       "metric": "fwd_bwd_s", "value": 2.0, "peer_median": 1.0,
                                       "rel_change": 1.0, "z": 20.0}]},
                   nodes=[node])


def test_straggler_from_training_records_never_drains(store):
    """A user who reports one rank slow in 3 jobs within 24 h gets an alert each time,
    never a drain: training records are the user's own words."""
    cfg = config_mod.from_dict({})
    now = 1767225600.0
    for k, job in enumerate(["1", "2", "3", "4"]):
        d = act_on_verdict(store, rank_straggler_verdict(job), cfg=cfg, node="n1", now=now + 60 * k)
        assert (d.outcome, d.actions[0][1]) == ("proceed", "alert")
    # record-named stragglers do not count towards a later telemetry-named one either
    d = act_on_verdict(store, straggler_verdict("5"), cfg=cfg, node="n1", now=now + 600)
    assert (d.outcome, d.actions[0][1]) == ("proceed", "alert")
    act_on_verdict(store, straggler_verdict("6"), cfg=cfg, node="n1", now=now + 700)
    d = act_on_verdict(store, straggler_verdict("7"), cfg=cfg, node="n1", now=now + 800)
    assert d.outcome == "drain" and d.actions[0][0].evidence["escalated"]["jobs"] == ["5", "6", "7"]


def test_cli_and_job_show_name_the_gpu_model(cli):
    """A named template with three H100 runs, then one run on A100s: `baseline show` shows
    the newest run's model with the other models' runs, `--gpu-model` picks one, `template
    list` names both, and the A100 run's verdict (job show) says it learns on its model."""
    import dataclasses

    from gpuguard.epilog.verdict import format_verdict, load_verdict

    root, cfg = cli
    store = open_store(cfg.store_path)
    h100 = S.random_profile(random.Random(5), "gm-h100", nodes=1)
    h100.duration_s = 900
    a100 = dataclasses.replace(h100, name="gm-a100", gpu_name="NVIDIA A100-SXM4-80GB", clock_mhz=1410.0,
                               step_time_s=h100.step_time_s * 1.25)
    t = S.T0
    for p in (h100, a100):
        S.write_inventory(store, p, t)
    for k, p in enumerate((h100, h100, h100, a100)):
        rows = S.generate(p, "healthy", seed=k, job_id=f"gm{k}", start=t)
        S.write(store, rows)
        v = judge_job(store, rows.job_id, cfg=cfg, template="gm", exit_code=0, now=rows.end)
        t = rows.end + 60
    assert (v.cause, v.gpu_model, v.evidence["other_gpu_models"]) == (
        "learning", "NVIDIA A100-SXM4-80GB", {"NVIDIA H100 80GB HBM3": 3})
    text = format_verdict(load_verdict(store, "gm3"))
    assert "  template gm (learning, 0 baseline runs on NVIDIA A100-SXM4-80GB)" in text.splitlines()
    assert "  runs on other GPU models (not compared with): NVIDIA H100 80GB HBM3 3" in text.splitlines()
    assert load_verdict(store, "gm0")["gpu_model"] == "NVIDIA H100 80GB HBM3"
    store.close()
    r = CliRunner()
    out = r.invoke(root, ["baseline", "show", "gm"])
    assert out.exit_code == 0, out.output
    assert out.output.splitlines()[:2] == [
        "template gm on NVIDIA A100-SXM4-80GB: learning, 1 baseline run(s) since "
        + out.output.split(" since ", 1)[1].splitlines()[0],
        "other GPU models (see --gpu-model): NVIDIA H100 80GB HBM3: 3 run(s)"]
    out = r.invoke(root, ["baseline", "show", "gm", "--gpu-model", "NVIDIA H100 80GB HBM3", "--format", "json"])
    doc = json.loads(out.output)
    assert (doc["gpu_model"], doc["state"], doc["runs"], doc["other_gpu_models"]) == (
        "NVIDIA H100 80GB HBM3", "ready", 3, {"NVIDIA A100-SXM4-80GB": 1})
    assert doc["jobs"] == ["gm2", "gm1", "gm0"]
    out = r.invoke(root, ["baseline", "show", "gm", "--gpu-model", "NVIDIA V100"])
    assert out.exit_code == 2 and "no baseline run on GPU model 'NVIDIA V100'" in out.output
    out = r.invoke(root, ["template", "list", "--format", "json"])
    row = json.loads(out.output)[0]
    assert (row["gpu_model"], row["baseline_runs"], row["state"], row["gpu_models"]) == (
        "NVIDIA A100-SXM4-80GB", 1, "learning", {"NVIDIA A100-SXM4-80GB": 1, "NVIDIA H100 80GB HBM3": 3})
    out = r.invoke(root, ["template", "list", "--format", "csv"])
    assert out.output.splitlines()[1].endswith(
        ",NVIDIA A100-SXM4-80GB,,NVIDIA A100-SXM4-80GB: 1; NVIDIA H100 80GB HBM3: 3")
    out = r.invoke(root, ["baseline", "reset", "gm", "--yes"])
    assert out.exit_code == 0 and out.output == "baseline of gm reset on 2 GPU models; it is learning again\n"
