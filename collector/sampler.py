"""The collector's sampler thread: each tick's read of the job's GPUs and its host sample,
on a thread of its own that the collector's main thread watches.

Why: a C call into the NVML driver cannot be interrupted from Python, and the main thread
must stay free to handle SIGTERM, flush the buffer and exit, so the NVML reads run on
another thread. Handing each tick's batch to a worker and waiting for it (what
:meth:`gpuguard.gpu.telemetry.JobTelemetry.read` does, one deadline per batch) wakes three
threads a tick; measured with the fake pynvml (``bench/collector_cpu.py``), the hand-off
was a third of the collector's CPU at 8 GPUs. The sampler runs the whole tick loop itself
(read, host sample, rows into the buffer), so a tick wakes one thread, like a plain loop;
the main thread wakes for flushes, liveness checks and the watch.

The watch (:meth:`Sampler.check`, every ``timeout_s`` = ``[gpu] call_timeout_s``): the
sampler notes when its current NVML read began. A read running longer than
``timeout_s`` is hung: the main thread marks the source's telemetry scope stuck (no
further call enters the driver while it is outstanding, and ``close`` skips
``nvmlShutdown``), then takes the ticks over itself with
:meth:`Collector.sample_once <gpuguard.collector.run.Collector.sample_once>`: rows with
``{"telemetry": "Timeout"}`` until the call returns, then reads through the worker
hand-off with its per-batch deadline. The sampler thread ends when its call returns, and
drops that late reading. A hang is thus seen within ``2 * timeout_s``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from gpuguard.gpu.nvml_calls import _Done
from gpuguard.gpu.telemetry import SCOPE


class _HungRead:
    """Stands in for the runner's job in :attr:`NvmlSource._stuck` while the sampler's
    read is hung: ``done`` is set when it returns."""

    __slots__ = ("done", "label")

    def __init__(self) -> None:
        self.done = _Done()
        self.label = SCOPE


class Sampler:
    """The tick loop of one :class:`~gpuguard.collector.run.Collector` on its own thread
    (module docstring). ``reader``: the source's
    :class:`~gpuguard.gpu.telemetry.JobTelemetry`; ``timeout_s``: how long one read may
    take before it is declared hung."""

    def __init__(self, coll: Any, reader: Any, timeout_s: float):
        self.coll = coll
        self.reader = reader
        self.timeout_s = timeout_s
        #: monotonic time the current NVML read began; None between reads
        self.busy_since: float | None = None
        #: set by the main thread when a read passed ``timeout_s``
        self.hung = False
        self._hung_read: _HungRead | None = None
        self.thread = threading.Thread(target=self._loop, name="gpuguard-sampler", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _loop(self) -> None:
        try:
            self._ticks()
        except Exception as e:  # a bug here must not end the job's monitoring: the main thread ticks
            self.coll.log.error("tool error: sampler thread failed: %s: %s; sampling on the main thread",
                                type(e).__name__, e)

    def _ticks(self) -> None:
        c = self.coll
        next_t = time.monotonic()
        while not c.stop_event.is_set():
            self.busy_since = time.monotonic()
            rows = c.gpu_rows(self.reader.read_here)
            with c.lock:
                if self.hung:  # declared hung meanwhile: the main thread ticks now
                    if self._hung_read is not None:
                        self._hung_read.done.set()
                    return
                self.busy_since = None
                if rows:
                    c.buffer.add("samples", rows)
            c.sample_host()
            next_t += c.interval_s
            now = time.monotonic()
            if next_t <= now:  # fell behind: skip the missed ticks
                next_t = now + c.interval_s
            c.stop_event.wait(next_t - now)

    def check(self, now: float) -> bool:
        """Main thread: True once the sampler is hung (declaring it so, the first time) or
        its thread ended on an error (then :meth:`returned` stays False: the main thread
        keeps ticking)."""
        if self.hung:
            return True
        if not self.thread.is_alive() and not self.coll.stop_event.is_set():
            self.hung = True
            return True
        with self.coll.lock:
            since = self.busy_since
            if since is None or now - since <= self.timeout_s:
                return False
            self.hung = True
            self._hung_read = _HungRead()
            src = self.reader.src
            src._stuck[SCOPE] = (SCOPE, self._hung_read)
        self.coll.log.error("NVML telemetry read hung for more than %.3g s: GPU samples are marked Timeout "
                            "until it returns", self.timeout_s)
        return True

    def returned(self) -> bool:
        """Main thread: the hung read has returned (the thread is ending)."""
        return self._hung_read is not None and self._hung_read.done.is_set()

    def stop(self, wait_s: float) -> None:
        """After the stop event is set: let the thread finish its tick (at most ``wait_s``;
        a thread stuck in the driver is left behind, it is a daemon)."""
        if self.thread.is_alive():
            self.thread.join(timeout=wait_s)
