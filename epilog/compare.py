"""Comparing one run's metrics with its template's baseline.

One metric is compared like this (thresholds from ``[verdict]``, sources in
:data:`gpuguard.config.SCHEMA`)::

    z   = (x - median) / (1.4826 * max(MAD, mad_floor_frac * |median|))
    rel = (x - median) / |median|
    flagged = |z| >= z_threshold (3.5, Iglewicz & Hoaglin)
              and |rel| >= min_rel_change (shares: |x - median| >= share_min_abs_change too)
              and the same deviation shows over at least one long window after warm-up

:class:`Settings` is ``[verdict]``; :class:`Windows` holds the analysis span (after the
warm-up) and its long windows; :func:`compare` returns one :class:`Comparison` per
metric of :data:`gpuguard.epilog.metrics.METRICS`. Pure functions over a
:class:`~gpuguard.epilog.jobdata.JobData` and a
:class:`~gpuguard.epilog.baseline.Baseline`: no store access.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuguard.config import Config, ConfigError
from gpuguard.epilog import baseline as baseline_mod
from gpuguard.epilog import robust
from gpuguard.epilog.jobdata import JobData
from gpuguard.epilog.metrics import (
    METRICS,
    REASON_SHARES,
    REFERENCE_METRICS,
    host_rss_peak_mib,
    analysis_span,
    long_windows,
    sustained,
    window_metrics,
)


#: Metrics that are shares (of step time, of GPU samples): they must also move by
#: ``share_min_abs_change``.
SHARES = ("data_wait_share", "comm_share", *REASON_SHARES)
#: A run whose step times are still this much above the second half's median is still
#: warming up (our choice: 5 %, half the smallest change the verdict reports).
SETTLE_TOL = 0.05
#: The warm-up is never stretched past this share of the run: a run slow for longer is
#: judged as a whole (our choice: compile / autotune / sequence-length warm-up lasts
#: minutes, a slow first 40 % is something else).
MAX_SETTLE_FRAC = 0.4


@dataclass(frozen=True)
class Settings:
    """``[verdict]`` of the config. The defaults and their sources live in one place,
    :data:`gpuguard.config.SCHEMA`; build it with :meth:`from_config`."""

    warmup_s: float
    long_window_s: float
    short_window_s: float
    z_threshold: float
    mad_floor_frac: float
    min_rel_change: float
    share_min_abs_change: float
    peer_min_rel_change: float
    throttle_active_share: float
    leak_min_rise_frac: float
    escalate_codes: tuple[str, ...]
    escalate_count: int
    escalate_window_s: float

    @classmethod
    def from_config(cls, cfg: Config | None) -> Settings:
        """Read ``[verdict]``; raises :class:`ConfigError` for values out of range."""
        if cfg is None:
            from gpuguard.config import from_dict

            cfg = from_dict({})
        v = dict(cfg.values["verdict"])
        if "escalate_codes" in v:
            v["escalate_codes"] = tuple(v["escalate_codes"])
        s = cls(**{k: v[k] for k in cls.__dataclass_fields__ if k in v})
        where = cfg.path or "<config>"
        if s.warmup_s < 0 or s.long_window_s <= 0 or s.short_window_s <= 0:
            raise ConfigError(f"{where}: verdict windows must be > 0 (warmup_s >= 0)")
        if s.z_threshold <= 0 or s.mad_floor_frac < 0 or s.min_rel_change < 0:
            raise ConfigError(f"{where}: verdict.z_threshold must be > 0, mad_floor_frac and min_rel_change >= 0")
        if s.escalate_count < 1:
            raise ConfigError(f"{where}: verdict.escalate_count must be >= 1")
        return s


@dataclass
class Comparison:
    """One metric of the run against the template baseline.

    ``value``: this run (unit in :data:`gpuguard.epilog.metrics.METRICS`); ``median``,
    ``mad`` (raw MAD), ``n``: the baseline (``None``/0 when it has no value); ``z``:
    robust z (``None`` when not judged: learning, or fewer than ``min_runs`` values);
    ``rel_change``: (value - median) / |median|; ``flagged``: the deviation counts;
    ``sustained_s``: length of the long windows that showed it.
    """

    metric: str
    value: float | None
    median: float | None
    mad: float | None
    z: float | None
    rel_change: float | None
    flagged: bool
    n: int = 0
    sustained_s: float = 0.0

    @property
    def direction(self) -> int:
        """+1 above the baseline, -1 below, 0 equal or not compared."""
        if self.z is None or self.z == 0:
            return 0
        return 1 if self.z > 0 else -1

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in ("z", "rel_change"):
            if d[k] is not None and not math.isfinite(d[k]):
                d[k] = "inf" if d[k] > 0 else "-inf"
        d["unit"] = unit_of(self.metric)
        return d


def unit_of(metric: str) -> str:
    """The unit of a compared value: the metric table's, or a peer spread's
    (:data:`gpuguard.epilog.peers.SPREAD_METRICS`)."""
    if metric in METRICS:
        return METRICS[metric][0]
    if metric in REFERENCE_METRICS:
        return REFERENCE_METRICS[metric][0]
    from gpuguard.epilog.peers import SPREAD_METRICS

    return SPREAD_METRICS[metric][0]


def deviates(metric: str, x: float, med: float, mad_raw: float, s: Settings,
              sign: int = 0) -> tuple[bool, float, float]:
    z, _ = robust.robust_z(x, med, mad_raw, s.mad_floor_frac)
    rel = robust.rel_change(x, med)
    ok = abs(z) >= s.z_threshold and abs(rel) >= s.min_rel_change
    if metric in SHARES:
        ok = ok and abs(x - med) >= s.share_min_abs_change
    if sign and (z > 0) != (sign > 0):
        ok = False
    return ok, z, rel


def settled_warmup_s(data: JobData, s: Settings) -> float:
    """Seconds at the start of the job left out of the comparison: ``warmup_s``, or longer
    while the step times are still settling — compilation, autotuning and sequence-length
    warm-up can outlast any fixed ``warmup_s``. From ``warmup_s`` on, in steps of half a
    probe window (``long_window_s / 2``, at most 1/20 of the run, at least
    ``short_window_s``), the first window whose median step time is within
    :data:`SETTLE_TOL` of the median over the second half of the run ends the warm-up. A
    run still that slow at :data:`MAX_SETTLE_FRAC` of its length keeps ``warmup_s`` (it is
    judged as a whole). Without step records: ``warmup_s``.

    A *short run* — one whose ``warmup_s`` is more than :data:`MAX_SETTLE_FRAC` of it
    (cancelled, at its time limit, a test run; under 12.5 minutes with the default 5) —
    would be judged on a sliver after ``warmup_s``, or on all of it, warm-up included, when
    it ends inside it. Its warm-up is where its step times settle instead: the same probe
    windows from the job's start, against the median over the last third of the run (the
    second half of a short run can still hold warm-up), up to one probe window before the
    end; never later than ``warmup_s``. A short run that never settles keeps ``warmup_s``."""
    if data.start is None or data.end is None or not data.steps:
        return s.warmup_s
    dur = data.end - data.start
    short = s.warmup_s > MAX_SETTLE_FRAC * dur
    ref_from = data.start + (2 * dur / 3 if short else dur / 2)
    ref = robust.median(data.step_columns(ref_from, data.end + 1.0).column("step_time_s"))
    if not ref:
        return s.warmup_s
    probe = max(s.short_window_s, min(s.long_window_s / 2, dur / 20))
    if short:  # probe windows starting from the job's start to one probe before its end, at most warmup_s
        t, last_start = data.start, min(data.start + s.warmup_s, data.end - probe)
    else:
        t, last_start = data.start + s.warmup_s, data.start + MAX_SETTLE_FRAC * dur - probe
    while t <= last_start:
        m = robust.median(data.step_columns(t, t + probe).column("step_time_s"))
        if m is None and short:  # before the first step (CUDA/NCCL init): not settled yet
            t += probe / 2
            continue
        if m is None or m <= ref * (1.0 + SETTLE_TOL):
            return t - data.start
        t += probe / 2
    return s.warmup_s


class Windows:
    """The analysis span (after the warm-up, :func:`settled_warmup_s`), its long windows
    and their metrics, computed once on demand."""

    def __init__(self, data: JobData, s: Settings):
        self.data = data
        self.warmup_s = settled_warmup_s(data, s)
        t0, t1 = analysis_span(data, self.warmup_s)
        self.span = (t0, t1)
        self.windows = long_windows(t0, t1, s.long_window_s, s.short_window_s) if t0 is not None else []
        self._metrics: dict[tuple[float, float], dict[str, float | None]] = {}

    def metric(self, name: str) -> Callable[[float, float], float | None]:
        def value(a: float, b: float) -> float | None:
            if not self._metrics and self.windows:  # every window at once: numpy passes, equal values
                from gpuguard.epilog.window_buckets import many_window_metrics

                self._metrics.update(zip(self.windows, many_window_metrics(self.data, self.windows), strict=True))
            if (a, b) not in self._metrics:
                self._metrics[(a, b)] = window_metrics(self.data, a, b)
            return self._metrics[(a, b)].get(name)
        return value


def compare(metrics: Mapping[str, float | None], base: baseline_mod.Baseline, wins: Windows,
            s: Settings, min_runs: int) -> list[Comparison]:
    """Compare each metric with the baseline (see the module docstring)."""
    out = []
    judged = base.state == baseline_mod.READY
    for m in METRICS:
        x = metrics.get(m)
        st = base.stats.get(m)
        if x is None or st is None:
            out.append(Comparison(m, x, st.median if st else None, st.mad if st else None, None, None, False,
                                  st.n if st else 0))
            continue
        rel = robust.rel_change(x, st.median)
        if not judged or st.n < min_runs:
            out.append(Comparison(m, x, st.median, st.mad, None, rel, False, st.n))
            continue
        dev, z, rel = deviates(m, x, st.median, st.mad, s)
        held = 0.0
        if dev and METRICS[m][1]:
            sign = 1 if z > 0 else -1
            dev, held = sustained(wins.windows, wins.metric(m),
                                  lambda v, m=m, st=st, sign=sign: deviates(m, v, st.median, st.mad, s, sign)[0])
        elif dev:
            held = (wins.span[1] or 0) - (wins.span[0] or 0)
        out.append(Comparison(m, x, st.median, st.mad, z, rel, dev, st.n, round(held, 1)))
    out += compare_spreads(base, wins, s, min_runs)
    out += reference_values(wins.data, base)
    return out


def reference_values(data: JobData, base: baseline_mod.Baseline) -> list[Comparison]:
    """The run's :data:`~gpuguard.epilog.metrics.REFERENCE_METRICS` beside the baseline's
    median of them: never judged (``z`` None, not flagged); a detector reads the median."""
    out = []
    dur = data.end - data.start if data.start is not None and data.end is not None else None
    for m, x in (("host_rss_peak_mib", host_rss_peak_mib(data)), ("run_duration_s", dur)):
        st = base.stats.get(m)
        out.append(Comparison(m, x, st.median if st else None, st.mad if st else None, None,
                              robust.rel_change(x, st.median) if st and x is not None else None, False,
                              st.n if st else 0))
    return out


def compare_spreads(base: baseline_mod.Baseline, wins: Windows, s: Settings, min_runs: int) -> list[Comparison]:
    """The run's peer spreads (:data:`gpuguard.epilog.peers.SPREAD_METRICS`) against the
    same spreads in the template's history runs: flagged when at least
    :data:`gpuguard.epilog.peers.SPREAD_MIN_RISE` above the history median with robust z
    >= ``z_threshold`` (MAD floor :data:`gpuguard.epilog.peers.SPREAD_MAD_FLOOR` of the
    median, and never under a tenth of the rise: a spread of a few tenths of a per cent
    has no meaningful relative floor). Up only: a smaller spread is no anomaly."""
    from gpuguard.epilog import peers

    t0, t1 = wins.span
    x = peers.rank_compute_spread(wins.data, t0, t1) if t0 is not None else None  # type: ignore[arg-type]
    st = base.stats.get("rank_compute_spread")
    m = "rank_compute_spread"
    if x is None or st is None:
        return [Comparison(m, x, st.median if st else None, st.mad if st else None, None, None, False,
                           st.n if st else 0)]
    rel = robust.rel_change(x, st.median)
    if base.state != baseline_mod.READY or st.n < min_runs:
        return [Comparison(m, x, st.median, st.mad, None, rel, False, st.n)]
    scale = 1.4826 * max(st.mad, peers.SPREAD_MAD_FLOOR * abs(1.0 + st.median), peers.SPREAD_MIN_RISE / 10)
    z = (x - st.median) / scale
    flagged = z >= s.z_threshold and x - st.median >= peers.SPREAD_MIN_RISE
    return [Comparison(m, x, st.median, st.mad, z, rel, flagged, st.n,
                       round((t1 or 0) - (t0 or 0), 1) if flagged else 0.0)]

