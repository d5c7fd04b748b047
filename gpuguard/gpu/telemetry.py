"""The collector's per-interval NVML path: only the job's GPUs, only what a sample row needs.

A full :meth:`NvmlSource.snapshot` (the Prolog's health read) makes about 1,000 NVML calls
on an 8-GPU NVLink node and hands each to a worker thread; the collector needs the
metric table's sampled fields (:data:`gpuguard.metrics.GPU_SAMPLED`) of the job's GPUs
only. :func:`read_job_gpus` therefore:

* resolves the job's GPUs to NVML handles once (``nvmlDeviceGetHandleByIndex``, UUID and
  PCI bus id read then, not per tick);
* reads every job GPU in **one** worker-thread job with one deadline
  (``call_timeout_s``), instead of one thread handoff per call;
* per GPU per tick: the metric table's NVML reads (:class:`gpuguard.metrics.Nvml`: one
  call per getter, so ``nvmlDeviceGetUtilizationRates`` answers gpu and memory
  utilisation) — ``...UtilizationRates``, ``...MemoryInfo``, ``...PowerUsage``,
  ``...Temperature``, ``...ClockInfo(SM)`` — and ``...CurrentClocksEventReasons``: 6 calls;
* with ``slow=True`` (the collector asks once a minute, ``[collector] slow_every_s``): the
  cumulative counters (:data:`gpuguard.metrics.GPU_SLOW`) in one
  ``nvmlDeviceGetFieldValues`` call per GPU (their ``Nvml.field_id``: NVML API
  reference, "Field Value Queries"), or the single getters where the driver or
  nvidia-ml-py lacks it.

A metric added to the table with an :class:`~gpuguard.metrics.Nvml` read is read here
with no code of its own.

A 1-GPU job thus costs 1/8 of an 8-GPU job. Error handling follows
:mod:`gpuguard.gpu.nvml`: NotSupported leaves ``None``; other NVML errors go to
``read_errors`` by field; ``GpuIsLost`` stops reads of that GPU for the tick. A batch that
does not return within the deadline marks every job GPU's fields ``"Timeout"`` and is not
retried while the hung call is outstanding.
"""

from __future__ import annotations

import time
from typing import Any

from gpuguard.gpu.nvml import UNSUPPORTED_ERRORS, CallTimeout, _text, error_name
from gpuguard.metrics import GPU_SAMPLED, GPU_SLOW
from gpuguard.model import GpuState, NodeSnapshot, decode_clock_event_reasons, norm_pci

#: The hung-call scope of the telemetry batch in :attr:`NvmlSource._stuck`.
SCOPE = "telemetry"

def _fast_reads() -> tuple[tuple[tuple[str, ...], tuple[str, ...], Any, Any], ...]:
    """``(fields, nvml function names (fallbacks after the first), args builder,
    converter)`` per NVML call of a tick: the metric table's :class:`~gpuguard.metrics.Nvml`
    reads of the sampled metrics (one call per getter and arguments, shared by the
    metrics it answers), then the clock-event reasons (decoded to names)."""
    groups: dict[tuple[str, str, tuple[str, ...]], list[Any]] = {}
    for m in GPU_SAMPLED:
        if m.nvml is not None:
            groups.setdefault((m.nvml.getter, m.nvml.fallback, m.nvml.args), []).append(m)
    out = []
    for (getter, fallback, args), ms in groups.items():
        out.append((tuple(m.name for m in ms), (getter, fallback) if fallback else (getter,),
                    lambda nv, args=args: tuple(getattr(nv, a) for a in args),
                    lambda v, ms=ms: tuple(m.nvml.convert(v, False) for m in ms)))
    out.append((("clock_event_reasons",), ("nvmlDeviceGetCurrentClocksEventReasons",
                                           "nvmlDeviceGetCurrentClocksThrottleReasons"),
                lambda nv: (), lambda m: (decode_clock_event_reasons(int(m)),)))
    return tuple(out)


_FAST = _fast_reads()

#: Slow counters (the table's ``gpu_slow`` metrics with an NVML read): (GpuState field,
#: NVML field id constant, single-call fallback, its args, the metric's Nvml read).
_SLOW = tuple((m.name, m.nvml.field_id, m.nvml.getter, lambda nv, a=m.nvml.args: tuple(getattr(nv, x) for x in a),
               m.nvml) for m in GPU_SLOW if m.nvml is not None)


class _Gpu:
    __slots__ = ("handle", "index", "pci", "uuid")

    def __init__(self, index: int, handle: Any, uuid: str | None, pci: str | None):
        self.index, self.handle, self.uuid, self.pci = index, handle, uuid, pci


def _call(nv: Any, names: tuple[str, ...], handle: Any, args: tuple[Any, ...]) -> tuple[Any, str | None]:
    """``(value, None)``, ``(None, None)`` for unsupported, or ``(None, error name)``."""
    for name in names:
        fn = getattr(nv, name, None)
        if fn is None:
            continue
        try:
            return fn(handle, *args), None
        except Exception as e:
            err = error_name(e)
            if err == "FunctionNotFound":
                continue
            return None, (None if err in UNSUPPORTED_ERRORS else err)
    return None, None


def _slow_values(nv: Any, g: GpuState, handle: Any) -> None:
    ids = [getattr(nv, c, None) for _f, c, _fn, _a, _r in _SLOW]
    fv = getattr(nv, "nvmlDeviceGetFieldValues", None)
    if fv is not None and None not in ids:
        try:
            vals = fv(handle, ids)
        except Exception as e:
            if error_name(e) not in ("FunctionNotFound", *UNSUPPORTED_ERRORS):
                for f, *_ in _SLOW:
                    g.read_errors[f] = error_name(e)
                return
        else:
            for (f, *_, rd), v in zip(_SLOW, vals, strict=True):
                if v.nvmlReturn == 0:
                    setattr(g, f, rd.convert(v.value.ullVal, True))
                elif v.nvmlReturn != nv.NVML_ERROR_NOT_SUPPORTED:
                    g.read_errors[f] = error_name(nv.NVMLError(v.nvmlReturn))
            return
    for f, _c, fn, args, rd in _SLOW:
        val, err = _call(nv, (fn,), handle, args(nv))
        if err:
            g.read_errors[f] = err
        elif val is not None:
            setattr(g, f, rd.convert(val, True))


def _read_batch(nv: Any, gpus: list[_Gpu], slow: bool) -> list[GpuState]:
    """Runs on the worker thread: every job GPU, one pass."""
    out = []
    for d in gpus:
        g = GpuState(index=d.index, uuid=d.uuid, pci_bus_id=d.pci)
        out.append(g)
        for fields, names, args, conv in _FAST:
            val, err = _call(nv, names, d.handle, args(nv))
            if err:
                for f in fields:
                    g.read_errors[f] = err
                if err == "GpuIsLost":
                    break
            elif val is not None:
                try:
                    for f, v in zip(fields, conv(val), strict=True):
                        setattr(g, f, v)
                except Exception as e:  # an unconvertible value is a read error
                    for f in fields:
                        g.read_errors[f] = error_name(e)
        else:
            if slow:
                _slow_values(nv, g, d.handle)
    return out


def _resolve(nv: Any, indices: list[int], uuids: list[str]) -> list[_Gpu]:
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
        out.append(_Gpu(i, h, uuid, pci))
    return out


def read_job_gpus(src: Any, indices: list[int], uuids: list[str], slow: bool) -> NodeSnapshot:
    """One sample of the job's GPUs through ``src`` (an :class:`NvmlSource`, whose NVML
    initialisation, worker thread and hung-call bookkeeping are reused). Returns a
    :class:`NodeSnapshot` holding only the job's GPUs with only the sampled fields set;
    ``error`` set when NVML is unusable or the handle lookup failed. Never raises."""
    snap = NodeSnapshot(taken_at=time.time(), source="nvml")
    err = src._init()
    if err is not None:
        snap.error = err
        return snap
    nv = src._nv
    src._prune_stuck()
    gpus = getattr(src, "_telemetry_gpus", None)
    if SCOPE in src._stuck:
        for d in gpus or []:
            g = GpuState(index=d.index, uuid=d.uuid, pci_bus_id=d.pci)
            g.read_errors = {"telemetry": "Timeout"}
            snap.gpus.append(g)
        return snap
    try:
        if gpus is None:
            job = src._runner.call(src.call_timeout_s, "telemetry handles", _resolve, nv, indices, uuids)
            if job.exc is not None:
                snap.error = f"NVML error: resolving the job's GPUs failed: {error_name(job.exc)}"
                return snap
            gpus = src._telemetry_gpus = job.result
        job = src._runner.call(src.call_timeout_s, "telemetry", _read_batch, nv, gpus, slow)
    except CallTimeout as t:
        src._stuck[SCOPE] = ("telemetry", t.args[0])
        for d in gpus or []:
            g = GpuState(index=d.index, uuid=d.uuid, pci_bus_id=d.pci)
            g.read_errors = {"telemetry": "Timeout"}
            snap.gpus.append(g)
        if gpus is None:
            snap.error = f"NVML hung: resolving the job's GPUs did not return within {src.call_timeout_s} s"
        return snap
    if job.exc is not None:
        snap.error = f"tool error: telemetry read failed: {type(job.exc).__name__}: {job.exc}"
        return snap
    snap.gpus = job.result
    return snap
