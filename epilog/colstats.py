"""The verdict's statistics over numpy columns, equal to their plain-Python forms value
for value: the judge of a 64-node day-long job computes them over arrays of 700,000
values, where walking Python lists took seconds. NaN is "no value" (the lists' None).

* :func:`median` is :func:`gpuguard.robust.median` (mean of the two middle values);
* :func:`nearest_rank` is :func:`gpuguard.metrics.percentile` over the finite values;
* :func:`seq_sum` adds in array order, one value after the other, as a Python loop does
  (numpy's ``sum`` adds pairwise and can differ in the last bits).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def finite(a: Any) -> Any:
    """The finite values of ``a`` (a view when all are)."""
    ok = np.isfinite(a)
    return a if ok.all() else a[ok]


def median(a: Any) -> float | None:
    """Median of the finite values, or None when there are none."""
    v = np.sort(finite(a))
    n = v.shape[0]
    if n == 0:
        return None
    mid = n // 2
    return float(v[mid]) if n % 2 else (float(v[mid - 1]) + float(v[mid])) / 2.0


def nearest_rank(a: Any, p: float) -> float | None:
    """Nearest-rank percentile ``p`` (0-100) of the finite values, or None."""
    v = np.sort(finite(a))
    n = v.shape[0]
    return float(v[max(1, math.ceil(p / 100 * n)) - 1]) if n else None


def seq_sum(a: Any) -> float:
    """Sum in array order (module docstring); 0.0 for an empty array."""
    return float(np.cumsum(a)[-1]) if a.shape[0] else 0.0
