"""The values a run is compared on, computed over a time window of one job.

Which values, their units and which direction is worse are rows of the metric table
(:data:`gpuguard.metrics.COMPARED`); this module computes them over a window. One number
per window (``None`` when the job has no data for it). Percentiles are nearest rank
(:func:`gpuguard.metrics.percentile`), as in the whole-job summary: a value here differs
from the summary's field of the same statistic only by its window (after the warm-up),
and is shown labelled so. Clock-event shares (``power_cap_share``, ``thermal_share``,
``hw_slowdown_share``) count the GPU samples with any of :data:`REASON_SHARES`' reasons.

Windows: the warm-up at the start of the job is left out (``[verdict] warmup_s``); the
value compared with the baseline is the one over the rest of the job; the deviation
must also show in at least one *long* window (``[verdict] long_window_s``, sliding by
the short window) to count. A job whose post-warm-up span is shorter than one long
window is one window.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from gpuguard.epilog import robust
from gpuguard.epilog.jobdata import SERIES_ATTR, JobData
from gpuguard.metrics import compared, compared_gpu, percentile
from gpuguard.model import CLOCK_EVENT_REASONS

#: comparison name -> (unit, windowed, description), from the metric table.
METRICS: dict[str, tuple[str, bool, str]] = {c.name: (c.unit, c.windowed, c.description)
                                             for c in compared().values()}

#: Values kept with every run as a detector's reference and never judged themselves:
#: stored in ``comparisons`` (value and the baseline's median, no z, never flagged) and
#: in the baseline like any metric. name -> (unit, description).
REFERENCE_METRICS: dict[str, tuple[str, str]] = {
    "host_rss_peak_mib": ("MiB", "host memory (RSS) peak, largest node of the job: the level a host memory "
                                 "rise is held against (memory-leak)"),
    "run_duration_s": ("s", "from the job's first to its last data point: a run far shorter than the "
                            "template's usual may not have reached its memory peak (job-changed)"),
}

#: Clock-event reason groups compared with the template's history (nvml.h
#: ``nvmlClocksEventReason*``): metric -> reasons whose share of samples it counts.
REASON_SHARES: dict[str, tuple[str, ...]] = {
    "power_cap_share": ("sw_power_cap",),
    "thermal_share": ("sw_thermal_slowdown", "hw_thermal_slowdown"),
    "hw_slowdown_share": ("hw_slowdown", "hw_power_brake_slowdown"),
}

_SERIES_ATTR = SERIES_ATTR


def _p(values: list[float | None], p: float) -> float | None:
    return percentile(sorted(robust.clean(values)), p)


def _step_metrics(data: JobData, t0: float, t1: float) -> dict[str, float | None]:
    """Step-record metrics over ``[t0, t1)``, on the records' columns
    (:meth:`JobData.step_columns`: a 64-node day-long job has about 740,000 of them in its
    whole span). Sums are taken in record order, as a loop over the records would."""
    import numpy as np

    from gpuguard.epilog.colstats import nearest_rank, seq_sum

    recs = data.step_columns(t0, t1)
    st = recs.step_time_s
    counts = np.where(np.isnan(recs.samples), recs.tokens, recs.samples)
    ok = ~np.isnan(st) & (st != 0)
    out: dict[str, float | None] = {
        "step_time_p50_s": None, "step_time_p95_s": None,
        "throughput_per_s": None, "data_wait_share": None, "comm_share": None,
        "samples_per_step": nearest_rank(counts, 50),
    }
    if not ok.any():
        return out
    times = np.sort(st[ok])
    out["step_time_p50_s"] = float(percentile(times, 50))  # type: ignore[arg-type]
    out["step_time_p95_s"] = float(percentile(times, 95))  # type: ignore[arg-type]
    has_n = ok & ~np.isnan(counts)
    if has_n.any():
        # per (node, rank), in order of first appearance: the sum over ranks is then the
        # same sequence of additions as over a dict filled record by record
        ranks, rank_code = np.unique(np.nan_to_num(recs.rank[has_n], nan=-np.inf), return_inverse=True)
        key = recs.node[has_n].astype(np.int64) * len(ranks) + rank_code.reshape(-1)
        _keys, first, inv = np.unique(key, return_index=True, return_inverse=True)
        inv = inv.reshape(-1)
        n_sum = np.bincount(inv, weights=counts[has_n]).tolist()
        s_sum = np.bincount(inv, weights=st[has_n]).tolist()
        out["throughput_per_s"] = sum(n_sum[k] / s_sum[k] for k in np.argsort(first).tolist() if s_sum[k] > 0)
    for col, name in ((recs.data_wait_s, "data_wait_share"), (recs.comm_s, "comm_share")):
        pair = ok & ~np.isnan(col)
        total = seq_sum(st[pair])
        if pair.any() and total > 0:
            out[name] = seq_sum(col[pair]) / total
    return out


def _gpu_values(data: JobData, attr: str, t0: float, t1: float) -> Any:
    """Every GPU's samples of series ``attr`` in ``[t0, t1)``, one array (NaN = no value)."""
    import numpy as np

    parts = []
    for g in data.gpus:
        i, j = g.span(t0, t1)
        parts.append(g.array(attr)[i:j])
    return np.concatenate(parts) if parts else np.zeros(0)


def exact_window_metrics(data: JobData, t0: float, t1: float, *, all_records: bool = False
                         ) -> dict[str, float | None]:
    """The windowed metrics over ``[t0, t1)`` (epoch seconds), from every point loaded;
    with ``all_records``, step-time percentiles from every stored record when the loader
    bucketed them (one SQL query: for the compared whole-span value)."""
    from gpuguard.epilog.colstats import nearest_rank

    out = _step_metrics(data, t0, t1)
    if all_records and data.exact_step_times is not None:
        times = data.exact_step_times(t0, t1)
        out["step_time_p50_s"] = percentile(times, 50)
        out["step_time_p95_s"] = percentile(times, 95)
    for name, metric in compared_gpu().items():
        if metric in _SERIES_ATTR:  # the clock-event shares come from _reason_shares below
            out[name] = nearest_rank(_gpu_values(data, _SERIES_ATTR[metric], t0, t1), 50)
    out.update(_reason_shares(data, t0, t1))
    return out


def _reason_shares(data: JobData, t0: float, t1: float) -> dict[str, float | None]:
    bits = {m: sum(CLOCK_EVENT_REASONS[r][0] for r in rs) for m, rs in REASON_SHARES.items()}
    counts = dict.fromkeys(REASON_SHARES, 0)
    total = 0
    for g in data.gpus:
        i, j = g.span(t0, t1)
        masks = g.array("mask")[i:j]
        total += j - i
        for m, b in bits.items():
            counts[m] += int(((masks & b) != 0).sum())
    return {m: (counts[m] / total if total else None) for m in REASON_SHARES}


#: Width of the one-minute buckets a long window is combined from (the default
#: ``[verdict] short_window_s``), and the shortest window that is combined rather than
#: computed from its points (our choice: three buckets).
BUCKET_S = 60.0
MIN_BUCKETS = 3
#: Jobs with fewer loaded points (GPU points plus step records) than this are computed
#: window by window from their points: exact, and cheap at that size (our choice: about
#: an hour of 8 GPUs and one rank at 1 s; the per-minute combination is for day-long jobs).
MIN_POINTS_FOR_BUCKETS = 40_000


def _points(data: JobData) -> int:
    n = data.window_cache.get("points")
    if n is None:
        n = data.window_cache["points"] = sum(len(g.t) for g in data.gpus) + len(data.steps)
    return n


def window_metrics(data: JobData, t0: float, t1: float) -> dict[str, float | None]:
    """The windowed metrics over a long window ``[t0, t1)`` (epoch seconds).

    A window of at least :data:`MIN_BUCKETS` one-minute buckets (aligned on the job's
    first data point) is combined from the buckets lying wholly inside it, each computed
    once per job (:func:`exact_window_metrics` over the minute) and cached on ``data``:
    percentiles are the median of the buckets' values, throughput and shares their mean.
    A day-long job's 1,400 long windows thus cost 1,440 one-minute computations instead of
    1,400 ten-minute ones. Shorter windows, and jobs of fewer than
    :data:`MIN_POINTS_FOR_BUCKETS` points, are computed from their points."""
    if data.start is None or t1 - t0 < (MIN_BUCKETS + 1) * BUCKET_S or _points(data) < MIN_POINTS_FOR_BUCKETS:
        return exact_window_metrics(data, t0, t1)
    first = math.ceil((t0 - data.start) / BUCKET_S - 1e-9)
    last = math.floor((t1 - data.start) / BUCKET_S + 1e-9)  # exclusive
    vals: dict[str, list[float]] = {}
    for k in range(first, last):
        b = data.window_cache.get(k)
        if b is None and "all_buckets" not in data.window_cache:
            from gpuguard.epilog.window_buckets import fill_cache

            fill_cache(data, BUCKET_S)  # every bucket in one numpy pass, equal values
            b = data.window_cache.get(k)
        if b is None:
            a = data.start + k * BUCKET_S
            b = data.window_cache[k] = exact_window_metrics(data, a, a + BUCKET_S)
        for name, v in b.items():
            if v is not None:
                vals.setdefault(name, []).append(v)
    out: dict[str, float | None] = {}
    for name in (*_STEP_NAMES, *compared_gpu(), *REASON_SHARES):
        vs = vals.get(name)
        if not vs:
            out[name] = None
        elif name in ("throughput_per_s", "data_wait_share", "comm_share", *REASON_SHARES):
            out[name] = sum(vs) / len(vs)
        else:
            out[name] = percentile(sorted(vs), 50)
    return out


_STEP_NAMES = ("step_time_p50_s", "step_time_p95_s", "throughput_per_s", "data_wait_share", "comm_share",
               "samples_per_step")


def job_metrics(data: JobData, warmup_s: float) -> dict[str, float | None]:
    """Every metric of :data:`METRICS` for the job: windowed ones after the warm-up,
    the others over the whole job. A job that ends inside its warm-up is measured
    over all of it (better than nothing; its windows are the whole job too)."""
    t0, t1 = analysis_span(data, warmup_s)
    if t0 is None or t1 is None:
        return dict.fromkeys(METRICS)
    out = exact_window_metrics(data, t0, t1, all_records=True)
    from gpuguard.epilog import colstats

    out["checkpoint_time_s"] = _p(data.checkpoint_s, 50)
    peaks = [p for p in (colstats.finite(g.array("mem")) for g in data.gpus) if p.shape[0]]
    out["mem_peak_mib"] = max((float(p.max()) for p in peaks), default=None)
    return {m: out.get(m) for m in METRICS}


def host_rss_peak_mib(data: JobData) -> float | None:
    """The largest host RSS reading (MiB) of any node of the job, over the whole job
    (:data:`REFERENCE_METRICS`), or ``None`` without host samples."""
    peaks = [max(v for v in vs if v is not None and math.isfinite(v))
             for _ts, vs in data.host.values() if any(v is not None and math.isfinite(v) for v in vs)]
    return max(peaks) if peaks else None


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
