"""Storing a job's training records (the ``steps`` and ``checkpoints`` rows one node's
Epilog ingested from the job directory, :mod:`gpuguard.collector.ingest`).
"""

from __future__ import annotations

from typing import Any


def save_training_records(store: Any, job_id: str, node: str, ingest: Any) -> tuple[int, int]:
    """Replace the ``steps`` and ``checkpoints`` rows of (``job_id``, ``node``) with the
    records of ``ingest`` (an ``IngestResult``) in one transaction; an empty ingest
    changes nothing (a rerun after the directory was removed keeps the first run's rows).
    Returns the numbers of step and checkpoint rows. Raises
    :class:`gpuguard.store.StoreError`."""
    import sqlite3

    from gpuguard.store import StoreError

    steps = []
    for r in ingest.steps:
        ph = r.get("phases") or {}
        steps.append({
            "job_id": job_id, "node": node, "rank": r.get("rank"), "step": r.get("step"), "t": r.get("t"),
            "step_time_s": r.get("step_time_s"), "samples": r.get("samples"), "tokens": r.get("tokens"),
            "loss": r.get("loss"), "loss_nonfinite": 1 if r.get("loss_nonfinite") else 0,
            "grad_norm": r.get("grad_norm"), "data_wait_s": ph.get("data_wait_s"), "fwd_bwd_s": ph.get("fwd_bwd_s"),
            "comm_s": ph.get("comm_s"), "optim_s": ph.get("optim_s"),
        })
    ckpts = [{"job_id": job_id, "node": node, "rank": r.get("rank"), "step": r.get("step"), "t": r.get("t"),
              "duration_s": r.get("duration_s")} for r in ingest.checkpoints]
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
