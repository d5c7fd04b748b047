"""Memory-leak analysis: GPU memory (per GPU) or host RSS (per node) rising steadily
after the warm-up.

Theil–Sen slope > 0, rise over the span >= ``[verdict] leak_min_rise_frac`` of capacity
(GPU; from the product name) or of the starting level (host), over at least a long
window (a job shorter than that: most of its span after the warm-up), each quarter of the span
higher than the last by >= 15 % of the rise (our choice: a caching allocator grows in
steps, then plateaus; a leak keeps climbing), and the second half still rising at >= half
the slope. The projection says when it reaches capacity.
"""

from __future__ import annotations

from typing import Any

from gpuguard.epilog import robust
from gpuguard.epilog.compare import Settings, Windows
from gpuguard.epilog.jobdata import JobData


def _leak_of(ts: Any, ys: Any, t0: float, t1: float, capacity: float | None,
             s: Settings) -> dict[str, Any] | None:
    """``ts``/``ys``: numpy arrays (NaN = no value) or lists (None = no value)."""
    import numpy as np

    from gpuguard.epilog import colstats

    ts = np.asarray(ts, dtype=np.float64)
    ys = ys if isinstance(ys, np.ndarray) else np.array([np.nan if y is None else y for y in ys], dtype=np.float64)
    keep = (ts >= t0) & (ts < t1) & ~np.isnan(ys)
    tt_a, yy_a = ts[keep], ys[keep]
    n = tt_a.shape[0]
    # a long window, or most of a shorter job's span after warm-up
    if n < 8 or tt_a[-1] - tt_a[0] < min(s.long_window_s, 0.8 * (t1 - t0)):
        return None
    q = [colstats.median(yy_a[k * n // 4:(k + 1) * n // 4]) for k in range(4)]
    total = q[3] - q[0]  # type: ignore[operator]
    # every test below must pass for a leak; the quarter test is linear, the Theil-Sen
    # slope quadratic in its (bounded) points, so the cheap one goes first: a flat series
    # (almost every GPU of a healthy job) never pays for the slope. Same result either order.
    if total <= 0 or any(q[k + 1] - q[k] < 0.15 * total for k in range(3)):  # type: ignore[operator]
        return None
    tt, yy = tt_a.tolist(), yy_a.tolist()
    slope = robust.theil_sen(tt, yy)
    if not slope or slope <= 0:
        return None
    span = tt[-1] - tt[0]
    rise = slope * span
    start_level = q[0] or 0.0
    ref = capacity if capacity else start_level
    if not ref or rise < s.leak_min_rise_frac * ref:
        return None
    half = n // 2
    late = robust.theil_sen(tt[half:], yy[half:]) or 0.0
    if late < 0.5 * slope:
        return None
    out: dict[str, Any] = {"slope_mib_per_h": round(slope * 3600, 1), "rise_mib": round(rise, 1),
                           "start_mib": round(start_level, 1), "last_mib": round(yy[-1], 1),
                           "capacity_mib": capacity, "projected_full_at": None, "hours_to_full": None}
    if capacity:
        hours = max(0.0, (capacity - yy[-1]) / slope / 3600)
        out["hours_to_full"] = round(hours, 2)
        out["projected_full_at"] = round(tt[-1] + hours * 3600, 1)
    return out


def leak_spans(data: JobData, wins: Windows, s: Settings) -> list[tuple[float, float]]:
    """The spans the leak check reads, in order: the analysis span (``wins.span``); where a
    short run's settled warm-up (:func:`gpuguard.epilog.compare.settled_warmup_s`) ended
    before ``[verdict] warmup_s`` and at least one short window follows ``warmup_s``, the
    span from ``warmup_s`` comes first. A caching allocator grows in a job's first
    minutes, which a settled step time does not say are over: a leak is looked for after
    the fixed warm-up first, and only where that finds none over the longer span."""
    t0, t1 = wins.span
    if t0 is None or t1 is None or data.start is None:
        return []
    fixed = data.start + s.warmup_s
    first = [(fixed, t1)] if fixed > t0 and t1 - fixed >= s.short_window_s else []
    return [*first, (t0, t1)]


def memory_leak(data: JobData, wins: Windows, s: Settings) -> dict[str, Any] | None:
    """GPU memory or host RSS rising steadily (module docstring) over the first of
    :func:`leak_spans` that shows a rise: ``{"leaks": [...], "worst": {...}}`` (at most 8,
    steepest first) or ``None``."""
    for t0, t1 in leak_spans(data, wins, s):
        found = _leaks(data, t0, t1, s)
        if found:
            return found
    return None


def _leaks(data: JobData, t0: float, t1: float, s: Settings) -> dict[str, Any] | None:
    hits = []
    for g in data.gpus:
        r = _leak_of(g.array("t"), g.array("mem"), t0, t1, data.mem_total_mib.get(g.key), s)
        if r:
            hits.append(dict(r, where=g.key, kind="gpu", node=g.node, gpu_index=g.gpu_index, gpu_uuid=g.gpu_uuid))
    for node, (ts, vs) in data.host.items():
        r = _leak_of(ts, vs, t0, t1, None, s)
        if r:
            hits.append(dict(r, where=f"{node}/host", kind="host", node=node))
    if not hits:
        return None
    hits.sort(key=lambda h: -h["slope_mib_per_h"])
    return {"leaks": hits[:8], "worst": hits[0]}
