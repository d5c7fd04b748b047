"""Robust statistics for baselines and verdicts, in plain Python (the Epilog runs on
compute nodes where only gpuguard's own dependencies are installed; numpy, one of them,
is imported lazily by :func:`theil_sen` alone, for its quadratic pair count).

Every function takes a sequence of floats and ignores ``None``/NaN entries; an empty
input gives ``None`` rather than an exception, because a missing metric (a job without
training records, a GPU without power readings) is normal and simply not compared.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

#: MAD -> standard deviation for normal data: 1/Phi^-1(3/4). Source: Rousseeuw & Croux
#: (1993), "Alternatives to the Median Absolute Deviation", JASA 88:1273; the constant
#: of Iglewicz & Hoaglin's modified z-score M = 0.6745 (x - median) / MAD.
MAD_TO_SIGMA = 1.4826


def clean(xs: Iterable[float | None]) -> list[float]:
    """The finite values of ``xs`` as floats."""
    # x - x is 0 for a finite number and NaN for inf/NaN: one comparison instead of a call
    # (the verdict filters a few hundred thousand values of a day-long job)
    return [float(x) for x in xs if x is not None and x - x == 0]


def median(xs: Iterable[float | None]) -> float | None:
    """Median of the finite values, or ``None`` when there are none."""
    v = sorted(clean(xs))
    n = len(v)
    if n == 0:
        return None
    mid = n // 2
    return v[mid] if n % 2 else (v[mid - 1] + v[mid]) / 2.0


def mad(xs: Iterable[float | None], center: float | None = None) -> float | None:
    """Median absolute deviation (raw, *not* scaled by 1.4826) about ``center`` (default:
    the median), or ``None`` for no data."""
    v = clean(xs)
    if not v:
        return None
    c = median(v) if center is None else center
    return median(abs(x - c) for x in v)


def quantile(xs: Iterable[float | None], q: float) -> float | None:
    """Quantile ``q`` in [0, 1] with linear interpolation between order statistics
    (numpy's default "linear" method), or ``None`` for no data."""
    v = sorted(clean(xs))
    if not v:
        return None
    pos = (len(v) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def mean(xs: Iterable[float | None]) -> float | None:
    v = clean(xs)
    return sum(v) / len(v) if v else None


def robust_z(x: float, med: float, mad_raw: float, floor_frac: float) -> tuple[float, float]:
    """Modified z-score with a MAD floor.

    ``z = (x - med) / (1.4826 * max(mad_raw, floor_frac * |med|))``. Returns
    ``(z, scale)`` where ``scale`` is the denominator. When both the MAD and the floor
    are zero (a metric that was exactly 0 in every baseline run), any non-zero ``x`` is
    infinitely far: ``z = ±inf``; ``x == med`` gives 0.
    """
    spread = max(mad_raw, floor_frac * abs(med))
    scale = MAD_TO_SIGMA * spread
    if scale == 0.0:
        if x == med:
            return 0.0, 0.0
        return (math.inf if x > med else -math.inf), 0.0
    return (x - med) / scale, scale


def rel_change(x: float, med: float) -> float:
    """``(x - med) / |med|``; ±inf when the median is 0 and ``x`` is not."""
    if med == 0.0:
        return 0.0 if x == 0.0 else (math.inf if x > 0 else -math.inf)
    return (x - med) / abs(med)


def theil_sen(ts: Sequence[float], ys: Sequence[float], max_points: int = 200) -> float | None:
    """Theil–Sen slope (median of pairwise slopes; Sen 1968, JASA 63:1379): robust to the
    step changes of a caching allocator. Long series are thinned evenly to
    ``max_points`` (pairs grow quadratically). ``None`` for fewer than 2 distinct times."""
    pts = [(t, y) for t, y in zip(ts, ys, strict=True) if y is not None and math.isfinite(y)]
    if len(pts) > max_points:
        step = len(pts) / max_points
        pts = [pts[int(i * step)] for i in range(max_points)]
    if len(pts) < 2:
        return None
    # the n(n-1)/2 pairs in numpy (lazily imported: the Epilog's memory-leak check takes
    # ten of these at 200 points, 0.1 s as a Python loop); the same float operations per
    # pair, and the median of the same multiset of slopes
    import numpy as np

    t = np.array([p[0] for p in pts], dtype=np.float64)
    y = np.array([p[1] for p in pts], dtype=np.float64)
    i, j = np.triu_indices(len(pts), k=1)
    dt = t[j] - t[i]
    keep = dt != 0
    slopes = (y[j][keep] - y[i][keep]) / dt[keep]
    v = np.sort(slopes[np.isfinite(slopes)])
    n = v.shape[0]
    if n == 0:
        return None
    mid = n // 2
    return float(v[mid]) if n % 2 else (float(v[mid - 1]) + float(v[mid])) / 2.0
