"""Baselines and comparisons on small hand-made jobs: exact medians, MADs, z-scores;
learning below min runs; anomalous and failed runs kept out; reset; windows."""

from __future__ import annotations

import math

import pytest

from gpuguard import config as config_mod
from gpuguard.epilog import baseline as B
from gpuguard.epilog import robust
from gpuguard.epilog.verdict import judge_job, load_verdict
from gpuguard.store import open_store

T0 = 1767225600.0


@pytest.fixture
def store(tmp_path):
    s = open_store(str(tmp_path / "v.db"))
    yield s
    s.close()


def cfg(**verdict):
    v = {"warmup_s": 0.0, "long_window_s": 600.0, "short_window_s": 60.0}
    v.update(verdict)
    return config_mod.from_dict({"verdict": v})


def flat_job(store, job_id, start, *, step_time=1.0, duration=1200.0, gpus=2, clock=1800.0,
             data_wait=0.0, comm=0.0, slow_from=None, slow_step=None, mem=1000.0):
    """A job with constant step time (``slow_step`` from ``slow_from`` s on) and constant
    GPU readings, 10-s samples; one rank per GPU, one step record per rank per step."""
    steps, samples = [], []
    t, n = start, 0
    while t < start + duration:
        st = slow_step if slow_from is not None and t - start >= slow_from else step_time
        t += st
        n += 1
        for r in range(gpus):
            steps.append({"job_id": job_id, "node": "n1", "rank": r, "step": n, "t": t, "step_time_s": st,
                          "samples": 10, "data_wait_s": data_wait, "fwd_bwd_s": st - data_wait - comm,
                          "comm_s": comm, "optim_s": 0.0})
    for k in range(int(duration // 10) + 1):
        for g in range(gpus):
            samples.append({"job_id": job_id, "node": "n1", "at": start + 10 * k, "gpu_index": g,
                            "gpu_uuid": f"GPU-{g}", "gpu_util_pct": 95.0, "mem_used_mib": mem, "power_w": 400.0,
                            "temp_c": 60.0, "sm_clock_mhz": clock, "clock_event_mask": 0,
                            "ecc_volatile_uncorrected": 0})
    store.insert_many("steps", steps)
    store.insert_many("samples", samples)
    return start + duration


def test_robust_z_exact():
    assert robust.median([3, 1, 2, None, float("nan")]) == 2
    assert robust.mad([1.0, 1.1, 1.2]) == pytest.approx(0.1)
    z, scale = robust.robust_z(2.0, 1.1, 0.1, 0.02)
    assert scale == pytest.approx(0.14826)
    assert z == pytest.approx(0.9 / 0.14826)
    # MAD floor: a spread of 0 uses 2 % of the median
    z, scale = robust.robust_z(1.2, 1.0, 0.0, 0.02)
    assert scale == pytest.approx(1.4826 * 0.02)
    assert z == pytest.approx(0.2 / (1.4826 * 0.02))
    assert robust.robust_z(1.0, 0.0, 0.0, 0.0)[0] == math.inf
    assert robust.rel_change(1.5, 1.0) == pytest.approx(0.5)
    assert robust.quantile([1, 2, 3, 4, 5], 0.95) == pytest.approx(4.8)
    assert robust.theil_sen([0, 1, 2, 3, 4], [0, 2, 4, 6, 100]) == pytest.approx(2.0)


def test_learning_below_min_runs_then_judged(store):
    c = cfg()
    t = T0
    for i, st in enumerate((1.0, 1.1, 1.2)):
        end = flat_job(store, f"j{i}", t, step_time=st)
        v = judge_job(store, f"j{i}", cfg=c, template="tpl", exit_code=0, now=end + 1)
        assert v.cause == "learning" and v.state == "learning"
        assert all(not cmp.flagged and cmp.z is None for cmp in v.comparisons)
        t = end + 100
    b = B.compute_baseline(store, "tpl", cfg=c)
    assert b.state == "ready" and b.runs == 3
    assert b.stats["step_time_p50_s"] == B.Stat(1.1, pytest.approx(0.1), 3)
    # cached table matches
    rows = {r["metric"]: r for r in B.cached_baseline(store, "tpl")}
    assert rows["step_time_p50_s"]["median"] == pytest.approx(1.1) and rows["step_time_p50_s"]["n"] == 3
    # within the spread: z = 0.3 / 0.14826 = 2.02 < 3.5, not flagged
    end = flat_job(store, "j3", t, step_time=1.4)
    v = judge_job(store, "j3", cfg=c, template="tpl", exit_code=0, now=end + 1)
    cmp = v.comparison("step_time_p50_s")
    assert cmp.median == pytest.approx(1.1) and cmp.mad == pytest.approx(0.1) and cmp.n == 3
    assert cmp.z == pytest.approx(0.3 / 0.14826) and not cmp.flagged
    assert cmp.rel_change == pytest.approx(0.3 / 1.1)
    assert v.cause == "healthy" and v.state == "judged"
    t = end + 100
    # clearly slower, clocks as usual, no data/comm signal: job-changed
    end = flat_job(store, "j4", t, step_time=2.0)
    v = judge_job(store, "j4", cfg=c, template="tpl", exit_code=0, now=end + 1)
    cmp = v.comparison("step_time_p50_s")
    # the baseline now has j0..j3: median of 1.0, 1.1, 1.2, 1.4 = 1.15, MAD = 0.1
    assert cmp.median == pytest.approx(1.15) and cmp.mad == pytest.approx(0.1)
    assert cmp.z == pytest.approx(0.85 / 0.14826)
    assert cmp.flagged and cmp.sustained_s >= 600
    assert v.cause == "job-changed"
    # anomalous: out of the baseline
    b = B.compute_baseline(store, "tpl", cfg=c)
    assert "j4" not in b.jobs and b.runs == 4
    stored = load_verdict(store, "j4")
    assert stored["cause"] == "job-changed" and not stored["baseline_ok"]
    assert {c["metric"] for c in stored["comparisons"]} >= {"step_time_p50_s", "sm_clock_mhz"}


def test_failed_runs_stay_out_of_the_baseline(store):
    c = cfg()
    t = T0
    for i in range(3):
        end = flat_job(store, f"f{i}", t, step_time=1.0)
        judge_job(store, f"f{i}", cfg=c, template="tpl", exit_code=256, now=end + 1)
        t = end + 100
    b = B.compute_baseline(store, "tpl", cfg=c)
    assert b.runs == 0 and b.state == "learning"
    rows = B.list_templates(store, cfg=c)
    assert rows[0]["name"] == "tpl" and rows[0]["jobs"] == 3 and rows[0]["state"] == "learning"


def test_baseline_takes_last_n_and_reset(store):
    c = config_mod.from_dict({"verdict": {"warmup_s": 0.0}, "baseline": {"runs": 3, "min_runs": 2}})
    t = T0
    for i, st in enumerate((5.0, 1.0, 1.0, 1.02)):
        end = flat_job(store, f"r{i}", t, step_time=st, duration=300)
        judge_job(store, f"r{i}", cfg=c, template="tpl", exit_code=0, now=t)
        t = end + 100
    b = B.compute_baseline(store, "tpl", cfg=c)
    # N = 3: the newest three fit runs, r0 (5 s) has dropped out
    assert b.jobs == ["r3", "r2", "r1"]
    assert b.stats["step_time_p50_s"].median == pytest.approx(1.0)
    assert B.reset_baseline(store, "tpl", now=t) > 0
    b = B.compute_baseline(store, "tpl", cfg=c)
    assert b.runs == 0 and b.state == "learning" and not B.cached_baseline(store, "tpl")


def test_short_spike_is_not_sustained(store):
    """A slowdown shorter than the long window moves no long window enough: not flagged."""
    c = cfg(long_window_s=600.0)
    t = T0
    for i in range(3):
        end = flat_job(store, f"b{i}", t, step_time=1.0, duration=2400)
        judge_job(store, f"b{i}", cfg=c, template="tpl", exit_code=0, now=end + 1)
        t = end + 100
    # the last 300 s at 3x: p95 of the whole job rises, but no 10-min window's p95 ...
    end = flat_job(store, "spike", t, step_time=1.0, duration=2400, slow_from=2100, slow_step=3.0)
    v = judge_job(store, "spike", cfg=c, template="tpl", exit_code=0, now=end + 1)
    p50 = v.comparison("step_time_p50_s")
    assert not p50.flagged
    # ... while the same slowdown over 1500 s is sustained and flagged
    end = flat_job(store, "long", end + 100, step_time=1.0, duration=2400, slow_from=900, slow_step=3.0)
    v = judge_job(store, "long", cfg=c, template="tpl", exit_code=0, now=end + 1)
    assert v.comparison("step_time_p95_s").flagged
    assert v.comparison("step_time_p95_s").sustained_s >= 600


def test_share_needs_absolute_change(store):
    """Data wait 0.001 -> 0.004 s per 1-s step is +300 % but 0.3 points: not flagged."""
    c = cfg()
    t = T0
    for i in range(3):
        end = flat_job(store, f"d{i}", t, data_wait=0.001)
        judge_job(store, f"d{i}", cfg=c, template="tpl", exit_code=0, now=end + 1)
        t = end + 100
    end = flat_job(store, "d3", t, data_wait=0.004)
    v = judge_job(store, "d3", cfg=c, template="tpl", exit_code=0, now=end + 1)
    cmp = v.comparison("data_wait_share")
    assert cmp.rel_change == pytest.approx(3.0) and not cmp.flagged
    assert v.cause == "healthy"


def test_no_data_is_learning_and_not_in_baseline(store):
    v = judge_job(store, "empty", cfg=cfg(), template="tpl", exit_code=0, now=T0)
    assert v.cause == "learning" and "no_data" in v.evidence
    assert B.compute_baseline(store, "tpl").runs == 0


def test_bad_config_values_raise():
    with pytest.raises(config_mod.ConfigError):
        judge_job(None, "x", cfg=config_mod.from_dict({"baseline": {"runs": 2, "min_runs": 3}}), template="t")
    with pytest.raises(config_mod.ConfigError):
        judge_job(None, "x", cfg=config_mod.from_dict({"verdict": {"z_threshold": 0}}), template="t")


def test_long_windows_are_capped_for_huge_spans():
    from gpuguard.epilog.metrics import MAX_WINDOWS, long_windows

    w = long_windows(0.0, 1e12, 600.0, 60.0)
    assert len(w) <= MAX_WINDOWS + 1
    assert w[0] == (0.0, 600.0) and w[-1][1] == pytest.approx(1e12)
    assert len(long_windows(0.0, 3600.0, 600.0, 60.0)) == 51  # normal jobs keep the 60 s slide


def test_relearn_runs_config_range():
    with pytest.raises(config_mod.ConfigError, match="relearn_runs must be 0 or >= baseline.min_runs"):
        B.BaselineSettings.from_config(config_mod.from_dict({"baseline": {"relearn_runs": 2, "min_runs": 3}}))
    assert B.BaselineSettings.from_config(config_mod.from_dict({"baseline": {"relearn_runs": 0}})).relearn_runs == 0
