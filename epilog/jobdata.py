"""Read one job's time series back from the store for the verdict.

Tables read (all keyed by ``job_id``; ``node`` restricts to the given nodes):

* ``gpu_series``/``gpu_samples``/``gpu_slow`` (collector, :mod:`gpuguard.samples`): one
  row per GPU per interval — time, ``gpu_util_pct``, ``mem_util_pct``, ``mem_used_mib``,
  ``power_w``, ``temp_c``, ``sm_clock_mhz``, ``clock_event_mask`` (NVML bit mask,
  :data:`gpuguard.model.CLOCK_EVENT_REASONS`), and ``ecc_volatile_uncorrected`` where
  the slow path read it; a long series is read in buckets (:data:`MAX_POINTS_PER_GPU`).
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
from dataclasses import dataclass, field
from typing import Any

from gpuguard import samples
from gpuguard.metrics import BY_NAME, series_attrs, stored_column, with_fields
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
@with_fields((a, "list[float | None]", field(default_factory=list), "clock") for a in series_attrs().values())
class GpuSeries:
    """One GPU's samples, sorted by time; lists are aligned with ``t``. A compared GPU
    metric's series (:data:`SERIES_ATTR`) not declared here becomes a field."""

    node: str
    gpu_index: int
    gpu_uuid: str | None
    t: list[float] = field(default_factory=list)
    util: list[float | None] = field(default_factory=list)
    mem_util: list[float | None] = field(default_factory=list)
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

    def array(self, name: str) -> Any:
        """Series ``name`` (``t``, ``util``, ..., ``mask``, ``ecc_unc``) as a numpy array,
        NaN where the list holds None (``mask``: int64). Made once and kept while the list
        is the same object of the same length: the judge's checks over a 64-node job's
        512 GPUs read these instead of walking 700,000 list items per metric."""
        cache = self.__dict__.setdefault("_arrays", {})
        lst = getattr(self, name)
        hit = cache.get(name)
        if hit is None or hit[0] is not lst or hit[1] != len(lst):
            import numpy as np

            arr = (np.array(lst, dtype=np.int64) if name == "mask" else
                   np.array([np.nan if v is None else v for v in lst], dtype=np.float64))
            hit = cache[name] = (lst, len(lst), arr)
        return hit[2]

    def keep_array(self, name: str, arr: Any) -> None:
        """Record ``arr`` as :meth:`array`'s value of series ``name`` (whose list was made from it)."""
        lst = getattr(self, name)
        self.__dict__.setdefault("_arrays", {})[name] = (lst, len(lst), arr)


@dataclass(slots=True)
class StepRec:
    """One training step record of one rank (times in seconds). Slotted: the judge of a
    64-node day-long job holds about 740,000 of them (a per-instance dict would be most
    of its memory)."""

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
    #: GPU key (``node/gpuN``) -> NVML product name (the inventory's, or the part's):
    #: what :attr:`gpu_model` is made of
    gpu_names: dict[str, str] = field(default_factory=dict)
    #: exact step times in ``[t0, t1)`` (SQL), set when the step records were bucketed
    exact_step_times: Any = None
    #: per-bucket window values cached by :func:`gpuguard.epilog.metrics.window_metrics`
    window_cache: dict[Any, Any] = field(default_factory=dict)

    @property
    def has_steps(self) -> bool:
        return bool(self.steps)

    @property
    def gpu_model(self) -> str:
        """The job's GPU model: the NVML product name of its GPUs (``"NVIDIA H100 80GB
        HBM3"``), the distinct names sorted and joined by ``" + "`` for a job on more than
        one model, ``""`` when no GPU's name is known. The key under which a template's
        baseline is kept (:func:`gpuguard.epilog.baseline.compute_baseline`)."""
        return gpu_model_key(self.gpu_names.values())

    def steps_between(self, t0: float, t1: float) -> list[StepRec]:
        i = bisect.bisect_left(self.step_t, t0)
        j = bisect.bisect_left(self.step_t, t1)
        return self.steps[i:j]

    def step_columns(self, t0: float | None = None, t1: float | None = None) -> Any:
        """The step records in ``[t0, t1)`` (default: all) as a
        :class:`gpuguard.epilog.steptable.StepTable`: ``steps`` itself when the judge built
        it so, else a table of ``steps`` made once and kept (the verdict asks per window)."""
        from gpuguard.epilog.steptable import StepTable

        tab = self.steps if isinstance(self.steps, StepTable) else None
        if tab is None:
            cached = self.window_cache.get("step_columns")
            if cached is None or cached[0] is not self.steps or len(cached[1]) != len(self.steps):
                cached = self.window_cache["step_columns"] = (self.steps, StepTable.of(self.steps))
            tab = cached[1]
        if t0 is None and t1 is None:
            return tab
        i = bisect.bisect_left(self.step_t, t0) if t0 is not None else 0
        j = bisect.bisect_left(self.step_t, t1) if t1 is not None else len(tab)
        return tab[i:j]


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


def gpu_model_key(names: Any) -> str:
    """The GPU-model key of a set of NVML product names (:attr:`JobData.gpu_model`):
    distinct non-empty names, stripped, sorted, joined by ``" + "``; ``""`` for none."""
    return " + ".join(sorted({str(n).strip() for n in names if n and str(n).strip()}))


_MEM_RE = re.compile(r"(\d+)\s*GB", re.I)


def capacity_from_name(name: str | None) -> float | None:
    """GPU memory in MiB from an NVML product name (``"NVIDIA H100 80GB HBM3"`` ->
    81920), or ``None``. Used only to project a leak when no total is stored."""
    if not name:
        return None
    m = _MEM_RE.search(name)
    return float(int(m.group(1)) * 1024) if m else None


def _load_steps_any(store: Any, job_id: str, nf: str, nparams: list[Any]) -> list[StepRec]:
    """Step records of any table shape (time in ``t`` or ``at``; phases flattened or a JSON
    ``phases`` column), one dict per row: for stores not written by this gpuguard."""
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
        hw_findings = [r for r in rows if (r["severity"] == "critical"
                       or (r["code"].startswith(_HW_FINDING_PREFIXES) and r.get("action") != "record"))
                       and not _untrusted(r)]
    return hw_events, hw_findings


def _untrusted(finding: dict[str, Any]) -> bool:
    """A finding read from a kernel-log file any user can write to (``logger -t kernel``):
    it alerts the operator but is no evidence that the machine slowed the job."""
    text = finding.get("evidence") or ""
    if "untrusted_source" not in text:
        return False
    try:
        return bool(json.loads(text).get("untrusted_source"))
    except (ValueError, AttributeError):
        return False


def load_job(store: Any, job_id: str, nodes: list[str] | None = None) -> JobData:
    """Read job ``job_id`` (on ``nodes``, default all) from ``store``.

    Raises :class:`gpuguard.store.StoreError` when the store cannot be read.
    """
    tables = _tables(store)
    nf, nparams = _node_filter(nodes)
    gpus = _load_gpus(store, job_id, nodes) if "gpu_series" in tables else {}
    step_cols = {r[1] for r in store.db.conn.execute("pragma table_info(steps)")} if "steps" in tables else set()
    if {"t", "step_time_s", "samples", "tokens", *_PHASES} <= step_cols:
        steps = _load_steps(store, job_id, nodes)
    else:
        steps = _load_steps_any(store, job_id, nf, nparams) if "steps" in tables else []
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
    names: dict[str, str] = {}
    if "inventory" in tables and gpus:
        inv = {(r["node"], r["uuid"]): r for r in store.query("select node, uuid, name from inventory")}
        for g in gpus.values():
            row = inv.get((g.node, g.gpu_uuid))
            if row and row["name"]:
                names[g.key] = str(row["name"])
            cap = capacity_from_name(row["name"]) if row else None
            if cap:
                caps[g.key] = cap
    gl = sorted(gpus.values(), key=lambda g: (g.node, g.gpu_index))
    from gpuguard.net.evidence import communication_evidence

    net = communication_evidence(store, job_nodes, start, end) if start is not None else {}
    data = JobData(job_id, job_nodes, start, end, gl, steps, [s.t for s in steps], host, ckpt,
                   hw_events, hw_findings, caps, net, gpu_names=names)
    if len(steps) < step_count(store, job_id, nodes, step_cols):
        data.exact_step_times = lambda t0, t1: step_times(store, job_id, nodes, t0, t1)
    return data


#: At most this many step records per job come back to Python; more are read as buckets
#: of whole seconds per (node, rank) holding the bucket's means (our choice: a day at one
#: step per second in 5 s buckets). The compared whole-job step-time percentiles stay exact
#: (:func:`step_times`, in SQL); only the long-window checks see bucket means.
MAX_STEP_RECORDS = 20_000


def _load_steps(store: Any, job_id: str, nodes: list[str] | None) -> list[StepRec]:
    """Step records of the store's own ``steps`` shape, as tuples (no dict per row)."""
    conn = store.db.conn
    nf, nparams = _node_filter(nodes)
    where = f"from steps where job_id = ?{nf} and t is not null"
    params = [job_id, *nparams]
    n, lo, hi, ranks = conn.execute(f"select count(*), min(t), max(t), count(distinct node || '/' || rank) {where}",
                                    params).fetchone()
    cols = "step_time_s, samples, tokens, data_wait_s, fwd_bwd_s, comm_s, optim_s"
    if n <= MAX_STEP_RECORDS:
        rows = conn.execute(f"select node, rank, t, {cols} {where} order by t", params)
    else:
        bucket_s = math.ceil((hi - lo) / max(1, MAX_STEP_RECORDS // max(ranks, 1)))
        avgs = ", ".join(f"avg({c})" for c in cols.split(", "))
        rows = conn.execute(f"select node, rank, max(t), {avgs} {where} "
                            f"group by node, rank, cast((t - ?) / ? as integer) order by 3", [*params, lo, bucket_s])
    # the ingest stored only finite numbers (gpuguard.collector.ingest): no per-value check
    return [StepRec(node, rank, float(t), st, sa, to, dw, fb, cm, op)
            for node, rank, t, st, sa, to, dw, fb, cm, op in rows]


def step_count(store: Any, job_id: str, nodes: list[str] | None, cols: set[str]) -> int:
    """Number of stored step records of the job (0 without a ``steps`` table)."""
    if "t" not in cols:
        return 0
    nf, nparams = _node_filter(nodes)
    return store.db.conn.execute(f"select count(*) from steps where job_id = ?{nf} and t is not null",
                                 [job_id, *nparams]).fetchone()[0]


def step_times(store: Any, job_id: str, nodes: list[str] | None, t0: float, t1: float) -> list[float]:
    """Every step time in ``[t0, t1)`` (record time ``t``), ascending, read by SQLite: exact
    percentiles also when :func:`load_job` bucketed the records."""
    nf, nparams = _node_filter(nodes)
    rows = store.db.conn.execute(f"select step_time_s from steps where job_id = ?{nf} and t >= ? and t < ? "
                                 "and step_time_s > 0", [job_id, *nparams, t0, t1])
    out = [r[0] for r in rows]
    out.sort()
    return out


#: GpuSeries attribute of each sampled metric the verdict reads as a mean per point (the
#: GPU metrics it compares: :func:`gpuguard.metrics.series_attrs`).
SERIES_ATTR = series_attrs()


def _load_gpus(store: Any, job_id: str, nodes: list[str] | None) -> dict[tuple[str, int], GpuSeries]:
    """The job's GPU series from the compact sample store, through the same bucketed pass
    as the job summary (:func:`gpuguard.samples.read_buckets`; the Epilog's verdict reuses
    the summary's result). A series of at most :data:`gpuguard.samples.MAX_POINTS` samples
    is read sample by sample; a longer one as buckets of whole seconds holding means
    (memory: max; a clock-event bit: set when active in at least half the bucket's samples;
    ECC: the bucket's max), so the verdict's memory does not grow with the job."""
    conn = store.db.conn
    out: dict[tuple[str, int], GpuSeries] = {}
    for sid, node, idx, uuid, t0 in samples.series_of(conn, job_id, nodes):
        b = samples.read_buckets(conn, sid, t0, cache=getattr(store, "memo", None))
        out[(node or "", idx)] = series_from_buckets(conn, node or "", idx, uuid, b)
    return out


def series_from_buckets(conn: Any, node: str, idx: int, uuid: str | None, b: samples.Buckets) -> GpuSeries:
    """One GPU's :class:`GpuSeries` from its :class:`gpuguard.samples.Buckets`: a point per
    bucket at its first sample time, holding the bucket's means (memory: max; a
    clock-event bit: set when active in at least half the bucket's samples; ECC: the
    largest ``gpu_slow`` reading in the bucket, for a sample-by-sample series the one at
    that sample's time)."""
    g = GpuSeries(node, idx, uuid)
    if not b.n:
        return g
    t0 = b.t0
    g.t = [t0 + x / 1000.0 for x in b.t_min]
    for name, a in SERIES_ATTR.items():
        sc = BY_NAME[name].scale
        setattr(g, a, [None if not c else v / c / sc for v, c in zip(b.sums[name], b.counts[name], strict=True)])
    sc = BY_NAME["mem_used_mib"].scale
    g.mem = [None if v is None else v / sc for v in b.maxes["mem_used_mib"]]
    mask = [0] * len(b.n)
    for bit, counts in b.bits.items():
        for i, (c, n) in enumerate(zip(counts, b.n, strict=True)):
            if c and 2 * c >= n:
                mask[i] |= bit
    g.mask = mask
    ecc_col = stored_column(BY_NAME["ecc_volatile_uncorrected"])
    group = b.group_sql()
    ecc = dict(conn.execute(f"select {group}, max({ecc_col}) from gpu_slow where sid = ? group by 1", (b.sid,)))
    if not b.bucket_ms:
        g.ecc_unc = [ecc.get(x) for x in b.t_min]
    else:
        off = round(t0 * 1000) if b.align_ms else 0
        g.ecc_unc = [ecc.get((x + off) // b.bucket_ms) for x in b.t_min]
    return g


def ecc_growth(g: GpuSeries) -> int:
    """Growth of the volatile uncorrectable ECC count over the job's samples."""
    vals = [v for v in g.ecc_unc if v is not None]
    return int(max(vals) - vals[0]) if vals else 0


def _slow_cum(g: GpuSeries) -> list[list[int]]:
    """Per slowdown reason, the running count of samples with it active (``[0]`` + one
    entry per sample), computed once per series: a window's count is two lookups."""
    cum = getattr(g, "_slow_cum", None)
    if cum is None or len(cum[0]) != len(g.mask) + 1:
        import numpy as np

        mask = g.array("mask")
        cum = [np.concatenate([[0], np.cumsum((mask & CLOCK_EVENT_REASONS[r][0]) != 0)]).tolist()
               for r in SLOWDOWN_REASONS]
        g._slow_cum = cum  # type: ignore[attr-defined]
    return cum


def reasons_share(gpus: list[GpuSeries], t0: float, t1: float) -> dict[str, float]:
    """Share (0-1) of GPU samples in ``[t0, t1)`` with each slowdown reason active."""
    counts = [0] * len(SLOWDOWN_REASONS)
    total = 0
    for g in gpus:
        i, j = g.span(t0, t1)
        total += j - i
        for k, run in enumerate(_slow_cum(g)):
            counts[k] += run[j] - run[i]
    return {r: counts[k] / total for k, r in enumerate(SLOWDOWN_REASONS) if total and counts[k]}
