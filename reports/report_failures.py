"""The failures report: jobs that ended in the window, by final state, with GPU-hours.

Which jobs it counts: the docstring of :mod:`gpuguard.reports.queries`, which
re-exports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpuguard.reports.query_base import (
    FAILURE_STATES,
    Column,
    Filters,
    Report,
    Table,
    _fast,
    _flt,
    _group_sql,
    _groups,
    _narrow,
    _params,
    _sort,
    group_columns,
)

if TYPE_CHECKING:
    from gpuguard.store import Store


def failures_report(store: Store, *, since: float, until: float, by: str = "account",
                    cluster: str | Filters | None = None) -> Report:
    """Shares (fractions 0..1) of COMPLETED, FAILED, CANCELLED, TIMEOUT, NODE_FAIL,
    OUT_OF_MEMORY, PREEMPTED (and OTHER: BOOT_FAIL, DEADLINE, REVOKED) among jobs that
    ended in the window, and the GPU-hours of each (lost, for every state but COMPLETED).
    Raises :class:`ReportError`."""
    g = _group_sql(by)
    params = _params(since, until, cluster)
    _fast(store)
    col = "" if _narrow(store, "end_at", since, until) else "+"
    listed = ", ".join(f"'{s}'" for s in FAILURE_STATES)
    sums = []
    for st in (*FAILURE_STATES, "OTHER"):
        cond = f"state NOT IN ({listed})" if st == "OTHER" else f"state = '{st}'"
        sums.append(f"SUM(CASE WHEN {cond} THEN 1 ELSE 0 END) AS n_{st}")
        sums.append(f"SUM(CASE WHEN {cond} THEN gh ELSE 0 END) / 3600.0 AS {st}_gpu_hours")
    agg = store.query(f"""
        SELECT grp, COUNT(*) AS jobs, SUM(gh) / 3600.0 AS gpu_hours, {', '.join(sums)}
        FROM (SELECT {g} AS grp, state, COALESCE(charge_s, 0) * gpus AS gh FROM sacct_jobs
              WHERE {col}end_at >= :since AND {col}end_at < :until
                AND state NOT IN ('PENDING', 'RUNNING', 'REQUEUED', 'SUSPENDED', 'RESIZING')
                {_flt(cluster).sql()[0]})
        GROUP BY grp
    """, params)
    states = (*FAILURE_STATES, "OTHER")
    rows = []
    for a in agg:
        r: dict[str, Any] = {**_groups(by, a.pop("grp")), "jobs": a["jobs"], "gpu_hours": a["gpu_hours"] or 0.0}
        r["lost_gpu_hours"] = r["gpu_hours"] - (a["COMPLETED_gpu_hours"] or 0.0)
        for st in states:
            r[f"{st}_share"] = a[f"n_{st}"] / a["jobs"]
            r[f"{st}_gpu_hours"] = a[f"{st}_gpu_hours"] or 0.0
            r[f"_n_{st}"] = a[f"n_{st}"]
        rows.append(r)
    total: dict[str, Any] = {"group": "TOTAL", "jobs": sum(r["jobs"] for r in rows)}
    total["gpu_hours"] = sum(r["gpu_hours"] for r in rows)
    total["lost_gpu_hours"] = sum(r["lost_gpu_hours"] for r in rows)
    for st in states:
        n = sum(r.pop(f"_n_{st}") for r in rows)
        total[f"{st}_share"] = n / total["jobs"] if total["jobs"] else 0.0
        total[f"{st}_gpu_hours"] = sum(r[f"{st}_gpu_hours"] for r in rows)
    cols = [*group_columns(by), Column("jobs", "jobs", "count")]
    cols += [Column(f"{s}_share", s, "share") for s in states]
    cols += [Column("gpu_hours", "GPU-h", "hours"), Column("lost_gpu_hours", "GPU-h lost", "hours")]
    cols += [Column(f"{s}_gpu_hours", f"GPU-h {s}", "hours") for s in states if s != "COMPLETED"]
    notes = ["jobs that ended in the window; shares of their final state; GPU-hours = elapsed x GPUs of the "
             "whole job; lost = every state but COMPLETED",
             "OTHER: BOOT_FAIL, DEADLINE, REVOKED"]
    return Report("failures", "Failures", since, until, by,
                  [Table("failures", f"Job outcomes per {by} (jobs ended in the window)", cols,
                         _sort(rows, by, "jobs"), total)], notes)
