"""The per-(job, node) summary the Epilog writes: GPU, host and training metrics of one job.

:func:`summarize_job` reads what the store holds for the job on one node — the
collector's ``samples`` and ``host_samples``, the ingested ``steps`` and ``checkpoints``,
``events`` and the epilog's own health run — and returns a :class:`JobSummary`;
:func:`save_summary` upserts it into ``job_summaries`` (primary key job_id + node).

Conventions:

* Units are in the names (DESIGN.md, "Storage"): ``_pct`` is 0-100, ``_s`` seconds,
  ``_mib`` MiB, ``_w`` watts, ``_c`` degrees Celsius, ``_mhz`` MHz; times ``*_at`` are
  UTC epoch seconds. ``None`` means "no data" (no samples, a field the GPU does not
  report, no training records), never zero.
* Percentiles are **nearest-rank** (:func:`percentile`): the p-th percentile of n sorted
  values is the value at 1-based rank ``ceil(p/100 * n)``, always an observed value, so
  tests can state exact results. This is Hyndman & Fan's definition 1 / the "nearest rank"
  method; it is *not* :func:`statistics.quantiles` (which interpolates).
* The job window is ``(started_at, ended_at]``: ``started_at`` is the end of this job's
  latest Prolog health run on the node (so the XIDs the Prolog itself found are not
  counted, and a requeued job with the same id is summarised from its last attempt),
  ``ended_at`` the Epilog's time. Without a Prolog run the window is open at the start
  and events are matched by job id instead. Samples are counted by insertion order: every
  sample of the job stored from the first one stamped after ``started_at`` on, whatever
  later stamps say (a clock stepped back or forward during the job).

Every statistic is the metric table's (:mod:`gpuguard.metrics`), computed by SQLite
over the compact sample store (:mod:`gpuguard.samples`): no Python object per sample, so
memory does not grow with the job (``bench/epilog_summary.py``: 24 h and 7 days x 8 GPUs
at 1 s).
"""

from __future__ import annotations

import json
import sqlite3
import time
from typing import Any

from gpuguard import samples
from gpuguard.epilog.summary_doc import (
    COLLECTOR_STATUSES,
    METRICS,
    SUMMARY_VERSION,
    ExitStatus,
    GpuSummary,
    JobSummary,
    decode_exit_status,
)
from gpuguard.metrics import (
    BY_NAME,
    GPU_SAMPLED,
    GPU_SLOW,
    percentile,
    percentile_hist,
    stored_column,
)
from gpuguard.metrics import METRICS as METRIC_TABLE
from gpuguard.model import CLOCK_EVENT_REASONS
from gpuguard.store import StoreError

# Re-exported names (the document's types live in summary_doc).
__all__ = [
    "COLLECTOR_STATUSES",
    "MAX_EVENTS_LISTED",
    "MAX_GAP_FACTOR",
    "MAX_WINDOWS",
    "METRICS",
    "SUMMARY_VERSION",
    "XID_KINDS",
    "ExitStatus",
    "GpuSummary",
    "JobSummary",
    "decode_exit_status",
    "load_summaries",
    "save_summary",
    "summarize_job",
]

#: ``events.kind`` values that are GPU hardware events (gpuguard.xid.parse kinds).
XID_KINDS = ("xid", "sxid", "fallen_off_bus")

#: Sample intervals longer than this many times the GPU's median interval are cut to it
#: when integrating clock-event seconds: a collector stall must not turn one throttled
#: sample into minutes of throttling.
MAX_GAP_FACTOR = 3.0

#: At most this many windows per series in :attr:`JobSummary.windows`: longer jobs get
#: wider windows (our choice: a 24 h job at the default 60 s is 1,440; 7 days get 7 min).
MAX_WINDOWS = 1500


#: At most this many XID events are listed in the summary (all are counted).
MAX_EVENTS_LISTED = 50

def _r(x: float | None, nd: int = 3) -> float | None:
    """Round for storage/display; ``None`` stays ``None``."""
    return None if x is None else round(x, nd)


# -- computing it ------------------------------------------------------------------------
def _job_window(store: Any, job_id: str, node: str) -> float | None:
    rows = store.query(
        "select finished_at from health_runs where node = ? and job_id = ? and hook = 'prolog' "
        "order by id desc limit 1", [node, job_id])
    return rows[0]["finished_at"] if rows else None


def _first_rowid(store: Any, table: str, job_id: str, node: str, started_at: float | None) -> int:
    """The first row of this attempt of the job: the earliest (by rowid) row stamped at or
    after ``started_at``; every later row belongs to the attempt whatever its stamp (a
    clock step). All of the job's rows when none is (the clock stepped back before the
    first sample) or when there is no window."""
    if started_at is None:
        return 0
    rows = store.query(f"select min(rowid) as r from {table} where job_id = ? and node = ? and at >= ?",
                       [job_id, node, started_at])
    return rows[0]["r"] if rows and rows[0]["r"] is not None else 0


def _reasons_s(b: samples.Buckets, per_sample_s: list[float], cap_s: float) -> dict[str, float]:
    """Seconds each clock-event reason was active on one GPU: each sample's reasons hold
    until the next sample (left-point rule; the last sample adds nothing), each sample's
    share (``per_sample_s``: :meth:`~gpuguard.samples.Buckets.per_sample_s`; exact for a
    series read sample by sample, per bucket for a long one) cut to ``cap_s``."""
    per = [min(x, cap_s) for x in per_sample_s]
    out: dict[str, float] = {}
    for name, (bit, _label) in CLOCK_EVENT_REASONS.items():
        s = sum(c * w for c, w in zip(b.bits[bit], per, strict=True) if c)
        if s:
            out[name] = s
    return out


_MEANS = [m for m in GPU_SAMPLED if "mean" in m.stats]
_MAXES = [m for m in GPU_SAMPLED if {"max", "peak"} & set(m.stats)]
_PCTS = [BY_NAME[name] for name in samples.PCT_SAMPLED]


def _max_stat(m: Any) -> str:
    return "peak" if "peak" in m.stats else "max"


def _slow_increase(conn: Any, sid: int, lo: int, hi: int) -> dict[str, int | None]:
    """Growth (last - first, >= 0; max - first for a counter that reset) of each slow counter."""
    out: dict[str, int | None] = {}
    for m in GPU_SLOW:
        c = stored_column(m)
        first = conn.execute(f"select {c} from gpu_slow where sid = ? and t_ms between ? and ? and {c} is not null "
                             "order by t_ms limit 1", (sid, lo, hi)).fetchone()
        top = conn.execute(f"select max({c}) from gpu_slow where sid = ? and t_ms between ? and ?",
                           (sid, lo, hi)).fetchone()
        out[m.name] = None if first is None else max(top[0] - first[0], 0)
    return out


def _gpu_part(summary: JobSummary, conn: Any, series: list[tuple], start: float | None, end: float | None,
              memo: dict[Any, Any] | None = None, align_s: float | None = None) -> None:
    """Fill the GPU fields from the compact sample store: one bucketed pass per GPU
    (:func:`gpuguard.samples.read_buckets`, buckets aligned on ``align_s``; reused by the
    spool part, :mod:`gpuguard.epilog.nodepart`) plus one ``GROUP BY`` per percentile
    metric, all in SQLite over integer-scaled columns, so memory does not grow with the
    job's length."""
    pooled = {m.name: [0, 0] for m in _MEANS}
    pooled_max: dict[str, float | None] = {m.name: None for m in _MAXES}
    hists: dict[str, dict[int, int]] = {m.name: {} for m in _PCTS}
    inc_total: dict[str, int | None] = {m.name: None for m in GPU_SLOW}
    reasons: dict[str, float] = {}
    all_dt: dict[int, int] = {}
    firsts: list[float] = []
    lasts: list[float] = []
    for sid, _node, idx, uuid, t0 in series:
        lo, hi = samples.t_range(t0, start, end)
        if not conn.execute("select 1 from gpu_samples where sid = ? and t_ms >= ? limit 1", (sid, lo)).fetchone():
            lo = -(2**62)  # nothing stamped after the start: the clock stepped back before the first sample
        b = samples.read_buckets(conn, sid, t0, lo, hi, cache=memo, align_s=align_s)
        n = sum(b.n)
        if not n:
            continue
        summary.sample_count += n
        firsts.append(t0 + b.t_min[0] / 1000.0)
        lasts.append(t0 + b.t_max[-1] / 1000.0)
        g = GpuSummary(gpu_index=idx, gpu_uuid=uuid, sample_count=n)
        for m in _MEANS:
            s_, c_ = sum(x for x in b.sums[m.name] if x is not None), sum(b.counts[m.name])
            if c_:
                setattr(g, m.field("mean"), _r(s_ / c_ / m.scale))
                pooled[m.name][0] += s_
                pooled[m.name][1] += c_
        for m in _MAXES:
            top = max((x for x in b.maxes[m.name] if x is not None), default=None)
            v = None if top is None else top / m.scale
            setattr(g, m.field(_max_stat(m)), v)
            if v is not None:
                pooled_max[m.name] = v if pooled_max[m.name] is None else max(pooled_max[m.name], v)
        _count_values(conn, b, sid, lo, hi, hists)
        for name, inc in _slow_increase(conn, sid, lo, hi).items():
            setattr(g, BY_NAME[name].field("increase"), inc)
            if inc is not None:
                inc_total[name] = (inc_total[name] or 0) + inc
        dts: dict[int, int] = {}
        per_sample = b.per_sample_s()
        for w, k in zip(per_sample[:-1], b.n[:-1], strict=True):
            ms = round(w * 1000)
            dts[ms] = dts.get(ms, 0) + k
            all_dt[ms] = all_dt.get(ms, 0) + k
        med = _median_hist(dts)
        g_reasons = _reasons_s(b, per_sample, med * MAX_GAP_FACTOR / 1000.0) if med is not None else {}
        g.clock_event_s = {k: _r(v) for k, v in g_reasons.items()}
        for k, v in g_reasons.items():
            reasons[k] = reasons.get(k, 0.0) + v
        summary.gpus.append(g)
    summary.first_sample_at = min(firsts) if firsts else None
    summary.last_sample_at = max(lasts) if lasts else None
    med = _median_hist(all_dt)
    summary.sample_interval_s = None if med is None else _r(med / 1000.0)
    for m in _MEANS:
        s_, c_ = pooled[m.name]
        setattr(summary, m.field("mean"), _r(s_ / c_ / m.scale) if c_ else None)
    for m in _MAXES:
        setattr(summary, m.field(_max_stat(m)), pooled_max[m.name])
    for m in _PCTS:
        hist = sorted(hists[m.name].items())
        for st in m.stats:
            if st.startswith("p") and st[1:].isdigit():
                v = percentile_hist(hist, float(st[1:]))
                setattr(summary, m.field(st), None if v is None else v / m.scale)
    for name, inc in inc_total.items():
        setattr(summary, BY_NAME[name].field("increase"), inc)
    summary.clock_event_gpu_s = {k: _r(v) for k, v in reasons.items()}


def _count_values(conn: Any, b: samples.Buckets, sid: int, lo: int, hi: int, hists: dict[str, dict[int, int]]) -> None:
    """Add series ``sid``'s values of each percentile metric in ``t_ms`` ``[lo, hi]`` to
    ``hists`` (``{metric: {stored value: count}}``): the collector's closed minutes'
    counts over ``b.live_ms``, one ``GROUP BY`` over the raw rows around them."""
    for m in _PCTS:
        h = hists[m.name]
        c = stored_column(m)
        outside, params = "", (sid, lo, hi)
        if b.live_ms is not None:
            outside, params = " and (t_ms < ? or t_ms >= ?)", (sid, lo, hi, *b.live_ms)
            for v, k in b.live_hists.get(m.name, {}).items():
                h[v] = h.get(v, 0) + k
        for v, k in conn.execute(f"select {c}, count(*) from gpu_samples where sid = ? and t_ms between ? and ? "
                                 f"and {c} is not null{outside} group by 1", params):
            h[v] = h.get(v, 0) + k


def _median_hist(h: dict[int, int]) -> float | None:
    """Median (mean of the two middle values for an even count, as ``statistics.median``)
    of a ``{value: count}`` histogram."""
    n = sum(h.values())
    if not n:
        return None
    items = sorted(h.items())
    lo_rank, hi_rank = (n + 1) // 2, n // 2 + 1
    lo = hi = None
    seen = 0
    for v, c in items:
        seen += c
        if lo is None and seen >= lo_rank:
            lo = v
        if seen >= hi_rank:
            hi = v
            break
    return (lo + hi) / 2.0  # type: ignore[operator]


def _step_part(summary: JobSummary, conn: Any, job_id: str, node: str) -> None:
    """Training fields from the ``steps`` and ``checkpoints`` rows of the job, aggregated
    by SQLite (one column of step times comes back to Python, for the percentiles).

    Throughput: for each rank, the samples (tokens) of its records that carry a count
    and a positive step time, divided by those records' summed step time; the node's
    throughput is the sum over ranks (data-parallel ranks add up). Shares: summed phase
    time over summed step time of the records that report that phase. Checkpoint time:
    each rank's summed checkpoint durations; the busiest rank counts (ranks checkpoint
    in parallel, so adding them would overstate the wall time lost).
    """
    key = "from steps where job_id = ? and node = ?"
    p = (job_id, node)
    # one pass grouped by rank for the counts, throughput and shares (the shares' sums
    # are over records with a step time), one over the covering index for the steps
    pos, has = "case when step_time_s > 0 and {0} is not null then {1} end", "case when {0} is not null then {1} end"
    per_rank = conn.execute(
        "select rank, count(*), coalesce(sum(case when loss_nonfinite then 1 else 0 end), 0), "
        f"sum({pos.format('samples', 'samples')}), sum({pos.format('samples', 'step_time_s')}), "
        f"sum({pos.format('tokens', 'tokens')}), sum({pos.format('tokens', 'step_time_s')}), "
        f"sum({has.format('step_time_s', 'data_wait_s')}), "
        f"sum({has.format('step_time_s is not null and data_wait_s', 'step_time_s')}), "
        f"sum({has.format('step_time_s', 'comm_s')}), sum({has.format('step_time_s is not null and comm_s', 'step_time_s')}) "
        f"{key} group by rank", p).fetchall()
    summary.step_records = sum(r[1] for r in per_rank)
    summary.steps = conn.execute(f"select count(distinct step) {key}", p).fetchone()[0] if per_rank else 0
    summary.ranks = sum(1 for r in per_rank if r[0] is not None)
    summary.nonfinite_loss_count = sum(r[2] for r in per_rank)
    times = [r[0] for r in conn.execute(f"select step_time_s {key} and step_time_s is not null", p)]
    times.sort()
    m = BY_NAME["step_time_s"]
    for st in m.stats:
        setattr(summary, m.field(st), percentile(times, float(st[1:])))
    sps = [ns / s_t for _r0, _n, _nf, ns, s_t, _nt, _tt, *_rest in per_rank if s_t]
    tps = [nt / t_t for _r0, _n, _nf, _ns, _st, nt, t_t, *_rest in per_rank if t_t]
    summary.throughput_samples_per_s = _r(sum(sps)) if sps else None
    summary.throughput_tokens_per_s = _r(sum(tps)) if tps else None

    def total(i: int) -> float | None:
        vals = [r[i] for r in per_rank if r[i] is not None]
        return sum(vals) if vals else None

    dw, dw_t, cm, cm_t = total(7), total(8), total(9), total(10)
    summary.data_wait_share_pct = _r(100.0 * dw / dw_t) if dw_t else None
    summary.comm_share_pct = _r(100.0 * cm / cm_t) if cm_t else None
    busiest = conn.execute("select sum(coalesce(duration_s, 0)), count(*) from checkpoints "
                           "where job_id = ? and node = ? group by rank order by 1 desc limit 1", p).fetchone()
    if busiest:
        summary.checkpoint_total_s = _r(busiest[0])
        summary.checkpoint_count = busiest[1]


def _host_part(summary: JobSummary, conn: Any, job_id: str, node: str, first_rowid: int) -> None:
    """Host fields of the metric table (``host`` scope) from ``host_samples`` rows of the
    attempt (rowid from ``first_rowid``: insertion order, see :func:`_first_rowid`)."""
    ms = [m for m in METRIC_TABLE if m.scope == "host"]
    sel = ["count(*)"]
    for m in ms:
        for st in m.stats:
            if st == "mean":
                sel.append(f"avg({m.name})")
            elif st in ("max", "peak"):
                sel.append(f"max({m.name})")
            elif st == "increase":  # cumulative since the job started: last minus first
                sel.append(f"max({m.name}) - min({m.name})")
    row = conn.execute(f"select {', '.join(sel)} from host_samples where job_id = ? and node = ? and rowid >= ?",
                       (job_id, node, first_rowid)).fetchone()
    summary.host_sample_count = row[0]
    i = 1
    for m in ms:
        for st in m.stats:
            v = row[i]
            setattr(summary, m.field(st), None if v is None else (_r(v) if st != "peak" else v))
            i += 1


def _events_part(summary: JobSummary, store: Any, job_id: str, node: str) -> None:
    kinds = ",".join("?" * len(XID_KINDS))
    cols = "at, kind, code, gpu_index, pci_bus_id, action, message"
    if summary.started_at is not None:
        rows = store.query(
            f"select {cols} from events where node = ? and kind in ({kinds}) and at > ? and at <= ? order by at, id",
            [node, *XID_KINDS, summary.started_at, summary.ended_at])
    else:
        rows = store.query(
            f"select {cols} from events where node = ? and kind in ({kinds}) and job_id = ? order by at, id",
            [node, *XID_KINDS, job_id])
    summary.xid_event_count = len(rows)
    summary.xid_events = rows[:MAX_EVENTS_LISTED]


def _post_job_part(summary: JobSummary, store: Any, job_id: str, node: str) -> None:
    runs = store.query(
        "select id, decision, reason from health_runs where node = ? and job_id = ? and hook = 'epilog' "
        "order by id desc limit 1", [node, job_id])
    if not runs:
        return
    fs = store.query("select code, severity, action, gpu_index from findings where run_id = ? order by id",
                     [runs[0]["id"]])
    summary.post_job = {"outcome": runs[0]["decision"], "reason": runs[0]["reason"], "findings": fs}


def summarize_job(store: Any, job_id: str, node: str, *, exit_status_raw: int | None,
                  collector_status: str = "unknown", ingest: Any = None,
                  started_at: float | None = None, ended_at: float | None = None,
                  window_s: float | None = None, max_windows: int = MAX_WINDOWS,
                  window_align_s: float | None = None) -> JobSummary:
    """Summarise job ``job_id`` on ``node`` from ``store`` (a :class:`gpuguard.store.Store`).

    * ``exit_status_raw``: ``SLURM_JOB_EXIT_CODE`` as an int (raw wait status), or None;
    * ``collector_status``: one of :data:`COLLECTOR_STATUSES` (``ValueError`` otherwise);
    * ``ingest``: the collector's ``IngestResult`` (``malformed``, ``rejected_files``,
      ``truncated``) or None when nothing was ingested;
    * ``started_at``/``ended_at``: the job window (module docstring); default: the end of
      the job's latest Prolog run on ``node``, and now;
    * ``window_align_s``: the spool part's first window width (``[verdict]
      short_window_s``): a long GPU series is then read in buckets aligned on it
      (:func:`gpuguard.samples.read_buckets`), so that this node's part
      (:func:`gpuguard.epilog.nodepart.build_node_part`) reuses this pass.

    Reads only; raises :class:`gpuguard.store.StoreError` when the store cannot be read.
    """
    if collector_status not in COLLECTOR_STATUSES:
        raise ValueError(f"collector_status must be one of {', '.join(COLLECTOR_STATUSES)}, got {collector_status!r}")
    now = time.time()
    if started_at is None:
        started_at = _job_window(store, job_id, node)
    ended_at = now if ended_at is None else ended_at
    ex = decode_exit_status(exit_status_raw)
    s = JobSummary(job_id=str(job_id), node=node, created_at=now, started_at=started_at, ended_at=ended_at,
                   exit_status_raw=exit_status_raw, exit_code=ex.code, exit_signal=ex.signal, exit_text=ex.text,
                   collector_status=collector_status)
    # Samples of this attempt are counted from the first one stamped at or after the
    # attempt's start, with no upper bound: the collector is stopped before the summary,
    # and a clock stepped back during the job leaves later samples stamped before the
    # window (the store's per-GPU timeline stays monotonic: gpuguard.samples.write).
    conn = store.db.conn
    from gpuguard.beside import Beside

    try:
        # the training steps are read on a second connection while this one reads the GPUs
        steps = Beside(store, lambda reader: _step_part(s, reader.db.conn, job_id, node))
        try:
            _gpu_part(s, conn, samples.series_of(conn, job_id, [node]), started_at, None,
                      getattr(store, "memo", None), window_align_s)
            _host_part(s, conn, job_id, node, _first_rowid(store, "host_samples", job_id, node, started_at))
        finally:
            steps.result()
        if window_s is not None:
            s.windows = _windows_part(s, conn, job_id, node, window_s, max_windows, getattr(store, "memo", None))
    except sqlite3.Error as e:
        raise StoreError(f"store {store.path}: job summary read failed: {e}") from None
    _events_part(s, store, job_id, node)
    _post_job_part(s, store, job_id, node)
    if ingest is not None:
        s.malformed_records = int(getattr(ingest, "malformed", 0) or 0)
        s.rejected_files = [[str(a), str(b)] for a, b in (getattr(ingest, "rejected_files", None) or [])]
        s.records_truncated = bool(getattr(ingest, "truncated", False))
    return s


def _windows_part(s: JobSummary, conn: Any, job_id: str, node: str, window_s: float,
                  max_windows: int, memo: dict[Any, Any] | None) -> dict[str, Any] | None:
    """:attr:`JobSummary.windows` from the same bucketed pass as the GPU fields (cached)
    and one grouped query over the steps."""
    if window_s <= 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    if s.first_sample_at is None:
        return None
    start = s.first_sample_at
    width = max(window_s, (s.last_sample_at - start) / max_windows)  # type: ignore[operator]
    count = int((s.last_sample_at - start) // width) + 1  # type: ignore[operator]
    out: dict[str, Any] = {"window_s": width, "start": start, "count": count, "gpus": {}, "ranks": {}}
    for sid, _n, idx, _u, t0 in samples.series_of(conn, job_id, [node]):
        lo, hi = samples.t_range(t0, s.started_at, None)
        if not conn.execute("select 1 from gpu_samples where sid = ? and t_ms >= ? limit 1", (sid, lo)).fetchone():
            lo = -(2**62)
        out["gpus"][str(idx)] = samples.windows_of(samples.read_buckets(conn, sid, t0, lo, hi, cache=memo), start, width, count)
    ranks: dict[str, dict[str, list[Any]]] = {}
    for rank, k, n, st, sa, to in conn.execute(
            "select rank, cast((t - ?) / ? as integer) as k, count(*), sum(step_time_s), sum(samples), sum(tokens) "
            "from steps where job_id = ? and node = ? and t >= ? group by rank, k", (start, width, job_id, node, start)):
        if not 0 <= k < count:
            continue
        r = ranks.setdefault(f"{node}/{rank}", {f: [None] * count for f in
                                                ("n", "step_time_s_sum", "samples_sum", "tokens_sum")})
        r["n"][k], r["step_time_s_sum"][k], r["samples_sum"][k], r["tokens_sum"][k] = n, st, sa, to
    out["ranks"] = ranks
    return out


def save_summary(store: Any, summary: JobSummary) -> None:
    """Upsert ``summary`` into ``job_summaries`` (one row per job and node; a rerun of
    the epilog replaces it). Raises :class:`gpuguard.store.StoreError`."""
    row = {
        "job_id": summary.job_id, "node": summary.node, "created_at": summary.created_at,
        "started_at": summary.started_at, "ended_at": summary.ended_at,
        "exit_status_raw": summary.exit_status_raw, "exit_code": summary.exit_code,
        "exit_signal": summary.exit_signal, "collector_status": summary.collector_status,
        "sample_count": summary.sample_count, "step_records": summary.step_records,
        "summary_version": summary.version,
        "summary": json.dumps({k: v for k, v in summary.to_dict().items() if k != "windows"}, default=str),
    }

    try:
        with store.tx():
            store.db["job_summaries"].upsert(row, pk=("job_id", "node"))
    except sqlite3.Error as e:
        raise StoreError(f"store {store.path}: job summary write failed: {e}") from None


def load_summaries(store: Any, job_id: str) -> list[JobSummary]:
    """Every node's stored summary of ``job_id``, by node name. Raises
    :class:`gpuguard.store.StoreError`."""
    rows = store.query("select summary from job_summaries where job_id = ? order by node", [str(job_id)])
    return [JobSummary.from_dict(json.loads(r["summary"])) for r in rows]
