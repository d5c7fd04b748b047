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

Only the standard library is used (``statistics``, ``math``): the Epilog's budget
(issue 3) is a 1-hour, 4-GPU job at 1 s sampling — 14,400 sample rows, 3,600 steps —
in at most 2 s; ``bench/epilog_summary.py`` measures it.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import signal
import sqlite3
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuguard.model import CLOCK_EVENT_REASONS
from gpuguard.store import StoreError

#: Bump when a field's meaning changes; stored beside the summary.
SUMMARY_VERSION = 1

#: ``events.kind`` values that are GPU hardware events (gpuguard.xid.parse kinds).
XID_KINDS = ("xid", "sxid", "fallen_off_bus")

#: What :attr:`JobSummary.collector_status` can say, with its meaning.
COLLECTOR_STATUSES = {
    "ok": "running until the epilog stopped it",
    "died": "its pid file named a process that was gone before the epilog",
    "never_started": "no pid file: the prolog did not start it (disabled, or it failed)",
    "did_not_exit": "still running after SIGTERM and the bounded wait",
    "unknown": "the epilog could not stop or ask it (tool error)",
}

#: Sample intervals longer than this many times the GPU's median interval are cut to it
#: when integrating clock-event seconds: a collector stall must not turn one throttled
#: sample into minutes of throttling.
MAX_GAP_FACTOR = 3.0

#: At most this many XID events are listed in the summary (all are counted).
MAX_EVENTS_LISTED = 50

#: Scalar metrics: name -> (unit, description). The order is the display order of
#: ``gpuguard job show``; issue 4's baselines (median/MAD per template) iterate over it.
METRICS: dict[str, tuple[str, str]] = {
    "gpu_util_mean_pct": ("%", "GPU utilisation, mean over all samples of all GPUs"),
    "gpu_util_p95_pct": ("%", "GPU utilisation, p95 (nearest rank) over all samples"),
    "mem_used_peak_mib": ("MiB", "GPU memory used, peak over all GPUs"),
    "power_mean_w": ("W", "GPU power, mean over all samples"),
    "temp_max_c": ("C", "GPU temperature, maximum"),
    "sm_clock_mean_mhz": ("MHz", "SM clock, mean over all samples"),
    "ecc_volatile_uncorrected_increase": ("errors", "volatile uncorrectable ECC errors that appeared during the job"),
    "xid_event_count": ("events", "XID/SXid events on this node during the job"),
    "step_time_p50_s": ("s", "step time, median (nearest rank)"),
    "step_time_p95_s": ("s", "step time, p95 (nearest rank)"),
    "step_time_p99_s": ("s", "step time, p99 (nearest rank)"),
    "throughput_samples_per_s": ("samples/s", "training throughput, summed over ranks"),
    "throughput_tokens_per_s": ("tokens/s", "training throughput, summed over ranks"),
    "data_wait_share_pct": ("%", "share of step time spent waiting for data"),
    "comm_share_pct": ("%", "share of step time spent in communication"),
    "checkpoint_total_s": ("s", "time spent writing checkpoints (busiest rank)"),
    "host_cpu_mean_pct": ("%", "job CPU use, mean"),
    "host_rss_peak_mib": ("MiB", "job host memory (RSS), peak"),
}


# -- small statistics ------------------------------------------------------------------
def percentile(sorted_values: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile of an ascending sequence: the value at 1-based rank
    ``ceil(p / 100 * n)`` (rank 1 for ``p = 0``). ``None`` for an empty sequence.

    Raises ``ValueError`` for ``p`` outside 0..100. Example: p95 of 1..20 is 19,
    p50 of 1..4 is 2.
    """
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be within 0..100, got {p}")
    n = len(sorted_values)
    if n == 0:
        return None
    rank = max(1, math.ceil(p / 100 * n))
    return sorted_values[rank - 1]


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _max(values: list[float]) -> float | None:
    return max(values) if values else None


def _r(x: float | None, nd: int = 3) -> float | None:
    """Round for storage/display; ``None`` stays ``None``."""
    return None if x is None else round(x, nd)


# -- exit status -------------------------------------------------------------------------
@dataclass
class ExitStatus:
    """A decoded wait status. Exactly one of ``code`` / ``signal`` is set unless ``raw``
    is None (unknown)."""

    raw: int | None
    code: int | None = None
    signal: int | None = None
    core_dumped: bool = False

    @property
    def text(self) -> str:
        """``exit 3``, ``signal 9 (SIGKILL)``, ``unknown``."""
        if self.code is not None:
            return f"exit {self.code}"
        if self.signal is not None:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = "?"
            return f"signal {self.signal} ({name})" + (" core dumped" if self.core_dumped else "")
        return "unknown"


def decode_exit_status(raw: int | None) -> ExitStatus:
    """Decode ``SLURM_JOB_EXIT_CODE``, a raw ``waitpid()`` status (slurm.conf(5),
    "Prolog and Epilog Scripts": the Epilog gets the batch script's exit status as
    ``SLURM_JOB_EXIT_CODE``; SLURM-FACTS.md §4 measured ``exit 3`` -> ``768`` and a
    SIGKILLed batch shell -> ``9``).

    Low 7 bits zero: normal exit, code = bits 8-15 (``768`` -> exit 3). Otherwise the
    low 7 bits are the terminating signal and bit 7 the core-dump flag (``9`` -> signal 9).

    Caveat (SLURM-FACTS.md §4): a job cancelled with ``scancel`` or killed at its time
    limit reads ``0`` here, exactly like a success; the final state (CANCELLED, TIMEOUT)
    is only in sacct after the job has left the queue. ``0`` therefore means "the batch
    script did not report a failure", not "the job completed".
    """
    if raw is None:
        return ExitStatus(None)
    if raw & 0x7F == 0:
        return ExitStatus(raw, code=(raw >> 8) & 0xFF)
    return ExitStatus(raw, signal=raw & 0x7F, core_dumped=bool(raw & 0x80))


# -- the summary -------------------------------------------------------------------------
@dataclass
class GpuSummary:
    """One GPU of the job (issue 4's straggler-GPU verdict compares these with each
    other). ``clock_event_s``: reason name -> seconds that reason was active."""

    gpu_index: int
    gpu_uuid: str | None
    sample_count: int
    gpu_util_mean_pct: float | None = None
    sm_clock_mean_mhz: float | None = None
    power_mean_w: float | None = None
    temp_max_c: float | None = None
    mem_used_peak_mib: float | None = None
    ecc_volatile_uncorrected_increase: int | None = None
    clock_event_s: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class JobSummary:
    """Everything the Epilog knows about one job on one node. Field units are in the
    names (module docstring); :data:`METRICS` lists the scalar metrics.

    * ``exit_*``: the decoded ``SLURM_JOB_EXIT_CODE`` (:func:`decode_exit_status`);
    * ``collector_status``: one of :data:`COLLECTOR_STATUSES`;
    * ``clock_event_gpu_s``: reason name -> GPU-seconds (summed over the job's GPUs) the
      reason was active; per-GPU seconds are in ``gpus[i].clock_event_s``;
    * ``xid_events``: up to :data:`MAX_EVENTS_LISTED` dicts ``{at, kind, code, gpu_index,
      pci_bus_id, action, message}``; ``xid_event_count`` counts them all;
    * ``step_records``: step records of all ranks; ``steps``: distinct step numbers;
    * ``malformed_records``/``rejected_files``/``records_truncated``: from the ingest of
      the job directory (``rejected_files`` is a list of ``[name, why]``);
    * ``post_job``: the epilog health run (``{outcome, reason, findings: [{code,
      severity, action, gpu_index}]}``) or None.
    """

    job_id: str
    node: str
    version: int = SUMMARY_VERSION
    created_at: float | None = None
    started_at: float | None = None
    ended_at: float | None = None
    exit_status_raw: int | None = None
    exit_code: int | None = None
    exit_signal: int | None = None
    exit_text: str = "unknown"
    collector_status: str = "unknown"
    #: times the supervisor restarted a killed collector, and the seconds it was down
    #: (death to restart, summed; :mod:`gpuguard.collector.supervise`)
    collector_restarts: int = 0
    collector_down_s: float | None = None
    sample_count: int = 0
    first_sample_at: float | None = None
    last_sample_at: float | None = None
    sample_interval_s: float | None = None
    gpus: list[GpuSummary] = field(default_factory=list)
    gpu_util_mean_pct: float | None = None
    gpu_util_p95_pct: float | None = None
    mem_used_peak_mib: float | None = None
    power_mean_w: float | None = None
    temp_max_c: float | None = None
    sm_clock_mean_mhz: float | None = None
    clock_event_gpu_s: dict[str, float] = field(default_factory=dict)
    ecc_volatile_uncorrected_increase: int | None = None
    xid_event_count: int = 0
    xid_events: list[dict[str, Any]] = field(default_factory=list)
    host_sample_count: int = 0
    host_cpu_mean_pct: float | None = None
    host_rss_peak_mib: float | None = None
    step_records: int = 0
    steps: int = 0
    ranks: int = 0
    step_time_p50_s: float | None = None
    step_time_p95_s: float | None = None
    step_time_p99_s: float | None = None
    throughput_samples_per_s: float | None = None
    throughput_tokens_per_s: float | None = None
    data_wait_share_pct: float | None = None
    comm_share_pct: float | None = None
    checkpoint_count: int = 0
    checkpoint_total_s: float | None = None
    nonfinite_loss_count: int = 0
    malformed_records: int = 0
    rejected_files: list[list[str]] = field(default_factory=list)
    records_truncated: bool = False
    post_job: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (nested :class:`GpuSummary` become dicts)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobSummary:
        """Inverse of :meth:`to_dict`; keys this version does not know are ignored (a
        newer gpuguard may have written them)."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        gnames = {f.name for f in dataclasses.fields(GpuSummary)}
        kw["gpus"] = [GpuSummary(**{k: v for k, v in g.items() if k in gnames}) for g in d.get("gpus") or []]
        return cls(**kw)

    def metrics(self) -> dict[str, float | int | None]:
        """The :data:`METRICS` as ``name -> value``."""
        return {name: getattr(self, name) for name in METRICS}


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


def _integrate_reasons(ats: list[float], masks: list[int | None]) -> dict[str, float]:
    """Seconds each clock-event reason was active on one GPU: each sample's reasons hold
    until the next sample (left-point rule; the last sample adds nothing), each interval
    cut to :data:`MAX_GAP_FACTOR` times the median interval. A ``None`` mask adds nothing."""
    if len(ats) < 2:
        return {}
    diffs = [max(0.0, b - a) for a, b in itertools.pairwise(ats)]  # a clock step back: 0
    cap = statistics.median(diffs) * MAX_GAP_FACTOR
    by_mask: dict[int, float] = {}
    for mask, dt in zip(masks[:-1], diffs, strict=True):
        if mask:
            by_mask[mask] = by_mask.get(mask, 0.0) + min(dt, cap)
    out: dict[str, float] = {}
    for name, (bit, _label) in CLOCK_EVENT_REASONS.items():
        s = sum(v for m, v in by_mask.items() if m & bit)
        if s:
            out[name] = s
    return out


def _gpu_part(summary: JobSummary, rows: list[tuple]) -> None:
    """Fill the GPU fields from sample rows ``(gpu_index, gpu_uuid, at, util, mem, power,
    temp, sm, mask, ecc)`` ordered by GPU then time."""
    utils: list[float] = []
    mems: list[float] = []
    powers: list[float] = []
    temps: list[float] = []
    sms: list[float] = []
    ecc_total: int | None = None
    reasons: dict[str, float] = {}
    intervals: list[float] = []
    by_gpu: dict[int, list[tuple]] = {}
    for r in rows:
        by_gpu.setdefault(r[0], []).append(r)
    for idx, grows in by_gpu.items():
        g_util = [r[3] for r in grows if r[3] is not None]
        g_mem = [r[4] for r in grows if r[4] is not None]
        g_pow = [r[5] for r in grows if r[5] is not None]
        g_temp = [r[6] for r in grows if r[6] is not None]
        g_sm = [r[7] for r in grows if r[7] is not None]
        g_ecc = [r[9] for r in grows if r[9] is not None]
        ats = [r[2] for r in grows]
        g_reasons = _integrate_reasons(ats, [r[8] for r in grows])
        intervals += [b - a for a, b in itertools.pairwise(ats) if b > a]
        inc = max(max(g_ecc) - g_ecc[0], 0) if g_ecc else None
        if inc is not None:
            ecc_total = (ecc_total or 0) + inc
        uuid = next((r[1] for r in grows if r[1]), None)
        summary.gpus.append(GpuSummary(
            gpu_index=idx, gpu_uuid=uuid, sample_count=len(grows),
            gpu_util_mean_pct=_r(_mean(g_util)), sm_clock_mean_mhz=_r(_mean(g_sm)),
            power_mean_w=_r(_mean(g_pow)), temp_max_c=_max(g_temp), mem_used_peak_mib=_max(g_mem),
            ecc_volatile_uncorrected_increase=inc,
            clock_event_s={k: _r(v) for k, v in g_reasons.items()},
        ))
        utils += g_util
        mems += g_mem
        powers += g_pow
        temps += g_temp
        sms += g_sm
        for k, v in g_reasons.items():
            reasons[k] = reasons.get(k, 0.0) + v
    summary.sample_count = len(rows)
    if rows:
        ats_all = [r[2] for r in rows]
        summary.first_sample_at = min(ats_all)
        summary.last_sample_at = max(ats_all)
    summary.sample_interval_s = _r(statistics.median(intervals)) if intervals else None
    utils.sort()
    summary.gpu_util_mean_pct = _r(_mean(utils))
    summary.gpu_util_p95_pct = percentile(utils, 95)
    summary.mem_used_peak_mib = _max(mems)
    summary.power_mean_w = _r(_mean(powers))
    summary.temp_max_c = _max(temps)
    summary.sm_clock_mean_mhz = _r(_mean(sms))
    summary.clock_event_gpu_s = {k: _r(v) for k, v in reasons.items()}
    summary.ecc_volatile_uncorrected_increase = ecc_total


def _step_part(summary: JobSummary, rows: list[tuple], ckpts: list[tuple]) -> None:
    """Training fields from step rows ``(rank, step, step_time_s, samples, tokens,
    loss_nonfinite, data_wait_s, comm_s)`` and checkpoint rows ``(rank, duration_s)``.

    Throughput: for each rank, the samples (tokens) of its records that carry a count
    and a positive step time, divided by those records' summed step time; the node's
    throughput is the sum over ranks (data-parallel ranks add up). Shares: summed phase
    time over summed step time of the records that report that phase. Checkpoint time:
    each rank's summed checkpoint durations; the busiest rank counts (ranks checkpoint
    in parallel, so adding them would overstate the wall time lost).
    """
    summary.step_records = len(rows)
    summary.steps = len({r[1] for r in rows})
    summary.ranks = len({r[0] for r in rows})
    times = sorted(r[2] for r in rows if r[2] is not None)
    summary.step_time_p50_s = percentile(times, 50)
    summary.step_time_p95_s = percentile(times, 95)
    summary.step_time_p99_s = percentile(times, 99)
    per_rank: dict[int, list[float]] = {}  # rank -> [samples, s_time, tokens, t_time]
    dw = [0.0, 0.0]
    cm = [0.0, 0.0]
    nonfinite = 0
    for rank, _step, st, samples, tokens, nf, data_wait, comm in rows:
        nonfinite += 1 if nf else 0
        if st is None:
            continue
        acc = per_rank.setdefault(rank, [0.0, 0.0, 0.0, 0.0])
        if st > 0 and samples is not None:
            acc[0] += samples
            acc[1] += st
        if st > 0 and tokens is not None:
            acc[2] += tokens
            acc[3] += st
        if data_wait is not None:
            dw[0] += data_wait
            dw[1] += st
        if comm is not None:
            cm[0] += comm
            cm[1] += st
    summary.nonfinite_loss_count = nonfinite
    sps = [a[0] / a[1] for a in per_rank.values() if a[1] > 0]
    tps = [a[2] / a[3] for a in per_rank.values() if a[3] > 0]
    summary.throughput_samples_per_s = _r(sum(sps)) if sps else None
    summary.throughput_tokens_per_s = _r(sum(tps)) if tps else None
    summary.data_wait_share_pct = _r(100.0 * dw[0] / dw[1]) if dw[1] > 0 else None
    summary.comm_share_pct = _r(100.0 * cm[0] / cm[1]) if cm[1] > 0 else None
    by_rank: dict[int, list[float]] = {}
    for rank, dur in ckpts:
        by_rank.setdefault(rank, []).append(dur or 0.0)
    if by_rank:
        busiest = max(by_rank.values(), key=sum)
        summary.checkpoint_total_s = _r(sum(busiest))
        summary.checkpoint_count = len(busiest)


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
                  started_at: float | None = None, ended_at: float | None = None) -> JobSummary:
    """Summarise job ``job_id`` on ``node`` from ``store`` (a :class:`gpuguard.store.Store`).

    * ``exit_status_raw``: ``SLURM_JOB_EXIT_CODE`` as an int (raw wait status), or None;
    * ``collector_status``: one of :data:`COLLECTOR_STATUSES` (``ValueError`` otherwise);
    * ``ingest``: the collector's ``IngestResult`` (``malformed``, ``rejected_files``,
      ``truncated``) or None when nothing was ingested;
    * ``started_at``/``ended_at``: the job window (module docstring); default: the end of
      the job's latest Prolog run on ``node``, and now.

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
    # Samples of this attempt are counted by insertion order (rowid), not by a wall-clock
    # window: a clock stepped back during the job stamps later samples before started_at,
    # and the epilog's own "now" then lies before the samples taken before the step. The
    # collector is stopped before the summary, so nothing is stored after the job.
    first = _first_rowid(store, "samples", job_id, node, started_at)
    rows = [tuple(r.values()) for r in store.query(
        "select gpu_index, gpu_uuid, at, gpu_util_pct, mem_used_mib, power_w, temp_c, sm_clock_mhz, "
        "clock_event_mask, ecc_volatile_uncorrected from samples where job_id = ? and node = ? and rowid >= ? "
        "order by gpu_index, rowid", [job_id, node, first])]
    _gpu_part(s, rows)
    host = store.query("select cpu_pct, rss_mib from host_samples where job_id = ? and node = ? and rowid >= ?",
                       [job_id, node, _first_rowid(store, "host_samples", job_id, node, started_at)])
    s.host_sample_count = len(host)
    s.host_cpu_mean_pct = _r(_mean([h["cpu_pct"] for h in host if h["cpu_pct"] is not None]))
    s.host_rss_peak_mib = _max([h["rss_mib"] for h in host if h["rss_mib"] is not None])
    steps = [tuple(r.values()) for r in store.query(
        "select rank, step, step_time_s, samples, tokens, loss_nonfinite, data_wait_s, comm_s "
        "from steps where job_id = ? and node = ?", [job_id, node])]
    ckpts = [tuple(r.values()) for r in store.query(
        "select rank, duration_s from checkpoints where job_id = ? and node = ?", [job_id, node])]
    _step_part(s, steps, ckpts)
    _events_part(s, store, job_id, node)
    _post_job_part(s, store, job_id, node)
    if ingest is not None:
        s.malformed_records = int(getattr(ingest, "malformed", 0) or 0)
        s.rejected_files = [[str(a), str(b)] for a, b in (getattr(ingest, "rejected_files", None) or [])]
        s.records_truncated = bool(getattr(ingest, "truncated", False))
    return s


def save_summary(store: Any, summary: JobSummary) -> None:
    """Upsert ``summary`` into ``job_summaries`` (one row per job and node; a rerun of
    the epilog replaces it). Raises :class:`gpuguard.store.StoreError`."""
    row = {
        "job_id": summary.job_id, "node": summary.node, "created_at": summary.created_at,
        "started_at": summary.started_at, "ended_at": summary.ended_at,
        "exit_status_raw": summary.exit_status_raw, "exit_code": summary.exit_code,
        "exit_signal": summary.exit_signal, "collector_status": summary.collector_status,
        "sample_count": summary.sample_count, "step_records": summary.step_records,
        "summary_version": summary.version, "summary": json.dumps(summary.to_dict(), default=str),
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
