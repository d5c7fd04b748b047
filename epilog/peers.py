"""Straggler analyses: one GPU or one node of a job slower than its peers in the same job.

Baseline-free: a GPU (node) is compared with the other GPUs (nodes) of the same run, so a
straggler is found on a template's first run. Thresholds: ``[verdict]
peer_min_rel_change`` and ``z_threshold`` (robust z over the peers with the MAD floor),
sustained over at least one long window (:mod:`gpuguard.epilog.compare`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from gpuguard.epilog import baseline as baseline_mod
from gpuguard.epilog import robust
from gpuguard.epilog.compare import Settings, Windows, deviates
from gpuguard.epilog.jobdata import GpuSeries, JobData, reasons_share
from gpuguard.epilog.metrics import sustained


_PEER_FIELDS = (("clock", "sm_clock_mhz"), ("power", "power_w"), ("util", "gpu_util_pct"))


def _gpu_value(g: GpuSeries, attr: str, a: float, b: float) -> float | None:
    i, j = g.span(a, b)
    return robust.median(getattr(g, attr)[i:j])


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


def _stragglers_pair(gpus: list[GpuSeries], wins: Windows, s: Settings,
                     stats: Mapping[str, baseline_mod.Stat]) -> list[dict[str, Any]]:
    """Two GPUs have no majority: one straggles when it is ``peer_min_rel_change`` below
    the other *and* flagged low against the template baseline while the other is not."""
    t0, t1 = wins.span
    for attr, metric in _PEER_FIELDS:
        st = stats.get(metric)
        if st is None:
            continue
        vals = [_gpu_value(g, attr, t0, t1) for g in gpus]  # type: ignore[arg-type]
        if None in vals:
            continue
        for k in (0, 1):
            x, other = vals[k], vals[1 - k]
            ok, z, rel, _ = peer_outlier(x, [other], s, -1)  # type: ignore[arg-type]
            low = deviates(metric, x, st.median, st.mad, s, -1)[0]  # type: ignore[arg-type]
            other_ok = abs(robust.rel_change(other, st.median)) < s.min_rel_change  # type: ignore[arg-type]
            if ok and low and other_ok:
                g = gpus[k]
                reasons = reasons_share([g], t0, t1)  # type: ignore[arg-type]
                return [{"node": g.node, "gpu_index": g.gpu_index, "gpu_uuid": g.gpu_uuid, "metric": metric,
                         "value": round(x, 2), "peer_median": round(other, 2), "rel_change": round(rel, 3),  # type: ignore[arg-type]
                         "z": round(z, 2), "baseline_median": st.median, "sustained_s": None,
                         "reasons": {r: round(v, 3) for r, v in reasons.items()}}]
    return []


#: A GPU whose median utilisation over the job stays under this (percent) is *unused* by
#: the job, not a straggler: a job that allocates 4 GPUs and computes on 3 must not look
#: like a slow GPU, let alone escalate to a drain (three such jobs would drain a healthy
#: node). Same threshold as an idle GPU in the prolog's checks.
UNUSED_UTIL_PCT = 5.0


def _used(g: GpuSeries, t0: float, t1: float) -> bool:
    u = _gpu_value(g, "util", t0, t1)
    return u is None or u >= UNUSED_UTIL_PCT


def stragglers_gpu(data: JobData, wins: Windows, s: Settings,
                    stats: Mapping[str, baseline_mod.Stat] | None = None) -> list[dict[str, Any]]:
    if wins.span[0] is None:
        return []
    gpus = [g for g in data.gpus if g.t and _used(g, *wins.span)]
    if len(gpus) == 2 and stats:
        return _stragglers_pair(gpus, wins, s, stats)
    if len(gpus) < 3:
        return []
    t0, t1 = wins.span
    out = []
    for g in gpus:
        for attr, metric in _PEER_FIELDS:
            x = _gpu_value(g, attr, t0, t1)
            peers = robust.clean(_gpu_value(p, attr, t0, t1) for p in gpus if p is not g)
            if x is None or len(peers) < 2:
                continue
            ok, z, rel, pm = peer_outlier(x, peers, s, -1)
            if not ok:
                continue

            def win_value(a: float, b: float, g: GpuSeries = g, attr: str = attr) -> float | None:
                v = _gpu_value(g, attr, a, b)
                ps = robust.clean(_gpu_value(p, attr, a, b) for p in gpus if p is not g)
                if v is None or len(ps) < 2:
                    return None
                return v if peer_outlier(v, ps, s, -1)[0] else math.nan

            held, secs = sustained(wins.windows, win_value, lambda v: not math.isnan(v))
            if not held:
                continue
            reasons = reasons_share([g], t0, t1)
            out.append({"node": g.node, "gpu_index": g.gpu_index, "gpu_uuid": g.gpu_uuid, "metric": metric,
                        "value": round(x, 2), "peer_median": round(pm, 2), "rel_change": round(rel, 3),
                        "z": round(z, 2), "sustained_s": round(secs, 1),
                        "reasons": {r: round(v, 3) for r, v in reasons.items()}})
            break  # one line per GPU: the first metric that shows it (clock, power, util)
    return out


def stragglers_node(data: JobData, wins: Windows, gpu_hits: list[dict[str, Any]],
                     s: Settings) -> dict[str, Any] | None:
    nodes = sorted({g.node for g in data.gpus} | {r.node for r in data.steps if r.node})
    if len(nodes) < 2 or wins.span[0] is None:
        return None
    t0, t1 = wins.span

    def node_value(node: str, what: str, a: float, b: float) -> float | None:
        if what == "fwd_bwd_s":
            return robust.median(r.fwd_bwd_s for r in data.steps_between(a, b) if r.node == node)
        vals: list[float | None] = []
        for g in data.gpus:
            if g.node == node:
                i, j = g.span(a, b)
                vals.extend(g.clock[i:j])
        return robust.median(vals)

    for what, worse in (("fwd_bwd_s", 1), ("sm_clock_mhz", -1)):
        for node in nodes:
            x = node_value(node, what, t0, t1)
            others = robust.clean(node_value(n, what, t0, t1) for n in nodes if n != node)
            if x is None or not others:
                continue
            ok, z, rel, pm = peer_outlier(x, others, s, worse)
            if not ok:
                continue

            def win_value(a: float, b: float, node: str = node, what: str = what, worse: int = worse) -> float | None:
                v = node_value(node, what, a, b)
                os_ = robust.clean(node_value(n, what, a, b) for n in nodes if n != node)
                if v is None or not os_:
                    return None
                return v if peer_outlier(v, os_, s, worse)[0] else math.nan

            held, secs = sustained(wins.windows, win_value, lambda v: not math.isnan(v))
            if held:
                return {"node": node, "metric": what, "value": round(x, 4), "others_median": round(pm, 4),
                        "rel_change": round(rel, 3), "z": round(z, 2), "sustained_s": round(secs, 1),
                        "reasons": {r: round(v, 3) for r, v in
                                    reasons_share([g for g in data.gpus if g.node == node], t0, t1).items()}}
    by_node: dict[str, int] = {}
    for h in gpu_hits:
        by_node[h["node"]] = by_node.get(h["node"], 0) + 1
    if len(by_node) == 1:
        node, n = next(iter(by_node.items()))
        total = sum(1 for g in data.gpus if g.node == node)
        if n >= 2 and n * 2 >= total:
            return {"node": node, "metric": "gpus_straggling", "value": n, "of": total, "gpus": gpu_hits}
    return None
