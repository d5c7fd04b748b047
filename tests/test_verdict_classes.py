"""The verdict on the failure classes a held-back realistic set found, each reproduced with
the independent generator (tests/scenarios_real.py) through ingest, store, summary and
the job-level verdict."""

from __future__ import annotations

import random

import pytest

import scenarios_real as R
from gpuguard.epilog.verdict import judge_job
from gpuguard.store import open_store


def workload(name: str, nodes: int = 1, gpn: int = 8, **kw) -> R.Workload:
    """A fixed template: H100s, 40-minute jobs, 1 s steps, 12 % communication."""
    rng = random.Random(len(name))
    w = R.Workload(
        name=name, nodes=[f"{name}-n{k}" for k in range(nodes)], gpus_per_node=gpn, gpu=R.GPU_MODELS[0],
        duration_s=2400.0, step_s=1.0, samples_per_rank=16, seq_len=2048, data_frac=0.04,
        comm_frac=0.12 if nodes * gpn > 1 else 0.0, optim_frac=0.04, step_sigma=0.05, spike_p=0.003,
        eval_every=1000, eval_s=40.0, ckpt_every_s=1200.0, ckpt_s=30.0, warmup_s=120.0, mem_mib=50000.0,
        chunk_mib=2048.0, rss_mib=20000.0, cap_share=0.0,
        gpu_clock_f=[rng.gauss(1.0, 0.012) for _ in range(nodes * gpn)],
        gpu_power_f=[rng.gauss(1.0, 0.035) for _ in range(nodes * gpn)])
    for k, v in kw.items():
        setattr(w, k, v)
    return w


class World:
    """One store; a template gets ``history`` healthy runs before its first judged case."""

    def __init__(self, path: str):
        self.store = open_store(path)
        self.t = R.T_BASE
        self.n = 0
        self.tmp = path + ".d"

    def run(self, w: R.Workload, case: R.Case, seed: int, record: bool = True):
        self.n += 1
        run = R.run_job(self.store, w, case, f"{w.name}-{self.n}", self.t, seed, self.tmp)
        self.t = run.end + 120
        return judge_job(self.store, run.job_id, cfg=None, template=w.name, exit_code=0, now=run.end + 30,
                         record=record)

    def history(self, w: R.Workload, runs: int = 6) -> None:
        R.write_inventory(self.store, w, self.t)
        for k in range(runs):
            v = self.run(w, R.Case(), 1000 + k)
            assert v.cause in ("learning", "healthy"), v.summary


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    wd = World(str(tmp_path_factory.mktemp("classes") / "c.db"))
    for w in (workload("one8"), workload("two8", nodes=2), workload("pair", gpn=2)):
        wd.history(w)
        setattr(wd, w.name.replace("8", "_8"), w)
    yield wd
    wd.store.close()


def test_slow_start_beyond_warmup_is_healthy(world):
    """Compilation/autotune slowing the first ~20 % of the run is not a changed job."""
    for seed in (1, 2, 3):
        v = world.run(world.one_8, R.Case(confuser="slow-start"), seed, record=False)
        assert v.cause == "healthy", v.summary


def test_tail_only_shift_is_healthy(world):
    """A wider step-time tail (p95 up, p50 and throughput as usual) is not a changed job."""
    for seed in (4, 5, 6):
        v = world.run(world.one_8, R.Case(confuser="wider-tail"), seed, record=False)
        assert v.cause == "healthy", v.summary


def test_straggler_seen_through_rank_records(world):
    """+35 % compute on one rank among 15 peers at normal clocks: the others wait in comm.
    The slowest compute and the shortest comm wait name the GPU and the node."""
    for seed, g in ((7, 11), (8, 3)):
        v = world.run(world.two_8, R.Case("straggler-gpu", 0.35, None, {"gpu": g, "clock_too": False}), seed,
                      record=False)
        assert v.cause == "straggler-gpu", v.summary
        hit = v.evidence["gpus"][0]
        assert (hit["node"], hit["gpu_index"], hit["rank"]) == (f"two8-n{g // 8}", g % 8, g)
        assert hit["metric"] == "fwd_bwd_s" and hit["rel_change"] >= 0.25
        assert "communication" not in v.also


def test_subtle_straggler_against_history_spread(world):
    """+6 % compute on one rank at normal clocks: the step is ~4 % slower (below the
    whole-run limits), but the slowest rank's compute over its peers rose against the
    template's history of that spread, and the rank has the shortest comm wait."""
    for seed, g, w in ((21, 5, world.one_8), (22, 12, world.two_8)):
        v = world.run(w, R.Case("straggler-gpu", 0.06, None, {"gpu": g, "clock_too": False}), seed, record=False)
        assert v.cause == "straggler-gpu", v.summary
        hit = v.evidence["gpus"][0]
        assert (hit["node"], hit["gpu_index"], hit["rank"], hit["metric"]) == (w.nodes[g // 8], g % 8, g, "fwd_bwd_s")
        assert 0.04 <= hit["rel_change"] <= 0.09
        assert v.comparison("rank_compute_spread").flagged


def test_subtle_straggler_node_against_history_spread(world):
    """Every rank of one node +7 % compute: the node, by its best rank."""
    v = world.run(world.two_8, R.Case("straggler-node", 0.07, None, {"node": 1, "clock_too": False}), 23,
                  record=False)
    assert v.cause == "straggler-node", v.summary
    assert (v.evidence["node"], v.evidence["metric"]) == ("two8-n1", "fwd_bwd_s")


def test_one_gpu_hard_reason_is_a_straggler(world):
    """One GPU with HW slowdown in most samples and a clock only 6 % low (under the peer
    clock test): the GPU's own hard reason names it."""
    v = world.run(world.one_8, R.Case("straggler-gpu", 0.06, None, {"gpu": 3, "clock_too": True}), 24,
                  record=False)
    assert v.cause == "straggler-gpu", v.summary
    hits = {(h["gpu_index"], h["metric"]) for h in v.evidence["gpus"]}
    assert (3, "hard_reason_share") in hits or (3, "fwd_bwd_s") in hits
    assert all(h["gpu_index"] == 3 for h in v.evidence["gpus"])
    assert v.evidence["gpus"][0]["reasons"]["hw_slowdown"] >= 0.5


def test_straggler_pair_of_gpus(world):
    v = world.run(world.pair, R.Case("straggler-gpu", 0.3, None, {"gpu": 1, "clock_too": False}), 9, record=False)
    assert v.cause == "straggler-gpu" and v.evidence["gpus"][0]["gpu_index"] == 1, v.summary


def test_power_alone_is_not_a_straggler(world):
    """One GPU drawing 11 % less power at normal clock and unchanged step time."""
    for seed, g in ((10, 2), (11, 5)):
        v = world.run(world.one_8, R.Case(confuser="low-power-gpu", detail={"gpu": g}), seed, record=False)
        assert v.cause == "healthy", v.summary


def test_job_wide_data_stalls_blame_no_gpu(world):
    """Stalls on every rank at once: bimodal utilisation must not single out a GPU or node."""
    for seed, w in ((12, world.one_8), (13, world.two_8), (14, world.two_8)):
        v = world.run(w, R.Case("data-pipeline", 0.3, None, {"stalls": True}), seed, record=False)
        assert v.cause == "data-pipeline", v.summary
        assert not {"straggler-gpu", "straggler-node"} & set(v.also)


def test_smaller_batch_is_job_changed(world):
    """Half the batch: steps faster, samples/s lower, comm share up -> job-changed, with
    samples per step as the evidence."""
    v = world.run(world.one_8, R.Case("job-changed", 0.5, None, {"batch_f": 0.5}), 15, record=False)
    assert v.cause == "job-changed", v.summary
    assert "samples_per_step" in [c["metric"] for c in v.evidence["changed"]]


def test_power_cap_reason_share_against_history(world):
    """sw_power_cap active in most samples vs never in the baseline, steps 12 % slower,
    clocks only 3 % lower: gpu-throttling with the reason's share as evidence."""
    case = R.Case("gpu-throttling", 0.16, None, {"reason": "sw_power_cap", "clock_f": 0.97})
    v = world.run(world.one_8, case, 16, record=False)
    assert v.cause == "gpu-throttling", v.summary
    sh = v.evidence["reason_shares"]["sw_power_cap"]
    assert sh["value"] >= 0.6 and sh["median"] == 0.0


def test_small_power_cap_with_small_slowdown(world):
    """sw_power_cap in most samples vs never in history, clock 4.5 % lower, steps ~4 % slower
    (under the whole-run limit): the reason's share plus the small effect is throttling."""
    v = world.run(world.one_8, R.Case("gpu-throttling", 0.045, None, {"reason": "sw_power_cap"}), 25, record=False)
    assert v.cause == "gpu-throttling", v.summary
    assert v.evidence["reason_shares"]["sw_power_cap"]["median"] == 0.0


def test_small_leaks_and_allocator_chunk(world):
    """A 4.5 % rise over the run (one GPU, every GPU, host RSS; about 4 % after the warm-up) is a leak; one more
    allocator chunk of 3 % of capacity in mid-run is not."""
    for seed, kind in ((26, "one_gpu"), (27, "all_gpus"), (28, "host")):
        v = world.run(world.one_8, R.Case("memory-leak", 0.045, None, {"kind": kind, "gpu": 6}), seed, record=False)
        assert v.cause == "memory-leak", (kind, v.summary)
        assert v.evidence["worst"]["kind"] == ("host" if kind == "host" else "gpu")
    for seed in (29, 30):
        v = world.run(world.one_8, R.Case(confuser="allocator-chunk"), seed, record=False)
        assert v.cause == "healthy", v.summary


def test_baseline_relearns_after_consistent_job_changes(tmp_path):
    """A permanent double batch: job-changed K-1 times, re-learned on the K-th
    (relearn_runs = 5), healthy afterwards; shown in `template list`."""
    from gpuguard.epilog.baseline import compute_baseline, list_templates

    wd = World(str(tmp_path / "r.db"))
    w = workload("relearn", gpn=4)
    wd.history(w, runs=5)
    doubled = R.Case("job-changed", 1.0, None, {"batch_f": 2.0})
    causes = [wd.run(w, doubled, 50 + k) for k in range(5)]
    assert [v.cause for v in causes] == ["job-changed"] * 5
    assert [bool(v.evidence.get("relearned")) for v in causes] == [False] * 4 + [True]
    assert causes[-1].evidence["relearned"]["jobs"] == [v.job_id for v in causes]
    assert compute_baseline(wd.store, "relearn").jobs == [v.job_id for v in reversed(causes)]
    row = next(t for t in list_templates(wd.store) if t["name"] == "relearn")
    assert row["relearned_from"] == [v.job_id for v in causes] and row["relearned_at"] is not None
    assert wd.run(w, doubled, 60).cause == "healthy"
    assert wd.run(w, R.Case(), 61).cause == "job-changed"  # the old batch is now the change


def test_unrelated_odd_runs_do_not_relearn(tmp_path):
    """Five job-changed runs that disagree with each other (batch x2, x0.5, compute x0.7,
    x1.4, ...) keep the old baseline."""
    from gpuguard.epilog.baseline import list_templates

    wd = World(str(tmp_path / "n.db"))
    w = workload("norelearn", gpn=4)
    wd.history(w, runs=5)
    odd = [{"batch_f": 2.0}, {"batch_f": 0.5}, {"compute_f": 0.7}, {"compute_f": 1.4}, {"batch_f": 2.0}]
    vs = [wd.run(w, R.Case("job-changed", 0.5, None, d), 70 + k) for k, d in enumerate(odd)]
    assert [v.cause for v in vs] == ["job-changed"] * 5 and not any("relearned" in v.evidence for v in vs)
    assert next(t for t in list_templates(wd.store) if t["name"] == "norelearn")["relearned_at"] is None
    assert wd.run(w, R.Case(), 80).cause == "healthy"


def test_rank_imbalance_by_role_is_no_straggler(tmp_path):
    """One rank always 25 % slower (a pipeline stage, the loss rank): in every run, so the
    run is as fast as its baseline — no straggler, learning or judged (three such alerts
    would escalate to a drain of a healthy GPU)."""
    wd = World(str(tmp_path / "pp.db"))
    w = workload("roles", gpn=8)
    R.write_inventory(wd.store, w, wd.t)
    role = R.Case(confuser="rank-role", detail={"gpu": 7})
    causes = [wd.run(w, role, 90 + k).cause for k in range(6)]
    assert causes == ["learning"] * 3 + ["healthy"] * 3


def test_heavy_data_wait_is_not_throttling(world):
    """Half the step waiting for data idles the GPUs between steps: the all-sample SM clock
    median falls with the utilisation. That is the data pipeline, not a throttled GPU."""
    for seed in (17, 18):
        v = world.run(world.pair, R.Case("data-pipeline", 0.6, None, {"stalls": False}), seed, record=False)
        assert v.cause == "data-pipeline", v.summary


def test_short_run_allocator_growth_is_not_a_leak(world):
    """A run cut to 5 minutes of a 40-minute template (cancelled, time limit): after the
    warm-up the caching allocator is still growing, quarter after quarter, to the working
    set every healthy run of the template reaches (about 50 GB here). That ends at the
    usual GPU memory peak, so it is no leak (before: "memory rising 600000 MiB/h, full in
    0.05 h" on most seeds). A run this short is still mostly warm-up, which the verdict
    may call job-changed; that is left to the warm-up rules."""
    import dataclasses

    short = dataclasses.replace(world.one_8, duration_s=300.0)
    causes = [world.run(short, R.Case(), seed, record=False).cause for seed in (50, 51, 55, 59, 60, 61)]
    assert [c == "memory-leak" for c in causes] == [False] * 6, causes


def test_named_template_on_another_gpu_model_learns(tmp_path):
    """A named template's history on H100s, then the job moves to an A100 partition (step
    time follows the SM clock, memory fits the smaller GPU): no H100 run is a like-for-like
    reference, so the A100 runs learn — never "SM clock down" against the H100s (before: 5
    of 12 such runs in bench/verdict_independent.py were gpu-throttling). From the third A100
    run on the A100s have their own baseline; the H100 baseline is still there."""
    import dataclasses

    from gpuguard.epilog.baseline import compute_baseline, list_templates

    wd = World(str(tmp_path / "m.db"))
    h100 = workload("moved", gpn=4)
    wd.history(h100, runs=6)
    a100_gpu = R.GPU_MODELS[1]
    a100 = dataclasses.replace(h100, gpu=a100_gpu, step_s=h100.step_s * h100.gpu[2] / a100_gpu[2],
                               nodes=[f"{n}-a" for n in h100.nodes])
    R.write_inventory(wd.store, a100, wd.t)
    first = [wd.run(a100, R.Case(), 300 + k) for k in range(3)]
    assert [(v.cause, v.state, v.gpu_model) for v in first] == [("learning", "learning", a100_gpu[0])] * 3
    assert first[0].evidence["other_gpu_models"] == {"NVIDIA H100 80GB HBM3": 6}
    assert first[0].summary == ("template still learning on NVIDIA A100-SXM4-80GB: 0 of 3 runs on it; runs on "
                                "another GPU model are not compared with (6 on NVIDIA H100 80GB HBM3)")
    v = wd.run(a100, R.Case(), 310)
    assert (v.cause, v.state, v.baseline_runs) == ("healthy", "judged", 3), v.summary
    throttled = wd.run(a100, R.Case("gpu-throttling", 0.2, None, {"reason": "sw_thermal_slowdown"}), 311,
                       record=False)
    assert throttled.cause == "gpu-throttling", throttled.summary
    back = wd.run(h100, R.Case(), 312)
    assert (back.cause, back.baseline_runs, back.gpu_model) == ("healthy", 6, "NVIDIA H100 80GB HBM3")
    assert compute_baseline(wd.store, "moved", gpu_model=a100_gpu[0]).runs == 4
    row = next(t for t in list_templates(wd.store) if t["name"] == "moved")
    assert (row["gpu_model"], row["baseline_runs"], row["state"]) == ("NVIDIA H100 80GB HBM3", 7, "ready")
    assert row["gpu_models"] == {"NVIDIA A100-SXM4-80GB": 4, "NVIDIA H100 80GB HBM3": 7}


def test_hardware_fault_on_a_new_gpu_model_is_still_named(tmp_path):
    """Learning on a new GPU model judges nothing against a baseline, but an XID during the
    run is the machine's fault whatever the history (baseline-free)."""
    import dataclasses

    wd = World(str(tmp_path / "x.db"))
    h100 = workload("movedx", gpn=2)
    wd.history(h100, runs=4)
    l40 = dataclasses.replace(h100, gpu=R.GPU_MODELS[3], nodes=[f"{n}-l" for n in h100.nodes], mem_mib=30000.0)
    R.write_inventory(wd.store, l40, wd.t)
    v = wd.run(l40, R.Case("hardware-fault", 1.0, None, {"xid": 79, "gpu": 1}), 320)
    assert (v.cause, v.state, v.gpu_model) == ("hardware-fault", "learning", "NVIDIA L40S"), v.summary


def test_short_run_host_memory_ramp_is_not_a_leak(world):
    """A run cut to under 5 minutes: the host RSS is still growing to the level every
    healthy run of the template reaches (data loader workers starting, prefetch buffers
    filling: 40 % -> 100 % over the first 4 minutes here). That ends at the template's
    usual host memory peak (baseline median of host_rss_peak_mib), so it is no leak
    (before: "t002-n0/host memory rising 83065.5 MiB/h" in bench/verdict_independent.py
    seed 2, a communication case). A real host leak still is one: test_small_leaks_and_allocator_chunk."""
    import dataclasses

    short = dataclasses.replace(world.one_8, duration_s=270.0)
    vs = [world.run(short, R.Case(), seed, record=False) for seed in (70, 71, 72, 73)]
    assert [v.cause == "memory-leak" for v in vs] == [False] * 4, [v.summary for v in vs]
    peak = vs[0].comparison("host_rss_peak_mib")
    assert peak.n == 6 and peak.z is None and not peak.flagged and peak.median == pytest.approx(20000.0, rel=0.02)


def test_short_run_is_judged_after_its_own_warm_up(world, tmp_path):
    """A run cut to about 5.5 minutes of a 40-minute template: the fixed 300-s warm-up left
    the last seconds (a few steps) to judge, so data stalls were 'as usual'
    (bench/verdict_independent.py seed 2 t012: data-pipeline judged healthy) and a GPU leak
    was seen only as a higher memory peak (seed 3 t017: job-changed). A short run's warm-up
    ends where its own step times settle; its leak check starts after the fixed warm-up
    where a short window follows it. Healthy short runs stay healthy."""
    import dataclasses

    leak = R.Case("memory-leak", 0.13, None, {"kind": "one_gpu", "gpu": 3})
    short = dataclasses.replace(world.one_8, duration_s=340.0)
    leaks = [world.run(short, leak, seed, record=False) for seed in (80, 83, 84, 86)]
    assert [(v.cause, v.evidence.get("worst", {}).get("where")) for v in leaks] == [
        ("memory-leak", "one8-n0/gpu3")] * 4, [v.summary for v in leaks]
    wd = World(str(tmp_path / "s.db"))
    slow = workload("slow4", gpn=4, step_s=2.5)
    wd.history(slow)
    v = wd.run(dataclasses.replace(slow, duration_s=330.0), R.Case("data-pipeline", 0.35, None, {"stalls": True}),
               88, record=False)
    assert v.end - v.start < 320.0 and v.cause == "data-pipeline" and v.evidence["warmup_s"] < 300.0, v.summary
    healthy = [world.run(dataclasses.replace(world.one_8, duration_s=d), R.Case(), seed, record=False)
               for d, seed in ((330.0, 80), (420.0, 81), (270.0, 82), (600.0, 83))]
    assert [v.cause for v in healthy] == ["healthy"] * 4, [v.summary for v in healthy]


def test_short_run_lower_memory_peak_is_not_a_changed_job(world):
    """A 4.5-minute run of a 40-minute template has not allocated its whole working set
    yet: its GPU memory peak is flagged below the usual (before: job-changed, "mem_peak_mib
    4.159e+04 MiB vs ..."; seed 3 t022 in bench/verdict_independent.py). A run under half
    the template's usual length (baseline median of run_duration_s) with a lower peak is no
    changed job; the same lower peak in a run of the usual length is one."""
    import dataclasses

    v = world.run(dataclasses.replace(world.one_8, duration_s=270.0), R.Case(), 71, record=False)
    assert v.cause == "healthy" and v.evidence["unexplained"] == ["mem_peak_mib"], v.summary
    dur = v.comparison("run_duration_s")
    assert dur.n == 6 and dur.z is None and not dur.flagged and dur.value < 0.5 * dur.median
    smaller = world.run(dataclasses.replace(world.one_8, mem_mib=30000.0), R.Case(), 72, record=False)
    assert smaller.cause == "job-changed" and smaller.summary.startswith("the job itself changed: mem_peak_mib")
