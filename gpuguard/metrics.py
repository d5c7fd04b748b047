"""The metric table: every metric gpuguard samples, summarises, compares or shows, once.

One :class:`Metric` row says where a value is read, whether it is sampled and how it is
stored, which summary statistics are computed from it (and so the summary field names),
and how it is displayed. One :class:`Compared` row says which summary statistic the
verdict compares with the template baseline and which direction is worse.

Driven by this table:

* the collector's sample row and the compact store schema (:data:`GPU_SAMPLED`,
  :data:`GPU_SLOW`, :func:`stored_column`, :func:`scale_row`; ``gpuguard.samples``);
* the one summary computation (``gpuguard.epilog.summary``: :func:`summary_fields`);
* the baseline and the verdict's comparisons (:func:`compared`);
* ``gpuguard job show`` (:func:`unit_of`, :func:`fmt_value`).

Adding a sampled GPU metric = one :class:`Metric` row here, its NVML read in
``gpuguard.gpu.telemetry`` (and the GpuState field the read fills), a collector migration
step calling :func:`gpuguard.samples.add_missing_columns` (the columns come from this
table), and its summary field lines in ``JobSummary``/``GpuSummary``; a
:class:`Compared` row has the verdict compare it (its series attribute in
``gpuguard.epilog.jobdata.SERIES_ATTR``).

Names carry units (DESIGN.md, "Storage"): the summary field of statistic ``stat`` of
metric ``<stem>_<unit>`` is ``<prefix><stem>_<stat>_<unit>`` (``gpu_util_pct`` + ``p95``
-> ``gpu_util_p95_pct``; ``rss_mib`` of the host + ``peak`` -> ``host_rss_peak_mib``).

Percentiles are **nearest rank** everywhere (:func:`percentile`): an observed value, so
tests can state exact results; the whole-job summary and the verdict's windows use the
same function, so one name means one computation (the verdict's values are over a
different *window*, after the warm-up, and are labelled so).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

#: Unit suffixes a metric name may end in (DESIGN.md, "Storage").
UNIT_SUFFIXES = ("pct", "mib", "w", "c", "mhz", "s")

#: Summary statistics a :class:`Metric` may ask for, with their meaning.
STATS = {
    "mean": "arithmetic mean over the samples of all the job's GPUs",
    "p50": "nearest-rank median", "p95": "nearest-rank 95th percentile",
    "p99": "nearest-rank 99th percentile",
    "max": "largest sample", "peak": "largest sample (memory: the name operators use)",
    "increase": "growth of a cumulative counter over the job (last - first, >= 0)",
}


@dataclass(frozen=True)
class Metric:
    """One metric.

    * ``name``: unit-suffixed name, also the sample column (``power_w``);
    * ``scope``: ``gpu`` (per GPU per interval), ``gpu_slow`` (per GPU, cumulative
      counters read once a minute), ``host`` (per job per interval, cgroup), ``step``
      (training records);
    * ``source``: where the value is read (NVML function / cgroup file / record field);
    * ``scale``: the store keeps ``round(value * scale)`` as an integer (``power_w`` in
      0.1 W); 0 = not sampled (derived in the summary);
    * ``stats``: summary statistics (:data:`STATS`) over the whole job;
    * ``fmt``: ``format()`` spec for text display;
    * ``prefix``: summary-field prefix (``host_`` for host metrics).
    """

    name: str
    unit: str
    scope: str
    source: str
    scale: int
    stats: tuple[str, ...]
    fmt: str
    description: str
    prefix: str = ""

    @property
    def sampled(self) -> bool:
        return self.scale > 0

    def field(self, stat: str) -> str:
        """Summary field name of ``stat`` (module docstring)."""
        stem, _, suffix = self.name.rpartition("_")
        if suffix in UNIT_SUFFIXES:
            return f"{self.prefix}{stem}_{stat}_{suffix}"
        return f"{self.prefix}{self.name}_{stat}"


#: The table. Order = display order. Sources: NVML API reference (``nvmlDevice*``), the
#: kernel's cgroup v2 documentation (``cpu.stat``, ``memory.stat``), gpuguard's training
#: record format (``gpuguard.collector.train``).
METRICS: tuple[Metric, ...] = (
    Metric("gpu_util_pct", "%", "gpu", "nvmlDeviceGetUtilizationRates().gpu", 1, ("mean", "p95"), ".1f",
           "GPU utilisation: share of time a kernel ran"),
    Metric("mem_util_pct", "%", "gpu", "nvmlDeviceGetUtilizationRates().memory", 1, ("mean",), ".1f",
           "memory-controller utilisation: share of time device memory was read or written"),
    Metric("mem_used_mib", "MiB", "gpu", "nvmlDeviceGetMemoryInfo().used (bytes / 2**20)", 1, ("peak",), ".0f",
           "GPU memory used"),
    Metric("power_w", "W", "gpu", "nvmlDeviceGetPowerUsage (mW / 1000)", 10, ("mean",), ".1f", "board power"),
    Metric("temp_c", "°C", "gpu", "nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)", 1, ("max",), ".0f",
           "GPU core temperature"),
    Metric("sm_clock_mhz", "MHz", "gpu", "nvmlDeviceGetClockInfo(NVML_CLOCK_SM)", 1, ("mean",), ".0f", "SM clock"),
    Metric("clock_event_mask", "bits", "gpu", "nvmlDeviceGetCurrentClocksEventReasons", 1, (), "d",
           "active clock-event (throttle) reasons; summarised as seconds per reason"),
    Metric("ecc_volatile_uncorrected", "errors", "gpu_slow",
           "nvmlDeviceGetTotalEccErrors(UNCORRECTED, VOLATILE_ECC)", 1, ("increase",), "d",
           "volatile uncorrectable ECC errors"),
    Metric("pcie_replay_count", "replays", "gpu_slow", "nvmlDeviceGetPcieReplayCounter", 1, ("increase",), "d",
           "PCIe link-level replays (a rising count means a marginal link)"),
    Metric("cpu_pct", "%", "host", "cgroup cpu.stat usage_usec over wall time (100 = one core)", 0, ("mean",), ".1f",
           "job CPU use", prefix="host_"),
    Metric("rss_mib", "MiB", "host", "cgroup memory.stat anon", 0, ("peak",), ".0f", "job host memory (RSS)",
           prefix="host_"),
    Metric("io_read_mib", "MiB", "host", "cgroup io.stat rbytes (v1: blkio io_service_bytes Read), cumulative", 0,
           ("increase",), ".1f", "block I/O read by the job", prefix="host_"),
    Metric("io_write_mib", "MiB", "host", "cgroup io.stat wbytes (v1: blkio io_service_bytes Write), cumulative", 0,
           ("increase",), ".1f", "block I/O written by the job", prefix="host_"),
    Metric("step_time_s", "s", "step", "training record step_time_s", 0, ("p50", "p95", "p99"), ".4g",
           "training step time"),
)

BY_NAME = {m.name: m for m in METRICS}
#: Sampled per interval, in the stored column order.
GPU_SAMPLED: tuple[Metric, ...] = tuple(m for m in METRICS if m.scope == "gpu")
#: Cumulative counters sampled once a minute (``[collector] slow_every_s``).
GPU_SLOW: tuple[Metric, ...] = tuple(m for m in METRICS if m.scope == "gpu_slow")

#: Derived summary fields (not one column's statistic): name -> (unit, fmt, description).
DERIVED: dict[str, tuple[str, str, str]] = {
    "ecc_volatile_uncorrected_increase": ("errors", "d", "volatile uncorrectable ECC errors during the job"),
    "xid_event_count": ("events", "d", "XID/SXid events on this node during the job"),
    "throughput_samples_per_s": ("samples/s", ".4g", "training throughput, summed over ranks"),
    "throughput_tokens_per_s": ("tokens/s", ".4g", "training throughput, summed over ranks"),
    "data_wait_share_pct": ("%", ".1f", "share of step time spent waiting for data"),
    "comm_share_pct": ("%", ".1f", "share of step time spent in communication"),
    "checkpoint_total_s": ("s", ".1f", "time spent writing checkpoints (busiest rank)"),
}


def stored_column(m: Metric) -> str:
    """The compact store's column for ``m``: its name, with ``_x<scale>`` when scaled
    (``power_w_x10`` holds tenths of a watt)."""
    return m.name if m.scale == 1 else f"{m.name}_x{m.scale}"


def scale_value(m: Metric, v: float | int | None) -> int | None:
    """``round(v * scale)``; ``None``, NaN and infinities become ``None`` (no reading)."""
    if v is None:
        return None
    x = float(v) * m.scale
    return round(x) if math.isfinite(x) else None


def summary_fields() -> dict[str, tuple[str, str, str]]:
    """Every scalar summary field, in display order: name -> (unit, fmt, description)."""
    out: dict[str, tuple[str, str, str]] = {}
    for m in METRICS:
        for st in m.stats:
            out[m.field(st)] = (m.unit, m.fmt, f"{m.description}, {STATS[st]}")
    out.update(DERIVED)
    return out


@dataclass(frozen=True)
class Compared:
    """A value the verdict compares with the template baseline (median/MAD of earlier runs).

    ``name``: the comparison's key (stored in ``baselines``/``comparisons``); ``metric`` +
    ``stat``: what it is computed from; ``worse``: +1 when higher is worse, -1 when lower
    is worse, 0 when any change matters (the comparison itself flags both directions); ``windowed``: computed over
    the post-warm-up span and checked over the long windows, else over the whole job."""

    name: str
    unit: str
    metric: str
    stat: str
    worse: int
    windowed: bool
    description: str


#: The verdict's comparisons. Shares are 0-1 fractions here (the summary shows %).
COMPARED: tuple[Compared, ...] = (
    Compared("step_time_p50_s", "s", "step_time_s", "p50", +1, True, "step time, median"),
    Compared("step_time_p95_s", "s", "step_time_s", "p95", +1, True, "step time, 95th percentile"),
    Compared("throughput_per_s", "1/s", "step", "sum over ranks", -1, True,
             "samples (else tokens) per second, all ranks"),
    Compared("data_wait_share", "0-1", "step", "share", +1, True, "share of step time waiting for data"),
    Compared("comm_share", "0-1", "step", "share", +1, True, "share of step time in communication"),
    Compared("checkpoint_time_s", "s", "checkpoint", "p50", +1, False, "checkpoint duration, median"),
    Compared("gpu_util_pct", "%", "gpu_util_pct", "p50", -1, True, "GPU utilisation, median"),
    Compared("mem_util_pct", "%", "mem_util_pct", "p50", -1, True, "memory-controller utilisation, median"),
    Compared("mem_peak_mib", "MiB", "mem_used_mib", "max", +1, False, "GPU memory peak"),
    Compared("power_w", "W", "power_w", "p50", -1, True, "GPU power, median"),
    Compared("sm_clock_mhz", "MHz", "sm_clock_mhz", "p50", -1, True, "SM clock, median"),
    Compared("temp_c", "°C", "temp_c", "p50", +1, True, "GPU temperature, median"),
    # a changed batch (samples or tokens per step) means the job changed: either way
    Compared("samples_per_step", "1", "step", "p50", 0, True,
             "samples (else tokens) per step of one rank, median"),
    Compared("power_cap_share", "0-1", "clock_event_mask", "share", +1, True,
             "share of GPU samples with sw_power_cap active"),
    Compared("thermal_share", "0-1", "clock_event_mask", "share", +1, True,
             "share of GPU samples with a thermal slowdown active"),
    Compared("hw_slowdown_share", "0-1", "clock_event_mask", "share", +1, True,
             "share of GPU samples with HW slowdown or power brake active"),
)


def compared() -> dict[str, Compared]:
    """The verdict's compared values, name -> :class:`Compared`, in display order."""
    return {c.name: c for c in COMPARED}


def compared_gpu() -> dict[str, str]:
    """Windowed per-GPU compared values: comparison name -> sampled metric name
    (``gpu_util_pct`` -> ``gpu_util_pct``); the verdict computes their p50 per window."""
    return {c.name: c.metric for c in COMPARED if c.windowed and c.stat == "p50" and c.metric in BY_NAME
            and BY_NAME[c.metric].scope == "gpu"}


def unit_of(name: str) -> str:
    """Unit of a summary field or comparison name (``""`` when unknown)."""
    c = compared().get(name)
    if c is not None:
        return c.unit
    return summary_fields().get(name, ("",))[0]


def fmt_value(name: str, v: object) -> str:
    """A value for people: the table's format, ``-`` for None."""
    if v is None:
        return "-"
    spec = summary_fields().get(name, ("", ".4g", ""))[1]
    try:
        return format(v, spec)
    except (TypeError, ValueError):
        return str(v)


def percentile(sorted_values: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile of an ascending sequence: the value at 1-based rank
    ``ceil(p / 100 * n)`` (rank 1 for ``p = 0``; Hyndman & Fan definition 1). ``None`` for
    an empty sequence. Raises ``ValueError`` for ``p`` outside 0..100. p95 of 1..20 is 19,
    p50 of 1..4 is 2."""
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be within 0..100, got {p}")
    n = len(sorted_values)
    if n == 0:
        return None
    return sorted_values[max(1, math.ceil(p / 100 * n)) - 1]


def percentile_hist(hist: Sequence[tuple[float, int]], p: float) -> float | None:
    """:func:`percentile` from a histogram ``[(value, count), ...]`` ascending by value
    (what ``GROUP BY value`` over integer-scaled samples gives). ``None`` when empty."""
    n = sum(c for _v, c in hist)
    if n == 0:
        return None
    rank = max(1, math.ceil(p / 100 * n))
    seen = 0
    for v, c in hist:
        seen += c
        if seen >= rank:
            return v
    return hist[-1][0]
