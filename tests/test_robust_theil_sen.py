"""robust.theil_sen: the median of every pairwise slope, equal to the plain pair loop."""

from __future__ import annotations

import math
import random

from gpuguard import robust


def _pair_loop(ts: list[float], ys: list[float | None], max_points: int = 200) -> float | None:
    pts = [(t, y) for t, y in zip(ts, ys, strict=True) if y is not None and math.isfinite(y)]
    if len(pts) > max_points:
        step = len(pts) / max_points
        pts = [pts[int(i * step)] for i in range(max_points)]
    slopes = [(pts[j][1] - pts[i][1]) / (pts[j][0] - pts[i][0])
              for i in range(len(pts)) for j in range(i + 1, len(pts)) if pts[j][0] != pts[i][0]]
    return robust.median(slopes)


def test_known_slopes() -> None:
    # ten slopes: six of 2 and the outlier's 25, 32.7, 48, 94: the middle two are 2
    assert robust.theil_sen([0.0, 1.0, 2.0, 3.0, 4.0], [0.0, 2.0, 4.0, 6.0, 100.0]) == 2.0
    # six slopes 2, 2, 2, 33.3, 49, 96: the mean of the middle two
    assert robust.theil_sen([0.0, 1.0, 2.0, 3.0], [0.0, 2.0, 4.0, 100.0]) == (2.0 + 100.0 / 3.0) / 2.0
    assert robust.theil_sen([1.0, 1.0], [0.0, 5.0]) is None  # no two distinct times
    assert robust.theil_sen([1.0], [3.0]) is None
    assert robust.theil_sen([0.0, 10.0, 20.0], [None, 1.0, 3.0]) == 0.2


def test_equals_the_pair_loop_on_random_series() -> None:
    rnd = random.Random(3)
    for _ in range(300):
        n = rnd.choice([0, 2, 3, 5, 50, 200, 201, 700])
        ts = [1.76e9 + rnd.choice([i, i * 0.37, 5.0]) for i in range(n)]
        ys = [rnd.choice([None, math.nan, math.inf, rnd.random() * 1e5, rnd.randint(0, 80000), 6e4]) for _ in range(n)]
        assert robust.theil_sen(ts, ys) == _pair_loop(ts, ys)
