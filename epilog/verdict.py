"""The verdict: did this run go the way runs of its template go, and if not, why?

:func:`judge_job` reads the job's time series (:mod:`gpuguard.epilog.jobdata`), computes
its summary metrics (:mod:`gpuguard.epilog.metrics`), compares each with the template's
baseline (:mod:`gpuguard.epilog.baseline`) and names **one** primary cause with its
evidence; other causes that also showed are listed in ``also``.

Comparison of one metric (thresholds from ``[verdict]``, sources in
:data:`gpuguard.config.SCHEMA`)::

    z   = (x - median) / (1.4826 * max(MAD, mad_floor_frac * |median|))
    rel = (x - median) / |median|
    flagged = |z| >= z_threshold (3.5, Iglewicz & Hoaglin)
              and |rel| >= min_rel_change (shares: |x - median| >= share_min_abs_change too)
              and the same deviation shows over at least one long window after warm-up

Causes, in the order they are tried (the first that holds is primary):

``hardware-fault``
    XID/SXid events the catalog does not mark ``record`` (application errors), volatile
    uncorrectable ECC growth in the samples, or critical / hardware findings (``gpu.lost``,
    ``ecc.*``, ``xid.*``, ``nvlink.link_down``) on the job's nodes during the job.
``straggler-node``
    multi-node job: one node's median compute time per step (``fwd_bwd_s``) or SM clock
    at least ``peer_min_rel_change`` worse than the median of the other nodes (robust z
    over the others with the MAD floor), sustained; or the straggling GPUs are most of
    one node's GPUs.
``straggler-gpu``
    one GPU's SM clock, power or utilisation at least ``peer_min_rel_change`` below the
    median of its peers in the same job (>= 3 GPUs), sustained. No baseline needed. With
    two GPUs (no majority) one straggles when it is that far below the other, flagged
    low against the template baseline, and the other is within it.
``gpu-throttling``
    SM clock flagged down against the baseline with slowdown reasons (power cap, thermal,
    HW slowdown, power brake; named with their share of samples) active in at least
    ``throttle_active_share`` of GPU samples — or with a slowdown in step time when no
    reason is reported; or, without a baseline, thermal / HW slowdown / power-brake
    reasons active in that share over a long window.
``memory-leak``
    GPU memory (per GPU) or host RSS (per node) rising steadily after warm-up: Theil–Sen
    slope > 0, rise over the span >= ``leak_min_rise_frac`` of capacity (GPU; from the
    product name) or of the starting level (host), each quarter of the span higher than
    the last by >= 15 % of the rise, and the second half still rising at >= half the
    slope — an allocator that grows and then plateaus fails the last two tests. The
    projection says when it reaches capacity.
``data-pipeline``
    step time p50/p95 flagged up (or throughput down) with the data-wait share flagged up;
    GPU utilisation down is named when flagged.
``communication``
    step time up (or throughput down) with the communication share flagged up. (A node
    NCCL baseline is not recorded yet: the evidence says so.)
``job-changed``
    step time or throughput flagged (either way), or the memory peak flagged, with none
    of the signals above: the job itself differs.
``healthy``
    nothing above; flagged metrics that explain nothing (temperature alone, ...) are
    listed in the evidence as ``unexplained``.

Below ``[baseline] min_runs`` baseline runs the template is ``learning``: no metric is
judged against the baseline; the baseline-free causes (hardware fault, stragglers,
memory leak, hard throttling) are still named, otherwise the cause is ``learning``.

Node change-log context: ``inventory_changes`` on the job's nodes since the oldest run
of the baseline (driver, CUDA, VBIOS, InfoROM ... changed) go into ``context``.

Findings: :func:`verdict_findings` turns a verdict into ``verdict.<cause>`` findings;
:func:`act_on_verdict` maps them through the policy table with escalation (the same GPU
straggling in ``escalate_count`` jobs within ``escalate_window_s`` -> ``drain``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuguard import policy as policy_mod
from gpuguard.config import Config, ConfigError
from gpuguard.epilog import baseline as baseline_mod
from gpuguard.epilog import robust
from gpuguard.epilog.jobdata import (
    SLOWDOWN_REASONS,
    GpuSeries,
    JobData,
    ecc_growth,
    load_job,
    reasons_share,
)
from gpuguard.epilog.metrics import (
    METRICS,
    analysis_span,
    job_metrics,
    long_windows,
    sustained,
    window_metrics,
)
from gpuguard.epilog.template import Template, job_template
from gpuguard.model import Finding

CAUSES = ("healthy", "data-pipeline", "communication", "gpu-throttling", "straggler-gpu", "straggler-node",
          "hardware-fault", "memory-leak", "job-changed")
LEARNING = "learning"
#: Reasons that are never part of a healthy run (power cap is: GPUs at TDP run capped).
HARD_REASONS = ("hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")
_SHARES = ("data_wait_share", "comm_share")
_PERF_UP = ("step_time_p50_s", "step_time_p95_s")

#: Finding severity per cause; with no ``[policy]`` line the policy table falls back by
#: severity (warning -> alert, info -> record, unknown critical -> alert, never drain).
FINDING_SEVERITY = {
    "hardware-fault": "critical",  # the XID/ECC finding itself drains; this one explains the job
    "straggler-gpu": "warning",
    "straggler-node": "warning",
    "gpu-throttling": "warning",
    "memory-leak": "warning",
    "communication": "warning",
    "data-pipeline": "info",
    "job-changed": "info",
}


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
        d["unit"] = METRICS[self.metric][0]
        return d


@dataclass
class Verdict:
    """The verdict on one job.

    ``cause``: one of :data:`CAUSES` or ``learning``; ``state``: ``learning`` or
    ``judged``; ``summary``: one line; ``evidence``: the numbers behind the cause
    (JSON-ready); ``also``: other causes that showed; ``comparisons``: every metric;
    ``context``: node change-log rows since the baseline's runs; ``baseline_runs``: how
    many runs the baseline rests on.
    """

    job_id: str
    template: str
    cause: str
    state: str
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)
    comparisons: list[Comparison] = field(default_factory=list)
    also: list[str] = field(default_factory=list)
    context: list[dict[str, Any]] = field(default_factory=list)
    baseline_runs: int = 0
    template_source: str = "derived"
    nodes: list[str] = field(default_factory=list)
    start: float | None = None
    end: float | None = None

    @property
    def anomalous(self) -> bool:
        """True for every cause but ``healthy`` and ``learning``."""
        return self.cause not in baseline_mod.BASELINE_CAUSES

    def comparison(self, metric: str) -> Comparison | None:
        return next((c for c in self.comparisons if c.metric == metric), None)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``gpuguard job show --json``)."""
        return {
            "job_id": self.job_id, "template": self.template, "template_source": self.template_source,
            "state": self.state, "cause": self.cause, "summary": self.summary, "evidence": self.evidence,
            "also": self.also, "baseline_runs": self.baseline_runs, "context": self.context,
            "nodes": self.nodes, "start": self.start, "end": self.end,
            "comparisons": [c.to_dict() for c in self.comparisons],
        }


# -- comparison ---------------------------------------------------------------------------
def _deviates(metric: str, x: float, med: float, mad_raw: float, s: Settings,
              sign: int = 0) -> tuple[bool, float, float]:
    z, _ = robust.robust_z(x, med, mad_raw, s.mad_floor_frac)
    rel = robust.rel_change(x, med)
    ok = abs(z) >= s.z_threshold and abs(rel) >= s.min_rel_change
    if metric in _SHARES:
        ok = ok and abs(x - med) >= s.share_min_abs_change
    if sign and (z > 0) != (sign > 0):
        ok = False
    return ok, z, rel


class _Windows:
    """Long windows after the warm-up and their metrics, computed once on demand."""

    def __init__(self, data: JobData, s: Settings):
        self.data = data
        t0, t1 = analysis_span(data, s.warmup_s)
        self.span = (t0, t1)
        self.windows = long_windows(t0, t1, s.long_window_s, s.short_window_s) if t0 is not None else []
        self._metrics: dict[tuple[float, float], dict[str, float | None]] = {}

    def metric(self, name: str) -> Callable[[float, float], float | None]:
        def value(a: float, b: float) -> float | None:
            if (a, b) not in self._metrics:
                self._metrics[(a, b)] = window_metrics(self.data, a, b)
            return self._metrics[(a, b)].get(name)
        return value


def compare(metrics: Mapping[str, float | None], base: baseline_mod.Baseline, wins: _Windows,
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
        dev, z, rel = _deviates(m, x, st.median, st.mad, s)
        held = 0.0
        if dev and METRICS[m][1]:
            sign = 1 if z > 0 else -1
            dev, held = sustained(wins.windows, wins.metric(m),
                                  lambda v, m=m, st=st, sign=sign: _deviates(m, v, st.median, st.mad, s, sign)[0])
        elif dev:
            held = (wins.span[1] or 0) - (wins.span[0] or 0)
        out.append(Comparison(m, x, st.median, st.mad, z, rel, dev, st.n, round(held, 1)))
    return out


# -- baseline-free analyses ----------------------------------------------------------------
def _hardware(data: JobData) -> dict[str, Any] | None:
    ecc = {g.key: ecc_growth(g) for g in data.gpus if ecc_growth(g) > 0}
    if not (data.hw_events or data.hw_findings or ecc):
        return None
    ev = [{"at": e["at"], "node": e["node"], "kind": e["kind"], "code": e["code"], "gpu_index": e["gpu_index"],
           "action": e.get("action"), "message": (e.get("message") or "")[:200]} for e in data.hw_events[:20]]
    fi = [{"at": f["at"], "node": f["node"], "code": f["code"], "severity": f["severity"],
           "gpu_index": f["gpu_index"], "message": (f.get("message") or "")[:200]} for f in data.hw_findings[:20]]
    parts = [f"{e['kind'].upper()} {e['code']} on {e['node']} gpu{e['gpu_index']}" for e in ev[:3]]
    parts += [f"{f['code']} on {f['node']} gpu{f['gpu_index']}" for f in fi[:3]]
    parts += [f"{k}: volatile uncorrectable ECC +{n}" for k, n in ecc.items()]
    return {"events": ev, "findings": fi, "ecc_uncorrected_growth": ecc, "text": "; ".join(parts[:4])}


_PEER_FIELDS = (("clock", "sm_clock_mhz"), ("power", "power_w"), ("util", "gpu_util_pct"))


def _gpu_value(g: GpuSeries, attr: str, a: float, b: float) -> float | None:
    i, j = g.span(a, b)
    return robust.median(getattr(g, attr)[i:j])


def _peer_outlier(x: float, peers: list[float], s: Settings, worse: int) -> tuple[bool, float, float, float]:
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


def _stragglers_pair(gpus: list[GpuSeries], wins: _Windows, s: Settings,
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
            ok, z, rel, _ = _peer_outlier(x, [other], s, -1)  # type: ignore[arg-type]
            low = _deviates(metric, x, st.median, st.mad, s, -1)[0]  # type: ignore[arg-type]
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
#: like a slow GPU, let alone escalate to a drain (found in review: 3 such jobs drained a
#: healthy node). Same threshold as an idle GPU in the prolog's checks.
UNUSED_UTIL_PCT = 5.0


def _used(g: GpuSeries, t0: float, t1: float) -> bool:
    u = _gpu_value(g, "util", t0, t1)
    return u is None or u >= UNUSED_UTIL_PCT


def _stragglers_gpu(data: JobData, wins: _Windows, s: Settings,
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
            ok, z, rel, pm = _peer_outlier(x, peers, s, -1)
            if not ok:
                continue

            def win_value(a: float, b: float, g: GpuSeries = g, attr: str = attr) -> float | None:
                v = _gpu_value(g, attr, a, b)
                ps = robust.clean(_gpu_value(p, attr, a, b) for p in gpus if p is not g)
                if v is None or len(ps) < 2:
                    return None
                return v if _peer_outlier(v, ps, s, -1)[0] else math.nan

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


def _stragglers_node(data: JobData, wins: _Windows, gpu_hits: list[dict[str, Any]],
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
            ok, z, rel, pm = _peer_outlier(x, others, s, worse)
            if not ok:
                continue

            def win_value(a: float, b: float, node: str = node, what: str = what, worse: int = worse) -> float | None:
                v = node_value(node, what, a, b)
                os_ = robust.clean(node_value(n, what, a, b) for n in nodes if n != node)
                if v is None or not os_:
                    return None
                return v if _peer_outlier(v, os_, s, worse)[0] else math.nan

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


def _leak_of(ts: list[float], ys: list[float | None], t0: float, t1: float, capacity: float | None,
             s: Settings) -> dict[str, Any] | None:
    pts = [(t, y) for t, y in zip(ts, ys, strict=True) if t0 <= t < t1 and y is not None]
    if len(pts) < 8 or pts[-1][0] - pts[0][0] < s.long_window_s:
        return None
    tt = [p[0] for p in pts]
    yy = [p[1] for p in pts]
    slope = robust.theil_sen(tt, yy)
    if not slope or slope <= 0:
        return None
    span = tt[-1] - tt[0]
    rise = slope * span
    n = len(pts)
    q = [robust.median(yy[k * n // 4:(k + 1) * n // 4]) for k in range(4)]
    start_level = q[0] or 0.0
    ref = capacity if capacity else start_level
    if not ref or rise < s.leak_min_rise_frac * ref:
        return None
    total = q[3] - q[0]  # type: ignore[operator]
    if total <= 0 or any(q[k + 1] - q[k] < 0.15 * total for k in range(3)):  # type: ignore[operator]
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


def _memory_leak(data: JobData, wins: _Windows, s: Settings) -> dict[str, Any] | None:
    t0, t1 = wins.span
    if t0 is None:
        return None
    hits = []
    for g in data.gpus:
        r = _leak_of(g.t, g.mem, t0, t1, data.mem_total_mib.get(g.key), s)
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


def _hard_throttle(data: JobData, wins: _Windows, s: Settings) -> dict[str, Any] | None:
    if wins.span[0] is None or not data.gpus:
        return None

    def share(a: float, b: float) -> float | None:
        sh = reasons_share(data.gpus, a, b)
        hard = [v for r, v in sh.items() if r in HARD_REASONS]
        return max(hard) if hard else 0.0

    held, secs = sustained(wins.windows, share, lambda v: v >= s.throttle_active_share)
    if not held:
        return None
    return {"reasons": _named_reasons(data, wins), "sustained_s": round(secs, 1)}


def _named_reasons(data: JobData, wins: _Windows) -> dict[str, float]:
    t0, t1 = wins.span
    return {r: round(v, 3) for r, v in reasons_share(data.gpus, t0, t1).items() if v >= 0.05}  # type: ignore[arg-type]


# -- the verdict ------------------------------------------------------------------------------
def _fmt(c: Comparison) -> str:
    unit = METRICS[c.metric][0]
    rel = "" if c.rel_change is None or not math.isfinite(c.rel_change) else f" ({c.rel_change:+.0%})"
    return f"{c.metric} {c.value:.4g} {unit} vs {c.median:.4g}{rel}"


def _decide(data: JobData, comps: list[Comparison], base: baseline_mod.Baseline, wins: _Windows,
            s: Settings) -> tuple[str, str, dict[str, Any], list[str]]:
    judged = base.state == baseline_mod.READY
    by = {c.metric: c for c in comps}

    def up(m: str) -> bool:
        c = by.get(m)
        return bool(c and c.flagged and c.direction > 0)

    def down(m: str) -> bool:
        c = by.get(m)
        return bool(c and c.flagged and c.direction < 0)

    flagged = [c for c in comps if c.flagged]
    perf_worse = any(up(m) for m in _PERF_UP) or down("throughput_per_s")
    found: list[tuple[str, str, dict[str, Any]]] = []

    hw = _hardware(data)
    if hw:
        found.append(("hardware-fault", f"hardware fault during the job: {hw['text']}", hw))
    gpu_hits = _stragglers_gpu(data, wins, s, base.stats if judged else None)
    node_hit = _stragglers_node(data, wins, gpu_hits, s)
    if node_hit:
        found.append(("straggler-node", f"node {node_hit['node']} straggles: {node_hit['metric']} "
                      f"{node_hit['value']} vs {node_hit.get('others_median', '-')} on the other nodes", node_hit))
    if gpu_hits:
        h = gpu_hits[0]
        rs = ", ".join(h["reasons"]) or "no slowdown reason reported"
        found.append(("straggler-gpu", f"{h['node']} GPU {h['gpu_index']} straggles: {h['metric']} {h['value']} "
                      f"vs peers {h['peer_median']} ({h['rel_change']:+.0%}); {rs}", {"gpus": gpu_hits}))
    reasons = _named_reasons(data, wins)
    slow_share = max((v for r, v in reasons.items() if r in SLOWDOWN_REASONS), default=0.0)
    if down("sm_clock_mhz") and (slow_share >= s.throttle_active_share or perf_worse):
        c = by["sm_clock_mhz"]
        rs = ", ".join(f"{r} {v:.0%}" for r, v in reasons.items()) or "no reason reported (application clocks?)"
        found.append(("gpu-throttling", f"SM clock down: {_fmt(c)}; active: {rs}",
                      {"reasons": reasons, "sm_clock": c.to_dict()}))
    else:
        hard = _hard_throttle(data, wins, s)
        if hard:
            rs = ", ".join(f"{r} {v:.0%}" for r, v in hard["reasons"].items())
            found.append(("gpu-throttling", f"GPU slowdown reasons active: {rs}", hard))
    leak = _memory_leak(data, wins, s)
    if leak:
        w = leak["worst"]
        proj = f", full in {w['hours_to_full']} h" if w["hours_to_full"] is not None else ""
        found.append(("memory-leak", f"{w['where']} memory rising {w['slope_mib_per_h']} MiB/h after warm-up "
                      f"({w['start_mib']} -> {w['last_mib']} MiB){proj}", leak))
    if judged:
        dw, cm = up("data_wait_share"), up("comm_share")
        if perf_worse and (dw or cm):
            dw_d = by["data_wait_share"].value - by["data_wait_share"].median if dw else -1.0  # type: ignore[operator]
            cm_d = by["comm_share"].value - by["comm_share"].median if cm else -1.0  # type: ignore[operator]
            perf = [_fmt(by[m]) for m in (*_PERF_UP, "throughput_per_s") if by[m].flagged]
            if dw_d >= cm_d:
                ev = {"data_wait_share": by["data_wait_share"].to_dict(), "performance": perf}
                if down("gpu_util_pct"):
                    ev["gpu_util"] = by["gpu_util_pct"].to_dict()
                util = f"; {_fmt(by['gpu_util_pct'])}" if down("gpu_util_pct") else ""
                found.append(("data-pipeline", f"waiting for data: {_fmt(by['data_wait_share'])}; "
                              f"{perf[0]}{util}", ev))
            else:
                found.append(("communication", f"communication: {_fmt(by['comm_share'])}; {perf[0]}",
                              {"comm_share": by["comm_share"].to_dict(), "performance": perf,
                               "node_nccl_baseline": None}))
            if dw and cm:
                other = "communication" if dw_d >= cm_d else "data-pipeline"
                found.append((other, "", {}))
        changed = [c for c in flagged if c.metric in (*_PERF_UP, "throughput_per_s", "mem_peak_mib")]
        if not data.has_steps:
            changed += [c for c in flagged if c.metric == "gpu_util_pct"]
        if leak:
            changed = [c for c in changed if c.metric != "mem_peak_mib"]
        if changed and not found:
            found.append(("job-changed", "the job itself changed: " + "; ".join(_fmt(c) for c in changed[:3])
                          + " with clocks, data wait and communication as usual",
                          {"changed": [c.to_dict() for c in changed]}))
    if found:
        cause, summary, ev = found[0]
        also = []
        # A straggler or a throttled GPU makes the others wait in the all-reduce: the
        # communication share rises as a consequence, not as a second cause.
        hidden = {"communication"} if cause in ("straggler-gpu", "straggler-node", "gpu-throttling") else set()
        for f in found[1:]:
            if f[0] != cause and f[0] not in also and f[0] not in hidden:
                also.append(f[0])
        ev = dict(ev)
        ev["flagged"] = [c.metric for c in flagged]
        return cause, summary, ev, also
    unexplained = [c.metric for c in flagged]
    ev = {"flagged": [], "unexplained": unexplained} if unexplained else {"flagged": []}
    if not judged:
        return LEARNING, "template still learning: nothing judged against a baseline", ev, []
    msg = "as usual: every metric within its baseline"
    if unexplained:
        msg = "no cause: " + ", ".join(unexplained) + " moved without a performance effect"
    return "healthy", msg, ev, []


def _context(store: Any, nodes: list[str], since: float | None, until: float | None) -> list[dict[str, Any]]:
    if not nodes or since is None:
        return []
    q = ",".join("?" * len(nodes))
    try:
        rows = store.query(
            f"select at, node, uuid, gpu_index, field, old, new from inventory_changes where node in ({q}) "
            "and at >= ? and at <= ? order by at", [*nodes, since, (until or time.time()) + 300.0])
    except Exception:  # context only: a store without the table or a read error loses nothing
        return []
    return rows[:50]


def judge_job(store: Any, job_id: str, *, cfg: Config | None, template: Template | str,
              nodes: list[str] | None = None, exit_code: int | None = None, record: bool = True,
              now: float | None = None, data: JobData | None = None) -> Verdict:
    """Judge job ``job_id`` against ``template``'s baseline and (``record``) store the
    verdict and comparisons, then refresh the baseline when the run is fit for it.

    ``store``: an open :class:`gpuguard.store.Store` holding the job's samples/steps and
    the baselines (single host: the node store). ``template``: a
    :class:`~gpuguard.epilog.template.Template` or a name (source ``derived`` assumed).
    ``nodes``: restrict to these nodes' data (default: every node the job has data on).
    ``exit_code``: the job's exit status (``SLURM_JOB_EXIT_CODE``); non-zero keeps the
    run out of the baseline, ``None`` = unknown (counted as completed). ``data``: the
    job's series when they do not come from ``store`` (the cluster judge builds them from
    the nodes' spool parts: :func:`gpuguard.epilog.part.to_job_data`).

    Raises :class:`gpuguard.store.StoreError` (store unreadable/unwritable) and
    :class:`gpuguard.config.ConfigError` (bad ``[verdict]``/``[baseline]`` values).
    """
    s = Settings.from_config(cfg)
    bs = baseline_mod.BaselineSettings.from_config(cfg)
    tmpl = template if isinstance(template, Template) else Template(str(template), "derived")
    now = time.time() if now is None else now
    data = load_job(store, job_id, nodes) if data is None else data
    base = baseline_mod.compute_baseline(store, tmpl.name, cfg=cfg, exclude_job=job_id)
    metrics = job_metrics(data, s.warmup_s)
    wins = _Windows(data, s)
    comps = compare(metrics, base, wins, s, bs.min_runs)
    judged = base.state == baseline_mod.READY
    cause, summary, evidence, also = _decide(data, comps, base, wins, s)
    if data.start is None:
        evidence["no_data"] = "no samples or step records for this job"
    evidence["baseline_runs"] = base.runs
    context = _context(store, data.nodes, base.since if base.since is not None else data.start, data.end)
    v = Verdict(job_id=str(job_id), template=tmpl.name, cause=cause, state="judged" if judged else LEARNING,
                summary=summary, evidence=evidence, comparisons=comps, also=also, context=context,
                baseline_runs=base.runs, template_source=tmpl.source, nodes=data.nodes,
                start=data.start, end=data.end)
    if record:
        critical = any(f["severity"] == "critical" for f in data.hw_findings)
        ok = (exit_code in (None, 0)) and not critical and not v.anomalous and data.start is not None
        row = {"job_id": v.job_id, "template": v.template, "at": now, "state": v.state, "cause": v.cause,
               "summary": v.summary, "evidence": baseline_mod.dumps(v.evidence), "also": baseline_mod.dumps(v.also),
               "context": baseline_mod.dumps(v.context), "exit_code": exit_code, "critical": int(critical),
               "baseline_ok": int(ok), "nodes": baseline_mod.dumps(v.nodes), "start_at": v.start, "end_at": v.end}
        crows = [{"job_id": v.job_id, "template": v.template, "metric": c.metric, "value": c.value,
                  "median": c.median, "mad": c.mad, "n": c.n, "z": _finite(c.z), "rel_change": _finite(c.rel_change),
                  "flagged": int(c.flagged), "sustained_s": c.sustained_s, "at": now} for c in comps]
        baseline_mod.record_verdict(store, row, crows, template_source=tmpl.source, now=now)
        baseline_mod.update_baseline(store, tmpl.name, cfg=cfg, now=now)
    return v


def _finite(x: float | None) -> float | None:
    if x is None:
        return None
    return x if math.isfinite(x) else math.copysign(1e308, x)


def load_verdict(store: Any, job_id: str) -> dict[str, Any] | None:
    """A stored verdict with its comparisons, as :meth:`Verdict.to_dict` shapes it
    (for ``gpuguard job show``), or ``None``. Raises :class:`gpuguard.store.StoreError`."""
    import json

    rows = store.query("select * from verdicts where job_id = ?", [str(job_id)])
    if not rows:
        return None
    r = rows[0]
    comps = store.query("select metric, value, median, mad, n, z, rel_change, flagged, sustained_s "
                        "from comparisons where job_id = ?", [str(job_id)])
    order = {m: i for i, m in enumerate(METRICS)}
    comps.sort(key=lambda c: order.get(c["metric"], 99))
    for c in comps:
        c["flagged"] = bool(c["flagged"])
        c["unit"] = METRICS.get(c["metric"], ("",))[0]
    return {"job_id": r["job_id"], "template": r["template"], "state": r["state"], "cause": r["cause"],
            "summary": r["summary"], "evidence": json.loads(r["evidence"] or "{}"),
            "also": json.loads(r["also"] or "[]"), "context": json.loads(r["context"] or "[]"),
            "exit_code": r["exit_code"], "baseline_ok": bool(r["baseline_ok"]), "judged_at": r["at"],
            "baseline_runs": (json.loads(r["evidence"] or "{}")).get("baseline_runs"),
            "nodes": json.loads(r["nodes"] or "[]"), "start": r["start_at"], "end": r["end_at"],
            "comparisons": comps}


# -- findings, policy, escalation ---------------------------------------------------------------
def verdict_findings(v: Verdict) -> list[Finding]:
    """``verdict.<cause>`` findings (``-`` -> ``_``) for an anomalous verdict: one per
    straggling GPU for ``straggler-gpu``, one otherwise; none for healthy/learning.
    ``evidence`` carries ``job_id``, ``template``, ``node`` and the cause's numbers."""
    if not v.anomalous:
        return []
    code = "verdict." + v.cause.replace("-", "_")
    sev = FINDING_SEVERITY.get(v.cause, "warning")
    base = {"job_id": v.job_id, "template": v.template}
    if v.cause == "straggler-gpu":
        return [Finding(code, sev, f"job {v.job_id}: GPU {h['gpu_index']} {h['metric']} {h['value']} vs peers "
                        f"{h['peer_median']} ({h['rel_change']:+.0%})", gpu_index=h["gpu_index"],
                        gpu_uuid=h.get("gpu_uuid"), evidence=dict(base, **h))
                for h in v.evidence.get("gpus", [])]
    node = v.evidence.get("node") or (v.evidence.get("worst") or {}).get("node")
    if node is None and len(v.nodes) == 1:
        node = v.nodes[0]
    gpu_index = (v.evidence.get("worst") or {}).get("gpu_index") if v.cause == "memory-leak" else None
    return [Finding(code, sev, f"job {v.job_id}: {v.summary}", gpu_index=gpu_index,
                    evidence=dict(base, node=node, summary=v.summary))]


def _node_of(f: Finding) -> str | None:
    return f.evidence.get("node")


def escalation(store: Any, f: Finding, *, s: Settings, now: float) -> dict[str, Any] | None:
    """Whether ``f`` repeats: the same code on the same GPU (UUID, else node and index;
    node-level codes: the same node) in at least ``escalate_count`` distinct jobs, this
    one included, within ``escalate_window_s``. Returns ``{"jobs": [...], "window_s"}``
    or ``None``. Raises :class:`gpuguard.store.StoreError`."""
    if f.code not in s.escalate_codes:
        return None
    node = _node_of(f)
    job = f.evidence.get("job_id")
    sql = "select distinct job_id from findings where code = ? and at >= ? and job_id is not null"
    params: list[Any] = [f.code, now - s.escalate_window_s]
    if f.gpu_uuid:
        sql += " and gpu_uuid = ?"
        params.append(f.gpu_uuid)
    else:
        sql += " and node = ?"
        params.append(node)
        if f.gpu_index is not None:
            sql += " and gpu_index = ?"
            params.append(f.gpu_index)
    jobs = {r["job_id"] for r in store.query(sql, params)} - {job}
    if len(jobs) + 1 >= s.escalate_count:
        return {"jobs": [*sorted(jobs), job], "window_s": s.escalate_window_s}
    return None


def act_on_verdict(store: Any, v: Verdict, *, cfg: Config | None, node: str | None = None,
                   now: float | None = None, record: bool = True) -> policy_mod.Decision:
    """Map the verdict's findings through the policy table (``[policy]`` overrides, then
    :data:`gpuguard.policy.DEFAULT_ACTIONS`, then the severity fallback), escalate repeats
    to ``drain`` (:func:`escalation`), record them in ``findings`` (with ``record``) and
    return the decision for ``node`` (default: every node): ``drain`` only for findings
    on that node. Raises :class:`gpuguard.store.StoreError`."""
    s = Settings.from_config(cfg)
    now = time.time() if now is None else now
    acts: list[tuple[Finding, str]] = []
    for f in verdict_findings(v):
        action = policy_mod.action_for(f, cfg.policy if cfg else None, cfg.xid_policy if cfg else None)
        esc = escalation(store, f, s=s, now=now) if action != "drain" else None
        if esc:
            f.evidence["escalated"] = esc
            f.message += f" (repeated in {len(esc['jobs'])} jobs within {esc['window_s'] / 3600:g} h)"
            action = "drain"
        acts.append((f, action))
    if record and acts:
        store.insert_many("findings", [
            {"run_id": None, "node": _node_of(f) or node, "at": now, "job_id": v.job_id, "code": f.code,
             "severity": f.severity, "action": a, "gpu_index": f.gpu_index, "gpu_uuid": f.gpu_uuid,
             "message": f.message, "evidence": baseline_mod.dumps(f.evidence)} for f, a in acts])
    mine = [(f, a) for f, a in acts if node is None or _node_of(f) in (None, node)]
    drains = [f for f, a in mine if a == "drain"]
    if drains:
        return policy_mod.Decision("drain", policy_mod.format_reason(drains), acts)
    return policy_mod.Decision("proceed", "", acts)


def exit_code_from_env(env: Mapping[str, str]) -> int | None:
    """``SLURM_JOB_EXIT_CODE`` (raw wait status, SLURM-FACTS.md §4) as an int, or None."""
    v = env.get("SLURM_JOB_EXIT_CODE")
    if not v or not (v.isascii() and v.isdigit()) or len(v) > 10:
        return None
    n = int(v)
    return n if n <= 2**32 - 1 else None  # Slurm keeps it as uint32


def run_verdict(store: Any, job_id: str, *, cfg: Config, env: Mapping[str, str] | None = None,
                slurm: Any = None, node: str | None = None,
                now: float | None = None) -> tuple[Verdict, policy_mod.Decision]:
    """The Epilog's one call, after the job summary is stored: resolve the template
    (``SLURM_JOB_COMMENT``, else derived with ``slurm.show_job``), judge the job, store
    the verdict and comparisons, refresh the baseline, and map the verdict's findings
    through the policy table with escalation. Returns ``(verdict, decision)``; when
    ``decision.outcome == "drain"`` the caller drains ``node`` with ``decision.reason``
    (it starts with ``gpuguard:``).

    ``env``: the hook environment (default ``os.environ``); ``node``: this node (default
    ``cfg.node_name``). Raises :class:`gpuguard.store.StoreError` and
    :class:`gpuguard.config.ConfigError`; the Epilog logs them as tool errors.
    """
    env = os.environ if env is None else env
    node = node or cfg.node_name
    gpu_name = None
    try:
        inv = store.query("select name from inventory where node = ? and name is not null limit 1", [node])
        gpu_name = inv[0]["name"] if inv else None
    except Exception:  # the name only refines a derived template
        gpu_name = None
    tmpl = job_template(env, slurm=slurm, gpu_name=gpu_name)
    v = judge_job(store, job_id, cfg=cfg, template=tmpl, exit_code=exit_code_from_env(env), now=now)
    return v, act_on_verdict(store, v, cfg=cfg, node=node, now=now)


def _num(v: Any, digits: int = 4) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if not math.isfinite(v) or abs(v) >= 1e300:
            return "inf" if v > 0 else "-inf"
        return f"{v:.{digits}g}"
    return str(v)


def format_verdict(d: dict[str, Any]) -> str:
    """Text for ``gpuguard job show``: the verdict and its evidence first, then one row
    per metric (this run, baseline median, deviation as relative change and z, flag),
    then the node change-log context. ``d`` is :func:`load_verdict`'s dict (or
    :meth:`Verdict.to_dict`)."""
    head = f"verdict: {d['cause']} — {d['summary']}"
    out = [head, f"  template {d['template']} ({d['state']}"
           + (f", {d.get('baseline_runs')} baseline runs)" if d.get("baseline_runs") is not None else ")")]
    if d.get("also"):
        out.append("  also: " + ", ".join(d["also"]))
    ev = d.get("evidence") or {}
    for key in ("gpus", "leaks"):
        for h in ev.get(key, [])[:8]:
            out.append("  evidence: " + ", ".join(f"{k}={_num(v)}" for k, v in h.items()
                                                  if k not in ("gpu_uuid",) and not isinstance(v, dict)))
    if ev.get("reasons"):
        out.append("  active reasons: " + ", ".join(f"{r} {v:.0%}" for r, v in ev["reasons"].items()))
    for e in (ev.get("events") or [])[:5]:
        out.append(f"  event: {e['node']} gpu{e['gpu_index']} {e['kind']} {e['code']} ({e.get('action')}) "
                   f"{e.get('message', '')}")
    for f in (ev.get("findings") or [])[:5]:
        out.append(f"  finding: {f['node']} gpu{f['gpu_index']} {f['code']} {f['severity']}: {f.get('message', '')}")
    if ev.get("unexplained"):
        out.append("  moved without a cause: " + ", ".join(ev["unexplained"]))
    rows = []
    for c in d.get("comparisons", []):
        dev = "-"
        if c.get("rel_change") is not None and c.get("median") is not None:
            rel = c["rel_change"]
            dev = (f"{rel:+.1%}" if isinstance(rel, float) and math.isfinite(rel) and abs(rel) < 1e300 else "new")
            if c.get("z") is not None:
                dev += f" (z {_num(c['z'], 3)})"
        rows.append([c["metric"], c.get("unit", ""), _num(c.get("value")), _num(c.get("median")), dev,
                     "FLAG" if c.get("flagged") else ""])
    if rows:
        headers = ["METRIC", "UNIT", "THIS RUN", "BASELINE MEDIAN", "DEVIATION", ""]
        cols = [headers, *rows]
        widths = [max(len(str(r[i])) for r in cols) for i in range(len(headers))]
        lines = ["  ".join(str(x).ljust(w) for x, w in zip(r, widths, strict=True)).rstrip() for r in cols]
        lines.insert(1, "  ".join("-" * w for w in widths))
        out += ["", *lines]
    if d.get("context"):
        out += ["", "node changes since the baseline's runs:"]
        for c in d["context"][:10]:
            out.append(f"  {c['node']} gpu{c['gpu_index']} {c['field']}: {c['old']} -> {c['new']}")
    return "\n".join(out)
