"""The one-pass bucket metrics (epilog/window_buckets.py) equal the per-bucket
exact_window_metrics value for value, and window_metrics gives the same windows with them."""

from __future__ import annotations

import math
import random

import pytest

from gpuguard.epilog import metrics, window_buckets
from gpuguard.epilog.jobdata import SERIES_ATTR, GpuSeries, JobData, StepRec
from gpuguard.epilog.steptable import StepTable

START = 1_764_460_800.25


def _maybe(rnd: random.Random, v: float, p_none: float = 0.05) -> float | None:
    return None if rnd.random() < p_none else v


def _gpu(rnd: random.Random, node: str, idx: int, span_s: float) -> GpuSeries:
    t, x = [], START + (rnd.random() * 5 if idx else 0.0)  # GPU 0 starts the job: edges at START + 60 k
    while x < START + span_s:
        t.append(x)
        # mostly 1 s apart, some gaps of minutes, some points exactly on a bucket edge
        x += rnd.choice((1.0, 1.0, 1.0, 0.5, 2.0, 137.0)) if rnd.random() < 0.98 else 60.0
        if rnd.random() < 0.01:
            x = START + 60.0 * math.ceil((x - START) / 60.0)
    g = GpuSeries(node, idx, None, t=t, mask=[rnd.choice((0, 0, 0, 4, 8, 32, 64, 128, 4 | 32)) for _ in t])
    for attr in {*SERIES_ATTR.values(), "mem"}:
        setattr(g, attr, [_maybe(rnd, float(rnd.randint(0, 100))) for _ in t])
    return g


def _steps(rnd: random.Random, span_s: float) -> list[StepRec]:
    recs = []
    for _ in range(int(span_s * 1.5)):
        st = rnd.choice((0.0, -0.5, 0.9 + rnd.random() * 0.2, 1.0, 1.0, None, 0.95))
        recs.append(StepRec(rnd.choice(("n1", "n2", None)), rnd.choice((0, 1, 3, None)),
                            START + 0.01 + rnd.random() * span_s, st,
                            _maybe(rnd, float(rnd.choice((32, 64))), 0.3), _maybe(rnd, 1000.0 * rnd.randint(1, 9), 0.3),
                            _maybe(rnd, (st or 0) * 0.05, 0.2), _maybe(rnd, 0.7, 0.1),
                            _maybe(rnd, rnd.random() * 0.3, 0.2), _maybe(rnd, 0.05, 0.1)))
    recs.sort(key=lambda r: r.t)
    return recs


def _job(seed: int, span_s: float = 3600.0, table: bool = False) -> JobData:
    rnd = random.Random(seed)
    gpus = [_gpu(rnd, n, i, span_s) for n in ("n1", "n2") for i in range(3)]
    recs = _steps(rnd, span_s)
    ts = [g.t[0] for g in gpus] + [r.t for r in recs]
    te = [g.t[-1] for g in gpus] + [r.t for r in recs]
    steps = StepTable.of(recs) if table else recs
    return JobData("1", ["n1", "n2"], min(ts), max(te), gpus, steps, [r.t for r in recs], {}, [], [], [], {})


@pytest.mark.parametrize(("seed", "table", "gathered"), [(1, False, 10**9), (2, True, 10**9), (3, False, 10**9),
                                                        (4, True, 300)])
def test_every_bucket_equals_the_per_bucket_computation(monkeypatch: pytest.MonkeyPatch, seed: int, table: bool,
                                                        gathered: int) -> None:
    monkeypatch.setattr(window_buckets, "MAX_GATHERED", gathered)  # 300: chunks of a few buckets
    data = _job(seed, table=table)
    count = int((data.end - data.start) // 60.0) + 2
    got = window_buckets.all_bucket_metrics(data, 60.0, count)
    assert len(got) == count
    for k, vals in enumerate(got):
        a = data.start + k * 60.0
        want = metrics.exact_window_metrics(data, a, a + 60.0)
        assert vals == want, k
        assert list(vals) == list(want)
    # the fixtures reach every branch: buckets without steps, without GPU points, and full ones
    assert any(v["step_time_p50_s"] is None for v in got)
    assert any(v["throughput_per_s"] is not None and v["comm_share"] is not None for v in got)
    assert any(v["power_cap_share"] is None for v in got)
    assert any(v["thermal_share"] for v in got)
    assert data.start == START
    edges = {round((t - START) / 60.0, 9) for g in data.gpus for t in g.t if (t - START) % 60.0 == 0}
    assert len(edges) > 3  # points exactly on a bucket's edge


def test_window_metrics_unchanged_by_the_one_pass_fill(monkeypatch: pytest.MonkeyPatch) -> None:
    data = _job(5, span_s=4 * 3600.0)
    monkeypatch.setattr(metrics, "MIN_POINTS_FOR_BUCKETS", 0)
    windows = metrics.long_windows(data.start + 300, data.end + 1e-6, 600.0, 60.0)
    fast = [metrics.window_metrics(data, a, b) for a, b in windows]
    assert data.window_cache["all_buckets"] == 60.0
    lazy_data = _job(5, span_s=4 * 3600.0)
    lazy_data.window_cache["all_buckets"] = 60.0  # marks the fill done: buckets one call at a time
    lazy = [metrics.window_metrics(lazy_data, a, b) for a, b in windows]
    assert fast == lazy
    assert sum(1 for k in lazy_data.window_cache if isinstance(k, int)) < sum(
        1 for k in data.window_cache if isinstance(k, int))


def test_a_span_of_more_than_max_buckets_is_left_to_the_per_bucket_path(monkeypatch: pytest.MonkeyPatch) -> None:
    data = _job(6, span_s=1800.0)
    monkeypatch.setattr(window_buckets, "MAX_BUCKETS", 10)
    window_buckets.fill_cache(data, 60.0)
    assert [k for k in data.window_cache if isinstance(k, int)] == []
    assert data.window_cache["all_buckets"] == 60.0


@pytest.mark.parametrize(("min_points", "gathered"), [(10**9, 10**9), (10**9, 500), (0, 10**9)])
def test_many_windows_equal_window_metrics_one_at_a_time(monkeypatch: pytest.MonkeyPatch, min_points: int,
                                                         gathered: int) -> None:
    """Windows computed from their points (few points: every window; chunked when the
    gathered points pass MAX_GATHERED) and from buckets (many points) alike."""
    monkeypatch.setattr(metrics, "MIN_POINTS_FOR_BUCKETS", min_points)
    monkeypatch.setattr(window_buckets, "MAX_GATHERED", gathered)
    data = _job(7, span_s=2 * 3600.0, table=True)
    windows = [*metrics.long_windows(data.start + 300, data.end + 1e-6, 600.0, 60.0),
               (data.start, data.start + 90.0), (data.start - 500.0, data.start - 400.0)]
    got = window_buckets.many_window_metrics(data, windows)
    one = _job(7, span_s=2 * 3600.0, table=True)
    one.window_cache["all_buckets"] = 60.0
    assert got == [metrics.window_metrics(one, a, b) for a, b in windows]
    assert got[-1]["gpu_util_pct"] is None and got[-1]["step_time_p50_s"] is None
    assert got[0]["gpu_util_pct"] is not None


def test_read_buckets_column_fill_equals_the_row_merge() -> None:
    """bucket_rows.fill_columns (one mask per bucket) gives what bucket_rows.fill_rows gives."""
    from gpuguard import bucket_rows, samples

    names, maxed = list(samples.SUMMED), list(samples.MAXED)
    rnd = random.Random(8)
    width = 6 + 2 * len(names) + len(maxed)
    rows = [(k, rnd.choice((None, 0, 4, 4 | 32, 1, 256)), rnd.randint(1, 60), 1000 * k, 1000 * k + 59, 60000 * k,
             *(rnd.choice((None, rnd.randint(0, 10**6))) for _ in range(width - 6))) for k in range(500)]
    a, b = samples.Buckets(1, 0.0, 60000), samples.Buckets(1, 0.0, 60000)
    bucket_rows.fill_columns(a, rows, names, maxed)
    bucket_rows.fill_rows(b, rows, names, maxed)
    for attr in ("n", "t_min", "t_max", "t_sum", "sums", "counts", "maxes", "bits"):
        assert getattr(a, attr) == getattr(b, attr), attr
    assert sum(a.bits[4]) > 0 and sum(a.bits[256]) > 0
    empty = samples.Buckets(1, 0.0, 60000)
    bucket_rows.fill_columns(empty, [], names, maxed)
    assert empty.n == [] and all(v == [] for v in empty.bits.values())
