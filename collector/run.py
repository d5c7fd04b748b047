"""The per-job collector: ``python -m gpuguard.collector.run --job-id N [--gpus 0,1] [--uid U]``.

Started detached by the prolog (:mod:`gpuguard.collector.launch`), runs as root, one per
job per node. Every ``[collector] interval_s`` it writes

* one ``samples`` row per *job* GPU (``--gpus``: the prolog's ``SLURM_JOB_GPUS`` /
  ``CUDA_VISIBLE_DEVICES``; numbers are GPU indices, ``GPU-...`` entries are UUIDs; no
  ``--gpus``: the job has no GPUs and only host rows are written). Indices are matched
  to the source's GPU index, which assumes gres.conf lists the GPUs in NVML index order
  (true for ``AutoDetect=nvml`` and for ``File=/dev/nvidia[0-N]`` on usual systems);
  UUIDs match exactly. On a node with a GPU in MIG mode, indices (Slurm's count MIG
  devices) and every GPU in MIG mode are not sampled, ``MIG-...`` entries are mapped to
  their parent GPU for the warning only (:mod:`gpuguard.collector.mig`: a MIG GPU's
  device-level readings are every tenant's, and a row must never claim another GPU);
* one ``host_samples`` row (:mod:`gpuguard.collector.host`);

and, when the GPU source can watch NVML events (``watch_xid_events``), one ``events`` row
(``kind="xid"``, ``source="nvml"``) per XID on a job GPU, from a second source on its own
thread (a source is not thread-safe).

With an NVML source the ticks run on a sampler thread (:mod:`gpuguard.collector.sampler`:
why, and how a hung NVML read is handled); the main thread handles signals, flushes, the
liveness checks and the XID queue. Rows are buffered (a GPU sample is one tuple, in the
store's integer form) and written in one transaction at least every
``min([collector] flush_s, 10)`` seconds, and on SIGTERM/SIGINT (then exit 0). A store
error keeps the rows in memory (at most :data:`MAX_BUFFERED_ROWS`; the oldest samples go
first) and the next flush retries; the collector never exits because of the store.

It never outlives its job (:class:`JobLiveness`, checked every ``--liveness-s``):

1. the job's cgroup directory, once seen, vanished (slurmstepd removes it at job end) —
   one ``stat``, authoritative;
2. no cgroup: no process of the job's uid in ``/proc`` for two checks in a row, once one
   was seen or ``--startup-grace-s`` has passed (the batch script starts after the prolog);
3. no cgroup: ``squeue -h -t all -j N -o %T`` (``[slurm] bin_dir``; a job name cannot forge it) reports a finished state or
   an unknown job, asked at most every ``--scontrol-every-s`` (it costs a slurmctld RPC),
   which covers a user with other processes on the node;
4. no probe has shown the job alive (cgroup present, a process of the uid, scontrol
   saying it runs) for ``--no-evidence-s`` (default 600 s): a collector that cannot tell
   gives up rather than linger;
5. ``--max-runtime-s`` (default 30 days) has passed: a hard cap whatever the probes say.

With the defaults (15 s checks) the collector is gone within 45 s of its job. Exit
status: 0 (stopped, job gone, cap reached), 2 (bad arguments or config). Its log lines go
to ``[paths] log_file`` (``collector[PID] job=N``).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import Any

from gpuguard.collector.cli import DEFAULT_MAX_RUNTIME_S
from gpuguard.collector.host import HostSampler
from gpuguard.collector.liveness import ALIVE_STATES, JobLiveness, scontrol_job_state
from gpuguard.collector.mig import layout_from_snapshot, parse_mig_entries, restrict
from gpuguard.collector.rows import (
    MAX_BUFFERED_ROWS,
    RowBuffer,
    clock_mask,
    gpu_row,
    parse_gpu_list,
    sample_of,
    select_gpus,
)
from gpuguard.model import NodeSnapshot

# Re-exported: liveness and the rows live in their own modules; tests and tools import them here.
__all__ = [
    "ALIVE_STATES",
    "MAX_BUFFERED_ROWS",
    "Collector",
    "JobLiveness",
    "RowBuffer",
    "build_parser",
    "clock_mask",
    "gpu_row",
    "main",
    "parse_gpu_list",
    "scontrol_job_state",
    "select_gpus",
]

MAX_FLUSH_S = 10.0
#: Cumulative counters (ECC, PCIe replays: :data:`gpuguard.metrics.GPU_SLOW`) are read this
#: often. Our choice: they change rarely and are judged per job, so a minute of delay
#: costs nothing, while reading them every second cost most of an NVML snapshot.
SLOW_EVERY_S = 60.0


# -- the collector -----------------------------------------------------------------------


class Collector:
    """The sampling loop. Everything it touches is injected, so tests can run it in
    process: ``source`` (``snapshot()``), ``host`` (:class:`HostSampler`), ``liveness``
    (``check() -> (alive, why)``), ``open_store`` (``() -> Store``; may raise
    ``StoreError``), ``xid_source_factory`` (``() -> source with watch_xid_events`` or
    ``None``). Times in seconds."""

    def __init__(self, *, job_id: str, node: str, source: Any, gpus: str | None, host: HostSampler,
                 liveness: Any, open_store: Callable[[], Any], interval_s: float, flush_s: float,
                 liveness_s: float = 15.0, max_runtime_s: float = DEFAULT_MAX_RUNTIME_S,
                 xid_source_factory: Callable[[], Any] | None = None,
                 log: logging.Logger | None = None, max_rows: int = MAX_BUFFERED_ROWS,
                 job_dir_check: Callable[[], None] | None = None, spill_path: str | None = None,
                 record_ingest: Callable[[Any], None] | None = None,
                 slow_every_s: float = SLOW_EVERY_S):
        if interval_s <= 0 or flush_s <= 0 or liveness_s <= 0:
            raise ValueError("interval_s, flush_s and liveness_s must be > 0")
        self.job_id = job_id
        self.node = node
        self.source = source
        self.indices, self.uuids = parse_gpu_list(gpus)
        self.host = host
        self.liveness = liveness
        self._open_store = open_store
        self.interval_s = interval_s
        self.flush_s = min(flush_s, MAX_FLUSH_S)
        self.liveness_s = liveness_s
        self.max_runtime_s = max_runtime_s
        self.xid_source_factory = xid_source_factory
        self.log = log or logging.getLogger("gpuguard")
        self.buffer = RowBuffer(max_rows)
        #: guards :attr:`buffer` (and the sampler's hung flag) between the main thread and
        #: the sampler thread
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.exit_reason = ""
        #: why the stop event was set (the signal handler's note), read at exit
        self.exit_reason_fn: Callable[[], str] = lambda: ""
        self._store: Any = None
        self._xid_q: queue.SimpleQueue[tuple[float, int, int]] = queue.SimpleQueue()
        #: job GPU index -> what names it in an XID event row (``uuid``, ``pci_bus_id``)
        self._gpu_by_index: dict[int, Any] = {}
        #: the source's per-job reader (``job_telemetry``), made on the first sample
        self._reader: Any = None
        self._warned: set[str] = set()
        self._store_failures = 0
        self.slow_every_s = slow_every_s
        self._next_slow = 0.0  # the first sample reads the slow counters too
        #: called every liveness period: the job directory's size cap (jobdir_cap)
        self.job_dir_check = job_dir_check
        #: training records stored during the job (gpuguard.collector.ingest_tail.record_ingest_tick)
        self.record_ingest = record_ingest
        #: where rows the store did not take at exit go (a locked store), for the epilog
        self.spill_path = spill_path
        #: the job's MIG devices (``MIG-...`` entries), resolved with the indices and UUIDs
        #: against the source's MIG layout before the first sample (gpuguard.collector.mig)
        self.migs = parse_mig_entries(gpus)
        self._mig_pending = bool(self.indices or self.uuids or self.migs)
        if gpus and gpus.strip() and not (self.indices or self.uuids or self.migs):
            # e.g. NoDevFiles: a job with GPUs that we cannot name would otherwise end
            # with no GPU metrics and no word why
            self.log.warning("job GPU list %r names no GPU index, GPU-UUID or MIG device: "
                             "no GPU metrics for this job", gpus[:200])

    # -- pieces --
    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.log.warning(msg, *args)

    def sample_once(self) -> None:
        """Read the job's GPUs and one host sample into the buffer (the tick on the
        calling thread; :mod:`gpuguard.collector.sampler` runs the same on its own)."""
        rows = self.gpu_rows()
        if rows:
            with self.lock:
                self.buffer.add("samples", rows)
        self.sample_host()

    def sample_host(self) -> None:
        """One ``host_samples`` row into the buffer. Never raises."""
        try:
            row = self.host.sample()
        except Exception as e:  # unreadable /proc or cgroup files: keep sampling GPUs
            self._warn_once(f"host:{type(e).__name__}", "host sample failed: %s: %s", type(e).__name__, e)
            return
        with self.lock:
            self.buffer.add("host_samples", [row])

    def _slow_due(self) -> bool:
        now = time.monotonic()
        if now < self._next_slow:
            return False
        self._next_slow = now + self.slow_every_s
        return True

    def _warn_missing(self, have: set[Any]) -> None:
        missing = [str(i) for i in self.indices if i not in have]
        missing += [u for u in self.uuids if u.lower() not in have]
        if missing:
            self._warn_once("missing", "job GPU(s) not found on this node: %s", ",".join(missing))

    def resolve_mig(self) -> bool:
        """Keep only the job GPUs that name NVML GPUs not in MIG mode
        (:func:`gpuguard.collector.mig.restrict`), once, before the first sample; one
        warning per reason something is left out. A source without ``mig_layout`` is
        asked for one snapshot (its GPUs' MIG modes). While a source that can tell fails
        to (NVML not up, a hung or failed call), nothing is sampled (one warning) and the
        next tick asks again: an index is never sampled before the node is known to have
        no GPU in MIG mode. A source with neither (a test double) keeps the list as
        given. Returns whether the list is resolved. Never raises."""
        layout_fn = getattr(self.source, "mig_layout", None)
        snap_fn = getattr(self.source, "snapshot", None)
        layout = None
        if layout_fn is not None or snap_fn is not None:
            try:
                layout = layout_fn() if layout_fn is not None else layout_from_snapshot(snap_fn())
            except Exception as e:  # a source bug: treated as a failed read
                self._warn_once(f"miglayout:{type(e).__name__}", "MIG layout read failed: %s: %s",
                                type(e).__name__, e)
            if layout is None:
                self._warn_once("miglayout", "GPU source cannot tell whether GPUs are in MIG mode yet: no GPU "
                                "sampled until it can (a GPU index may name a MIG device)")
                return False
        self._mig_pending = False
        self.indices, self.uuids, warnings = restrict(layout, self.indices, self.uuids, self.migs)
        for w in warnings:
            self.log.warning("%s", w)
        return True

    def reader(self) -> Any:
        """The source's per-job reader (``job_telemetry``), or None (no GPUs, or a source
        without one: replay, nvidia-smi)."""
        if self._mig_pending and not self.resolve_mig():
            return None
        if self._reader is None and (self.indices or self.uuids) and hasattr(self.source, "job_telemetry"):
            self._reader = self.source.job_telemetry(self.indices, self.uuids)
        return self._reader

    def gpu_rows(self, read: Callable[[bool], Any] | None = None) -> list[tuple[Any, ...]] | None:
        """This tick's ``samples`` rows (:mod:`gpuguard.collector.rows`), None when there
        are none. Through the source's per-job reader when it has one (job GPUs only,
        sampled values only, slow counters every ``slow_every_s``, one tuple per GPU and no
        other per-tick object; ``read``: which of its read methods, default ``read``, the
        worker hand-off with a deadline), else from a snapshot (``telemetry`` or
        ``snapshot``). Never raises."""
        if self._mig_pending and not self.resolve_mig():
            return None
        if not (self.indices or self.uuids):
            return None
        try:
            reader = self.reader()
            if reader is None:
                return self._snapshot_rows()
            return self._reading_rows((read or reader.read)(self._slow_due()))
        except Exception as e:  # a source bug must not end the job's monitoring
            self._warn_once(f"snap:{type(e).__name__}", "GPU snapshot failed: %s: %s", type(e).__name__, e)
            return None

    def _reading_rows(self, r: Any) -> list[tuple[Any, ...]] | None:
        if r.error:
            self._warn_once(f"snaperr:{r.error}", "GPU source: %s", r.error)
            return None
        if not self._gpu_by_index and r.gpus:  # the job's GPUs are resolved once
            self._gpu_by_index = {g.index: g for g in r.gpus}
            if getattr(self._reader, "unread", None):
                self.log.warning("metric(s) %s not read (this pynvml lacks the call or constant): stored as "
                                 "no reading", ", ".join(self._reader.unread))
            self._warn_missing({g.index for g in r.gpus} | {(g.uuid or "").lower() for g in r.gpus})
        job, node, at = self.job_id, self.node, r.taken_at
        for g in r.gpus:
            if g.errors:
                for name, err in g.errors.items():
                    self._warn_once(f"readerr:{g.index}:{name}:{err}", "GPU %d: reading %s failed: %s "
                                    "(stored as no reading)", g.index, name, err)
        return [(job, node, at, g.index, g.uuid, g.values, g.slow) for g in r.gpus]

    def _snapshot_rows(self) -> list[tuple[Any, ...]] | None:
        tele = getattr(self.source, "telemetry", None)
        snap: NodeSnapshot = (self.source.snapshot() if tele is None
                              else tele(self.indices, self.uuids, self._slow_due()))
        if snap.error:
            self._warn_once(f"snaperr:{snap.error}", "GPU source: %s", snap.error)
            return None
        gpus = select_gpus(snap, self.indices, self.uuids)
        if len(gpus) < len(self.indices) + len(self.uuids):
            self._warn_missing({g.index for g in gpus} | {(g.uuid or "").lower() for g in gpus})
        self._gpu_by_index = {g.index: g for g in gpus}
        return [sample_of(g, self.job_id, self.node, snap.taken_at) for g in gpus]

    def drain_xids(self) -> None:
        if self._xid_q.empty():
            return
        rows = []
        while True:
            try:
                at, index, xid = self._xid_q.get_nowait()
            except queue.Empty:
                break
            g = self._gpu_by_index.get(index)
            rows.append({
                "node": self.node, "at": at, "kind": "xid", "code": xid, "gpu_index": index,
                "gpu_uuid": g.uuid if g else None, "pci_bus_id": g.pci_bus_id if g else None,
                "message": f"XID {xid} on GPU {index} (NVML event)", "action": _xid_action(xid),
                "job_id": self.job_id, "source": "nvml",
            })
        if rows:
            for r in rows:
                self.log.warning("XID %d on GPU %d", r["code"], r["gpu_index"])
            with self.lock:
                self.buffer.add("events", rows)

    def flush(self) -> bool:
        """Write buffered rows; True when nothing is left. Never raises."""
        from gpuguard.store import StoreError

        if not len(self.buffer):
            return True
        try:
            if self._store is None:
                self._store = self._open_store()
            self.buffer.flush(self._store, self.lock)  # the sampler thread adds rows meanwhile
            if self._store_failures:
                self.log.info("store writable again after %d failed flush(es)", self._store_failures)
            self._store_failures = 0
        except (StoreError, OSError) as e:
            self._store_failures += 1
            if self._store_failures in (1, 10) or self._store_failures % 100 == 0:
                self.log.error("tool error: flush failed (%d time(s)), %d row(s) kept: %s",
                               self._store_failures, len(self.buffer), e)
            if self._store is not None:
                self._store.close()
                self._store = None
        if self.buffer.dropped:
            self._warn_once("dropped", "buffer full: dropping oldest rows (store unwritable)")
        return not len(self.buffer)

    def _start_sampler(self) -> Any:
        """The sampler thread (:mod:`gpuguard.collector.sampler`) when the source has a
        per-job reader, else None (this thread ticks)."""
        reader = self.reader()
        if reader is None or not hasattr(reader, "read_here"):
            return None
        from gpuguard.collector.sampler import Sampler

        sampler = Sampler(self, reader, getattr(self.source, "call_timeout_s", 5.0))
        sampler.start()
        return sampler

    def _xid_thread(self) -> None:
        job_idx = set(self.indices)
        src = None
        failures = 0
        try:
            src = self.xid_source_factory() if self.xid_source_factory else None
            if src is None or not hasattr(src, "watch_xid_events"):
                return
            while not self.stop_event.is_set():
                try:
                    events = src.watch_xid_events(1000)
                    failures = 0
                except Exception as e:
                    failures += 1
                    if failures in (1, 10):
                        self.log.warning("NVML XID watch failed (%d): %s", failures, e)
                    self.stop_event.wait(min(300.0, 5.0 * failures))
                    continue
                now = time.time()
                for index, xid in events:
                    uuid_match = self._gpu_by_index.get(index) is not None
                    if index in job_idx or uuid_match:
                        self._xid_q.put((now, index, xid))
        finally:
            if src is not None:
                try:
                    src.close()
                except Exception as e:
                    self.log.warning("closing the XID source: %s", e)

    # -- the loop --
    def run(self) -> int:
        """Sample until stopped, the job is gone or the cap is reached; flush; return 0."""
        if self._mig_pending:  # the XID watcher needs the GPUs resolved: an index may be another tenant's
            self.resolve_mig()
        self.log.info("collector running: gpus idx=%s uuid=%s interval=%.3gs flush=%.3gs",
                      self.indices, self.uuids, self.interval_s, self.flush_s)
        xt = None
        if self.xid_source_factory is not None and not self._mig_pending and (self.indices or self.uuids):
            xt = threading.Thread(target=self._xid_thread, name="xid-watch", daemon=True)
            xt.start()
        start = time.monotonic()
        next_sample = start
        next_flush = start + self.flush_s
        next_live = start + self.liveness_s
        sampler = self._start_sampler()
        hung = None  # a sampler stuck in NVML, while this thread ticks instead
        while not self.stop_event.is_set():
            now = time.monotonic()
            if sampler is not None and sampler.check(now):
                hung, sampler, next_sample = sampler, None, now
            if hung is not None and hung.returned():
                self.log.info("the hung NVML telemetry read returned; sampling on its own thread again")
                hung, sampler = None, self._start_sampler()
            if sampler is None and now >= next_sample:
                self.sample_once()
                next_sample += self.interval_s
                if next_sample <= time.monotonic():  # we fell behind: skip missed ticks
                    next_sample = time.monotonic() + self.interval_s
            self.drain_xids()
            if now >= next_flush:
                self.flush()
                next_flush = time.monotonic() + self.flush_s
            if now >= next_live:
                alive, why = self.liveness.check()
                if not alive:
                    self.exit_reason = f"job gone: {why}"
                    break
                # ingest first: what it stored is released from the disk before the cap counts
                if self.record_ingest is not None and self._store is not None:
                    self.record_ingest(self._store)
                if self.job_dir_check is not None:
                    self.job_dir_check()
                next_live = time.monotonic() + self.liveness_s
            if now - start >= self.max_runtime_s:
                self.exit_reason = f"hard cap of {self.max_runtime_s:.0f} s reached"
                break
            wake = min(next_flush, next_live, next_sample if sampler is None else now + sampler.timeout_s)
            self.stop_event.wait(max(0.0, wake - time.monotonic()))
        else:
            self.exit_reason = self.exit_reason or self.exit_reason_fn() or "stopped"
        self.stop_event.set()
        if sampler is not None:
            sampler.stop(min(2.0, sampler.timeout_s))
        self.drain_xids()
        if self.spill_path:
            # the epilog waits a few seconds at most: a locked store must not eat them;
            # one short try, then the rows go to the spill file
            with contextlib.suppress(Exception):
                if self._store is None:
                    self._store = self._open_store()
                self._store.db.conn.execute(f"PRAGMA busy_timeout = {EXIT_BUSY_TIMEOUT_MS}")
            ok = self.flush()
        else:
            ok = self.flush() or self.flush()
        if not ok and self.spill_path:
            from gpuguard.collector.spill import spill_rows

            n = spill_rows(self.spill_path, self.buffer.as_dicts())
            if n:
                self.log.warning("store unavailable at exit: %d row(s) kept in %s for the epilog", n, self.spill_path)
                ok = True
        w = self.buffer.written
        self.log.info("collector exiting (%s): wrote %d sample(s), %d host sample(s), %d event(s)%s",
                      self.exit_reason, w["samples"], w["host_samples"], w["events"],
                      "" if ok else f"; {len(self.buffer)} row(s) lost")
        if self._store is not None:
            self._store.close()
        if xt is not None:
            xt.join(timeout=2.0)
        return 0


def _xid_action(xid: int) -> str | None:
    try:
        from gpuguard.xid.catalog import classify

        return classify(types.SimpleNamespace(kind="xid", xid=xid, message="")).action
    except Exception:  # the catalog is advisory here; the epilog applies the policy
        return None


#: SQLite busy timeout of the collector's final flush when a spill file is set (ms; our
#: choice: the epilog's stop wait is a few seconds, and the spill keeps the rows anyway).
EXIT_BUSY_TIMEOUT_MS = 500


# The command line lives in gpuguard.collector.cli; re-exported here, since
# ``python -m gpuguard.collector.run`` is the command the Prolog starts.
from gpuguard.collector.cli import build_parser, main  # noqa: E402


if __name__ == "__main__":
    sys.exit(main())
