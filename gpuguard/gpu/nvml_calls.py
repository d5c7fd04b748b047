"""Running NVML calls under a deadline: the worker-thread call runner and its markers.

:class:`gpuguard.gpu.nvml.NvmlSource` makes every NVML call through :class:`_CallRunner`
(the module docstring of :mod:`gpuguard.gpu.nvml`, "Hung calls", says why a call runs on
a daemon worker thread); :data:`SKIP` and :data:`END` are what a call answers in place
of a value, :class:`_GpuRead` the per-GPU book-keeping of one snapshot, and
:func:`error_name` the short error name recorded in ``read_errors``.
"""

from __future__ import annotations

import _thread
import queue
import threading
from collections.abc import Callable
from typing import Any

from gpuguard.model import GpuState


class CallTimeout(Exception):
    """An NVML call did not return within its deadline (internal)."""


def error_name(exc: BaseException) -> str:
    """Short name of an exception as recorded in ``read_errors``: ``NVMLError_GpuIsLost``
    -> ``"GpuIsLost"``; a bare ``NVMLError`` with an unmapped code -> ``"NVMLError(<code>)"``;
    anything else -> its class name."""
    name = type(exc).__name__
    if name.startswith("NVMLError_"):
        return name[len("NVMLError_") :]
    if name == "NVMLError":
        return f"NVMLError({getattr(exc, 'value', '?')})"
    return name


class _Done:
    """A one-shot "finished" flag with :class:`threading.Event`'s ``set``/``is_set``/``wait``,
    on one bare lock: the collector hands a batch to the worker every tick, and an Event
    (a Condition, a lock and a waiter list per call) cost a third more CPU per hand-off
    (measured: 28 vs 21 us on the bench machine)."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = _thread.allocate_lock()
        self._lock.acquire()

    def set(self) -> None:
        if self._lock.locked():
            self._lock.release()

    def is_set(self) -> bool:
        return not self._lock.locked()

    def wait(self, timeout: float | None = None) -> bool:
        """True once set; False when ``timeout`` seconds passed first. Leaves it set."""
        if self._lock.acquire(True, -1 if timeout is None else max(0.0, timeout)):
            self._lock.release()
            return True
        return False


class _Job:
    __slots__ = ("args", "done", "exc", "fn", "label", "result")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], label: str) -> None:
        self.fn, self.args, self.label = fn, args, label
        self.done = _Done()
        self.result: Any = None
        self.exc: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except BaseException as e:  # handed back to the calling thread
            self.exc = e
        finally:
            self.done.set()


class _CallRunner:
    """Runs callables one at a time on a daemon worker thread, each with a deadline.

    A call past its deadline raises :class:`CallTimeout` in the caller; its worker is
    abandoned (told to exit once the call returns) and the next call gets a new worker.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] | None = None

    def _start_worker(self) -> queue.SimpleQueue[_Job | None]:
        jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()

        def work() -> None:
            while (job := jobs.get()) is not None:
                job.run()

        threading.Thread(target=work, name="gpuguard-nvml-call", daemon=True).start()
        return jobs

    def call(self, timeout_s: float, label: str, fn: Callable[..., Any], *args: Any) -> _Job:
        """Run ``fn(*args)``; return the finished job, or raise :class:`CallTimeout` whose
        ``args[0]`` is the still-running job (poll ``job.done`` to see it return)."""
        if self._jobs is None:
            self._jobs = self._start_worker()
        job = _Job(fn, args, label)
        self._jobs.put(job)
        if not job.done.wait(timeout_s):
            self._jobs.put(None)  # the worker exits after the hung call, if it ever returns
            self._jobs = None
            raise CallTimeout(job)
        return job

    def stop(self) -> None:
        if self._jobs is not None:
            self._jobs.put(None)
            self._jobs = None


class _Sentinel:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


#: The call was not made or gave no value; the field stays None.
SKIP = _Sentinel("SKIP")
#: NVML raised one of the caller's ``end_on`` errors (end of an enumeration).
END = _Sentinel("END")


class _GpuRead:
    """Book-keeping for one GPU during one snapshot."""

    def __init__(self, state: GpuState, scope: int | str) -> None:
        self.state = state
        self.scope = scope
        self.stopped = False
