"""The verdict's cause detectors: one function per cause, each returning its evidence.

A detector takes a :class:`Context` (the job's series, its comparisons with the
baseline, the windows, the settings) and returns a :class:`Found` (one-line summary,
JSON-ready evidence, a strength that orders causes of one precedence group) or
``None``. It says only whether *its* cause shows; which cause is primary and which
others it explains is decided by the table in :mod:`gpuguard.epilog.decide`.

Adding a cause: one detector here, one row in :data:`gpuguard.epilog.decide.CAUSE_TABLE`,
its tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpuguard.epilog import baseline as baseline_mod
from gpuguard.epilog import leak as leak_mod
from gpuguard.epilog import peers
from gpuguard.epilog.compare import Comparison, Settings, Windows, unit_of
from gpuguard.epilog.jobdata import SLOWDOWN_REASONS, JobData, ecc_growth, reasons_share
from gpuguard.epilog.metrics import REASON_SHARES, sustained
from gpuguard.model import HARD_SLOWDOWN_REASONS

#: Reasons that are never part of a healthy run (power cap is: GPUs at TDP run capped).
HARD_REASONS = HARD_SLOWDOWN_REASONS
#: Step-time metrics shown as the performance evidence.
PERF_UP = ("step_time_p50_s", "step_time_p95_s")
#: A clock-event reason group counts as evidence of throttling when its share of GPU
#: samples rose at least this much over the template's median (our choice: a quarter of
#: the samples is far above the sampling noise of a share over hundreds of readings and
#: the run-to-run variation of power-capped templates).
REASON_SHARE_MIN_RISE = 0.25
#: With such a rise, a median step time (SM clock) this much above (below) the template's
#: median, or a throughput this much below, is the performance effect that makes it
#: throttling (our choice: the driver reporting a new clock-event reason is the cause's
#: own evidence, so the effect needs no z test of its own; 3 % is twice the run-to-run
#: spread of a template's median step time on dedicated nodes).
REASON_PERF_MIN = 0.03
#: A run shorter than this share of the template's usual run length (baseline median of
#: ``run_duration_s``) is *cut short* (our choice: half: the bench's short runs last 5-35 %
#: of their history's; a run of the usual length varies by tens of per cent at most).
SHORT_RUN_FRAC = 0.5


@dataclass(frozen=True)
class Found:
    """A detector's result: ``summary`` (one line), ``evidence`` (JSON-ready numbers),
    ``strength`` (orders causes of one precedence group: the larger wins)."""

    summary: str
    evidence: dict[str, Any]
    strength: float = 0.0


@dataclass
class Context:
    """What every detector reads. ``comps``: metric -> :class:`Comparison`; ``judged``:
    the baseline is ready (else only baseline-free detectors run)."""

    data: JobData
    comps: dict[str, Comparison]
    base: baseline_mod.Baseline
    wins: Windows
    s: Settings
    _memo: dict[str, Any] = field(default_factory=dict)

    @property
    def judged(self) -> bool:
        return self.base.state == baseline_mod.READY

    def once(self, key: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` computed once per verdict (analyses shared by two detectors)."""
        if key not in self._memo:
            self._memo[key] = fn()
        return self._memo[key]

    def up(self, m: str) -> bool:
        c = self.comps.get(m)
        return bool(c and c.flagged and c.direction > 0)

    def down(self, m: str) -> bool:
        c = self.comps.get(m)
        return bool(c and c.flagged and c.direction < 0)

    def flagged(self) -> list[Comparison]:
        return [c for c in self.comps.values() if c.flagged]

    def perf_worse(self) -> bool:
        """The run is slower than its baseline: median step time up or throughput down.
        The p95 alone is not: heavy-tailed step times (a few slow batches, GC pauses) move
        it from run to run while the job makes the same progress."""
        return self.up("step_time_p50_s") or self.down("throughput_per_s")

    def slower(self) -> bool:
        """:meth:`perf_worse`, or — where a cause's own signal (a reason share, the data
        wait or communication share) is flagged and so corroborates it — a median step
        time at least ``min_rel_change / 2`` above the baseline or a throughput that far
        below (our choice: the second signal stands in for the z test, which a 5 %
        change misses on templates whose run-to-run spread is a few %)."""
        if self.perf_worse():
            return True
        half = self.s.min_rel_change / 2
        p50, thr = self.comps.get("step_time_p50_s"), self.comps.get("throughput_per_s")
        return bool((p50 and p50.z is not None and p50.rel_change is not None and p50.rel_change >= half)
                    or (thr and thr.z is not None and thr.rel_change is not None and thr.rel_change <= -half))

    def perf_changed(self) -> list[Comparison]:
        """Flagged performance metrics (either way): the p50 and throughput, the p95 only
        beside one of them."""
        core = [self.comps[m] for m in ("step_time_p50_s", "throughput_per_s") if self.flagged_metric(m)]
        if core and self.flagged_metric("step_time_p95_s"):
            core.insert(1 if self.flagged_metric("step_time_p50_s") else 0, self.comps["step_time_p95_s"])
        return core

    def flagged_metric(self, m: str) -> bool:
        c = self.comps.get(m)
        return bool(c and c.flagged)

    def perf_lines(self) -> list[str]:
        """The flagged performance metrics as text; else the median step time and
        throughput against their baseline (a corroborated, smaller slowdown)."""
        names = (*PERF_UP, "throughput_per_s")
        out = [fmt(self.comps[m]) for m in names if m in self.comps and self.comps[m].flagged]
        return out or [fmt(self.comps[m]) for m in ("step_time_p50_s", "throughput_per_s") if m in self.comps
                       and self.comps[m].value is not None and self.comps[m].median is not None]

    def records_count(self) -> bool:
        """Per-rank records may name a straggler: the baseline is ready and the run is
        slower than it, or its rank compute spread rose against the template's history
        (:mod:`gpuguard.epilog.peers`: ranks can differ by role)."""
        return self.once("records_count", lambda: self.judged and (self.slower() or self.spread_up()))

    def spread_up(self) -> bool:
        """The rank compute spread is flagged up against the template's history."""
        return self.up("rank_compute_spread")

    def rank_settings(self) -> Settings:
        """Peer thresholds for per-rank records: :func:`peers.spread_settings` when the
        spread rose against history, else ``[verdict]``'s."""
        return peers.spread_settings(self.s) if self.spread_up() else self.s

    def gpu_hits(self) -> list[dict[str, Any]]:
        return self.once("gpu_hits", lambda: peers.stragglers_gpu(
            self.data, self.wins, self.s, self.base.stats if self.judged else None, self.records_count(),
            self.rank_settings()))


def fmt(c: Comparison) -> str:
    """``metric value unit vs median (+rel%)`` for summaries."""
    unit = unit_of(c.metric)
    rel = "" if c.rel_change is None or not math.isfinite(c.rel_change) else f" ({c.rel_change:+.0%})"
    return f"{c.metric} {c.value:.4g} {unit} vs {c.median:.4g}{rel}"


# -- baseline-free causes ----------------------------------------------------------------------
def hardware_fault(ctx: Context) -> Found | None:
    """XID/SXid events the catalog does not mark ``record``, volatile uncorrectable ECC
    growth in the samples, or critical / hardware findings on the job's nodes during the job."""
    data = ctx.data
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
    text = "; ".join(parts[:4])
    return Found(f"hardware fault during the job: {text}",
                 {"events": ev, "findings": fi, "ecc_uncorrected_growth": ecc, "text": text})


def straggler_node(ctx: Context) -> Found | None:
    """One node of a multi-node job slower than the others (:func:`peers.stragglers_node`)."""
    hit = peers.stragglers_node(ctx.data, ctx.wins, ctx.gpu_hits(), ctx.s, ctx.records_count(),
                                ctx.rank_settings())
    if not hit:
        return None
    return Found(f"node {hit['node']} straggles: {hit['metric']} {hit['value']} vs "
                 f"{hit.get('others_median', '-')} on the other nodes", hit)


def straggler_gpu(ctx: Context) -> Found | None:
    """One GPU slower than its peers in the same job (:func:`peers.stragglers_gpu`)."""
    hits = ctx.gpu_hits()
    if not hits:
        return None
    h = hits[0]
    rs = ", ".join(h["reasons"]) or "no slowdown reason reported"
    if h["metric"] == "hard_reason_share":
        return Found(f"{h['node']} GPU {h['gpu_index']} straggles: hard clock-event reasons active in "
                     f"{h['value']:.0%} of its samples vs {h['peer_median']:.0%} on its peers; {rs}", {"gpus": hits})
    return Found(f"{h['node']} GPU {h['gpu_index']} straggles: {h['metric']} {h['value']} vs peers "
                 f"{h['peer_median']} ({h['rel_change']:+.0%}); {rs}", {"gpus": hits})


def named_reasons(ctx: Context) -> dict[str, float]:
    """Slowdown reasons active in at least 5 % of the span's GPU samples, with their share."""
    t0, t1 = ctx.wins.span
    if t0 is None:
        return {}
    return {r: round(v, 3) for r, v in reasons_share(ctx.data.gpus, t0, t1).items() if v >= 0.05}  # type: ignore[arg-type]


def _hard_throttle(ctx: Context) -> dict[str, Any] | None:
    if ctx.wins.span[0] is None or not ctx.data.gpus:
        return None
    t0, t1 = ctx.wins.span
    if ctx.s.throttle_active_share > 0 and not any(
            r in HARD_REASONS for r in reasons_share(ctx.data.gpus, t0, t1)):  # type: ignore[arg-type]
        # no hard-reason sample anywhere in the span: every long window (each inside the
        # span) has share 0, below the threshold; skips one scan of every GPU per window
        return None

    def share(a: float, b: float) -> float | None:
        sh = reasons_share(ctx.data.gpus, a, b)
        hard = [v for r, v in sh.items() if r in HARD_REASONS]
        return max(hard) if hard else 0.0

    held, secs = sustained(ctx.wins.windows, share, lambda v: v >= ctx.s.throttle_active_share)
    if not held:
        return None
    return {"reasons": named_reasons(ctx), "sustained_s": round(secs, 1)}


def reason_shares_up(ctx: Context) -> dict[str, dict[str, Any]]:
    """Clock-event reasons whose share of GPU samples is flagged up against the template's
    history by at least :data:`REASON_SHARE_MIN_RISE`, keyed by the reason's name
    (``sw_power_cap``, ``thermal``, ``hw_slowdown``): ``{"value", "median", "metric"}``."""
    out = {}
    for m, rs in REASON_SHARES.items():
        c = ctx.comps.get(m)
        if c and c.flagged and c.direction > 0 and c.value - c.median >= REASON_SHARE_MIN_RISE:  # type: ignore[operator]
            out[rs[0] if len(rs) == 1 else m.removesuffix("_share")] = {
                "metric": m, "value": round(c.value, 3), "median": round(c.median, 3)}  # type: ignore[arg-type]
    return out


def _reason_effect(ctx: Context) -> bool:
    """Median step time or SM clock at least :data:`REASON_PERF_MIN` worse than the
    template's median, or the throughput that much lower (judged comparisons only)."""
    for m, sign in (("step_time_p50_s", 1), ("throughput_per_s", -1), ("sm_clock_mhz", -1)):
        c = ctx.comps.get(m)
        if c and c.z is not None and c.rel_change is not None and sign * c.rel_change >= REASON_PERF_MIN:
            return True
    return False


def gpu_throttling(ctx: Context) -> Found | None:
    """A clock-event reason's share flagged up against the template's own history
    (:func:`reason_shares_up`) with the run slower or its SM clock down (flagged, or
    :data:`REASON_PERF_MIN` worse: :func:`_reason_effect`); or the SM clock
    flagged down with slowdown reasons active in at least ``throttle_active_share`` of
    GPU samples (or with a slower run when no reason is reported and the utilisation did
    not fall with the clock: idle readings between steps lower the median clock); or,
    baseline-free,
    hard reasons (thermal, HW slowdown, power brake) active in that share over a long
    window."""
    reasons = named_reasons(ctx)
    rose = reason_shares_up(ctx)
    slow_share = max((v for r, v in reasons.items() if r in SLOWDOWN_REASONS), default=0.0)
    # a clock that fell with the utilisation is an idling GPU's (data waits, pauses), not a throttled one's
    idle_clock = ctx.down("gpu_util_pct") and slow_share < ctx.s.throttle_active_share
    if ctx.down("sm_clock_mhz") and not idle_clock and (slow_share >= ctx.s.throttle_active_share
                                                        or ctx.perf_worse()):
        c = ctx.comps["sm_clock_mhz"]
        rs = ", ".join(f"{r} {v:.0%}" for r, v in reasons.items()) or "no reason reported (application clocks?)"
        return Found(f"SM clock down: {fmt(c)}; active: {rs}",
                     {"reasons": reasons, "sm_clock": c.to_dict(), "reason_shares": rose})
    if rose and (ctx.down("sm_clock_mhz") or ctx.slower() or _reason_effect(ctx)):
        rs = ", ".join(f"{m} {d['value']:.0%} vs {d['median']:.0%}" for m, d in rose.items())
        perf = ctx.perf_lines() or [fmt(ctx.comps["sm_clock_mhz"])]
        return Found(f"clock-event reasons above the template's history: {rs}; {perf[0]}",
                     {"reasons": reasons, "reason_shares": rose, "performance": perf,
                      "sm_clock": ctx.comps["sm_clock_mhz"].to_dict() if "sm_clock_mhz" in ctx.comps else None})
    hard = _hard_throttle(ctx)
    if hard:
        rs = ", ".join(f"{r} {v:.0%}" for r, v in hard["reasons"].items())
        return Found(f"GPU slowdown reasons active: {rs}", hard)
    return None


def _beyond_usual_peak(ctx: Context, leak: dict[str, Any]) -> dict[str, Any] | None:
    """``leak`` without the rises that end at or below the peak the template's healthy
    runs reach — GPU rises against the baseline median of ``mem_peak_mib``, host rises
    against that of ``host_rss_peak_mib`` (:data:`gpuguard.epilog.metrics.REFERENCE_METRICS`)
    — or ``None`` when none is left. A caching allocator grows to the job's working set
    and stays there, and a host process's RSS grows the same way while its data loader
    workers start and fill their prefetch buffers, so in a run shorter than its history's
    (cancelled, time limit) the whole span after the warm-up can be that growth, rising
    quarter after quarter; leaked memory is never given back, so a leak ends above the peak
    the same code reached when it ran healthy. A kind whose peak the baseline lacks
    (learning, or no earlier run had the readings) keeps its rises."""
    peaks = {}
    for kind, metric in (("gpu", "mem_peak_mib"), ("host", "host_rss_peak_mib")):
        c = ctx.comps.get(metric)
        peaks[kind] = c.median if ctx.judged and c is not None and c.n else None
    hits = [h for h in leak["leaks"] if peaks.get(h["kind"]) is None or h["last_mib"] > peaks[h["kind"]]]
    return {"leaks": hits, "worst": hits[0]} if hits else None


def memory_leak(ctx: Context) -> Found | None:
    """GPU memory or host RSS rising steadily after warm-up (:mod:`gpuguard.epilog.leak`)."""
    leak = leak_mod.memory_leak(ctx.data, ctx.wins, ctx.s)
    if not leak:
        return None
    leak = _beyond_usual_peak(ctx, leak)
    if not leak:
        return None
    w = leak["worst"]
    proj = f", full in {w['hours_to_full']} h" if w["hours_to_full"] is not None else ""
    return Found(f"{w['where']} memory rising {w['slope_mib_per_h']} MiB/h after warm-up "
                 f"({w['start_mib']} -> {w['last_mib']} MiB){proj}", leak)


# -- causes judged against the baseline ----------------------------------------------------------
def _share_rise(ctx: Context, metric: str, median_step: bool = False) -> float | None:
    """How far the share rose over its baseline median when it is flagged up and the run
    is slower (``median_step``: by its median step time, not by throughput alone), else
    None."""
    if not (ctx.up(metric) and ctx.slower()):
        return None
    if median_step:
        p50 = ctx.comps.get("step_time_p50_s")
        if not (p50 and p50.rel_change is not None and p50.rel_change >= ctx.s.min_rel_change / 2):
            return None
    c = ctx.comps[metric]
    return c.value - c.median  # type: ignore[operator]


def data_pipeline(ctx: Context) -> Found | None:
    """Slower run (step time up or throughput down) with the data-wait share flagged up;
    GPU utilisation down is named when flagged. Strength: the share's rise."""
    rise = _share_rise(ctx, "data_wait_share")
    if rise is None:
        return None
    perf = ctx.perf_lines()
    ev: dict[str, Any] = {"data_wait_share": ctx.comps["data_wait_share"].to_dict(), "performance": perf}
    util = ""
    if ctx.down("gpu_util_pct"):
        ev["gpu_util"] = ctx.comps["gpu_util_pct"].to_dict()
        util = f"; {fmt(ctx.comps['gpu_util_pct'])}"
    return Found(f"waiting for data: {fmt(ctx.comps['data_wait_share'])}; {perf[0]}{util}", ev, rise)


def communication(ctx: Context) -> Found | None:
    """Slower run — by its median step time: a slow all-reduce costs every step, while a
    few slow steps on one rank (GC pauses, a slow batch) also show as the others' comm
    wait and lower the throughput — with the communication share flagged up. Strength:
    the share's rise.
    The evidence cites each node's NCCL baseline and the fabric findings of the job's
    nodes during the job (:func:`gpuguard.net.evidence.communication_evidence`)."""
    rise = _share_rise(ctx, "comm_share", median_step=True)
    if rise is None:
        return None
    perf = ctx.perf_lines()
    return Found(f"communication: {fmt(ctx.comps['comm_share'])}; {perf[0]}",
                 {"comm_share": ctx.comps["comm_share"].to_dict(), "performance": perf,
                  "node_nccl_baseline": ctx.data.net.get("node_nccl_baseline"),
                  "fabric_findings": ctx.data.net.get("fabric_findings", [])}, rise)


def _cut_short(ctx: Context) -> bool:
    """The run lasted less than :data:`SHORT_RUN_FRAC` of the template's usual run
    (baseline median of ``run_duration_s``; False when the baseline has none)."""
    c = ctx.comps.get("run_duration_s")
    return bool(ctx.judged and c is not None and c.n and c.value is not None and c.median
                and c.value < SHORT_RUN_FRAC * c.median)


def _changed(ctx: Context) -> list[Comparison]:
    """What differs for the job's own reasons: :meth:`Context.perf_changed`, samples per
    step, the GPU memory peak (GPU utilisation when there are no training records). A
    memory peak *below* the usual in a run cut short (:func:`_cut_short`) is left out: a
    caching allocator reaches its working set with the first evaluation, the first
    checkpoint, the longest batch, which a cancelled run may never see."""
    mem_low = ctx.down("mem_peak_mib") and _cut_short(ctx)
    changed = ctx.perf_changed() + [c for c in ctx.flagged() if c.metric == "samples_per_step"
                                    or (c.metric == "mem_peak_mib" and not mem_low)]
    if not ctx.data.has_steps:
        changed += [c for c in ctx.flagged() if c.metric == "gpu_util_pct"]
    return changed


def batch_changed(ctx: Context) -> Found | None:
    """Samples (else tokens) per step flagged against the baseline, either way: the job
    runs another batch size, so step time, throughput and the phase shares all move
    for the job's own reason. Compared per sample: the evidence lists the per-sample
    figures beside it (throughput)."""
    if not ctx.flagged_metric("samples_per_step"):
        return None
    changed = [ctx.comps["samples_per_step"]] + [c for c in _changed(ctx) if c.metric != "samples_per_step"]
    return Found("the job itself changed: " + "; ".join(fmt(c) for c in changed[:3]),
                 {"changed": [c.to_dict() for c in changed]}, 1.0)


def job_changed(ctx: Context) -> Found | None:
    """Median step time or throughput flagged (either way; the p95 only beside one of
    them), samples per step, or the memory peak flagged (GPU utilisation too when the
    job has no training records): the job itself differs. Tried only when no other
    cause showed (the table's ``fallback``)."""
    changed = _changed(ctx)
    if not changed:
        return None
    return Found("the job itself changed: " + "; ".join(fmt(c) for c in changed[:3])
                 + " with clocks, data wait and communication as usual",
                 {"changed": [c.to_dict() for c in changed]})
