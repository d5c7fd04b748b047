"""The summary document the Epilog stores per (job, node): :class:`JobSummary` with its
:class:`GpuSummary` per GPU, the decoded exit status, and the constants that describe
them. Units, the job window and the percentile method are in the docstring of
:mod:`gpuguard.epilog.summary`, which computes the document and re-exports these names.
"""

from __future__ import annotations

import dataclasses
import signal
from dataclasses import dataclass, field
from typing import Any

from gpuguard.metrics import document_fields, summary_fields, with_fields

#: Bump when a field's meaning changes; stored beside the summary.
SUMMARY_VERSION = 1

#: What :attr:`JobSummary.collector_status` can say, with its meaning.
COLLECTOR_STATUSES = {
    "ok": "running until the epilog stopped it",
    "died": "its pid file named a process that was gone before the epilog",
    "never_started": "no pid file: the prolog did not start it (disabled, or it failed)",
    "did_not_exit": "still running after SIGTERM and the bounded wait",
    "unknown": "the epilog could not stop or ask it (tool error)",
}

#: Scalar metrics: name -> (unit, description), in the display order of ``gpuguard job
#: show``; generated from the metric table (:func:`gpuguard.metrics.summary_fields`).
METRICS: dict[str, tuple[str, str]] = {k: (u, d) for k, (u, _f, d) in summary_fields().items()}


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
@with_fields(document_fields(per_gpu=True, after={"gpu": "sample_count"}))
class GpuSummary:
    """One GPU of the job (the straggler-GPU verdict compares these with each other).
    After ``sample_count`` come the per-GPU statistics of the metric table's GPU metrics
    (:func:`gpuguard.metrics.document_fields`: ``gpu_util_mean_pct``, ``power_mean_w``,
    ``ecc_volatile_uncorrected_increase``, ...; None: no sample had the value).
    ``clock_event_s``: reason name -> seconds that reason was active."""

    gpu_index: int
    gpu_uuid: str | None
    sample_count: int
    clock_event_s: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
@with_fields(document_fields(per_gpu=False, after={"gpu": "gpus", "host": "host_sample_count", "step": "ranks"}))
class JobSummary:
    """Everything the Epilog knows about one job on one node. Field units are in the
    names (module docstring); :data:`METRICS` lists the scalar metrics. The statistics of
    the metric table (:func:`gpuguard.metrics.document_fields`) are fields too, placed
    after ``gpus`` (GPU metrics: ``gpu_util_p95_pct``, ``energy_increase_j``, ...),
    ``host_sample_count`` (``host_cpu_mean_pct``, ...) and ``ranks``
    (``step_time_p50_s``, ...); None means no data.

    * ``exit_*``: the decoded ``SLURM_JOB_EXIT_CODE`` (:func:`decode_exit_status`);
    * ``collector_status``: one of :data:`COLLECTOR_STATUSES`;
    * ``clock_event_gpu_s``: reason name -> GPU-seconds (summed over the job's GPUs) the
      reason was active; per-GPU seconds are in ``gpus[i].clock_event_s``;
    * ``xid_events``: up to :data:`~gpuguard.epilog.summary.MAX_EVENTS_LISTED` dicts
      ``{at, kind, code, gpu_index, pci_bus_id, action, message}``; ``xid_event_count``
      counts them all;
    * ``step_records``: step records of all ranks; ``steps``: distinct step numbers;
    * ``malformed_records``/``rejected_files``/``records_truncated``: from the ingest of
      the job directory (``rejected_files`` is a list of ``[name, why]``);
    * ``post_job``: the epilog health run (``{outcome, reason, findings: [{code,
      severity, action, gpu_index}]}``) or None; ``outcome`` is what the run did
      (``health_runs.decision``: ``proceed``, ``drain``, or ``suppressed`` / ``dry-run``
      for a drain maintenance or ``[slurm] drain = false`` held back).
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
    clock_event_gpu_s: dict[str, float] = field(default_factory=dict)
    xid_event_count: int = 0
    xid_events: list[dict[str, Any]] = field(default_factory=list)
    host_sample_count: int = 0
    step_records: int = 0
    steps: int = 0
    ranks: int = 0
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
    #: Per-window series (:func:`summarize_job` with ``window_s``), not stored with the
    #: summary: ``{"window_s", "start" (epoch s), "count", "gpus": {"<index>": {"n": [...],
    #: <metric>: [...]}} (metrics of gpuguard.samples.WINDOW_VALUES, real units, None for an
    #: empty window), "ranks": {"<node>/<rank>": {"n": [...], "step_time_s_sum": [...],
    #: "samples_sum": [...], "tokens_sum": [...]}}}``. The verdict's short windows, for a
    #: judge that has no access to this node's store.
    windows: dict[str, Any] | None = None

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
