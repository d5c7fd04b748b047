"""The summary metrics a run is compared on, computed over a time window of one job.

Each metric is one number per window (``None`` when the job has no data for it):

====================  =====  ==========================================================
metric                unit   definition over the window
====================  =====  ==========================================================
step_time_p50_s       s      median ``step_time_s`` of every rank's step records
step_time_p95_s       s      95th percentile of the same
throughput_per_s      1/s    sum over ranks of samples (else tokens) / step time
data_wait_share       0-1    sum ``data_wait_s`` / sum ``step_time_s``
comm_share            0-1    sum ``comm_s`` / sum ``step_time_s``
checkpoint_time_s     s      median checkpoint duration (whole job, not windowed)
gpu_util_pct          %      median GPU utilisation over all GPU samples
mem_peak_mib          MiB    largest ``mem_used_mib`` of any GPU (whole job, not windowed)
power_w               W      median board power over all GPU samples
sm_clock_mhz          MHz    median SM clock over all GPU samples
temp_c                °C     median GPU temperature over all GPU samples
samples_per_step      1      median samples (else tokens) per step record of one rank
power_cap_share       0-1    share of GPU samples with ``sw_power_cap`` active
thermal_share         0-1    share with ``sw_thermal_slowdown`` or ``hw_thermal_slowdown``
hw_slowdown_share     0-1    share with ``hw_slowdown`` or ``hw_power_brake_slowdown``
====================  =====  ==========================================================

Windows: the warm-up at the start of the job is left out (``[verdict] warmup_s``); the
value compared with the baseline is the one over the rest of the job; the deviation
must also show in at least one *long* window (``[verdict] long_window_s``, sliding by
the short window) to count. A job whose post-warm-up span is shorter than one long
window is one window.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpuguard.epilog import robust
from gpuguard.epilog.jobdata import JobData
from gpuguard.model import CLOCK_EVENT_REASONS

#: metric -> (unit, windowed, description)
METRICS: dict[str, tuple[str, bool, str]] = {
    "step_time_p50_s": ("s", True, "step time, median"),
    "step_time_p95_s": ("s", True, "step time, 95th percentile"),
    "throughput_per_s": ("1/s", True, "samples (else tokens) per second, all ranks"),
    "data_wait_share": ("0-1", True, "share of step time waiting for data"),
    "comm_share": ("0-1", True, "share of step time in communication"),
    "checkpoint_time_s": ("s", False, "checkpoint duration, median"),
    "gpu_util_pct": ("%", True, "GPU utilisation, median"),
    "mem_peak_mib": ("MiB", False, "GPU memory peak"),
    "power_w": ("W", True, "GPU power, median"),
    "sm_clock_mhz": ("MHz", True, "SM clock, median"),
    "temp_c": ("°C", True, "GPU temperature, median"),
    "samples_per_step": ("1", True, "samples (else tokens) per step of one rank, median"),
    "power_cap_share": ("0-1", True, "share of GPU samples with sw_power_cap active"),
    "thermal_share": ("0-1", True, "share of GPU samples with a thermal slowdown active"),
    "hw_slowdown_share": ("0-1", True, "share of GPU samples with HW slowdown or power brake active"),
}

#: Clock-event reason groups compared with the template's history (nvml.h
#: ``nvmlClocksEventReason*``): metric -> reasons whose share of samples it counts.
REASON_SHARES: dict[str, tuple[str, ...]] = {
    "power_cap_share": ("sw_power_cap",),
    "thermal_share": ("sw_thermal_slowdown", "hw_thermal_slowdown"),
    "hw_slowdown_share": ("hw_slowdown", "hw_power_brake_slowdown"),
}


def _step_metrics(data: JobData, t0: float, t1: float) -> dict[str, float | None]:
    recs = data.steps_between(t0, t1)
    times = [r.step_time_s for r in recs if r.step_time_s]
    out: dict[str, float | None] = {
        "step_time_p50_s": robust.median(times),
        "step_time_p95_s": robust.quantile(times, 0.95),
        "throughput_per_s": None, "data_wait_share": None, "comm_share": None,
        "samples_per_step": robust.median(r.samples if r.samples is not None else r.tokens for r in recs),
    }
    if not times:
        return out
    by_rank: dict[Any, list[float]] = {}
    for r in recs:
        if not r.step_time_s:
            continue
        n = r.samples if r.samples is not None else r.tokens
        if n is None:
            continue
        acc = by_rank.setdefault((r.node, r.rank), [0.0, 0.0])
        acc[0] += n
        acc[1] += r.step_time_s
    if by_rank:
        out["throughput_per_s"] = sum(n / s for n, s in by_rank.values() if s > 0)
    for phase, name in (("data_wait_s", "data_wait_share"), ("comm_s", "comm_share")):
        pairs = [(getattr(r, phase), r.step_time_s) for r in recs if getattr(r, phase) is not None and r.step_time_s]
        total = sum(s for _p, s in pairs)
        if pairs and total > 0:
            out[name] = sum(p for p, _s in pairs) / total
    return out


def _gpu_values(data: JobData, attr: str, t0: float, t1: float) -> list[float | None]:
    vals: list[float | None] = []
    for g in data.gpus:
        i, j = g.span(t0, t1)
        vals.extend(getattr(g, attr)[i:j])
    return vals


def window_metrics(data: JobData, t0: float, t1: float) -> dict[str, float | None]:
    """The windowed metrics over ``[t0, t1)`` (epoch seconds)."""
    out = _step_metrics(data, t0, t1)
    out["gpu_util_pct"] = robust.median(_gpu_values(data, "util", t0, t1))
    out["power_w"] = robust.median(_gpu_values(data, "power", t0, t1))
    out["sm_clock_mhz"] = robust.median(_gpu_values(data, "clock", t0, t1))
    out["temp_c"] = robust.median(_gpu_values(data, "temp", t0, t1))
    out.update(_reason_shares(data, t0, t1))
    return out


def _reason_shares(data: JobData, t0: float, t1: float) -> dict[str, float | None]:
    bits = {m: sum(CLOCK_EVENT_REASONS[r][0] for r in rs) for m, rs in REASON_SHARES.items()}
    counts = dict.fromkeys(REASON_SHARES, 0)
    total = 0
    for g in data.gpus:
        i, j = g.span(t0, t1)
        for mask in g.mask[i:j]:
            total += 1
            for m, b in bits.items():
                if mask & b:
                    counts[m] += 1
    return {m: (counts[m] / total if total else None) for m in REASON_SHARES}


def job_metrics(data: JobData, warmup_s: float) -> dict[str, float | None]:
    """Every metric of :data:`METRICS` for the job: windowed ones after the warm-up,
    the others over the whole job. A job that ends inside its warm-up is measured
    over all of it (better than nothing; its windows are the whole job too)."""
    t0, t1 = analysis_span(data, warmup_s)
    if t0 is None or t1 is None:
        return dict.fromkeys(METRICS)
    out = window_metrics(data, t0, t1)
    out["checkpoint_time_s"] = robust.median(data.checkpoint_s)
    peaks = [robust.clean(g.mem) for g in data.gpus]
    out["mem_peak_mib"] = max((max(p) for p in peaks if p), default=None)
    return {m: out.get(m) for m in METRICS}


def analysis_span(data: JobData, warmup_s: float) -> tuple[float | None, float | None]:
    """``(t0, t1)``: from the end of the warm-up to just past the last data point."""
    if data.start is None or data.end is None:
        return None, None
    t0 = data.start + warmup_s
    if t0 >= data.end:
        t0 = data.start
    return t0, data.end + 1e-6


#: At most this many long windows per job: the slide grows for long jobs, so a month-long
#: job (or a bogus timestamp in a user's training records) cannot make the Epilog build
#: millions of windows (review: a record with t=1e12 drove the Epilog to the OOM killer).
MAX_WINDOWS = 2000


def long_windows(t0: float, t1: float, long_s: float, short_s: float) -> list[tuple[float, float]]:
    """Long windows sliding by ``short_s`` (or more, to stay within :data:`MAX_WINDOWS`)
    inside ``[t0, t1)``; ``[(t0, t1)]`` when the span is shorter than one long window."""
    if t1 - t0 <= long_s or short_s <= 0:
        return [(t0, t1)]
    short_s = max(short_s, (t1 - t0 - long_s) / (MAX_WINDOWS - 1))
    out = []
    a = t0
    while a + long_s <= t1 + 1e-9:
        out.append((a, a + long_s))
        a += short_s
    if out[-1][1] < t1 - short_s / 2:
        out.append((t1 - long_s, t1))
    return out


def sustained(windows: list[tuple[float, float]], value_of: Callable[[float, float], float | None],
              deviates: Callable[[float], bool]) -> tuple[bool, float]:
    """Whether some long window's value deviates (``deviates(value)``), and the length
    in seconds covered by the deviating windows' union (for the evidence)."""
    hit = []
    for a, b in windows:
        v = value_of(a, b)
        if v is not None and deviates(v):
            hit.append((a, b))
    if not hit:
        return False, 0.0
    covered = 0.0
    cur_a, cur_b = hit[0]
    for a, b in hit[1:]:
        if a <= cur_b:
            cur_b = max(cur_b, b)
        else:
            covered += cur_b - cur_a
            cur_a, cur_b = a, b
    covered += cur_b - cur_a
    return True, covered
