"""The verdict and the interconnect: fabric findings during a job blame the machine,
and the communication evidence cites the node's NCCL baseline."""

from __future__ import annotations

import random

import pytest

import scenarios as S
from gpuguard.epilog.verdict import judge_job
from gpuguard.net.evidence import communication_evidence
from gpuguard.net.nccl_baseline import record_probe
from gpuguard.store import open_store


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    store = open_store(str(tmp_path_factory.mktemp("netv") / "v.db"))
    p = S.random_profile(random.Random(3), "multi", nodes=2)
    p.gpus_per_node = 4
    t = S.T0
    S.write_inventory(store, p, t)
    for k in range(4):
        rows = S.generate(p, "healthy", seed=100 + k, job_id=f"b{k}", start=t)
        S.write(store, rows)
        judge_job(store, rows.job_id, cfg=None, template=p.name, exit_code=0, now=rows.end + 30)
        t = rows.end + 60
    yield store, p, {"t": t}
    store.close()


def _job(world, family, seed, job_id):
    store, p, st = world
    rows = S.generate(p, family, seed=seed, job_id=job_id, start=st["t"])
    st["t"] = rows.end + 60
    S.write(store, rows)
    return rows


def test_communication_slowdown_without_fabric_fault_is_communication(world):
    store, p, _ = world
    rows = _job(world, "communication", 21, "c1")
    nodes = sorted({s["node"] for s in rows.tables["steps"]})
    record_probe(store, {"node": nodes[0], "at": rows.start - 600, "hook": "health", "job_id": None,
                         "gpu_model": "H100", "gpus": 8, "config_key": "k", "state": "ok", "duration_s": 9.0,
                         "ratio": 0.99, "detail": "{}"}, {1073741824: 331.5}, {})
    v = judge_job(store, "c1", cfg=None, template=p.name, exit_code=0, now=rows.end + 30, record=False)
    assert v.cause == "communication", v.summary
    assert v.evidence["node_nccl_baseline"] == {
        nodes[0]: {"last_probe_at": rows.start - 600, "last_state": "ok", "last_ratio": 0.99, "size_b": 1073741824,
                   "busbw_median_gbs": 331.5, "busbw_mad_gbs": 0.0, "probes": 1},
        nodes[1]: None}
    assert v.evidence["fabric_findings"] == []


def test_communication_slowdown_with_rising_ib_errors_is_the_machine(world):
    store, p, _ = world
    rows = _job(world, "communication", 21, "c2")
    node = sorted({s["node"] for s in rows.tables["steps"]})[1]
    store.insert("findings", {"run_id": None, "node": node, "at": rows.end + 20, "job_id": "c2",
                              "code": "ib.errors_rising", "severity": "warning", "action": "alert",
                              "gpu_index": None, "gpu_uuid": None,
                              "message": "mlx5_2/1 errors rising: symbol_error+1247", "evidence": "{}"})
    v = judge_job(store, "c2", cfg=None, template=p.name, exit_code=0, now=rows.end + 30, record=False)
    assert v.cause == "hardware-fault", v.summary
    assert f"ib.errors_rising on {node}" in v.summary
    ev = communication_evidence(store, [node], rows.start, rows.end)
    assert [f["code"] for f in ev["fabric_findings"]] == ["ib.errors_rising"] and ev["fabric_degraded"] is True


def test_evidence_cites_the_node_nccl_baseline(tmp_path):
    store = open_store(str(tmp_path / "n.db"))
    for i, bw in enumerate((330.0, 334.0, 338.0)):
        record_probe(store, {"node": "gn1", "at": 1000.0 + i, "hook": "health", "job_id": None, "gpu_model": "H100",
                             "gpus": 8, "config_key": "k", "state": "ok", "duration_s": 9.0, "ratio": 1.0,
                             "detail": "{}"}, {1073741824: bw, 67108864: 99.0}, {})
    ev = communication_evidence(store, ["gn1", "gn2"], 900.0, 2000.0)
    assert ev["node_nccl_baseline"] == {
        "gn1": {"last_probe_at": 1002.0, "last_state": "ok", "last_ratio": 1.0, "size_b": 1073741824,
                "busbw_median_gbs": 334.0, "busbw_mad_gbs": 4.0, "probes": 3},
        "gn2": None}
    assert ev["fabric_findings"] == [] and ev["fabric_degraded"] is False
    store.close()
