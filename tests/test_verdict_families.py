"""Every scenario family (tests/scenarios.py) gets its verdict through the real path:
rows in a store, judge_job, the stored verdict."""

from __future__ import annotations

import pytest

import scenarios as S
from gpuguard.epilog.verdict import judge_job, load_verdict
from gpuguard.store import open_store

SEEDS = (11, 12, 13)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """One store, two templates (1 node x 4 GPUs, 2 nodes x 4 GPUs), 4 healthy runs each."""
    store = open_store(str(tmp_path_factory.mktemp("fam") / "fam.db"))
    import random

    rng = random.Random(3)
    profiles = {"single": S.random_profile(rng, "single", nodes=1), "multi": S.random_profile(rng, "multi", nodes=2)}
    profiles["single"].gpus_per_node = 4
    profiles["multi"].gpus_per_node = 4
    t = S.T0
    for p in profiles.values():
        S.write_inventory(store, p, t)
        for k in range(4):
            rows = S.generate(p, "healthy", seed=100 + k, job_id=f"{p.name}-b{k}", start=t)
            S.write(store, rows)
            v = judge_job(store, rows.job_id, cfg=None, template=p.name, exit_code=0, now=rows.end + 30)
            assert v.cause == ("learning" if k < 3 else "healthy"), v.summary
            t = rows.end + 60
    state = {"t": t, "n": 0}
    yield store, profiles, state
    store.close()


def run(world, profile, family, seed, record=False):
    store, profiles, state = world
    p = profiles[profile]
    state["n"] += 1
    rows = S.generate(p, family, seed=seed, job_id=f"{profile}-{family}-{seed}-{state['n']}", start=state["t"])
    state["t"] = rows.end + 60
    S.write(store, rows)
    return rows, judge_job(store, rows.job_id, cfg=None, template=p.name, exit_code=0, now=rows.end + 30,
                           record=record)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("family", [f for f in S.FAMILIES if f != "straggler-node"])
def test_single_node_family(world, family, seed):
    _rows, v = run(world, "single", family, seed)
    assert v.cause == family, f"{family} judged {v.cause}: {v.summary}"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("family", S.FAMILIES)
def test_multi_node_family(world, family, seed):
    _rows, v = run(world, "multi", family, seed)
    assert v.cause == family, f"{family} judged {v.cause}: {v.summary}"


def test_straggler_gpu_names_the_gpu(world):
    rows, v = run(world, "single", "straggler-gpu", 21)
    node, idx = rows.truth["gpu"]
    hit = v.evidence["gpus"][0]
    assert (hit["node"], hit["gpu_index"]) == (node, idx)
    assert abs(hit["rel_change"]) >= 0.1 and hit["sustained_s"] >= 600


def test_straggler_node_names_the_node(world):
    rows, v = run(world, "multi", "straggler-node", 22)
    assert v.cause == "straggler-node" and v.evidence["node"] == rows.truth["node"]


def test_throttling_names_the_reasons(world):
    for seed in range(30, 40):
        rows, v = run(world, "single", "gpu-throttling", seed)
        assert v.cause == "gpu-throttling"
        named = set(v.evidence["reasons"])
        assert set(rows.truth["reasons"]) <= named, (rows.truth, v.evidence)


def test_memory_leak_projects_capacity(world):
    for seed in range(40, 50):
        rows, v = run(world, "single", "memory-leak", seed)
        if rows.truth["leak"]["kind"] == "host":
            continue
        worst = v.evidence["worst"]
        assert worst["capacity_mib"] == 80 * 1024 and worst["hours_to_full"] > 0
        assert worst["projected_full_at"] > rows.end
        return
    pytest.fail("no GPU leak among the seeds")


def test_hardware_fault_evidence(world):
    _rows, v = run(world, "multi", "hardware-fault", 50)
    assert v.cause == "hardware-fault"
    ev = v.evidence
    assert ev["events"] or ev["findings"] or ev["ecc_uncorrected_growth"]


def test_anomalous_run_stays_out_and_healthy_goes_in(world):
    store = world[0]
    rows, v = run(world, "single", "data-pipeline", 60, record=True)
    assert v.cause == "data-pipeline"
    stored = load_verdict(store, rows.job_id)
    assert stored["cause"] == "data-pipeline" and stored["baseline_ok"] is False
    from gpuguard.epilog.baseline import compute_baseline

    assert rows.job_id not in compute_baseline(store, "single").jobs
    rows, v = run(world, "single", "healthy", 61, record=True)
    assert v.cause == "healthy" and compute_baseline(store, "single").jobs[0] == rows.job_id


def test_learning_template_still_names_machine_faults(tmp_path):
    """No baseline yet: nothing is compared, but a fault or a straggler needs none."""
    import random

    store = open_store(str(tmp_path / "l.db"))
    p = S.random_profile(random.Random(5), "fresh", nodes=1)
    p.gpus_per_node = 4
    rows = S.generate(p, "straggler-gpu", seed=1, job_id="s1", start=S.T0)
    S.write(store, rows)
    v = judge_job(store, "s1", cfg=None, template="fresh", exit_code=0)
    assert v.state == "learning" and v.cause == "straggler-gpu"
    rows = S.generate(p, "job-changed", seed=2, job_id="s2", start=rows.end + 60)
    S.write(store, rows)
    v = judge_job(store, "s2", cfg=None, template="fresh", exit_code=0)
    assert v.cause == "learning"  # a changed job cannot be told without a baseline
    store.close()
