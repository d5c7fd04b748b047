"""The efficiency report: GPU utilisation and idle GPU-hours per group, from the epilog's
per-(job, node) summaries.

Which jobs it counts: the docstring of :mod:`gpuguard.reports.queries`, which
re-exports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpuguard.reports.query_base import (
    GPU_UNKNOWN_NOTE,
    _SECS,
    Column,
    Filters,
    Report,
    Table,
    _fast,
    _group_sql,
    _groups,
    _params,
    _sort,
    _usage_where,
    group_columns,
)

if TYPE_CHECKING:
    from gpuguard.store import Store


def _summary_source(store: Store) -> tuple[str, str | None]:
    """SQL for ``(jid, util, idle_frac)`` per job from gpuguard's summaries, or an empty
    relation and a note when there are none to read.

    ``job_summaries`` holds one row per (job, node) with the epilog's JobSummary as JSON
    in ``summary`` (``gpuguard.epilog.summary``): ``gpus[].gpu_util_mean_pct`` per GPU,
    ``gpu_util_mean_pct`` for the node. A job's ``util`` is the mean over all its GPUs on
    all nodes (GPU-weighted); ``idle_frac`` the fraction of those GPUs under ``:idle``.
    A node summary without per-GPU entries counts as one reading of its node mean. GPUs
    without samples (utilisation null) and unparsable JSON are left out; a job left with
    no reading at all is "no summary".

    The readings come from ``job_gpu_util`` (store migration 5: parsed once, when each
    summary is written, and aggregated per job along its ``(jid, util)`` index); a store
    without that table (older schema) parses the JSON here, with the same rule.
    """
    names = {r["name"] for r in store.query(
        "SELECT name FROM sqlite_master WHERE name IN ('job_summaries', 'job_gpu_util')")}
    empty = "SELECT NULL AS jid, NULL AS util, NULL AS idle_frac WHERE 0"
    agg = "AVG(u) AS util, AVG(CASE WHEN u < :idle THEN 1.0 ELSE 0.0 END) AS idle_frac"
    if "job_gpu_util" in names and "job_summaries" in names:
        return f"SELECT jid, {agg} FROM (SELECT jid, util AS u FROM job_gpu_util) GROUP BY jid", None
    cols = {r["name"] for r in store.query("SELECT name FROM pragma_table_info('job_summaries')")}
    if not cols:
        return empty, "no gpuguard job summaries in this store (table job_summaries absent): every job is 'no summary'"
    if not {"job_id", "summary"} <= cols:
        return empty, "job_summaries has no job_id/summary columns: every job is 'no summary'"
    from gpuguard.reports.util_schema import all_readings_sql

    return f"SELECT CAST(job_id AS INTEGER) AS jid, {agg} FROM ({all_readings_sql()}) GROUP BY 1", None


def efficiency_report(store: Store, *, since: float, until: float, by: str = "account", idle_util_pct: float = 5.0,
                      cluster: str | Filters | None = None) -> Report:
    """Per group, over GPU jobs (usage in the window, as the cost report): GPU-hours;
    GPU-hours weighted by utilisation (GPU-h x util/100); idle GPU-hours (GPU-h x the
    fraction of the job's GPUs whose mean utilisation is under ``idle_util_pct``); jobs
    and GPU-hours with and without a gpuguard summary. Mean utilisation is over measured
    GPU-hours only. Raises :class:`ReportError`."""
    g = _group_sql(by)
    src, note = _summary_source(store)
    _fast(store)
    agg = store.query(f"""
        WITH s AS MATERIALIZED ({src}),
        j AS (
            SELECT {g} AS grp, gpus * {_SECS} AS gs, s.util AS util, s.idle_frac AS idle_frac
            FROM sacct_jobs LEFT JOIN s ON s.jid = sacct_jobs.job_id_raw
            WHERE {_usage_where(store, since, until, cluster)} AND (gpus > 0 OR gpus IS NULL)
        )
        SELECT grp, SUM(gs IS NOT NULL) AS jobs, SUM(gs) / 3600.0 AS gpu_hours, SUM(gs IS NULL) AS gpu_unknown_jobs,
               SUM(util IS NOT NULL AND gs IS NOT NULL) AS jobs_with_summary,
               SUM(util IS NULL AND gs IS NOT NULL) AS jobs_no_summary,
               COALESCE(SUM(CASE WHEN util IS NOT NULL THEN gs END), 0) / 3600.0 AS measured_gpu_hours,
               COALESCE(SUM(CASE WHEN util IS NULL THEN gs END), 0) / 3600.0 AS no_summary_gpu_hours,
               COALESCE(SUM(gs * util / 100.0), 0) / 3600.0 AS util_weighted_gpu_hours,
               COALESCE(SUM(gs * idle_frac), 0) / 3600.0 AS idle_gpu_hours,
               SUM(CASE WHEN idle_frac > 0 THEN 1 ELSE 0 END) AS jobs_with_idle_gpus
        FROM j GROUP BY grp
    """, _params(since, until, cluster, idle=float(idle_util_pct)))
    rows = [dict(r, **_groups(by, r.pop("grp"))) for r in agg]
    keys = ("jobs", "gpu_hours", "jobs_with_summary", "jobs_no_summary", "measured_gpu_hours",
            "no_summary_gpu_hours", "util_weighted_gpu_hours", "idle_gpu_hours", "jobs_with_idle_gpus",
            "gpu_unknown_jobs")
    total: dict[str, Any] = {"group": "TOTAL", **{k: sum(r[k] or 0 for r in rows) for k in keys}}
    for r in rows:
        if not r["jobs"]:  # only jobs of unknown GPU count: no GPU figure is known
            for k in ("gpu_hours", "measured_gpu_hours", "no_summary_gpu_hours", "util_weighted_gpu_hours",
                      "idle_gpu_hours"):
                r[k] = None
    for r in [*rows, total]:
        r["mean_util_pct"] = (100.0 * (r["util_weighted_gpu_hours"] or 0) / r["measured_gpu_hours"]
                              if r["measured_gpu_hours"] else None)
    cols = [*group_columns(by), Column("jobs", "GPU jobs", "count"), Column("gpu_hours", "GPU-h", "hours"),
            Column("util_weighted_gpu_hours", "used GPU-h (util-weighted)", "hours"),
            Column("mean_util_pct", "mean util %", "pct"),
            Column("idle_gpu_hours", f"idle GPU-h (<{idle_util_pct:g}%)", "hours"),
            Column("jobs_with_idle_gpus", "jobs with idle GPUs", "count"),
            Column("jobs_with_summary", "with summary", "count"),
            Column("jobs_no_summary", "no gpuguard summary", "count"),
            Column("no_summary_gpu_hours", "GPU-h no summary", "hours")]
    if total["gpu_unknown_jobs"]:
        cols.insert(len(group_columns(by)) + 1, Column("gpu_unknown_jobs", "jobs, GPU usage unknown", "count"))
    else:
        for r in [*rows, total]:
            del r["gpu_unknown_jobs"]
    notes = [f"GPU jobs only; usage in the window as in the cost report; idle GPU-h = GPU-h x share of the job's "
             f"GPUs whose mean utilisation is < {idle_util_pct:g}%",
             "jobs without a gpuguard summary (or without GPU samples) are counted under 'no gpuguard summary', "
             "never dropped"]
    notes.append("utilisation: gpuguard's job summaries, else jobstats JS1: AdminComments (mean duty cycle per GPU)")
    if total.get("gpu_unknown_jobs"):
        notes.append(GPU_UNKNOWN_NOTE.format(n=total["gpu_unknown_jobs"]))
    if note:
        notes.append(note)
    return Report("efficiency", "Efficiency", since, until, by,
                  [Table("efficiency", f"GPU efficiency per {by}", cols, _sort(rows, by, "gpu_hours"), total)],
                  notes, {"idle_util_pct": idle_util_pct})
