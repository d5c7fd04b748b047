"""The collector's per-interval NVML path: only the job's GPUs, only what a sample row needs.

A full :meth:`NvmlSource.snapshot` (the Prolog's health read) makes about 1,000 NVML calls
on an 8-GPU NVLink node and hands each to a worker thread; the collector needs the
metric table's sampled values (:data:`gpuguard.metrics.GPU_SAMPLED`, and once a minute
:data:`~gpuguard.metrics.GPU_SLOW`) of the job's GPUs only. :class:`JobTelemetry`:

* resolves the job's GPUs to NVML handles once (``nvmlDeviceGetHandleByIndex``, UUID and
  PCI bus id read then, not per tick), and compiles its read plan once: which NVML
  function feeds which metric, the fallback functions that exist in the loaded pynvml;
* reads every job GPU in **one** worker-thread job with one deadline
  (``call_timeout_s``), instead of one thread hand-off per call;
* per GPU per tick, for the current table: ``nvmlDeviceGetUtilizationRates`` (gpu +
  memory), ``...MemoryInfo``, ``...PowerUsage``, ``...Temperature``, ``...ClockInfo(SM)``,
  ``...CurrentClocksEventReasons`` (:data:`READS`, :data:`CALLS`) — 6 calls;
* with ``slow=True`` (the collector asks once a minute, :data:`gpuguard.collector.run.SLOW_EVERY_S`):
  the cumulative counters in one ``nvmlDeviceGetFieldValues`` call per GPU
  (:data:`SLOW_READS`: ``NVML_FI_DEV_ECC_DBE_VOL_TOTAL``, ``NVML_FI_DEV_PCIE_REPLAY_COUNTER``;
  NVML API reference, "Field Value Queries"), or the single calls where the driver or
  nvidia-ml-py lacks it.

What a reading holds comes from the metric table: values in ``GPU_SAMPLED`` order and
units (and ``GPU_SLOW`` order), so the store writes them without renaming. A table row
whose ``source`` is an NVML field id constant (``"NVML_FI_DEV_MEMORY_TEMP"``) and that
has no entry here is read through ``nvmlDeviceGetFieldValues`` (per tick for ``gpu``
scope, per minute for ``gpu_slow``): such a metric needs no change in this module. Any
other unknown metric reads ``None`` (:attr:`JobTelemetry.unread` names them).

A 1-GPU job thus makes 1/8 of the NVML calls of an 8-GPU job. Error handling follows
:mod:`gpuguard.gpu.nvml`: NotSupported (and FunctionNotFound after the fallbacks) leaves
``None``; other NVML errors go to the reading's ``errors`` by metric name; ``GpuIsLost``
stops reads of that GPU for the tick. A batch that does not return within the deadline
gives every job GPU ``errors == {"telemetry": "Timeout"}`` and all values ``None``, and is
not retried while the hung call is outstanding.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from gpuguard.gpu.nvml import UNSUPPORTED_ERRORS, CallTimeout, _mib, _text, error_name
from gpuguard.metrics import GPU_SAMPLED, GPU_SLOW, Metric
from gpuguard.model import CLOCK_EVENT_REASONS, GpuState, NodeSnapshot, decode_clock_event_reasons, norm_pci

#: The hung-call scope of the telemetry batch in :attr:`NvmlSource._stuck`.
SCOPE = "telemetry"

#: Clock-event bits gpuguard knows (model.CLOCK_EVENT_REASONS); other bits are dropped.
KNOWN_CLOCK_BITS = 0
for _bit, _label in CLOCK_EVENT_REASONS.values():
    KNOWN_CLOCK_BITS |= _bit

#: NVML calls of the per-tick path: key -> (function names, fallbacks after the first;
#: extra arguments after the handle, built from the pynvml module).
CALLS: dict[str, tuple[tuple[str, ...], Callable[[Any], tuple[Any, ...]]]] = {
    "utilization": (("nvmlDeviceGetUtilizationRates",), lambda nv: ()),
    "memory": (("nvmlDeviceGetMemoryInfo",), lambda nv: ()),
    "power": (("nvmlDeviceGetPowerUsage",), lambda nv: ()),
    "temperature": (("nvmlDeviceGetTemperature", "nvmlDeviceGetTemperatureV"), lambda nv: (nv.NVML_TEMPERATURE_GPU,)),
    "sm_clock": (("nvmlDeviceGetClockInfo",), lambda nv: (nv.NVML_CLOCK_SM,)),
    "clock_events": (("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"),
                     lambda nv: ()),
}

#: Sampled metric -> (its call in :data:`CALLS`, the value in the metric's unit from the
#: call's result). Units: NVML API reference (mW, bytes, MHz, degrees C, percent).
READS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "gpu_util_pct": ("utilization", operator.attrgetter("gpu")),
    "mem_util_pct": ("utilization", operator.attrgetter("memory")),
    "mem_used_mib": ("memory", lambda m: _mib(m.used)),
    "power_w": ("power", lambda mw: mw / 1000.0),
    "temp_c": ("temperature", float),
    "sm_clock_mhz": ("sm_clock", float),
    "clock_event_mask": ("clock_events", lambda m: int(m) & KNOWN_CLOCK_BITS),
}

#: Slow counter -> (NVML field id constant, single-call fallback, its extra arguments).
SLOW_READS: dict[str, tuple[str, str, Callable[[Any], tuple[Any, ...]]]] = {
    "ecc_volatile_uncorrected": ("NVML_FI_DEV_ECC_DBE_VOL_TOTAL", "nvmlDeviceGetTotalEccErrors",
                                 lambda nv: (nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)),
    "pcie_replay_count": ("NVML_FI_DEV_PCIE_REPLAY_COUNTER", "nvmlDeviceGetPcieReplayCounter", lambda nv: ()),
}

#: ``c_nvmlFieldValue_t.valueType`` -> the union member holding the value (nvml.h
#: ``nvmlValueType_t``: DOUBLE 0, UNSIGNED_INT 1, UNSIGNED_LONG 2, UNSIGNED_LONG_LONG 3,
#: SIGNED_LONG_LONG 4, SIGNED_INT 5).
_VALUE_MEMBER = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal"}


def field_id_name(m: Metric) -> str | None:
    """The NVML field id constant a metric's ``source`` names (``"NVML_FI_..."``), else None."""
    word = m.source.split("(")[0].split()[0] if m.source.strip() else ""
    return word if word.startswith("NVML_FI_") else None


class GpuReading(NamedTuple):
    """One job GPU at one tick: ``values`` in ``GPU_SAMPLED`` order and units (``None`` =
    no reading); ``slow`` in ``GPU_SLOW`` order, or ``None`` when not read this tick;
    ``errors``: metric name (or ``"telemetry"``) -> NVML error name, ``None`` when none."""

    index: int
    uuid: str | None
    pci_bus_id: str | None
    values: tuple[Any, ...]
    slow: tuple[Any, ...] | None
    errors: dict[str, str] | None


class Reading(NamedTuple):
    """One tick: ``taken_at`` (epoch s, when the read began), ``error`` (a snapshot-level
    error string as :class:`NodeSnapshot.error`, then ``gpus == []``), ``gpus``."""

    taken_at: float
    error: str | None
    gpus: list[GpuReading]


class JobGpu:
    """A job GPU resolved once: ``index``, ``handle``, ``uuid``, ``pci_bus_id``."""

    __slots__ = ("handle", "index", "pci_bus_id", "uuid")

    def __init__(self, index: int, handle: Any, uuid: str | None, pci_bus_id: str | None):
        self.index, self.handle, self.uuid, self.pci_bus_id = index, handle, uuid, pci_bus_id


class _Call:
    """One NVML call of the plan: ``fn`` (the function in use), ``rest`` (older fallbacks,
    taken when the driver answers FunctionNotFound), its arguments, ``(position,
    metric, getter)`` of the values it feeds, and ``alt``: calls made instead when it
    answers NotSupported or FunctionNotFound as a whole (the single counter calls behind
    a field-values call)."""

    __slots__ = ("alt", "args", "fn", "outs", "rest")

    def __init__(self, fns: list[Callable[..., Any]], args: tuple[Any, ...],
                 outs: list[tuple[int, str, Callable[[Any], Any]]]):
        self.fn = fns[0] if fns else None
        self.rest = list(fns[1:])
        self.args, self.outs = args, outs
        self.alt: list[_Call] = []


def _field_call(nv: Any, metrics: list[tuple[int, str, str]]) -> _Call | None:
    """One ``nvmlDeviceGetFieldValues`` call for ``(position, metric, field id name)``;
    None when pynvml lacks the function or a constant."""
    fv = getattr(nv, "nvmlDeviceGetFieldValues", None)
    ids = [getattr(nv, c, None) for _p, _n, c in metrics]
    if fv is None or None in ids or not metrics:
        return None

    def getter(i: int) -> Callable[[Any], Any]:
        def get(values: Any) -> Any:
            v = values[i]
            if v.nvmlReturn != 0:  # a per-field error, NotSupported included
                raise nv.NVMLError(v.nvmlReturn)
            return getattr(v.value, _VALUE_MEMBER.get(getattr(v, "valueType", 3), "ullVal"))
        return get

    return _Call([fv], (ids,), [(p, n, getter(i)) for i, (p, n, _c) in enumerate(metrics)])


def compile_plan(nv: Any) -> tuple[list[_Call], list[_Call], list[str]]:
    """The per-tick calls, the slow calls and the metrics nothing reads, from the metric
    table and the loaded pynvml module (functions it lacks are dropped from the
    fallbacks)."""
    calls: dict[str, _Call] = {}
    fields: list[tuple[int, str, str]] = []
    unread: list[str] = []
    for pos, m in enumerate(GPU_SAMPLED):
        how = READS.get(m.name)
        if how is None:
            fid = field_id_name(m)
            if fid is not None:
                fields.append((pos, m.name, fid))
            else:
                unread.append(m.name)
            continue
        key, get = how
        if key not in calls:
            names, args = CALLS[key]
            calls[key] = _Call([f for f in (getattr(nv, n, None) for n in names) if f is not None], args(nv), [])
        calls[key].outs.append((pos, m.name, get))
    fast = [c for c in calls.values() if c.fn is not None]
    unread += [n for c in calls.values() if c.fn is None for _p, n, _g in c.outs]
    fc = _field_call(nv, fields)
    if fc is not None:
        fast.append(fc)
    elif fields:
        unread += [n for _p, n, _c in fields]
    slow_fields: list[tuple[int, str, str]] = []
    for pos, m in enumerate(GPU_SLOW):
        fid = SLOW_READS[m.name][0] if m.name in SLOW_READS else field_id_name(m)
        if fid is not None:
            slow_fields.append((pos, m.name, fid))
        else:
            unread.append(m.name)
    singles: list[_Call] = []  # one call per counter that has one
    for pos, name, _fid in slow_fields:
        if name in SLOW_READS and getattr(nv, SLOW_READS[name][1], None) is not None:
            _c, fn, args = SLOW_READS[name]
            singles.append(_Call([getattr(nv, fn)], args(nv), [(pos, name, int)]))
    sc = _field_call(nv, slow_fields)
    if sc is not None:
        sc.alt = singles
        return fast, [sc], unread
    have = {n for c in singles for _p, n, _g in c.outs}
    return fast, singles, unread + [n for _p, n, _f in slow_fields if n not in have]


def _run_calls(calls: list[_Call], handle: Any, out: list[Any], errors: dict[str, str] | None
               ) -> tuple[dict[str, str] | None, bool]:
    """Make ``calls`` on one GPU, filling ``out`` by position; returns ``(errors, lost)``.
    The hot path of the collector: failures go to :func:`_failed`."""
    for c in calls:
        try:
            raw = c.fn(handle, *c.args)
        except Exception as e:
            errors, lost = _failed(c, e, handle, out, errors)
            if lost:
                return errors, True
            continue
        for pos, name, get in c.outs:
            try:
                out[pos] = get(raw)
            except Exception as e:  # an unconvertible value (or a field's own error)
                errors = _note(errors, (name,), e)
    return errors, False


def _note(errors: dict[str, str] | None, names: Any, e: BaseException) -> dict[str, str] | None:
    err = error_name(e)
    if err in UNSUPPORTED_ERRORS:
        return errors
    errors = errors if errors is not None else {}
    for name in names:
        errors[name] = err
    return errors


def _failed(c: _Call, e: BaseException, handle: Any, out: list[Any], errors: dict[str, str] | None
            ) -> tuple[dict[str, str] | None, bool]:
    """A call of the plan raised ``e``: fall back, read the alternatives, or record it."""
    err = error_name(e)
    if err == "FunctionNotFound" and c.rest:
        c.fn = c.rest.pop(0)  # the driver predates it: the older function from now on
        return _run_calls([c], handle, out, errors)
    if err in UNSUPPORTED_ERRORS:
        return _run_calls(c.alt, handle, out, errors) if c.alt else (errors, False)
    errors = _note(errors, [n for _p, n, _g in c.outs], e)
    return errors, err == "GpuIsLost"


def _read_batch(gpus: list[JobGpu], fast: list[_Call], slow: list[_Call] | None, n_fast: int,
                n_slow: int) -> list[GpuReading]:
    """Runs on the worker thread: every job GPU, one pass."""
    out = []
    for g in gpus:
        vals: list[Any] = [None] * n_fast
        errors, lost = _run_calls(fast, g.handle, vals, None)
        svals = None
        if slow is not None and not lost:
            sv: list[Any] = [None] * n_slow
            errors, _lost = _run_calls(slow, g.handle, sv, errors)
            svals = tuple(sv)
        out.append(_new_reading(GpuReading, (g.index, g.uuid, g.pci_bus_id, tuple(vals), svals, errors)))
    return out


#: ``GpuReading(...)`` without its Python-level ``__new__`` (one fewer frame per GPU per tick)
_new_reading = tuple.__new__


def _resolve(nv: Any, indices: list[int], uuids: list[str]) -> list[JobGpu]:
    """Runs on the worker thread: the job's GPUs (by index or UUID) with their handles."""
    want_u = {u.lower() for u in uuids}
    out = []
    for i in range(int(nv.nvmlDeviceGetCount())):
        if i not in indices and not want_u:
            continue
        h = nv.nvmlDeviceGetHandleByIndex(i)
        try:
            uuid = _text(nv.nvmlDeviceGetUUID(h))
        except Exception:
            uuid = None
        if i not in indices and (uuid or "").lower() not in want_u:
            continue
        try:
            pci = norm_pci(_text(nv.nvmlDeviceGetPciInfo(h).busId))
        except Exception:
            pci = None
        out.append(JobGpu(i, h, uuid, pci))
    return out


class JobTelemetry:
    """The per-interval reader of one job's GPUs through an :class:`NvmlSource` (its NVML
    initialisation, worker thread and hung-call bookkeeping are reused). ``indices`` /
    ``uuids``: the job's GPUs as ``--gpus`` names them. Not thread-safe (one per source)."""

    def __init__(self, src: Any, indices: list[int], uuids: list[str]):
        self.src = src
        self.indices = list(indices)
        self.uuids = list(uuids)
        #: the job's GPUs once resolved (None before the first successful read)
        self.gpus: list[JobGpu] | None = None
        #: metric names nothing here reads (always None), known once the plan is compiled
        self.unread: list[str] = []
        self._plan: tuple[list[_Call], list[_Call], list[str]] | None = None
        self._n = (len(GPU_SAMPLED), len(GPU_SLOW))
        self._none = (None,) * len(GPU_SAMPLED)

    def _timed_out(self, taken_at: float) -> Reading:
        err = {"telemetry": "Timeout"}
        return Reading(taken_at, None, [GpuReading(g.index, g.uuid, g.pci_bus_id, self._none, None, dict(err))
                                        for g in self.gpus or []])

    def read(self, slow: bool) -> Reading:
        """One tick of the job's GPUs (the slow counters too when ``slow``). Never raises."""
        src = self.src
        taken_at = time.time()
        err = src._init()
        if err is not None:
            return Reading(taken_at, err, [])
        if src._stuck:
            src._prune_stuck()
            if SCOPE in src._stuck:
                return self._timed_out(taken_at)
        if self._plan is None:
            self._plan = compile_plan(src._nv)
            self.unread = self._plan[2]
        fast, slow_calls, _unread = self._plan
        try:
            if self.gpus is None:
                job = src._runner.call(src.call_timeout_s, "telemetry handles", _resolve, src._nv,
                                       self.indices, self.uuids)
                if job.exc is not None:
                    return Reading(taken_at, f"NVML error: resolving the job's GPUs failed: {error_name(job.exc)}", [])
                self.gpus = job.result
            job = src._runner.call(src.call_timeout_s, SCOPE, _read_batch, self.gpus, fast,
                                   slow_calls if slow else None, *self._n)
        except CallTimeout as t:
            src._stuck[SCOPE] = (SCOPE, t.args[0])
            if self.gpus is None:
                return Reading(taken_at, f"NVML hung: resolving the job's GPUs did not return within "
                                         f"{src.call_timeout_s} s", [])
            return self._timed_out(taken_at)
        if job.exc is not None:
            return Reading(taken_at, f"tool error: telemetry read failed: {type(job.exc).__name__}: {job.exc}", [])
        return Reading(taken_at, None, job.result)

    def read_here(self, slow: bool) -> Reading:
        """:meth:`read` on the calling thread, without the worker hand-off and its
        deadline: for a caller that runs this on a thread of its own and watches it
        (the collector's sampler thread, :mod:`gpuguard.collector.sampler`). Never raises;
        a hung NVML call blocks the calling thread until it returns."""
        src = self.src
        taken_at = time.time()
        err = src._init()
        if err is not None:
            return Reading(taken_at, err, [])
        if src._stuck:
            src._prune_stuck()
            if SCOPE in src._stuck:
                return self._timed_out(taken_at)
        try:
            if self._plan is None:
                self._plan = compile_plan(src._nv)
                self.unread = self._plan[2]
            if self.gpus is None:
                try:
                    self.gpus = _resolve(src._nv, self.indices, self.uuids)
                except Exception as e:
                    return Reading(taken_at, f"NVML error: resolving the job's GPUs failed: {error_name(e)}", [])
            fast, slow_calls, _unread = self._plan
            return Reading(taken_at, None, _read_batch(self.gpus, fast, slow_calls if slow else None, *self._n))
        except Exception as e:
            return Reading(taken_at, f"tool error: telemetry read failed: {type(e).__name__}: {e}", [])

    def timed_out(self, taken_at: float) -> Reading:
        """The reading of a tick whose batch hung: every job GPU, values None, errors
        ``{"telemetry": "Timeout"}``."""
        return self._timed_out(taken_at)


def to_gpu_state(r: GpuReading) -> GpuState:
    """A reading as a :class:`GpuState` (the GpuState fields named like the metrics;
    the clock-event mask as reason names)."""
    g = GpuState(index=r.index, uuid=r.uuid, pci_bus_id=r.pci_bus_id)
    for m, v in zip(GPU_SAMPLED, r.values, strict=True):
        if m.name == "clock_event_mask":
            g.clock_event_reasons = None if v is None else decode_clock_event_reasons(v)
        elif hasattr(g, m.name):
            setattr(g, m.name, v)
    if r.slow is not None:
        for m, v in zip(GPU_SLOW, r.slow, strict=True):
            if hasattr(g, m.name):
                setattr(g, m.name, v)
    if r.errors:
        g.read_errors = {("clock_event_reasons" if k == "clock_event_mask" else k): e for k, e in r.errors.items()}
    return g


def read_job_gpus(src: Any, indices: list[int], uuids: list[str], slow: bool) -> NodeSnapshot:
    """One tick of the job's GPUs as a :class:`NodeSnapshot` holding only the job's GPUs
    with only the sampled fields set (:meth:`JobTelemetry.read` through a reader kept on
    ``src``); ``error`` set when NVML is unusable or the handle look-up failed. Never
    raises. The collector itself uses :class:`JobTelemetry` (no GpuState per tick)."""
    key = (tuple(indices), tuple(uuids))
    cache = getattr(src, "_job_telemetry", None)
    if cache is None or cache[0] != key:
        cache = src._job_telemetry = (key, JobTelemetry(src, indices, uuids))
    r = cache[1].read(slow)
    snap = NodeSnapshot(taken_at=r.taken_at, source="nvml")
    snap.error = r.error
    snap.gpus = [to_gpu_state(g) for g in r.gpus]
    return snap
