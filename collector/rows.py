"""The rows the collector writes and the bounded buffer that holds them until the store
takes them (:class:`RowBuffer`). :mod:`gpuguard.collector.run` re-exports these.

A ``samples`` row in the buffer is the tuple :func:`gpuguard.samples.write` takes:
``(job_id, node, at, gpu_index, gpu_uuid, values, slow)``, ``values`` in the metric
table's :data:`~gpuguard.metrics.GPU_SAMPLED` order in the stored integer form
(:func:`gpuguard.samples.scaled_values`), ``slow`` likewise in
:data:`~gpuguard.metrics.GPU_SLOW` order or None (built from a telemetry reading, or
from a snapshot's GpuState by :func:`sample_of`); one tuple per GPU per tick, no dict.
:func:`gpu_row` gives the dict form (spill files, tests and tools).
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Any

from gpuguard.metrics import GPU_SAMPLED, GPU_SLOW
from gpuguard.model import CLOCK_EVENT_REASONS, GpuState, NodeSnapshot, encode_clock_event_reasons
from gpuguard.samples import scaled_values

MAX_BUFFERED_ROWS = 200_000


def parse_gpu_list(value: str | None) -> tuple[list[int], list[str]]:
    """``"0,1"`` -> ``([0, 1], [])``; ``"GPU-ab,GPU-cd"`` -> ``([], ["GPU-ab", "GPU-cd"])``.

    Entries that are neither (``MIG-...``, ``NoDevFiles``) are ignored; ``None``/empty ->
    ``([], [])``."""
    idx: list[int] = []
    uuids: list[str] = []
    for item in (value or "").split(","):
        item = item.strip()
        if item.isdigit():
            idx.append(int(item))
        elif item.upper().startswith("GPU-"):
            uuids.append(item)
    return idx, uuids


def select_gpus(snap: NodeSnapshot, indices: list[int], uuids: list[str]) -> list[GpuState]:
    """The snapshot's GPUs named by index or UUID (case-insensitive), in index order."""
    want_u = {u.lower() for u in uuids}
    want_i = set(indices)
    return sorted((g for g in snap.gpus if g.index in want_i or (g.uuid and g.uuid.lower() in want_u)),
                  key=lambda g: g.index)


def clock_mask(reasons: list[str] | None) -> int | None:
    """:func:`~gpuguard.model.encode_clock_event_reasons` ignoring unknown names."""
    if reasons is None:
        return None
    return encode_clock_event_reasons([r for r in reasons if r in CLOCK_EVENT_REASONS])


def gpu_row(g: GpuState, job_id: str, node: str, at: float) -> dict[str, Any]:
    """One ``samples`` row for GPU ``g``: the sampled metrics of :mod:`gpuguard.metrics`
    (``GPU_SAMPLED`` and ``GPU_SLOW``) read from the GpuState fields of the same name."""
    row: dict[str, Any] = {"job_id": job_id, "node": node, "at": at, "gpu_index": g.index, "gpu_uuid": g.uuid}
    for m in _ROW_METRICS:
        row[m] = getattr(g, m)
    row["clock_event_mask"] = clock_mask(g.clock_event_reasons)
    return row


_ROW_METRICS = tuple(m.name for m in (*GPU_SAMPLED, *GPU_SLOW) if m.name != "clock_event_mask")
_SAMPLED = tuple(m.name for m in GPU_SAMPLED)
_SLOW = tuple(m.name for m in GPU_SLOW)


def sample_of(g: GpuState, job_id: str, node: str, at: float) -> tuple[Any, ...]:
    """The buffered ``samples`` tuple (module docstring) for GPU ``g`` of a snapshot (the
    GpuState fields named like the metrics; the mask from ``clock_event_reasons``)."""
    vals, slow = scaled_values(
        [clock_mask(g.clock_event_reasons) if n == "clock_event_mask" else getattr(g, n, None) for n in _SAMPLED],
        [getattr(g, n, None) for n in _SLOW])
    return (job_id, node, at, g.index, g.uuid, vals, slow)


def row_dict(row: tuple[Any, ...] | dict[str, Any]) -> dict[str, Any]:
    """A buffered ``samples`` row as the dict :func:`gpu_row` makes, real units (dicts
    pass through)."""
    if isinstance(row, dict):
        return row
    job_id, node, at, gi, uuid, vals, slow = row
    out: dict[str, Any] = {"job_id": job_id, "node": node, "at": at, "gpu_index": gi, "gpu_uuid": uuid}
    for m, v in zip((*GPU_SAMPLED, *GPU_SLOW), (*vals, *(slow or (None,) * len(GPU_SLOW))), strict=True):
        out[m.name] = v / m.scale if v is not None and m.scale != 1 else v
    return out


class RowBuffer:
    """Rows waiting for the store, per table; bounded to ``max_rows`` (the oldest
    ``samples``, then ``host_samples`` rows are dropped first; events last). ``samples``
    rows are tuples (module docstring) or dicts; other tables' rows are dicts."""

    TABLES = ("events", "samples", "host_samples")

    def __init__(self, max_rows: int = MAX_BUFFERED_ROWS):
        self.max_rows = max_rows
        self.rows: dict[str, deque[Any]] = {t: deque() for t in self.TABLES}
        self.dropped = 0
        self.written = dict.fromkeys(self.TABLES, 0)
        self._n = 0
        self._dropped_from = dict.fromkeys(self.TABLES, 0)

    def add(self, table: str, rows: list[Any]) -> None:
        self.rows[table].extend(rows)
        self._n += len(rows)
        over = self._n - self.max_rows
        if over > 0:
            for t in ("samples", "host_samples", "events"):
                while over > 0 and self.rows[t]:
                    self.rows[t].popleft()
                    self._dropped_from[t] += 1
                    self.dropped += 1
                    self._n -= 1
                    over -= 1

    def __len__(self) -> int:
        return self._n

    def as_dicts(self) -> dict[str, list[dict[str, Any]]]:
        """Every buffered row as a dict, per table (for a spill file)."""
        return {t: [row_dict(r) for r in q] if t == "samples" else list(q) for t, q in self.rows.items()}

    def flush(self, store: Any, lock: Any = None) -> None:
        """Write every table's rows in one transaction (:meth:`Store.insert_tables
        <gpuguard.store.Store.insert_tables>`: one commit per flush); on failure every row
        stays. ``lock`` guards the buffer against a thread adding rows meanwhile; it is
        held only to copy the rows out and to remove the written ones, not during the
        write. Raises :class:`gpuguard.store.StoreError` (after keeping the rows)."""
        lock = lock if lock is not None else contextlib.nullcontext()
        with lock:
            batches = {t: list(q) for t, q in self.rows.items() if q}
            dropped = dict(self._dropped_from)
        if not batches:
            return
        store.insert_tables(batches)
        with lock:
            for t, batch in batches.items():
                # rows added meanwhile are behind the batch; rows dropped meanwhile (a full
                # buffer) were the batch's oldest
                n = len(batch) - (self._dropped_from[t] - dropped[t])
                q = self.rows[t]
                for _ in range(max(0, n)):
                    q.popleft()
                self._n -= max(0, n)
                self.written[t] += len(batch)
