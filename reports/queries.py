"""The reports: cost, queue wait, failures and efficiency over the ``sacct_jobs`` cache.

Every figure is aggregated by SQLite (parameterised SQL, window functions for
percentiles); Python only folds the few aggregated rows (one per group x GPU type x
partition x outcome at most) into tables.

Which jobs a report counts, for a window ``[since, until)`` (UTC epoch seconds):

* **cost** and **efficiency** charge usage inside the window, as ``sreport`` does: a job's
  seconds are ``min(elapsed_s, overlap of [start, end) with the window)``; a job still
  running is charged up to its last sync (``usage_end_at``). GPU-hours = seconds x
  allocated GPUs / 3600; CPU-hours likewise with allocated CPUs.
* **wait** counts jobs that *started* in the window: wait = start - eligible (Slurm's
  Eligible excludes time held or waiting on a dependency; where Eligible is unknown the
  submit time is used), start - submit beside it; negative differences count as 0.
  Percentiles use the **nearest-rank** method: p-th percentile = the value at rank
  ``ceil(p/100 x n)`` of the n waits in ascending order (always an observed wait; numpy
  ``method="inverted_cdf"``). Jobs pending at the last sync are listed with their
  current wait (last sync time - eligible, or - submit when not yet eligible).
* **failures** counts jobs that *ended* in the window, by final state; GPU-hours are
  the whole job's (elapsed x GPUs).
* **efficiency** joins gpuguard's per-(job, node) summaries (table ``job_summaries``,
  the epilog's JSON in ``summary``: per-GPU ``gpu_util_mean_pct``); a job's utilisation is
  the mean over its GPUs; its idle GPU-hours are its GPU-hours x the share of its GPUs
  under ``idle_util_pct``. GPU jobs without a summary are counted and their GPU-hours
  shown as "no summary", never dropped.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from gpuguard.reports.query_base import (
    BY_CHOICES,
    FAILURE_STATES,
    FILTER_COLUMNS,
    FULL_SCAN_SHARE,
    GPU_UNKNOWN_NOTE,
    MAX_BY_KEYS,
    NONE_LABEL,
    PERCENTILES,
    REPORTS,
    _SECS,
    Column,
    Filters,
    Rates,
    Report,
    ReportError,
    Table,
    _flt,
    _group_sql,
    _groups,
    _usage_where,
    by_keys,
    group_columns,
)
from gpuguard.reports.report_cost import cost_report
from gpuguard.reports.report_efficiency import efficiency_report
from gpuguard.reports.report_failures import failures_report
from gpuguard.reports.report_wait import wait_report

if TYPE_CHECKING:
    from gpuguard.store import Store

# Re-exported: the CLI, renderers, buckets and tests import the reports' names from here.
__all__ = [
    "BY_CHOICES",
    "FAILURE_STATES",
    "FILTER_COLUMNS",
    "FULL_SCAN_SHARE",
    "GPU_UNKNOWN_NOTE",
    "MAX_BY_KEYS",
    "NONE_LABEL",
    "PERCENTILES",
    "REPORTS",
    "_SECS",
    "Column",
    "Filters",
    "Rates",
    "Report",
    "ReportError",
    "Table",
    "_flt",
    "_group_sql",
    "_groups",
    "_usage_where",
    "by_keys",
    "cost_report",
    "efficiency_report",
    "failures_report",
    "group_columns",
    "wait_report",
]


def run_reports(store: Store, names: list[str], *, since: float, until: float, by: str = "account",
                rates: Rates | None = None, idle_util_pct: float = 5.0, cluster: str | Filters | None = None,
                per: str | None = None, tz=None, series: bool = False) -> list[Report]:
    """Run the named reports (``cost``, ``wait``, ``failures``, ``efficiency``) in that
    order. ``by``: one or two keys (``account,user``); ``cluster``: a cluster name or
    :class:`Filters`; ``per``: ``day``/``week``/``month`` buckets in ``tz``
    (:mod:`gpuguard.reports.buckets`); ``series``: give the cost report its usage-over-time
    series (for the HTML chart). Raises :class:`ReportError`."""
    by_keys(by)
    flt = _flt(cluster)
    out = []
    for n in names:
        if n == "cost":
            def run(a, b):
                return cost_report(store, since=a, until=b, by=by, rates=rates, cluster=flt)
        elif n == "wait":
            def run(a, b):
                return wait_report(store, since=a, until=b, by=by, cluster=flt)
        elif n == "failures":
            def run(a, b):
                return failures_report(store, since=a, until=b, by=by, cluster=flt)
        elif n == "efficiency":
            def run(a, b):
                return efficiency_report(store, since=a, until=b, by=by, idle_util_pct=idle_util_pct, cluster=flt)
        else:
            raise ReportError(f"unknown report {n!r}; expected one of {', '.join(REPORTS)}")
        if per:
            from datetime import UTC

            from gpuguard.reports.buckets import bucketed

            rep = bucketed(run, since, until, per, tz or UTC)
        else:
            rep = run(since, until)
        if series and n == "cost":
            from datetime import UTC

            from gpuguard.reports.buckets import usage_series

            rep.series = usage_series(store, since, until, by, tz or UTC, flt, per)
        if flt.describe():
            rep.notes.append(f"filtered: {flt.describe()}")
            rep.params = {**rep.params, "filters": flt.describe()}
        out.append(rep)
    return out
