"""GPU state from NVML (nvidia-ml-py, import ``pynvml``), every call under a deadline.

:class:`NvmlSource` reads one :class:`~gpuguard.model.NodeSnapshot`
(``source="nvml"``) with one :class:`~gpuguard.model.GpuState` per GPU. Function names
below are the NVML API reference names (``nvmlDevice*`` / ``nvmlSystem*``), called
through the nvidia-ml-py wrappers of the same names. Units are converted as model.py
names them: mW -> W (``/ 1000``), bytes -> MiB (``/ 2**20``), the clock-event bit mask
-> reason names (:func:`~gpuguard.model.decode_clock_event_reasons`),
``nvmlSystemGetCudaDriverVersion`` 12020 -> ``"12.2"``, PCI bus id -> :func:`norm_pci`.

Error handling, per call (DESIGN.md: "a hung driver is a critical finding, not a
hung prolog"; model.py: ``None`` means unsupported, never zero):

* success: the converted value.
* ``NVMLError_NotSupported``: the field stays ``None``.
* ``NVMLError_FunctionNotFound``: the field stays ``None`` (the installed driver predates
  the function, so it is unsupported *here*); where a newer and an older function exist
  (``nvmlDeviceGetCurrentClocksEventReasons`` then ``...ClocksThrottleReasons``;
  ``nvmlDeviceGetTemperature`` then ``...TemperatureV``) the next one is tried first,
  also when the pynvml module lacks the name.
* ``NVMLError_NoPermission``: ``read_errors[field] = "NoPermission"``. Not "unsupported"
  (root would read it) and not a fault (``GpuState.lost`` stays False).
* ``NVMLError_GpuIsLost``: ``read_errors[field] = "GpuIsLost"``; no further call is made
  to that GPU in this snapshot.
* ``NVMLError_Unknown``, ``NVMLError_Timeout`` and any other ``NVMLError_*``:
  ``read_errors[field]`` = the class name without ``NVMLError_`` (``"Unknown"``,
  ``"Timeout"``, ``"CorruptedInforom"``; ``"NVMLError(<code>)"`` for an unmapped code);
  reading goes on, since the call did return.
* the call did not return within ``call_timeout_s``: ``read_errors[field] = "Timeout"``;
  no further call is made to that GPU, in this snapshot or later ones, until the hung
  call returns (later snapshots repeat the ``"Timeout"`` entry for it).
* any other exception, from the call or from converting its value:
  ``read_errors[field]`` = the exception's class name (``"ValueError"``).

A read that yields several fields (``nvmlDeviceGetRemappedRows``, ...) records the error
under each of them. Errors of the node-level reads (``driver_version``,
``cuda_version``) are copied into every GPU's ``read_errors``. Pseudo-field keys:
``"handle"`` (``nvmlDeviceGetHandleByIndex`` failed, including ``NoPermission`` for a GPU
outside a job's device cgroup; nothing else was read) and
``"nvlinks[<link>].<NvLinkState field>"`` for one NVLink read. ``nvlinks`` is ``None``
when link 0 answers NotSupported/InvalidArgument and also when the enumeration was cut
short (GPU stopped, budget spent): a partial list would read as missing links.

Hung calls. A C call into the driver cannot be interrupted from Python. Each call runs
on a daemon worker thread and the caller waits on an event with a deadline; on expiry
the worker is abandoned (a fresh one serves the next call) and the GPU is not queried
again while the abandoned call is outstanding, so a wedged GPU costs one
``call_timeout_s`` and one thread, not one per field or per snapshot. A hung
*node-level* call (``nvmlSystemGetDriverVersion``, ``nvmlSystemGetCudaDriverVersion``,
``nvmlDeviceGetCount``) ends the snapshot with ``error="NVML hung: ..."``, and so do later
snapshots until it returns. The process can still exit: the workers are daemon threads,
which the interpreter does not join at exit; ctypes releases the GIL during the foreign
call; and :meth:`NvmlSource.close` skips ``nvmlShutdown`` (which would wait on the same
driver lock) while a call is outstanding. What Python cannot fix is a thread stuck *in
the kernel* (an uninterruptible ``ioctl``): the process then lingers until the driver
returns, and Slurm's ``PrologEpilogTimeout`` is the backstop.

Snapshot-level errors (``NodeSnapshot.error``, ``gpus == []``), never an exception:

* ``"tool error: ..."``: gpuguard's own fault (``pynvml`` not importable: a broken
  install; the source used after ``close()``). :func:`gpuguard.health.take_snapshot` turns
  it into a tool error, never a finding, so it can never drain a node.
* ``"NVML unavailable: ..."``: ``NVMLError_LibraryNotFound`` or
  ``NVMLError_DriverNotLoaded`` from ``nvmlInit``: a GPU-less node (info) or a GPU node
  whose driver is missing (a fault: ``gpu.driver_unusable``).
* ``"NVML init failed: <ErrorName> ..."``: any other ``nvmlInit`` failure, e.g.
  ``LibRmVersionMismatch`` after a driver upgrade without reboot, or ``Timeout``.
* ``"NVML hung: ..."``: a node-level call did not return (see above).
* ``"NVML error: <call> failed: <ErrorName>"``: ``nvmlDeviceGetCount`` failed.

Budget. ``total_budget_s`` bounds the per-GPU reads of one snapshot: it is checked
before every per-GPU call, so a snapshot lasts at most ``total_budget_s +
call_timeout_s`` plus the three node-level calls. Once spent, the remaining fields are
left unread as ``None`` with no ``read_errors`` entry (running out of our own time says
nothing about the GPU), and a note is appended to :attr:`NvmlSource.last_notes` and
logged as a warning. ``NodeSnapshot`` has no field for such a note yet.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any, Self

from gpuguard.gpu.nvml_calls import (
    END,
    SKIP,
    CallTimeout,
    _CallRunner,
    _GpuRead,
    _Job,
    error_name,
)
from gpuguard.gpu.nvml_fields import GpuFieldReaders, _mib, _text
from gpuguard.model import GpuState, NodeSnapshot

# Re-exported: gpuguard.gpu.telemetry and callers import these from here.
__all__ = [
    "END",
    "SKIP",
    "STOP_ERRORS",
    "UNAVAILABLE_INIT_ERRORS",
    "UNSUPPORTED_ERRORS",
    "CallTimeout",
    "NvmlSource",
    "NvmlSourceError",
    "_mib",
    "_text",
    "error_name",
]

log = logging.getLogger(__name__)

#: NVML errors that mean "this GPU/driver does not offer the value": the field stays None.
UNSUPPORTED_ERRORS = frozenset({"NotSupported", "FunctionNotFound"})
#: NVML errors after which no further call is made to the GPU.
STOP_ERRORS = frozenset({"GpuIsLost"})
#: ``nvmlInit`` errors that mean "no NVML on this node" (fail open).
UNAVAILABLE_INIT_ERRORS = frozenset({"LibraryNotFound", "DriverNotLoaded"})

_NODE = "node"  # scope of the node-level calls in the hung-call bookkeeping


class NvmlSourceError(RuntimeError):
    """Raised by :meth:`NvmlSource.watch_xid_events` when NVML cannot be used."""


def _cuda_version(v: int) -> str:
    """``nvmlSystemGetCudaDriverVersion`` integer (1000*major + 10*minor) -> ``"12.2"``."""
    return f"{v // 1000}.{(v % 1000) // 10}"


class NvmlSource(GpuFieldReaders):
    """A GPU source backed by NVML.

    ``call_timeout_s``: deadline of each NVML call (seconds). ``total_budget_s``: bound on
    one :meth:`snapshot` (``None``: unbounded); see the module docstring. ``pynvml_module``:
    the module to use instead of ``import pynvml`` (tests inject ``tests/fake_pynvml.py``);
    the real import is deferred to the first :meth:`snapshot` so importing this module
    stays cheap for the prolog.

    Not thread-safe: use one source per thread. NVML is initialised on the first
    :meth:`snapshot` (retried on the next one if that failed, except after a hung
    ``nvmlInit``) and shut down by :meth:`close`. Also a context manager.
    """

    source_name = "nvml"

    def __init__(
        self,
        call_timeout_s: float = 5.0,
        total_budget_s: float | None = None,
        pynvml_module: Any = None,
    ) -> None:
        if call_timeout_s <= 0:
            raise ValueError("call_timeout_s must be > 0")
        if total_budget_s is not None and total_budget_s < 0:
            raise ValueError("total_budget_s must be >= 0 or None")
        self.call_timeout_s = call_timeout_s
        self.total_budget_s = total_budget_s
        self._nv = pynvml_module
        self._runner = _CallRunner()
        self._initialised = False
        self._init_hung = False
        self._closed = False
        #: scope (GPU index or "node") -> (field, job) of a call that passed its deadline
        #: and has not returned yet; that scope is not queried while it is outstanding.
        self._stuck: dict[int | str, tuple[str, _Job]] = {}
        self._deadline: float | None = None
        self._budget_skips: dict[int, int] = {}
        self._xid_set: Any = None
        #: Notes about the last snapshot that have no place in NodeSnapshot (budget).
        self.last_notes: list[str] = []
        self._job_telemetry: Any = None  # (key, JobTelemetry) kept by telemetry()

    # -- lifecycle -------------------------------------------------------------

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _prune_stuck(self) -> None:
        for scope, (_field, job) in list(self._stuck.items()):
            if job.done.is_set():
                del self._stuck[scope]

    def _init(self) -> str | None:
        """Import and initialise NVML; return a NodeSnapshot error string, or None."""
        if self._closed:
            return "tool error: NVML source used after close()"
        if self._initialised:
            return None
        if self._init_hung:
            return "NVML init failed: Timeout (an earlier nvmlInit never returned)"
        if self._nv is None:
            try:
                import pynvml  # deferred: the prolog pays for it only when it reads GPUs
            except ImportError as e:
                return f"tool error: pynvml not importable ({e})"
            self._nv = pynvml
        try:
            job = self._runner.call(self.call_timeout_s, "nvmlInit", self._nv.nvmlInit)
        except CallTimeout:
            self._init_hung = True
            return f"NVML init failed: Timeout (nvmlInit did not return within {self.call_timeout_s} s)"
        if job.exc is not None:
            name = error_name(job.exc)
            if name in UNAVAILABLE_INIT_ERRORS:
                return f"NVML unavailable: {job.exc} ({name})"
            return f"NVML init failed: {name} ({job.exc})"
        self._initialised = True
        return None

    def close(self) -> None:
        """Shut NVML down (``nvmlShutdown``) and stop the worker. Idempotent; never raises.

        ``nvmlShutdown`` is skipped while an earlier call is still hung: it would wait on
        the same driver lock. A closed source is not reopened: a later :meth:`snapshot`
        returns ``error="tool error: NVML source used after close()"``."""
        if self._closed:
            return
        self._closed = True
        self._prune_stuck()
        if self._initialised and not self._stuck:
            try:
                if self._xid_set is not None:
                    self._runner.call(
                        self.call_timeout_s,
                        "nvmlEventSetFree",
                        self._nv.nvmlEventSetFree,
                        self._xid_set,
                    )
                self._runner.call(self.call_timeout_s, "nvmlShutdown", self._nv.nvmlShutdown)
            except CallTimeout:
                log.warning(
                    "nvmlShutdown did not return within %s s; abandoned",
                    self.call_timeout_s,
                )
        self._xid_set = None
        self._initialised = False
        self._runner.stop()

    # -- one call --------------------------------------------------------------

    def _budget_left(self) -> bool:
        return self._deadline is None or time.monotonic() < self._deadline

    def _call(
        self,
        rd: _GpuRead,
        fields: Sequence[str],
        fn_names: Sequence[str],
        *args: Any,
        end_on: frozenset[str] = frozenset(),
        missing_is_error: bool = False,
    ) -> Any:
        """Call the first available of ``fn_names`` (later names are fallbacks, tried when
        the module lacks the name or NVML says ``FunctionNotFound``) under the deadline.

        Returns the raw value, :data:`SKIP` (field stays None; errors already recorded
        under each of ``fields``), or :data:`END` when NVML raised one of ``end_on``
        (nothing recorded). ``missing_is_error`` records an unsupported answer
        as an error too (for the handle lookup, without which nothing can be read).
        """
        if rd.stopped:
            return SKIP
        if not self._budget_left():
            if isinstance(rd.scope, int):
                self._budget_skips[rd.scope] = self._budget_skips.get(rd.scope, 0) + 1
            return SKIP
        last_unsupported = "FunctionNotFound"
        for name in fn_names:
            fn = getattr(self._nv, name, None)
            if fn is None:
                continue
            try:
                job = self._runner.call(self.call_timeout_s, name, fn, *args)
            except CallTimeout as t:
                self._stuck[rd.scope] = (fields[0], t.args[0])
                rd.stopped = True
                self._record(rd, fields, "Timeout")
                log.warning(
                    "NVML %s on %s did not return within %s s",
                    name,
                    rd.scope,
                    self.call_timeout_s,
                )
                return SKIP
            if job.exc is None:
                return job.result
            err = error_name(job.exc)
            if err in end_on:
                return END
            if err == "FunctionNotFound":
                continue
            if err in UNSUPPORTED_ERRORS:
                last_unsupported = err
                break
            if not isinstance(job.exc, Exception):  # KeyboardInterrupt, SystemExit
                raise job.exc
            self._record(rd, fields, err)
            if err in STOP_ERRORS:
                rd.stopped = True
            return SKIP
        if missing_is_error:
            self._record(rd, fields, last_unsupported)
        return SKIP

    @staticmethod
    def _record(rd: _GpuRead, fields: Sequence[str], err: str) -> None:
        for f in fields:
            rd.state.read_errors[f] = err

    def _read(
        self,
        rd: _GpuRead,
        convert: dict[str, Callable[[Any], Any]],
        fn_names: Sequence[str] | str,
        *args: Any,
    ) -> None:
        """One NVML call that fills the fields named in ``convert`` (field -> converter of
        the raw result). A converter that raises records its exception class name."""
        if isinstance(fn_names, str):
            fn_names = (fn_names,)
        raw = self._call(rd, tuple(convert), fn_names, *args)
        if raw is SKIP:
            return
        for f, conv in convert.items():
            try:
                setattr(rd.state, f, conv(raw))
            except Exception as e:  # an unconvertible value is a read error
                rd.state.read_errors[f] = error_name(e)

    # -- snapshot --------------------------------------------------------------

    def snapshot(self) -> NodeSnapshot:
        """Read every GPU. Returns a NodeSnapshot (``source="nvml"``); never raises for
        NVML or driver trouble (see the module docstring for where each outcome goes)."""
        started = time.time()
        self._deadline = None if self.total_budget_s is None else time.monotonic() + self.total_budget_s
        self._budget_skips = {}
        self.last_notes = []
        snap = NodeSnapshot(taken_at=started, source=self.source_name, hostname=socket.gethostname())
        err = self._init()
        if err is not None:
            snap.error = err
            return snap
        nv = self._nv
        self._prune_stuck()
        if _NODE in self._stuck:
            fld, job = self._stuck[_NODE]
            snap.error = f"NVML hung: {job.label} ({fld}) has not returned since an earlier snapshot"
            return snap

        node = _GpuRead(GpuState(index=-1), _NODE)
        saved_deadline, self._deadline = (
            self._deadline,
            None,
        )  # node-level calls are not budgeted
        self._read(node, {"driver_version": _text}, "nvmlSystemGetDriverVersion")
        self._read(node, {"cuda_version": _cuda_version}, "nvmlSystemGetCudaDriverVersion")
        count = self._call(node, ("count",), ("nvmlDeviceGetCount",), missing_is_error=True)
        self._deadline = saved_deadline
        if node.stopped and _NODE in self._stuck:
            fld, job = self._stuck[_NODE]
            snap.error = f"NVML hung: {job.label} ({fld}) did not return within {self.call_timeout_s} s"
            return snap
        snap.driver_version = node.state.driver_version
        snap.cuda_version = node.state.cuda_version
        if count is SKIP:
            snap.error = f"NVML error: nvmlDeviceGetCount failed: {node.state.read_errors.get('count')}"
            return snap
        node_errors = {k: v for k, v in node.state.read_errors.items() if k != "count"}

        for index in range(int(count)):
            g = GpuState(
                index=index,
                driver_version=snap.driver_version,
                cuda_version=snap.cuda_version,
            )
            g.read_errors.update(node_errors)
            snap.gpus.append(g)
            if index in self._stuck:
                fld, _job = self._stuck[index]
                g.read_errors[fld] = "Timeout"  # still hung since an earlier snapshot
                continue
            self._read_gpu(nv, _GpuRead(g, index))

        if self._budget_skips:
            gpus = ", ".join(str(i) for i in sorted(self._budget_skips))
            note = (
                f"total_budget_s={self.total_budget_s} exceeded after {time.time() - started:.2f} s: "
                f"{sum(self._budget_skips.values())} read(s) skipped on GPU(s) {gpus}; their fields are None"
            )
            self.last_notes.append(note)
            log.warning("%s", note)
        return snap

    def telemetry(self, indices: list[int], uuids: list[str], slow: bool) -> NodeSnapshot:
        """The per-interval read of the job's GPUs only, as a NodeSnapshot
        (:func:`gpuguard.gpu.telemetry.read_job_gpus`)."""
        from gpuguard.gpu.telemetry import read_job_gpus

        return read_job_gpus(self, indices, uuids, slow)

    def job_telemetry(self, indices: list[int], uuids: list[str]) -> Any:
        """The collector's per-interval reader of the job's GPUs
        (:class:`gpuguard.gpu.telemetry.JobTelemetry`: flat readings, no GpuState per tick)."""
        from gpuguard.gpu.telemetry import JobTelemetry

        return JobTelemetry(self, indices, uuids)

    def mig_layout(self) -> Any:
        """The node's MIG layout (:func:`gpuguard.gpu.nvml_mig.read_mig_layout`), or None."""
        from gpuguard.gpu.nvml_mig import read_mig_layout

        return read_mig_layout(self)

    # -- XID events ------------------------------------------------------------

    def watch_xid_events(self, timeout_ms: int) -> list[tuple[int, int]]:
        """Wait up to ``timeout_ms`` for NVML XID events; return ``[(gpu_index, xid), ...]``
        in arrival order (``[]`` when none arrived).

        The first call creates an event set (``nvmlEventSetCreate``) and registers every
        GPU that supports it for ``nvmlEventTypeXidCriticalError``
        (``nvmlDeviceRegisterEvents``); the set lives until :meth:`close`, so events between
        two calls are kept by NVML. After the first event, queued ones are drained with a
        zero timeout. NVML only reports XIDs while the set exists: the kernel log stays the
        durable XID source (DESIGN.md).

        Raises :class:`NvmlSourceError` when NVML is unavailable, the set cannot be created
        or a call hangs past ``call_timeout_s`` (the wait itself gets ``timeout_ms`` on top).
        """
        err = self._init()
        if err is not None:
            raise NvmlSourceError(err)
        nv = self._nv
        if self._xid_set is None:
            self._xid_set = self._checked("nvmlEventSetCreate", nv.nvmlEventSetCreate)
            for i in range(self._checked("nvmlDeviceGetCount", nv.nvmlDeviceGetCount)):
                try:
                    h = self._checked("nvmlDeviceGetHandleByIndex", nv.nvmlDeviceGetHandleByIndex, i)
                    self._checked(
                        "nvmlDeviceRegisterEvents",
                        nv.nvmlDeviceRegisterEvents,
                        h,
                        nv.nvmlEventTypeXidCriticalError,
                        self._xid_set,
                    )
                except NvmlSourceError as e:  # one GPU that cannot be watched does not stop the rest
                    log.warning("GPU %d: XID events not watched: %s", i, e)
        events: list[tuple[int, int]] = []
        wait_ms = int(timeout_ms)
        while True:
            label = "nvmlEventSetWait"
            try:
                job = self._runner.call(
                    self.call_timeout_s + wait_ms / 1000.0,
                    label,
                    nv.nvmlEventSetWait,
                    self._xid_set,
                    wait_ms,
                )
            except CallTimeout as t:
                self._stuck[_NODE] = (label, t.args[0])
                raise NvmlSourceError(
                    f"{label} did not return within {timeout_ms} ms + {self.call_timeout_s} s"
                ) from None
            if job.exc is not None:
                if error_name(job.exc) == "Timeout":
                    return events  # NVML_ERROR_TIMEOUT: nothing (more) queued
                raise NvmlSourceError(f"{label} failed: {error_name(job.exc)}") from job.exc
            data = job.result
            if data.eventType == nv.nvmlEventTypeXidCriticalError:
                index = self._checked("nvmlDeviceGetIndex", nv.nvmlDeviceGetIndex, data.device)
                events.append((int(index), int(data.eventData)))
            wait_ms = 0

    def _checked(self, label: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run one node-level call for the XID watcher; raise NvmlSourceError on any failure."""
        try:
            job = self._runner.call(self.call_timeout_s, label, fn, *args)
        except CallTimeout as t:
            self._stuck[_NODE] = (label, t.args[0])
            raise NvmlSourceError(f"{label} did not return within {self.call_timeout_s} s") from None
        if job.exc is not None:
            raise NvmlSourceError(f"{label} failed: {error_name(job.exc)}") from job.exc
        return job.result
