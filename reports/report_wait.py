"""The queue-wait report: nearest-rank wait percentiles per group, and the jobs still
pending with their current wait.

Which jobs it counts: the docstring of :mod:`gpuguard.reports.queries`, which
re-exports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuguard.reports.query_base import (
    PERCENTILES,
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


def _wait_sql(g: str, where: str) -> str:
    """Per group and for everything (``lvl`` 1): n, mean, nearest-rank percentiles and max
    of ``wait_s``; mean and max of ``submit_wait_s``.

    Waits are whole seconds (sacct times are), so the jobs are first counted per (group,
    wait) -- an index-ordered GROUP BY for ``--by account``, and far fewer rows than jobs
    -- and the percentiles read off the running count: the p-th is the smallest wait whose
    cumulative count reaches ``ceil(p/100 x n)``."""
    pct = ", ".join(f"MIN(CASE WHEN cum >= ({p} * n + 99) / 100 THEN wait_s END) AS p{p}_s" for p in PERCENTILES)
    return f"""
        WITH d AS MATERIALIZED (
            SELECT {g} AS grp, wait_s, COUNT(*) AS c, SUM(submit_wait_s) AS ss, MAX(submit_wait_s) AS sm
            FROM sacct_jobs WHERE {where} GROUP BY 1, 2
        ), dd AS (
            SELECT 0 AS lvl, grp, wait_s, c, ss, sm FROM d
            UNION ALL
            SELECT 1, 'TOTAL', wait_s, SUM(c), SUM(ss), MAX(sm) FROM d GROUP BY wait_s
        ), r AS (
            SELECT lvl, grp, wait_s, c, ss, sm,
                   SUM(c) OVER (PARTITION BY lvl, grp ORDER BY wait_s ROWS UNBOUNDED PRECEDING) AS cum,
                   SUM(c) OVER (PARTITION BY lvl, grp) AS n
            FROM dd
        )
        SELECT lvl, grp, MAX(n) AS jobs, SUM(wait_s * c) / MAX(n) AS mean_s, {pct}, MAX(wait_s) AS max_s,
               SUM(ss) / MAX(n) AS submit_mean_s, MAX(sm) AS submit_max_s
        FROM r GROUP BY lvl, grp
    """


def wait_report(store: Store, *, since: float, until: float, by: str = "account", cluster: str | Filters | None = None,
                pending_limit: int = 20) -> Report:
    """Queue wait per group (job-weighted mean, p50/p90/p99 nearest-rank, max; mean and
    max of start - submit beside it) for jobs that started in the window; jobs pending at
    the last sync per group and the ``pending_limit`` longest-waiting ones.
    Raises :class:`ReportError`."""
    g = _group_sql(by)
    p = _params(since, until, cluster)
    _fast(store)
    col = "" if _narrow(store, "start_at", since, until) else "+"
    where = (f"{col}start_at >= :since AND {col}start_at < :until AND wait_s IS NOT NULL"
             + _flt(cluster).sql()[0])
    rows, total = [], None
    for r in store.query(_wait_sql(g, where), p):
        lvl = r.pop("lvl")
        r.update(_groups(by, r.pop("grp")))
        r["jobs"] = int(r["jobs"])
        if lvl:
            total = r
        else:
            rows.append(r)
    fsql, fparams = _flt(cluster).sql()
    pend_where = "state = 'PENDING'" + fsql
    cur = "MAX(0, synced_at - COALESCE(eligible_at, submit_at))"
    pend = store.query(f"""
        SELECT {g} AS grp, COUNT(*) AS jobs, SUM(eligible_at IS NULL) AS not_eligible,
               AVG({cur}) AS mean_current_s, MAX({cur}) AS max_current_s
        FROM sacct_jobs WHERE {pend_where} GROUP BY 1
    """, fparams)
    pend_rows = [dict(r, **_groups(by, r.pop("grp"))) for r in pend]
    longest = store.query(f"""
        SELECT job_id, account, user, partition, gpus, submit_at, eligible_at, {cur} AS current_wait_s
        FROM sacct_jobs WHERE {pend_where}
        ORDER BY current_wait_s DESC, job_id_raw LIMIT :limit
    """, {**fparams, "limit": int(pending_limit)})
    cols = [*group_columns(by), Column("jobs", "jobs", "count"), Column("mean_s", "mean", "seconds")]
    cols += [Column(f"p{q}_s", f"p{q}", "seconds") for q in PERCENTILES]
    cols += [Column("max_s", "max", "seconds"), Column("submit_mean_s", "mean (from submit)", "seconds"),
             Column("submit_max_s", "max (from submit)", "seconds")]
    pcols = [*group_columns(by), Column("jobs", "pending", "count"),
             Column("not_eligible", "not yet eligible", "count"),
             Column("mean_current_s", "mean current wait", "seconds"),
             Column("max_current_s", "max current wait", "seconds")]
    lcols = [Column("job_id", "job"), Column("account", "account"), Column("user", "user"),
             Column("partition", "partition"), Column("gpus", "GPUs", "count"),
             Column("submit_at", "submitted", "time"), Column("eligible_at", "eligible", "time"),
             Column("current_wait_s", "current wait", "seconds")]
    notes = ["wait = start - eligible (Eligible excludes holds and dependencies; submit when unknown), for jobs "
             "that started in the window",
             "percentiles: nearest rank, the value at rank ceil(p/100 x n) of the sorted waits",
             "pending: as of the last sync; current wait = last sync - eligible (- submit if not yet eligible)"]
    return Report("wait", "Queue wait", since, until, by, [
        Table("wait", f"Queue wait per {by} (jobs started in the window)", cols,
              _sort(rows, by, "jobs"), total),
        Table("pending", f"Pending jobs per {by} (at the last sync)", pcols, _sort(pend_rows, by, "jobs")),
        Table("longest_pending", f"Longest-waiting pending jobs (top {pending_limit})", lcols, longest),
    ], notes)
