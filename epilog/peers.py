"""Straggler analyses: one GPU or one node of a job slower than its peers in the same job.

Baseline-free: a GPU (node) is compared with the other GPUs (nodes) of the same run, so a
straggler is found on a template's first run. Two kinds of evidence, tried in this order:

``fwd_bwd_s`` (per rank, from the training records)
    In a synchronous data-parallel job every rank waits in the all-reduce for the
    slowest, so a slow GPU shows as the *others'* communication wait; the slow rank
    itself has the longest compute time (``fwd_bwd_s``) and the shortest ``comm_s``.
    A rank is a straggler when its median compute time is at least
    ``peer_min_rel_change`` above the median of the other ranks (robust z over them with
    the MAD floor >= ``z_threshold``) and its median comm wait is the shortest of all.
    Ranks map to GPUs per node in order (the lowest rank on a node on its lowest GPU
    index: the launchers' default binding, one rank per GPU); with another count of
    ranks than GPUs on a node, the rank alone is named.
``sm_clock_mhz`` (per GPU, from the samples)
    median SM clock over *busy* samples (utilisation >= :data:`BUSY_UTIL_PCT`) at least
    ``peer_min_rel_change`` below the median of its peers. Busy samples only: a job-wide
    data stall or a checkpoint idles every GPU at once, and idle readings (low clocks)
    would make per-GPU medians differ by chance. Power and utilisation alone are never a
    straggler: a GPU drawing less power at normal clocks does the same work.

``hard_reason_share`` (per GPU, from the samples)
    a GPU with hard clock-event reasons (thermal, HW slowdown, power brake: never part of
    a healthy run) active in at least ``throttle_active_share`` of its samples while
    its peers' median share stays under a fifth of that: the hardware slows that one GPU,
    whatever its clock deficit (a HW slowdown that costs 6 % is below the clock test's
    ``peer_min_rel_change`` but is still the GPU's fault). Job-wide reasons are
    throttling (:func:`gpuguard.epilog.causes.gpu_throttling`), not a straggler.

All must hold over at least one long window too (:func:`gpuguard.epilog.metrics.sustained`).
Rank records count only when the template's baseline is ready and either the run is slower
than it (:meth:`gpuguard.epilog.causes.Context.slower`) or the run's *rank compute spread*
(:func:`rank_compute_spread`: the slowest rank's median compute over the median of the
others, minus 1) rose against the same spread in the template's history runs by at least
:data:`SPREAD_MIN_RISE` (compared like a metric, :func:`gpuguard.epilog.compare.compare`):
ranks can differ by role (pipeline stages, the rank that computes the loss), and such a
structural imbalance is in every run — naming it would alert, then escalate to a drain,
on a healthy GPU. With the spread risen, the straggler needs only
:data:`SPREAD_MIN_RISE` over its peers, with a MAD floor of :data:`SPREAD_MAD_FLOOR`: in a
synchronous job every rank computes the same work per step, so ranks' median compute
times agree to about a per cent, run after run, and a rank a few per cent slower that was
not so in the history is the GPU (or its node). The clock
evidence needs no baseline.
Two GPUs have no majority: by records, the rank whose compute is that much longer;
by clock, the GPU that far below the other *and* flagged low against the template
baseline while the other is within it.

A node straggles when even its *best* GPU (rank) is that much worse than the median of the
other nodes' GPUs (ranks): one slow GPU does not make its node slow; or when the straggling
GPUs are at least half of one node's GPUs (at least two).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuguard.epilog import baseline as baseline_mod
from gpuguard.epilog import robust
from gpuguard.epilog.compare import Settings, Windows, deviates
from gpuguard.epilog.jobdata import GpuSeries, JobData, reasons_share
from gpuguard.epilog.metrics import sustained
from gpuguard.model import HARD_SLOWDOWN_REASONS

#: The rank compute spread must rise this much over the template's history median for
#: per-rank records to count without a slower run, and the straggler must be this far
#: above its peers (our choice: 3 points of compute time, about three times the
#: spread of ranks' median compute among healthy GPUs of one model, and half the
#: smallest change the verdict reports on a whole run).
SPREAD_MIN_RISE = 0.03
#: MAD floor (fraction of the median) for the peer test in that case (our choice: ranks'
#: median compute times over hundreds of steps agree to well under 1 %).
SPREAD_MAD_FLOOR = 0.005
#: Compared values that are not rows of the metric table: name -> (unit, description).
SPREAD_METRICS = {
    "rank_compute_spread": ("ratio", "slowest rank's median fwd_bwd_s over the median of the other ranks, minus 1"),
}

#: Peers' median hard-reason share must stay under this fraction of
#: ``throttle_active_share`` for one GPU's hard reasons to single it out (our choice: a
#: fifth; a job-wide throttle shows on every GPU and is throttling, not a straggler).
HARD_PEER_FRAC = 0.2

#: A GPU whose median utilisation over the job stays under this (percent) is *unused* by
#: the job, not a straggler: a job that allocates 4 GPUs and computes on 3 must not look
#: like a slow GPU, let alone escalate to a drain (three such jobs would drain a healthy
#: node). Same threshold as an idle GPU in the prolog's checks.
UNUSED_UTIL_PCT = 5.0
#: A sample counts as busy (its SM clock is compared) at or above this utilisation
#: (our choice: half; NVML utilisation is the share of the last sample period with a
#: kernel running, so a reading that caught a data wait or a pause is well below it).
BUSY_UTIL_PCT = 50.0


@dataclass
class Unit:
    """One GPU (or rank) of the job and how to read its value over a window."""

    node: str
    gpu_index: int | None
    gpu_uuid: str | None
    rank: int | None
    value: Callable[[float, float], float | None]
    comm: Callable[[float, float], float | None] | None = None


def peer_outlier(x: float, peers: list[float], s: Settings, worse: int) -> tuple[bool, float, float, float]:
    """Is ``x`` worse than its peers (``worse`` = -1: lower is worse, +1: higher)?
    Returns ``(outlier, z, rel, peer_median)``."""
    pm = robust.median(peers)
    if pm is None:
        return False, 0.0, 0.0, 0.0
    pmad = robust.mad(peers, pm) or 0.0
    z, _ = robust.robust_z(x, pm, pmad, s.mad_floor_frac)
    rel = robust.rel_change(x, pm)
    ok = worse * rel >= s.peer_min_rel_change and worse * z >= s.z_threshold
    return ok, z, rel, pm


def _memo(fn: Callable[[float, float], float | None]) -> Callable[[float, float], float | None]:
    """``fn`` computed once per window ``(a, b)``: the node check asks every unit's value
    over the same span once per node and over each long window once per candidate, so
    without this a 64-node job recomputes each unit's median 64 times (quadratic in the
    number of GPUs). Results are identical; memory is one float per unit and window asked."""
    cache: dict[tuple[float, float], float | None] = {}

    def value(a: float, b: float) -> float | None:
        k = (a, b)
        if k not in cache:
            cache[k] = fn(a, b)
        return cache[k]
    return value


def _busy_clock(g: GpuSeries) -> Callable[[float, float], float | None]:
    from gpuguard.epilog import colstats

    def value(a: float, b: float) -> float | None:
        i, j = g.span(a, b)
        u = g.array("util")[i:j]
        # NaN >= x is False: a sample of unknown utilisation is not a busy reading
        return colstats.median(g.array("clock")[i:j][u >= BUSY_UTIL_PCT])
    return _memo(value)


def _used(g: GpuSeries, t0: float, t1: float) -> bool:
    from gpuguard.epilog import colstats

    i, j = g.span(t0, t1)
    u = colstats.median(g.array("util")[i:j])
    return u is None or u >= UNUSED_UTIL_PCT


def gpu_units(data: JobData, t0: float, t1: float) -> list[Unit]:
    """The job's used GPUs, valued by their busy-sample SM clock."""
    return [Unit(g.node, g.gpu_index, g.gpu_uuid, None, _busy_clock(g)) for g in data.gpus
            if g.t and _used(g, t0, t1)]


def rank_units(data: JobData) -> list[Unit]:
    """The job's ranks, valued by their median ``fwd_bwd_s`` (comm: median ``comm_s``),
    each mapped to its node's GPU in rank order (module docstring). Made once per job
    (kept in ``data.window_cache``): each unit memoises its medians, and the spread, GPU
    and node checks all ask the same units (512 ranks of a 64-node job)."""
    cached = data.window_cache.get("rank_units")
    if cached is not None:
        return list(cached)
    series = data.step_columns().rank_series()  # (node, rank) -> t, fwd_bwd_s, comm_s; by t
    gpus_on: dict[str, list[GpuSeries]] = {}
    for g in data.gpus:
        gpus_on.setdefault(g.node, []).append(g)
    out = []
    for node in sorted({n for n, _ in series}):
        mine = sorted(r for n, r in series if n == node)
        gs = sorted(gpus_on.get(node, []), key=lambda g: g.gpu_index)
        for k, rank in enumerate(mine):
            g = gs[k] if len(gs) == len(mine) else None
            ts, fb, cm = series[(node, rank)]

            def phase(vals: list[float | None], ts: list[float] = ts) -> Callable[[float, float], float | None]:
                return _memo(lambda a, b: robust.median(vals[bisect.bisect_left(ts, a):bisect.bisect_left(ts, b)]))
            out.append(Unit(node, g.gpu_index if g else None, g.gpu_uuid if g else None, rank,
                            phase(fb), phase(cm)))
    data.window_cache["rank_units"] = out
    return list(out)


def rank_compute_spread(data: JobData, t0: float, t1: float) -> float | None:
    """The slowest rank's median ``fwd_bwd_s`` over ``[t0, t1)`` divided by the median of
    the other ranks' medians, minus 1 (0.05: the slowest rank computes 5 % longer);
    ``None`` with fewer than two ranks with compute times."""
    vals = robust.clean(u.value(t0, t1) for u in rank_units(data))
    if len(vals) < 2:
        return None
    vals.sort()
    pm = robust.median(vals[:-1])
    return vals[-1] / pm - 1.0 if pm else None


def _hit(u: Unit, data: JobData, metric: str, x: float, pm: float, rel: float, z: float | None, secs: float | None,
         t0: float, t1: float) -> dict[str, Any]:
    gs = [g for g in data.gpus if g.node == u.node and g.gpu_index == u.gpu_index]
    reasons = reasons_share(gs, t0, t1) if gs else {}
    return {"node": u.node, "gpu_index": u.gpu_index, "gpu_uuid": u.gpu_uuid, "rank": u.rank, "metric": metric,
            "value": round(x, 4), "peer_median": round(pm, 4), "rel_change": round(rel, 3),
            "z": None if z is None else round(z, 2), "sustained_s": None if secs is None else round(secs, 1),
            "reasons": {r: round(v, 3) for r, v in reasons.items()}}


def _outliers(units: list[Unit], data: JobData, wins: Windows, s: Settings, metric: str,
              worse: int) -> list[dict[str, Any]]:
    """Units worse than the others (>= 2 units), sustained over a long window."""
    t0, t1 = wins.span
    vals = {id(u): u.value(t0, t1) for u in units}  # type: ignore[arg-type]
    comms = {id(u): u.comm(t0, t1) for u in units if u.comm} if metric == "fwd_bwd_s" else {}  # type: ignore[arg-type]
    out = []
    for u in units:
        x = vals[id(u)]
        peers = robust.clean(vals[id(p)] for p in units if p is not u)
        if x is None or not peers:
            continue
        ok, z, rel, pm = peer_outlier(x, peers, s, worse)
        if not ok:
            continue
        if comms and comms.get(id(u)) is not None and comms[id(u)] > min(robust.clean(comms.values())):
            continue  # the slow rank is the one the others wait for: its comm wait is the shortest

        def win_value(a: float, b: float, u: Unit = u) -> float | None:
            v = u.value(a, b)
            ps = robust.clean(p.value(a, b) for p in units if p is not u)
            if v is None or not ps:
                return None
            return v if peer_outlier(v, ps, s, worse)[0] else math.nan

        held, secs = sustained(wins.windows, win_value, lambda v: not math.isnan(v))
        if held:
            out.append(_hit(u, data, metric, x, pm, rel, z, secs, t0, t1))  # type: ignore[arg-type]
    return out


def _clock_pair(units: list[Unit], data: JobData, wins: Windows, s: Settings,
                stats: Mapping[str, baseline_mod.Stat]) -> list[dict[str, Any]]:
    st = stats.get("sm_clock_mhz")
    t0, t1 = wins.span
    vals = [u.value(t0, t1) for u in units]  # type: ignore[arg-type]
    if st is None or None in vals:
        return []
    for k in (0, 1):
        x, other = vals[k], vals[1 - k]
        ok, z, rel, _ = peer_outlier(x, [other], s, -1)  # type: ignore[arg-type]
        low = deviates("sm_clock_mhz", x, st.median, st.mad, s, -1)[0]  # type: ignore[arg-type]
        other_ok = abs(robust.rel_change(other, st.median)) < s.min_rel_change  # type: ignore[arg-type]
        if ok and low and other_ok:
            h = _hit(units[k], data, "sm_clock_mhz", x, other, rel, z, None, t0, t1)  # type: ignore[arg-type]
            h["baseline_median"] = st.median
            return [h]
    return []


def _hard_share(g: GpuSeries) -> Callable[[float, float], float | None]:
    def value(a: float, b: float) -> float | None:
        i, j = g.span(a, b)
        if j <= i:
            return None
        return max((v for r, v in reasons_share([g], a, b).items() if r in HARD_SLOWDOWN_REASONS), default=0.0)
    return _memo(value)


def hard_reason_gpus(data: JobData, wins: Windows, s: Settings) -> list[dict[str, Any]]:
    """GPUs singled out by their own hard clock-event reasons (module docstring)."""
    t0, t1 = wins.span
    if t0 is None or len(data.gpus) < 2 or s.throttle_active_share <= 0:
        return []
    units = [(g, _hard_share(g)) for g in data.gpus if g.t]
    vals = {id(g): f(t0, t1) for g, f in units}  # type: ignore[arg-type]
    if not any(v for v in vals.values()):
        return []
    out = []
    for g, f in units:
        x = vals[id(g)]
        peers_ = robust.clean(vals[id(p)] for p, _ in units if p is not g)
        if x is None or x < s.throttle_active_share or not peers_:
            continue
        pm = robust.median(peers_) or 0.0
        if pm >= HARD_PEER_FRAC * s.throttle_active_share:
            continue
        held, secs = sustained(wins.windows, f, lambda v: v >= s.throttle_active_share)
        if held:
            u = Unit(g.node, g.gpu_index, g.gpu_uuid, None, f)
            out.append(_hit(u, data, "hard_reason_share", x, pm, x - pm, None, secs, t0, t1))  # type: ignore[arg-type]
    return out


def spread_settings(s: Settings) -> Settings:
    """``s`` with the peer thresholds for a rank compute spread risen against history."""
    return dataclasses.replace(s, peer_min_rel_change=min(s.peer_min_rel_change, SPREAD_MIN_RISE),
                               mad_floor_frac=min(s.mad_floor_frac, SPREAD_MAD_FLOOR))


def stragglers_gpu(data: JobData, wins: Windows, s: Settings,
                   stats: Mapping[str, baseline_mod.Stat] | None = None,
                   records: bool = True, rank_s: Settings | None = None) -> list[dict[str, Any]]:
    """Straggling GPUs (module docstring), at most one line per GPU: records first (when
    ``records``, judged with ``rank_s``, default ``s``), then clock, then hard reasons.
    Each: ``node, gpu_index, gpu_uuid, rank, metric, value, peer_median, rel_change, z,
    sustained_s, reasons``."""
    t0, t1 = wins.span
    if t0 is None:
        return []
    ranks = rank_units(data) if records else []
    hits = _outliers(ranks, data, wins, rank_s or s, "fwd_bwd_s", +1) if len(ranks) >= 2 else []
    gpus = gpu_units(data, t0, t1)  # type: ignore[arg-type]
    if len(gpus) >= 3:
        seen = {(h["node"], h["gpu_index"]) for h in hits}
        hits += [h for h in _outliers(gpus, data, wins, s, "sm_clock_mhz", -1)
                 if (h["node"], h["gpu_index"]) not in seen]
    elif len(gpus) == 2 and stats and not hits:
        hits = _clock_pair(gpus, data, wins, s, stats)
    seen = {(h["node"], h["gpu_index"]) for h in hits}
    hits += [h for h in hard_reason_gpus(data, wins, s) if (h["node"], h["gpu_index"]) not in seen]
    return hits


def _node_best(units: list[Unit], node: str, worse: int, a: float, b: float) -> float | None:
    vals = robust.clean(u.value(a, b) for u in units if u.node == node)
    if not vals:
        return None
    return min(vals) if worse > 0 else max(vals)


def stragglers_node(data: JobData, wins: Windows, gpu_hits: list[dict[str, Any]],
                    s: Settings, records: bool = True, rank_s: Settings | None = None) -> dict[str, Any] | None:
    """A straggling node of a multi-node job (module docstring): ``node, metric, value``
    (its best GPU/rank), ``others_median``, ``rel_change``, ``z``, ``sustained_s``,
    ``reasons``; or ``gpus_straggling`` with the GPU lines. ``None`` when none. Rank
    records count only with ``records`` (judged with ``rank_s``, default ``s``)."""
    t0, t1 = wins.span
    nodes = sorted({g.node for g in data.gpus} | data.step_columns().node_names())
    if len(nodes) < 2 or t0 is None:
        return None
    sources = [("fwd_bwd_s", rank_units(data), 1, rank_s or s)] if records else []
    sources.append(("sm_clock_mhz", gpu_units(data, t0, t1), -1, s))  # type: ignore[arg-type]
    for metric, units, worse, ps in sources:
        for node in nodes:
            x = _node_best(units, node, worse, t0, t1)  # type: ignore[arg-type]
            others = robust.clean(u.value(t0, t1) for u in units if u.node != node)  # type: ignore[arg-type]
            if x is None or not others:
                continue
            ok, z, rel, pm = peer_outlier(x, others, ps, worse)
            if not ok:
                continue

            def win_value(a: float, b: float, node: str = node, units: list[Unit] = units,
                          worse: int = worse, ps: Settings = ps) -> float | None:
                v = _node_best(units, node, worse, a, b)
                os_ = robust.clean(u.value(a, b) for u in units if u.node != node)
                if v is None or not os_:
                    return None
                return v if peer_outlier(v, os_, ps, worse)[0] else math.nan

            held, secs = sustained(wins.windows, win_value, lambda v: not math.isnan(v))
            if held:
                return {"node": node, "metric": metric, "value": round(x, 4), "others_median": round(pm, 4),
                        "rel_change": round(rel, 3), "z": round(z, 2), "sustained_s": round(secs, 1),
                        "reasons": {r: round(v, 3) for r, v in
                                    reasons_share([g for g in data.gpus if g.node == node], t0, t1).items()}}  # type: ignore[arg-type]
    by_node: dict[str, int] = {}
    for h in gpu_hits:
        by_node[h["node"]] = by_node.get(h["node"], 0) + 1
    if len(by_node) == 1:
        node, n = next(iter(by_node.items()))
        total = sum(1 for g in data.gpus if g.node == node)
        if n >= 2 and n * 2 >= total:
            return {"node": node, "metric": "gpus_straggling", "value": n, "of": total, "gpus": gpu_hits}
    return None
