"""The node's MIG layout through NVML (:class:`gpuguard.collector.mig.MigLayout`): which
physical GPUs are in MIG mode and which MIG device UUIDs live on each.

Calls (NVML API reference, "Multi Instance GPU Management"): ``nvmlDeviceGetMigMode``
(current mode ``NVML_DEVICE_MIG_ENABLE``), ``nvmlDeviceGetMaxMigDeviceCount`` and
``nvmlDeviceGetMigDeviceHandleByIndex`` (slots without an instance answer NotFound),
``nvmlDeviceGetUUID`` on a MIG handle (``MIG-<uuid>``). A GPU answering NotSupported /
FunctionNotFound for its MIG mode (pre-Ampere, old driver) is not in MIG mode; any other
failure leaves its mode unknown, which :func:`gpuguard.collector.mig.restrict` treats as
MIG (its numbering cannot be trusted).
"""

from __future__ import annotations

from typing import Any

from gpuguard.gpu.nvml_calls import CallTimeout, error_name
from gpuguard.gpu.nvml_fields import _text

_NOT_MIG = frozenset({"NotSupported", "FunctionNotFound"})


class _Hung(Exception):
    """A call did not return: the rest would wait on the same driver lock."""


def read_mig_layout(src: Any) -> Any:
    """The layout of the node behind :class:`~gpuguard.gpu.nvml.NvmlSource` ``src``, or None
    when NVML cannot be initialised, the GPU count cannot be read or a call hangs. Each
    call runs on the source's worker under its per-call timeout."""
    from gpuguard.collector.mig import MigLayout

    if src._init() is not None:
        return None
    nv = src._nv

    def call(label: str, *args: Any) -> tuple[bool, Any]:
        fn = getattr(nv, label, None)
        if fn is None:
            return False, "FunctionNotFound"
        try:
            job = src._runner.call(src.call_timeout_s, label, fn, *args)
        except CallTimeout as t:  # the source's hung-call bookkeeping, as for its own node-level calls
            src._stuck["node"] = (label, t.args[0])
            raise _Hung from None
        if job.exc is not None:
            return False, error_name(job.exc)
        return True, job.result

    try:
        return _read(nv, call, MigLayout)
    except _Hung:
        return None


def _read(nv: Any, call: Any, layout: Any) -> Any:
    ok, n = call("nvmlDeviceGetCount")
    if not ok:
        return None
    gpus: dict[int, str | None] = {}
    mig_gpus: set[int] = set()
    parents: dict[str, int] = {}
    for i in range(int(n)):
        ok, h = call("nvmlDeviceGetHandleByIndex", i)
        if not ok:
            gpus[i] = None
            mig_gpus.add(i)
            continue
        ok, u = call("nvmlDeviceGetUUID", h)
        gpus[i] = _text(u) if ok else None
        ok, mode = call("nvmlDeviceGetMigMode", h)
        if not ok:
            if mode not in _NOT_MIG:
                mig_gpus.add(i)
            continue
        if mode[0] != nv.NVML_DEVICE_MIG_ENABLE:
            continue
        mig_gpus.add(i)
        ok, slots = call("nvmlDeviceGetMaxMigDeviceCount", h)
        for k in range(int(slots) if ok else 0):
            ok, mh = call("nvmlDeviceGetMigDeviceHandleByIndex", h, k)
            if ok:
                ok, mu = call("nvmlDeviceGetUUID", mh)
                if ok:
                    parents[_text(mu).lower()] = i
    return layout(gpus, frozenset(mig_gpus), parents)
