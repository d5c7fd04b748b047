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

Adding a sampled GPU metric = one :class:`Metric` row here. A plain NVML value (a getter
returning a number or a structure with the number in one attribute, or an
``NVML_FI_*`` field id) is declared by its :class:`Nvml` read and needs no reader code;
from the row come

* the :class:`~gpuguard.model.GpuState` field the collector's NVML read fills
  (:func:`gpu_state_fields`; ``gpuguard.gpu.telemetry`` reads every declared :class:`Nvml`);
* the sample row, the store columns and a named collector migration step adding them to
  existing stores (``gpuguard.collector.schema``, :func:`gpuguard.samples_schema.add_missing_columns`);
* the summary fields of ``JobSummary``/``GpuSummary`` (:func:`document_fields`) and their
  published JSON paths (``gpuguard.epilog.summary_shape``);
* ``gpuguard job show``'s summary rows and per-GPU columns (:func:`gpu_columns`).

A :class:`Compared` row has the verdict compare it with the template baseline; a
windowed per-GPU median (``stat="p50"``) needs nothing else (its series attribute:
:func:`series_attrs`).

Names carry units (DESIGN.md, "Storage"): the summary field of statistic ``stat`` of
metric ``<stem>_<unit>`` is ``<prefix><stem>_<stat>_<unit>`` (``gpu_util_pct`` + ``p95``
-> ``gpu_util_p95_pct``; ``rss_mib`` of the host + ``peak`` -> ``host_rss_peak_mib``).

Percentiles are **nearest rank** everywhere (:func:`percentile`): an observed value, so
tests can state exact results; the whole-job summary and the verdict's windows use the
same function, so one name means one computation (the verdict's values are over a
different *window*, after the warm-up, and are labelled so).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

#: Unit suffixes a metric name may end in (DESIGN.md, "Storage").
UNIT_SUFFIXES = ("pct", "mib", "w", "c", "mhz", "s", "j")

#: Summary statistics a :class:`Metric` may ask for, with their meaning.
STATS = {
    "mean": "arithmetic mean over the samples of all the job's GPUs",
    "p50": "nearest-rank median", "p95": "nearest-rank 95th percentile",
    "p99": "nearest-rank 99th percentile",
    "max": "largest sample", "peak": "largest sample (memory: the name operators use)",
    "increase": "growth of a cumulative counter over the job (last - first, >= 0)",
}


@dataclass(frozen=True)
class Nvml:
    """How a GPU metric is read through NVML (NVML API reference, "Device Queries" and
    "Field Value Queries"), for metrics that are one number:

    * ``getter``: the ``nvmlDevice*`` function, called as ``getter(handle, *args)``; empty
      for a value NVML gives only as a field (``field_id``), which a ``gpu`` metric then
      reads every tick in one ``nvmlDeviceGetFieldValues`` call per GPU shared by all
      such metrics;
    * ``args``: names of ``pynvml`` constants passed after the handle
      (``("NVML_CLOCK_SM",)``);
    * ``attr``: attribute of the returned structure holding the value (``"used"`` of
      ``nvmlMemory_t``); empty: the value itself;
    * ``raw_per_unit``: raw units per unit of the metric; the metric is the raw value
      divided by it (mW per W: 1000; bytes per MiB: 2**20);
    * ``fallback``: an older name of the getter, tried when the first is missing;
    * ``field_id``: the ``NVML_FI_*`` constant of the same value: the slow counters
      (scope ``gpu_slow``) are read in one ``nvmlDeviceGetFieldValues`` call per GPU, the
      getter being the fallback where the driver or nvidia-ml-py lacks the field.

    Metrics read from one getter with the same ``args`` share one call per GPU per tick."""

    getter: str = ""
    args: tuple[str, ...] = ()
    attr: str = ""
    raw_per_unit: float = 1
    fallback: str = ""
    field_id: str = ""

    def __post_init__(self) -> None:
        if not (self.getter or self.field_id):
            raise ValueError("an Nvml read needs a getter or a field_id")

    def convert(self, raw: Any, integer: bool) -> int | float:
        """The metric from the getter's result (``raw``) or a field value's number:
        ``int`` for counters (``integer``) read with ``raw_per_unit`` 1, else ``float``."""
        v = getattr(raw, self.attr) if self.attr else raw
        if integer and self.raw_per_unit == 1:
            return int(v)
        return float(v) if self.raw_per_unit == 1 else v / self.raw_per_unit


@dataclass(frozen=True)
class Prom:
    """How a GPU metric is exported to Prometheus (``gpuguard.ops.metrics``: the newest
    sample of each running job's GPUs, ``gpuguard_job_gpu_<name>``): ``name`` in
    Prometheus base units (naming practice: ``_ratio``, ``_bytes``, ``_watts``,
    ``_celsius``, ``_hertz``, ``_joules``) and ``per_unit``, the base units per unit of
    the metric (``mem_used_mib``: 2**20 bytes)."""

    name: str
    per_unit: float


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
    * ``prefix``: summary-field prefix (``host_`` for host metrics);
    * ``nvml``: the :class:`Nvml` read of a plain NVML value (the collector reads it
      with no code of its own); None where a reader computes it (the clock-event mask,
      cgroup and training values);
    * ``label``: column label in ``job show``'s per-GPU table (default: the name's stem
      in capitals);
    * ``series``: attribute of ``gpuguard.epilog.jobdata.GpuSeries`` holding the
      verdict's per-point values of a compared GPU metric (default: the name);
    * ``prom``: the :class:`Prom` export of a ``gpu``/``gpu_slow`` metric, or None.
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
    nvml: Nvml | None = None
    label: str = ""
    series: str = ""
    prom: Prom | None = None

    @property
    def sampled(self) -> bool:
        return self.scale > 0

    @property
    def integer(self) -> bool:
        """Whole counts (format ``d``): ``int`` fields, else ``float``."""
        return self.fmt == "d"

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
           "GPU utilisation: share of time a kernel ran",
           nvml=Nvml("nvmlDeviceGetUtilizationRates", attr="gpu"), label="UTIL", series="util",
           prom=Prom("utilization_ratio", 0.01)),
    Metric("mem_util_pct", "%", "gpu", "nvmlDeviceGetUtilizationRates().memory", 1, ("mean",), ".1f",
           "memory-controller utilisation: share of time device memory was read or written",
           nvml=Nvml("nvmlDeviceGetUtilizationRates", attr="memory"), label="MEMUTIL", series="mem_util",
           prom=Prom("memory_utilization_ratio", 0.01)),
    Metric("mem_used_mib", "MiB", "gpu", "nvmlDeviceGetMemoryInfo().used (bytes / 2**20)", 1, ("peak",), ".0f",
           "GPU memory used", nvml=Nvml("nvmlDeviceGetMemoryInfo", attr="used", raw_per_unit=2**20), label="MEM",
           prom=Prom("memory_used_bytes", 2**20)),
    Metric("power_w", "W", "gpu", "nvmlDeviceGetPowerUsage (mW / 1000)", 10, ("mean",), ".1f", "board power",
           nvml=Nvml("nvmlDeviceGetPowerUsage", raw_per_unit=1000), series="power",
           prom=Prom("power_watts", 1.0)),
    Metric("temp_c", "°C", "gpu", "nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)", 1, ("max",), ".0f",
           "GPU core temperature", nvml=Nvml("nvmlDeviceGetTemperature", args=("NVML_TEMPERATURE_GPU",),
                                             fallback="nvmlDeviceGetTemperatureV"), series="temp",
           prom=Prom("temperature_celsius", 1.0)),
    Metric("sm_clock_mhz", "MHz", "gpu", "nvmlDeviceGetClockInfo(NVML_CLOCK_SM)", 1, ("mean",), ".0f", "SM clock",
           nvml=Nvml("nvmlDeviceGetClockInfo", args=("NVML_CLOCK_SM",)), label="SM", series="clock",
           prom=Prom("sm_clock_hertz", 1e6)),
    Metric("clock_event_mask", "bits", "gpu", "nvmlDeviceGetCurrentClocksEventReasons", 1, (), "d",
           "active clock-event (throttle) reasons; summarised as seconds per reason"),
    Metric("ecc_volatile_uncorrected", "errors", "gpu_slow",
           "nvmlDeviceGetTotalEccErrors(UNCORRECTED, VOLATILE_ECC)", 1, ("increase",), "d",
           "volatile uncorrectable ECC errors",
           nvml=Nvml("nvmlDeviceGetTotalEccErrors", args=("NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_VOLATILE_ECC"),
                     field_id="NVML_FI_DEV_ECC_DBE_VOL_TOTAL"), label="ECC_UNC"),
    Metric("pcie_replay_count", "replays", "gpu_slow", "nvmlDeviceGetPcieReplayCounter", 1, ("increase",), "d",
           "PCIe link-level replays (a rising count means a marginal link)",
           nvml=Nvml("nvmlDeviceGetPcieReplayCounter", field_id="NVML_FI_DEV_PCIE_REPLAY_COUNTER"),
           label="PCIE_REPLAY"),
    # Not compared: a job's energy grows with its length; its power median is compared.
    Metric("energy_j", "J", "gpu_slow", "nvmlDeviceGetTotalEnergyConsumption (mJ since the driver loaded / 1000)", 1,
           ("increase",), ".0f", "GPU energy (board, read with the slow counters: the last slow interval of a job "
           "is not counted)", nvml=Nvml("nvmlDeviceGetTotalEnergyConsumption", raw_per_unit=1000,
                                         field_id="NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION"), label="ENERGY",
           prom=Prom("energy_joules", 1.0)),
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


def series_attrs() -> dict[str, str]:
    """Sampled metric -> attribute of ``gpuguard.epilog.jobdata.GpuSeries`` holding its
    per-point values, for every metric the verdict compares per GPU (:func:`compared_gpu`),
    in table order."""
    want = set(compared_gpu().values())
    return {m.name: m.series or m.name for m in GPU_SAMPLED if m.name in want}


# -- fields driven by the table -------------------------------------------------------------
#: Statistics kept per GPU as well as for the node (percentiles only for the node: they
#: pool the samples of all its GPUs).
PER_GPU_STATS = ("mean", "max", "peak", "increase")

#: How a statistic reads as a column label (:func:`gpu_columns`).
STAT_LABELS = {"mean": "MEAN", "max": "MAX", "peak": "PEAK", "increase": "NEW",
               "p50": "P50", "p95": "P95", "p99": "P99"}
#: Unit -> column-label suffix; units absent here are counts and add none.
UNIT_LABELS = {"%": "%", "MiB": "MIB", "W": "W", "°C": "C", "MHz": "MHZ", "J": "J", "s": "S"}


def _annotation(m: Metric) -> str:
    return "int | None" if m.integer else "float | None"


def document_fields(per_gpu: bool, after: dict[str, str]) -> list[tuple[str, str, Any, str | None]]:
    """The summary fields the table declares, as :func:`with_fields` specs: for a GPU's
    summary (``per_gpu``: the :data:`PER_GPU_STATS` of GPU metrics) or the node's (every
    statistic of every metric). ``after``: scope -> the field they follow in the document
    (scopes not named are left out)."""
    out = []
    for m in METRICS:
        scope = "gpu" if m.scope == "gpu_slow" else m.scope
        if scope not in after or (per_gpu and scope != "gpu"):
            continue
        for st in m.stats:
            if per_gpu and st not in PER_GPU_STATS:
                continue
            out.append((m.field(st), _annotation(m), None, after[scope]))
    return out


def gpu_state_fields() -> list[tuple[str, str, Any, str | None]]:
    """:class:`~gpuguard.model.GpuState` fields for the values the collector's NVML read
    fills (every metric with an :class:`Nvml` read), as :func:`with_fields` specs."""
    return [(m.name, _annotation(m), None, None) for m in (*GPU_SAMPLED, *GPU_SLOW) if m.nvml is not None]


def gpu_columns() -> list[tuple[str, str]]:
    """``job show``'s per-GPU columns: ``(summary field, label)`` for each per-GPU
    statistic, in table order (``("power_mean_w", "POWER_MEAN_W")``)."""
    out = []
    for m in (*GPU_SAMPLED, *GPU_SLOW):
        base, _, suffix = m.name.rpartition("_")
        stem = m.label or (base if suffix in UNIT_SUFFIXES else m.name).upper()
        unit = UNIT_LABELS.get(m.unit)
        for st in m.stats:
            if st in PER_GPU_STATS:
                out.append((m.field(st), f"{stem}_{STAT_LABELS[st]}" + (f"_{unit}" if unit else "")))
    return out


def with_fields(specs: Iterable[tuple[str, str, Any, str | None]]) -> Callable[[type], type]:
    """Class decorator, applied under ``@dataclass``: adds each ``(name, annotation,
    default, after)`` the class body does not declare itself, as if written there after
    field ``after`` (None: at the end), in the order given. This is how the table's
    fields reach the documents (:func:`document_fields`, :func:`gpu_state_fields`)
    while hand-written fields keep their place; ``default`` may be a
    ``dataclasses.field(...)``."""
    specs = list(specs)

    def deco(cls: type) -> type:
        ann = dict(inspect.get_annotations(cls))
        order = list(ann)
        last: dict[str | None, str] = {}
        for name, annotation, default, after in specs:
            if name in ann:
                continue
            ann[name] = annotation
            setattr(cls, name, default)
            prev = last.get(after, after)
            order.insert(order.index(prev) + 1 if prev in order else len(order), name)
            last[after] = name
        cls.__annotations__ = {n: ann[n] for n in order}
        return cls
    return deco


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
