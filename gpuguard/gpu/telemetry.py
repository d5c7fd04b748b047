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
* per GPU per tick: the metric table's NVML reads (:class:`gpuguard.metrics.Nvml`: one
  call per getter and arguments, so ``nvmlDeviceGetUtilizationRates`` answers gpu and
  memory utilisation) — ``...UtilizationRates``, ``...MemoryInfo``, ``...PowerUsage``,
  ``...Temperature``, ``...ClockInfo(SM)`` — and ``...CurrentClocksEventReasons`` for the
  clock-event mask (:data:`MASK_CALL`, computed here): 6 calls; metrics NVML gives only
  as a field value (``Nvml`` with a ``field_id`` and no getter) add one
  ``nvmlDeviceGetFieldValues`` call for all of them;
* with ``slow=True`` (the collector asks once a minute, :data:`gpuguard.collector.run.SLOW_EVERY_S`):
  the cumulative counters (:data:`gpuguard.metrics.GPU_SLOW`) in one
  ``nvmlDeviceGetFieldValues`` call per GPU (their ``Nvml.field_id``: NVML API reference,
  "Field Value Queries"), or the single getters where the driver or nvidia-ml-py lacks
  it, and for counters without a field id.

What a reading holds comes from the metric table: values in ``GPU_SAMPLED`` order (and
``GPU_SLOW`` order), already in the store's integer form, ``round(v * Metric.scale)`` of
the value :meth:`Nvml.convert <gpuguard.metrics.Nvml.convert>` gives, so the store
writes them as they are (one tuple per GPU per tick, nothing converted at flush).
A metric added to the table with an :class:`~gpuguard.metrics.Nvml` read is read here with
no code of its own; one without (other than the mask) reads ``None``
(:attr:`JobTelemetry.unread` names them). The plan (which function feeds which value
position, the converters, the fallbacks present in the loaded pynvml) is compiled once
per job (:func:`compile_plan`).

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

from gpuguard.gpu.nvml import UNSUPPORTED_ERRORS, CallTimeout, _text, error_name
from gpuguard.metrics import GPU_SAMPLED, GPU_SLOW, Nvml
from gpuguard.model import CLOCK_EVENT_REASONS, GpuState, NodeSnapshot, decode_clock_event_reasons, norm_pci

#: The hung-call scope of the telemetry batch in :attr:`NvmlSource._stuck`.
SCOPE = "telemetry"

#: Clock-event bits gpuguard knows (model.CLOCK_EVENT_REASONS); other bits are dropped.
KNOWN_CLOCK_BITS = 0
for _bit, _label in CLOCK_EVENT_REASONS.values():
    KNOWN_CLOCK_BITS |= _bit

#: The clock-event mask (``clock_event_mask``, no :class:`Nvml` read in the table: a bit
#: mask, not a number): its functions (newer name first) and the value from the result.
MASK_CALL = (("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"),
             lambda m: int(m) & KNOWN_CLOCK_BITS)

#: ``c_nvmlFieldValue_t.valueType`` -> the union member holding the value (nvml.h
#: ``nvmlValueType_t``: DOUBLE 0, UNSIGNED_INT 1, UNSIGNED_LONG 2, UNSIGNED_LONG_LONG 3,
#: SIGNED_LONG_LONG 4, SIGNED_INT 5).
_VALUE_MEMBER = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal"}


def converter(n: Nvml, integer: bool, scale: int | None) -> Callable[[Any], Any]:
    """The stored integer of a metric from its getter's result (or a field value's
    number): ``round(n.convert(raw, integer) * scale)``, compiled once (C-level
    ``attrgetter``/``int`` where the value is NVML's integer as it is). ``scale`` None:
    the value in real units, ``n.convert(raw, integer)``."""
    if scale is None:
        return lambda r: n.convert(r, integer)
    d, a = n.raw_per_unit, n.attr
    if d == 1 and scale == 1:  # NVML's unsigned integer is the stored value
        return operator.attrgetter(a) if a else int
    if a:
        return lambda r: round(getattr(r, a) / d * scale)
    return lambda r: round(r / d * scale)


class GpuReading(NamedTuple):
    """One job GPU at one tick: ``values`` in ``GPU_SAMPLED`` order, as the store keeps
    them (``round(value * Metric.scale)``: :func:`gpuguard.metrics.scale_value`; ``None`` =
    no reading; real units from a reader made with ``stored=False``); ``slow`` likewise
    in ``GPU_SLOW`` order, or ``None`` when not read;
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


def _field_call(nv: Any, metrics: list[tuple[int, str, str, Any]]) -> _Call | None:
    """One ``nvmlDeviceGetFieldValues`` call for ``(position, metric, field id name,
    converter)``; None when pynvml lacks the function or there is nothing to read."""
    fv = getattr(nv, "nvmlDeviceGetFieldValues", None)
    if fv is None or not metrics:
        return None

    def getter(i: int, conv: Any) -> Callable[[Any], Any]:
        def get(values: Any) -> Any:
            v = values[i]
            if v.nvmlReturn != 0:  # a per-field error, NotSupported included
                raise nv.NVMLError(v.nvmlReturn)
            return conv(getattr(v.value, _VALUE_MEMBER.get(getattr(v, "valueType", 3), "ullVal")))
        return get

    ids = [getattr(nv, c) for _p, _n, c, _cv in metrics]
    return _Call([fv], (ids,), [(p, n, getter(i, cv)) for i, (p, n, _c, cv) in enumerate(metrics)])


def compile_plan(nv: Any, stored: bool = True) -> tuple[list[_Call], list[_Call], list[str]]:
    """The per-tick calls, the slow calls and the metrics nothing reads, from the metric
    table and the loaded pynvml module (functions and constants it lacks are dropped).
    Values in the stored integer form, or in real units when not ``stored``."""
    calls: dict[tuple[Any, ...], _Call] = {}
    unread: list[str] = []
    fast_fields: list[tuple[int, str, str, Any]] = []

    def add(key: tuple[Any, ...], names: tuple[str, ...], args: tuple[Any, ...], out: tuple[int, str, Any]) -> None:
        if key not in calls:
            calls[key] = _Call([f for f in (getattr(nv, x, None) for x in names if x) if f is not None], args, [])
        calls[key].outs.append(out)

    for pos, m in enumerate(GPU_SAMPLED):
        n = m.nvml
        if m.name == "clock_event_mask":
            add(("mask",), MASK_CALL[0], (), (pos, m.name, MASK_CALL[1]))
        elif n is None or any(getattr(nv, a, None) is None for a in n.args):
            unread.append(m.name)
        elif not n.getter:  # a field value only: one nvmlDeviceGetFieldValues per tick for all of them
            if getattr(nv, n.field_id, None) is None:
                unread.append(m.name)
            else:
                fast_fields.append((pos, m.name, n.field_id, converter(n, False, m.scale if stored else None)))
        else:
            add((n.getter, n.fallback, n.args), (n.getter, n.fallback), tuple(getattr(nv, a) for a in n.args),
                (pos, m.name, converter(n, False, m.scale if stored else None)))
    fast = [c for c in calls.values() if c.fn is not None]
    unread += [n for c in calls.values() if c.fn is None for _p, n, _g in c.outs]
    fc = _field_call(nv, fast_fields)
    if fc is not None:
        fast.append(fc)
    else:
        unread += [name for _p, name, _f, _c in fast_fields]

    singles: list[_Call] = []  # one getter call per slow counter
    fields: list[tuple[int, str, str, Any]] = []
    for pos, m in enumerate(GPU_SLOW):
        n = m.nvml
        fn = getattr(nv, n.getter, None) if n is not None else None
        if fn is not None and all(getattr(nv, a, None) is not None for a in n.args):
            singles.append(_Call([fn], tuple(getattr(nv, a) for a in n.args), [(pos, m.name, converter(n, True, m.scale if stored else None))]))
        if n is not None and n.field_id and getattr(nv, n.field_id, None) is not None:
            fields.append((pos, m.name, n.field_id, converter(n, True, m.scale if stored else None)))
    in_fields = {name for _p, name, _f, _c in fields}
    fc = _field_call(nv, fields)
    if fc is not None:  # counters without a field id keep their getter call
        fc.alt = [c for c in singles if c.outs[0][1] in in_fields]
        slow = [fc] + [c for c in singles if c.outs[0][1] not in in_fields]
    else:
        slow = singles
    have = {o[1] for c in slow for o in c.outs}
    return fast, slow, unread + [m.name for m in GPU_SLOW if m.name not in have]


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
    ``uuids``: the job's GPUs as ``--gpus`` names them. ``stored``: values in the store's
    integer form (the collector), else in real units. Not thread-safe (one per source)."""

    def __init__(self, src: Any, indices: list[int], uuids: list[str], stored: bool = True):
        self.src = src
        self.stored = stored
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

    def _not_readable(self, taken_at: float) -> Reading | None:
        """The reading to return without touching the GPUs: NVML not initialised, or a
        call of this scope still hung (its GPUs read as ``Timeout``); else None."""
        src = self.src
        err = src._init()
        if err is not None:
            return Reading(taken_at, err, [])
        if src._stuck:
            src._prune_stuck()
            if SCOPE in src._stuck:
                return self._timed_out(taken_at)
        return None

    def read(self, slow: bool) -> Reading:
        """One tick of the job's GPUs (the slow counters too when ``slow``). Never raises."""
        src = self.src
        taken_at = time.time()
        early = self._not_readable(taken_at)
        if early is not None:
            return early
        if self._plan is None:
            self._plan = compile_plan(src._nv, self.stored)
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
        early = self._not_readable(taken_at)
        if early is not None:
            return early
        try:
            if self._plan is None:
                self._plan = compile_plan(src._nv, self.stored)
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


def to_gpu_state(r: GpuReading, stored: bool = True) -> GpuState:
    """A reading as a :class:`GpuState` in real units (the GpuState fields named like the
    metrics; the clock-event mask as reason names). ``stored``: the reading's values are
    in the store's integer form (divided by the scale here)."""
    g = GpuState(index=r.index, uuid=r.uuid, pci_bus_id=r.pci_bus_id)

    def real(m: Any, v: Any) -> Any:
        return v / m.scale if stored and v is not None and m.scale != 1 else v

    for m, v in zip(GPU_SAMPLED, r.values, strict=True):
        if m.name == "clock_event_mask":
            g.clock_event_reasons = None if v is None else decode_clock_event_reasons(v)
        elif hasattr(g, m.name):
            setattr(g, m.name, real(m, v))
    if r.slow is not None:
        for m, v in zip(GPU_SLOW, r.slow, strict=True):
            if hasattr(g, m.name):
                setattr(g, m.name, real(m, v))
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
        cache = src._job_telemetry = (key, JobTelemetry(src, indices, uuids, stored=False))
    r = cache[1].read(slow)
    snap = NodeSnapshot(taken_at=r.taken_at, source="nvml")
    snap.error = r.error
    snap.gpus = [to_gpu_state(g, stored=False) for g in r.gpus]
    return snap
