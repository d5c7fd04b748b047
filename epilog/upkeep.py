"""The Epilog's store upkeep after its summary and part: the job's working rows dropped,
then the retention tiers applied within the budget left. Our errors are logged only:
upkeep never fails a job or drains a node."""

from __future__ import annotations

from typing import Any


def drop_working_rows(store: Any, job_id: str, node: str, log: Any) -> None:
    """The Epilog's step 6b: drop the job's closed GPU minutes
    (:func:`gpuguard.live_minutes.drop_job`) and step sub-windows (``step_windows``): they
    spared the summary and the part reading every raw row, which stay in the store."""
    from gpuguard import live_minutes

    try:
        with store.tx():
            live_minutes.drop_job(store.db.conn, job_id, node)
            store.db.conn.execute("delete from step_windows where job_id = ? and node = ?", (job_id, node))
    except Exception as e:
        log.error("tool error: dropping the job's working rows: %s: %s", type(e).__name__, e)


def auto_prune(store: Any, cfg: Any, left_s: float, log: Any) -> None:
    """The Epilog's step 6c: the retention tiers (:func:`gpuguard.retention.prune`) within
    ``[store] prune_budget_s`` and at most half of what the Epilog's budget has left."""
    budget_s = min(float(cfg.get("store", "prune_budget_s")), left_s / 2)
    if budget_s <= 0:
        return
    from gpuguard.retention import prune

    try:
        res = prune(store, raw_days=cfg.get("store", "raw_days"), minutes_days=cfg.get("store", "minutes_days"),
                    budget_s=budget_s)
    except Exception as e:  # pruning is housekeeping: never fails the epilog
        log.error("tool error: store prune: %s: %s", type(e).__name__, e)
        return
    if res["samples_folded"] or res["minutes"] or res["step_records"] or not res["complete"]:
        log.info("store prune: folded %d sample(s) of %d series, deleted %d training step record(s)%s",
                 res["samples_folded"], res["series_done"], res["step_records"],
                 "" if res["complete"] else " (the rest in the next run)")
