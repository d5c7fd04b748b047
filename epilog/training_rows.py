"""Storing a job's training records (the ``steps`` and ``checkpoints`` rows one node's
Epilog ingested from the job directory, :mod:`gpuguard.collector.ingest`).
"""

from __future__ import annotations

from typing import Any


#: ``steps`` columns in the order of :func:`step_rows`' tuples.
STEP_COLUMNS = ("job_id", "node", "rank", "step", "t", "step_time_s", "samples", "tokens", "loss", "loss_nonfinite",
                "grad_norm", "data_wait_s", "fwd_bwd_s", "comm_s", "optim_s")
#: ``checkpoints`` columns in the order of :func:`checkpoint_rows`' tuples.
CHECKPOINT_COLUMNS = ("job_id", "node", "rank", "step", "t", "duration_s")


def step_rows(job_id: str, node: str, records: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """``steps`` rows (:data:`STEP_COLUMNS`) of normalised step records
    (:func:`gpuguard.collector.ingest.validate_record`)."""
    out = []
    for r in records:
        ph = r.get("phases") or {}
        out.append((job_id, node, r.get("rank"), r.get("step"), r.get("t"), r.get("step_time_s"), r.get("samples"),
                    r.get("tokens"), r.get("loss"), 1 if r.get("loss_nonfinite") else 0, r.get("grad_norm"),
                    ph.get("data_wait_s"), ph.get("fwd_bwd_s"), ph.get("comm_s"), ph.get("optim_s")))
    return out


def checkpoint_rows(job_id: str, node: str, records: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """``checkpoints`` rows (:data:`CHECKPOINT_COLUMNS`) of normalised checkpoint records."""
    return [(job_id, node, r.get("rank"), r.get("step"), r.get("t"), r.get("duration_s")) for r in records]


def save_training_records(store: Any, job_id: str, node: str, ingest: Any) -> tuple[int, int]:
    """Replace the ``steps`` and ``checkpoints`` rows of (``job_id``, ``node``) with the
    records of ``ingest`` (an ``IngestResult``) in one transaction; an empty ingest
    changes nothing (a rerun after the directory was removed keeps the first run's rows).
    Returns the numbers of step and checkpoint rows. Raises
    :class:`gpuguard.store.StoreError`."""
    import sqlite3

    from gpuguard.store import StoreError

    steps = [dict(zip(STEP_COLUMNS, row, strict=True)) for row in step_rows(job_id, node, ingest.steps)]
    ckpts = [dict(zip(CHECKPOINT_COLUMNS, row, strict=True)) for row in checkpoint_rows(job_id, node, ingest.checkpoints)]
    if not steps and not ckpts:
        # nothing (left) to ingest: a second epilog of the job finds the directory gone
        # and must not wipe what the first one stored
        return 0, 0
    try:
        with store.tx():
            store.db.conn.execute("delete from steps where job_id = ? and node = ?", [job_id, node])
            store.db.conn.execute("delete from checkpoints where job_id = ? and node = ?", [job_id, node])
            if steps:
                store.db["steps"].insert_all(steps, batch_size=500)
            if ckpts:
                store.db["checkpoints"].insert_all(ckpts, batch_size=500)
    except sqlite3.Error as e:
        raise StoreError(f"store {store.path}: training records write failed: {e}") from None
    return len(steps), len(ckpts)
