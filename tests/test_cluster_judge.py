"""The job judge: once per job, with every node's part, in a separate cluster store."""

from __future__ import annotations

import json

import pytest

import scenarios as S
from cluster_helpers import LOG, close_all, parts_of, write_per_node
from gpuguard.config import from_dict
from gpuguard.epilog import admincomment
from gpuguard.epilog.judge import judge_parts
from gpuguard.slurm import SlurmCli
from gpuguard.store import open_store


@pytest.fixture
def cfg():
    return from_dict({"slurm": {"drain": True}})


def _profile(name: str, nodes: int, gpus: int = 4) -> S.Profile:
    return S.Profile(name=name, nodes=nodes, gpus_per_node=gpus, duration_s=1800.0, interval_s=10.0)


def _judge(tmp_path, cluster, rows, p, cfg, slurm, node_map=None, job=None):
    stores = write_per_node(str(tmp_path / "nodes" / rows.job_id), rows, p, node_map)
    try:
        parts = parts_of(stores, rows.job_id, cfg, job)
    finally:
        close_all(stores)
    meta = {"job_id": rows.job_id, "nodes": sorted(parts), "exit_code_raw": 0, **(job or {})}
    from gpuguard.actuator import Actuator

    return parts, judge_parts(cluster, rows.job_id, parts, cfg=cfg, meta=meta, slurm=slurm, log=LOG,
                              now=rows.end + 30, retry_sleep_s=0, drainer=Actuator(slurm, log=LOG))


def test_template_alternating_nodes_is_judged_on_run_4(tmp_path, cfg, fake_slurm_bin):
    """Four runs of one template, on n1, n2, n1, n2, each node with its own store: the
    fourth is judged against the three before it, wherever they ran."""
    cluster = open_store(str(tmp_path / "cluster.db"))
    p = _profile("alt", 1)
    slurm = SlurmCli(fake_slurm_bin.bindir)
    t = S.T0
    states = []
    for k in range(4):
        rows = S.generate(p, "healthy", seed=50 + k, job_id=str(100 + k), start=t)
        node = ("n1", "n2")[k % 2]
        _parts, res = _judge(tmp_path, cluster, rows, p, cfg, slurm, {p.node_names[0]: node},
                             {"comment": "gpuguard:template=alt"})
        states.append((res.verdict["state"], res.verdict["cause"], res.verdict["baseline_runs"]))
        t = rows.end + 60
    assert states == [("learning", "learning", 0), ("learning", "learning", 1), ("learning", "learning", 2),
                      ("judged", "healthy", 3)]
    rows = cluster.query("select job_id, nodes from verdicts order by job_id")
    assert [(r["job_id"], json.loads(r["nodes"])) for r in rows] == [
        ("100", ["n1"]), ("101", ["n2"]), ("102", ["n1"]), ("103", ["n2"])]
    # one sacctmgr call per job, nothing else changed in Slurm
    calls = fake_slurm_bin()
    assert [c[5] for c in calls] == ["jobid=100", "jobid=101", "jobid=102", "jobid=103"]
    assert all(c[:5] == ["sacctmgr", "-i", "modify", "job", "where"] for c in calls)
    cluster.close()


def test_two_node_straggler_is_judged_once_with_both_nodes(tmp_path, cfg, fake_slurm_bin):
    cluster = open_store(str(tmp_path / "cluster.db"))
    p = _profile("strag", 2)
    rows = S.generate(p, "straggler-node", seed=7, job_id="200", start=S.T0)
    slow = rows.truth["node"]
    slurm = SlurmCli(fake_slurm_bin.bindir)
    parts, res = _judge(tmp_path, cluster, rows, p, cfg, slurm)
    assert sorted(parts) == p.node_names
    assert res.verdict["cause"] == "straggler-node", res.verdict["summary"]
    assert res.verdict["evidence"]["node"] == slow
    assert res.missing == []
    assert cluster.query("select count(*) as n from verdicts where job_id = '200'")[0]["n"] == 1
    findings = cluster.query("select node, code, job_id from findings where job_id = '200'")
    assert findings == [{"node": slow, "code": "verdict.straggler_node", "job_id": "200"}]
    # judged again with the same parts: nothing recomputed, nothing sent to Slurm again
    again = judge_parts(cluster, "200", parts, cfg=cfg, meta={"job_id": "200", "nodes": sorted(parts)},
                        slurm=slurm, log=LOG)
    assert again.skipped
    assert cluster.query("select node, code, job_id from findings where job_id = '200'") == findings
    assert len(fake_slurm_bin()) == 1
    doc = admincomment.decode(fake_slurm_bin()[0][7][len("AdminComment="):])
    assert (doc["c"], doc["e"]["node"], sorted(doc["n"])) == ("straggler-node", slow, p.node_names)
    cluster.close()


def test_healthy_two_node_control_and_missing_node(tmp_path, cfg, fake_slurm_bin):
    cluster = open_store(str(tmp_path / "cluster.db"))
    p = _profile("ctl", 2)
    rows = S.generate(p, "healthy", seed=8, job_id="300", start=S.T0)
    slurm = SlurmCli(fake_slurm_bin.bindir)
    parts, res = _judge(tmp_path, cluster, rows, p, cfg, slurm)
    assert res.verdict["cause"] == "learning"  # no baseline: nothing baseline-free showed
    assert cluster.query("select count(*) as n from findings where job_id = '300'")[0]["n"] == 0
    # the same job judged with one part missing names the missing node, everywhere
    one = {p.node_names[0]: parts[p.node_names[0]]}
    cluster2 = open_store(str(tmp_path / "cluster2.db"))
    res2 = judge_parts(cluster2, "300", one, cfg=cfg, meta={"job_id": "300", "nodes": p.node_names},
                       slurm=slurm, log=LOG, retry_sleep_s=0)
    assert res2.missing == [p.node_names[1]]
    assert res2.verdict["evidence"]["missing_nodes"] == [p.node_names[1]]
    row = cluster2.query("select state, parts, missing from cluster_jobs where job_id = '300'")[0]
    assert (row["state"], json.loads(row["parts"]), json.loads(row["missing"])) == (
        "partial", [p.node_names[0]], [p.node_names[1]])
    assert admincomment.decode(res2.comment)["x"] == [p.node_names[1]]
    # the late part arrives: judged again, now complete, one verdict row
    res3 = judge_parts(cluster2, "300", parts, cfg=cfg, meta={"job_id": "300", "nodes": p.node_names},
                       slurm=slurm, log=LOG, retry_sleep_s=0)
    assert not res3.skipped and res3.missing == []
    assert cluster2.query("select count(*) as n from verdicts where job_id = '300'")[0]["n"] == 1
    assert cluster2.query("select state from cluster_jobs where job_id = '300'")[0]["state"] == "complete"
    cluster.close()
    cluster2.close()


def test_escalation_counts_jobs_per_gpu_and_drains_once_from_the_judge(tmp_path, fake_slurm_bin):
    """The same GPU UUID straggling in 3 jobs within 24 h drains its node once, with the
    gpuguard: prefix; each job counts once however many nodes it had."""
    cfg = from_dict({"slurm": {"drain": True}})
    cluster = open_store(str(tmp_path / "cluster.db"))
    p = _profile("esc", 1)
    slurm = SlurmCli(fake_slurm_bin.bindir)
    t = S.T0
    for k in range(3):
        rows = S.generate(p, "straggler-gpu", seed=5, job_id=str(400 + k), start=t)
        _parts, res = _judge(tmp_path, cluster, rows, p, cfg, slurm, {p.node_names[0]: "n1"})
        assert res.verdict["cause"] == "straggler-gpu"
        t = rows.end + 60
    drains = [c for c in fake_slurm_bin() if c[:2] == ["scontrol", "update"]]
    assert len(drains) == 1
    assert drains[0][:4] == ["scontrol", "update", "nodename=n1", "state=drain"]
    assert drains[0][4].startswith("reason=gpuguard: verdict.straggler_gpu")
    assert cluster.query("select job_id, node, done from cluster_drains") == [
        {"job_id": "402", "node": "n1", "done": 1}]
    cluster.close()


FAMILIES = ["healthy", "data-pipeline", "gpu-throttling", "straggler-gpu", "hardware-fault", "memory-leak",
            "job-changed"]


@pytest.mark.parametrize("family", FAMILIES)
def test_windowed_parts_keep_the_verdict(tmp_path, cfg, fake_slurm_bin, family):
    """The judge's per-window view of the parts names the same cause as the raw series
    would (three healthy runs first, then the family). Job ids differ per family: the
    summary's bucket pass keeps a per-process cache keyed by job and node."""
    cluster = open_store(str(tmp_path / "cluster.db"))
    p = _profile("fam", 1)
    slurm = SlurmCli(fake_slurm_bin.bindir)
    base = 1000 + 10 * FAMILIES.index(family)
    t = S.T0
    for k in range(3):
        rows = S.generate(p, "healthy", seed=60 + k, job_id=str(base + k), start=t)
        _judge(tmp_path, cluster, rows, p, cfg, slurm, job={"comment": "gpuguard:template=fam"})
        t = rows.end + 60
    rows = S.generate(p, family, seed=9, job_id=str(base + 9), start=t)
    _parts, res = _judge(tmp_path, cluster, rows, p, cfg, slurm, job={"comment": "gpuguard:template=fam"})
    assert res.verdict["cause"] == family, res.verdict["summary"]
    cluster.close()


def test_a_dead_collector_is_not_a_hardware_event_in_the_part(tmp_path, cfg):
    p = _profile("dead", 1)
    rows = S.generate(p, "healthy", seed=4, job_id="600", start=S.T0)
    rows.tables.setdefault("events", []).append(
        {"node": p.node_names[0], "at": S.T0 + 100, "kind": "collector_died", "pid": 7, "job_id": "600",
         "source": "epilog", "message": "collector pid 7 was gone before the epilog"})
    stores = write_per_node(str(tmp_path / "n"), rows, p)
    try:
        parts = parts_of(stores, "600", cfg)
    finally:
        close_all(stores)
    assert parts[p.node_names[0]]["hw_events"] == []


def test_template_counts_allocated_gpus_and_falls_back_to_sampled_for_old_parts():
    """A part's job.gpus (SLURM_JOB_GPUS on its node) is the count; a part of an earlier
    release without it counts its sampled GPUs; a non-integer job.gpus is not a count."""
    from gpuguard.epilog.judge import _template

    meta = {"job_id": "5", "partition": "gpu", "name": "t", "num_nodes": 2, "nodes": ["n1", "n2"]}
    new = {"job": {"gpus": 8, "gpu_name": "NVIDIA A100-SXM4-80GB"}, "gpus": [{"name": "NVIDIA H100 80GB HBM3"}]}
    old = {"job": {}, "gpus": [{"name": "NVIDIA H100 80GB HBM3"}] * 3}
    odd = {"job": {"gpus": True}, "gpus": [{"name": None}]}
    assert _template(meta, {"n1": new, "n2": new}).name == "gpu.a100-sxm4-80gb.x8.n2.t"
    assert _template(meta, {"n1": old, "n2": old}).name == "gpu.h100-80gb-hbm3.x3.n2.t"
    assert _template(meta, {"n1": odd}).name == "gpu._.x1.n2.t"
