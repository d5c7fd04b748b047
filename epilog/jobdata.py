"""Read one job's time series back from the store for the verdict.

Tables read (all keyed by ``job_id``; ``node`` restricts to the given nodes):

* ``samples`` (collector): one row per GPU per interval — ``at`` (epoch s),
  ``gpu_util_pct``, ``mem_used_mib``, ``power_w``, ``temp_c``, ``sm_clock_mhz``,
  ``clock_event_mask`` (NVML bit mask, :data:`gpuguard.model.CLOCK_EVENT_REASONS`),
  ``ecc_volatile_uncorrected``.
* ``host_samples`` (collector): ``at``, ``rss_mib`` per node.
* ``steps`` (epilog ingest of the training API's step records
  ``{"v":1,"kind":"step","rank","t","step","step_time_s","samples","tokens",...,
  "phases":{"data_wait_s","fwd_bwd_s","comm_s","optim_s"}}``): the time column is
  ``t`` or ``at``; phases are flattened columns or a JSON ``phases`` column. Read by
  column name, whichever of these shapes the table has.
* ``checkpoints`` (epilog ingest): one row per checkpoint; its duration is the first
  of ``duration_s``, ``save_s``, ``write_s``, ``elapsed_s``, ``checkpoint_time_s``.
* ``events`` and ``findings``: hardware events (XID/SXid/ECC/GPU lost) on the job's
  nodes during the job, or tagged with the job id after it started.

A table that does not exist yet reads as empty (a store older than the epilog's
migration): the verdict then judges from what there is.
"""

from __future__ import annotations

import bisect
import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from gpuguard.model import CLOCK_EVENT_REASONS, SLOWDOWN_REASONS, reasons_mask
from gpuguard.net.evidence import FABRIC_CODES

SLOWDOWN_MASK = reasons_mask(SLOWDOWN_REASONS)

_CKPT_COLS = ("duration_s", "save_s", "write_s", "elapsed_s", "checkpoint_time_s")
_PHASES = ("data_wait_s", "fwd_bwd_s", "comm_s", "optim_s")
#: Finding codes that are hardware faults whatever their severity (besides every
#: critical finding), fabric findings included: a job slowed by a degraded link is the
#: machine's fault. Verdict/baseline findings are ours and never count.
_HW_FINDING_PREFIXES = ("xid.", "sxid.", "ecc.uncorrectable", "gpu.lost", "nvlink.link_down",
                        "ecc.row_remap", "ecc.retired_pages", *FABRIC_CODES)


@dataclass
class GpuSeries:
    """One GPU's samples, sorted by time; lists are aligned with ``t``."""

    node: str
    gpu_index: int
    gpu_uuid: str | None
    t: list[float] = field(default_factory=list)
    util: list[float | None] = field(default_factory=list)
    mem: list[float | None] = field(default_factory=list)
    power: list[float | None] = field(default_factory=list)
    temp: list[float | None] = field(default_factory=list)
    clock: list[float | None] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    ecc_unc: list[int | None] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.node}/gpu{self.gpu_index}"

    def span(self, t0: float, t1: float) -> tuple[int, int]:
        """Index range ``[i, j)`` of samples with ``t0 <= t < t1``."""
        return bisect.bisect_left(self.t, t0), bisect.bisect_left(self.t, t1)


@dataclass
class StepRec:
    """One training step record of one rank (times in seconds)."""

    node: str | None
    rank: int | None
    t: float
    step_time_s: float | None
    samples: float | None
    tokens: float | None
    data_wait_s: float | None
    fwd_bwd_s: float | None
    comm_s: float | None
    optim_s: float | None


@dataclass
class JobData:
    """Everything the verdict reads about one job. ``start``/``end`` are the first and
    last time seen in samples or steps (``None`` for a job with no data)."""

    job_id: str
    nodes: list[str]
    start: float | None
    end: float | None
    gpus: list[GpuSeries]
    steps: list[StepRec]
    step_t: list[float]
    host: dict[str, tuple[list[float], list[float | None]]]
    checkpoint_s: list[float]
    hw_events: list[dict[str, Any]]
    hw_findings: list[dict[str, Any]]
    mem_total_mib: dict[str, float]
    #: Interconnect evidence (:func:`gpuguard.net.evidence.communication_evidence`):
    #: each node's NCCL baseline and the fabric findings of the job's nodes during it.
    net: dict[str, Any] = field(default_factory=dict)

    @property
    def has_steps(self) -> bool:
        return bool(self.steps)

    def steps_between(self, t0: float, t1: float) -> list[StepRec]:
        i = bisect.bisect_left(self.step_t, t0)
        j = bisect.bisect_left(self.step_t, t1)
        return self.steps[i:j]


def _tables(store: Any) -> set[str]:
    return {r["name"] for r in store.query("select name from sqlite_master where type = 'table'")}


def _f(v: Any) -> float | None:
    if v is None:
        return None
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _node_filter(nodes: list[str] | None) -> tuple[str, list[Any]]:
    if not nodes:
        return "", []
    return f" and node in ({','.join('?' * len(nodes))})", list(nodes)


_MEM_RE = re.compile(r"(\d+)\s*GB", re.I)


def capacity_from_name(name: str | None) -> float | None:
    """GPU memory in MiB from an NVML product name (``"NVIDIA H100 80GB HBM3"`` ->
    81920), or ``None``. Used only to project a leak when no total is stored."""
    if not name:
        return None
    m = _MEM_RE.search(name)
    return float(int(m.group(1)) * 1024) if m else None


def _load_gpus(store: Any, job_id: str, nf: str, nparams: list[Any]) -> dict[tuple[str, int], GpuSeries]:
    gpus: dict[tuple[str, int], GpuSeries] = {}
    rows = store.query(
        "select node, at, gpu_index, gpu_uuid, gpu_util_pct, mem_used_mib, power_w, temp_c, "
        f"sm_clock_mhz, clock_event_mask, ecc_volatile_uncorrected from samples where job_id = ?{nf} "
        "order by at", [job_id, *nparams])
    for r in rows:
        key = (r["node"] or "", int(r["gpu_index"] if r["gpu_index"] is not None else -1))
        g = gpus.get(key)
        if g is None:
            g = gpus[key] = GpuSeries(key[0], key[1], r["gpu_uuid"])
        g.t.append(float(r["at"]))
        g.util.append(_f(r["gpu_util_pct"]))
        g.mem.append(_f(r["mem_used_mib"]))
        g.power.append(_f(r["power_w"]))
        g.temp.append(_f(r["temp_c"]))
        g.clock.append(_f(r["sm_clock_mhz"]))
        g.mask.append(int(r["clock_event_mask"] or 0))
        g.ecc_unc.append(r["ecc_volatile_uncorrected"])
    return gpus


def _load_steps(store: Any, job_id: str, nf: str, nparams: list[Any]) -> list[StepRec]:
    steps: list[StepRec] = []
    for r in store.query(f"select * from steps where job_id = ?{nf}", [job_id, *nparams]):
        t = _f(r.get("t", r.get("at")))
        if t is None:
            continue
        phases: dict[str, Any] = {}
        if r.get("phases"):
            try:
                phases = json.loads(r["phases"]) if isinstance(r["phases"], str) else dict(r["phases"])
            except (ValueError, TypeError):
                phases = {}
        steps.append(StepRec(
            node=r.get("node"), rank=r.get("rank"), t=t, step_time_s=_f(r.get("step_time_s")),
            samples=_f(r.get("samples")), tokens=_f(r.get("tokens")),
            **{p: _f(r[p]) if r.get(p) is not None else _f(phases.get(p)) for p in _PHASES},
        ))
    steps.sort(key=lambda s: s.t)
    return steps


def _load_hw(store: Any, tables: set[str], job_id: str, job_nodes: list[str], start: float,
             end: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    hw_events: list[dict[str, Any]] = []
    hw_findings: list[dict[str, Any]] = []
    # The epilog's own post-job health run is recorded a little after the last sample.
    lo, hi = start, end + 300.0
    jf, jparams = _node_filter(job_nodes)
    if "events" in tables:
        hw_events = store.query(
            "select * from events where coalesce(action, 'alert') != 'record' and "
            f"((at >= ? and at <= ?{jf}) or (job_id = ? and at >= ?)) order by at",
            [lo, hi, *jparams, job_id, lo])
    if "findings" in tables:
        rows = store.query(
            f"select * from findings where ((at >= ? and at <= ?{jf}) or (job_id = ? and at >= ?)) "
            "and code not like 'verdict.%' and code not like 'baseline.%' order by at",
            [lo, hi, *jparams, job_id, lo])
        hw_findings = [r for r in rows if r["severity"] == "critical"
                       or (r["code"].startswith(_HW_FINDING_PREFIXES) and r.get("action") != "record")]
    return hw_events, hw_findings


def load_job(store: Any, job_id: str, nodes: list[str] | None = None) -> JobData:
    """Read job ``job_id`` (on ``nodes``, default all) from ``store``.

    Raises :class:`gpuguard.store.StoreError` when the store cannot be read.
    """
    tables = _tables(store)
    nf, nparams = _node_filter(nodes)
    gpus = _load_gpus(store, job_id, nf, nparams) if "samples" in tables else {}
    steps = _load_steps(store, job_id, nf, nparams) if "steps" in tables else []
    host: dict[str, tuple[list[float], list[float | None]]] = {}
    if "host_samples" in tables:
        for r in store.query(f"select node, at, rss_mib from host_samples where job_id = ?{nf} order by at",
                             [job_id, *nparams]):
            ts, vs = host.setdefault(r["node"] or "", ([], []))
            ts.append(float(r["at"]))
            vs.append(_f(r["rss_mib"]))
    ckpt: list[float] = []
    if "checkpoints" in tables:
        for r in store.query(f"select * from checkpoints where job_id = ?{nf}", [job_id, *nparams]):
            for c in _CKPT_COLS:
                if _f(r.get(c)) is not None:
                    ckpt.append(_f(r[c]))  # type: ignore[arg-type]
                    break
    times = [g.t[0] for g in gpus.values() if g.t] + [g.t[-1] for g in gpus.values() if g.t]
    times += [steps[0].t - (steps[0].step_time_s or 0.0), steps[-1].t] if steps else []
    start = min(times) if times else None
    end = max(times) if times else None
    seen_nodes = sorted({g.node for g in gpus.values()} | {s.node for s in steps if s.node} | set(host))
    job_nodes = list(nodes) if nodes else seen_nodes
    hw_events, hw_findings = _load_hw(store, tables, job_id, job_nodes, start, end) if start is not None \
        else ([], [])
    caps: dict[str, float] = {}
    if "inventory" in tables and gpus:
        inv = {(r["node"], r["uuid"]): r for r in store.query("select node, uuid, name from inventory")}
        for g in gpus.values():
            row = inv.get((g.node, g.gpu_uuid))
            cap = capacity_from_name(row["name"]) if row else None
            if cap:
                caps[g.key] = cap
    gl = sorted(gpus.values(), key=lambda g: (g.node, g.gpu_index))
    from gpuguard.net.evidence import communication_evidence

    net = communication_evidence(store, job_nodes, start, end) if start is not None else {}
    return JobData(job_id, job_nodes, start, end, gl, steps, [s.t for s in steps], host, ckpt,
                   hw_events, hw_findings, caps, net)


def ecc_growth(g: GpuSeries) -> int:
    """Growth of the volatile uncorrectable ECC count over the job's samples."""
    vals = [v for v in g.ecc_unc if v is not None]
    return int(max(vals) - vals[0]) if vals else 0


def reasons_share(gpus: list[GpuSeries], t0: float, t1: float) -> dict[str, float]:
    """Share (0-1) of GPU samples in ``[t0, t1)`` with each slowdown reason active."""
    counts: dict[str, int] = defaultdict(int)
    total = 0
    for g in gpus:
        i, j = g.span(t0, t1)
        for m in g.mask[i:j]:
            total += 1
            for r in SLOWDOWN_REASONS:
                if m & CLOCK_EVENT_REASONS[r][0]:
                    counts[r] += 1
    return {r: counts[r] / total for r in SLOWDOWN_REASONS if total and counts[r]}
