"""Time buckets of a report (``--by ... --per day|week|month``).

A bucketed report is the plain report run once per bucket window, each window the
intersection of ``[since, until)`` with one calendar day, ISO week (Monday 00:00) or month
in the report's timezone; rows carry the bucket's label in ``period``. Running the report
per window (rather than grouping rows by their start time) charges a job that spans a
bucket edge to each bucket for its usage inside it, as ``sreport`` does, so the buckets of
the cost report add up to the whole window. The totals are those of the whole window
(percentiles of queue waits cannot be added up).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta, tzinfo

from gpuguard.reports.queries import Column, Report, ReportError

BUCKETS = ("day", "week", "month")
#: Most buckets one report runs (our choice: two years of days; each is one query).
MAX_BUCKETS = 800


def _floor(dt: datetime, bucket: str) -> datetime:
    d = dt.replace(hour=0, minute=0, second=0, microsecond=0)
    if bucket == "week":
        d -= timedelta(days=d.weekday())
    elif bucket == "month":
        d = d.replace(day=1)
    return d


def _next(d: datetime, bucket: str) -> datetime:
    if bucket == "day":
        n = d + timedelta(days=1)
    elif bucket == "week":
        n = d + timedelta(days=7)
    else:
        n = d.replace(year=d.year + (d.month == 12), month=d.month % 12 + 1)
    return n.replace(tzinfo=d.tzinfo)


def label(d: datetime, bucket: str) -> str:
    """``2026-11-03`` (day), ``2026-W45`` (ISO week), ``2026-11`` (month)."""
    if bucket == "day":
        return d.strftime("%Y-%m-%d")
    if bucket == "week":
        y, w, _ = d.isocalendar()
        return f"{y}-W{w:02d}"
    return d.strftime("%Y-%m")


def windows(since: float, until: float, bucket: str, tz: tzinfo) -> list[tuple[str, float, float]]:
    """``[(label, start, end)]`` covering ``[since, until)`` (UTC epoch seconds), cut at
    the bucket edges of wall-clock time in ``tz`` (a DST day is 23 or 25 hours long).
    Raises :class:`ReportError` for an unknown bucket or more than :data:`MAX_BUCKETS`."""
    if bucket not in BUCKETS:
        raise ReportError(f"--per {bucket!r}: expected one of {', '.join(BUCKETS)}")
    out = []
    # wall-clock arithmetic on naive times, then localised: timedelta on aware datetimes
    # would keep the UTC offset across a DST change
    d = _floor(datetime.fromtimestamp(since, tz).replace(tzinfo=None), bucket)
    while True:
        start = max(since, d.replace(tzinfo=tz).timestamp())
        n = _next(d, bucket)
        end = min(until, n.replace(tzinfo=tz).timestamp())
        if start >= until:
            break
        out.append((label(d, bucket), start, end))
        if len(out) > MAX_BUCKETS:
            raise ReportError(f"--per {bucket}: more than {MAX_BUCKETS} buckets in the window; use a longer bucket")
        d = n
    return out


def bucketed(run: Callable[[float, float], Report], since: float, until: float, bucket: str,
             tz: tzinfo) -> Report:
    """``run(since, until)`` once for the whole window and once per bucket; the result is
    the whole-window report whose first table has one row per (period, group...), a
    leading ``period`` column, and the whole window's total."""
    whole = run(since, until)
    main = whole.tables[0]
    rows = []
    for lab, a, b in windows(since, until, bucket, tz):
        for r in run(a, b).tables[0].rows:
            rows.append({"period": lab, **r})
    main.rows = rows
    main.columns = [Column("period", bucket), *main.columns]
    main.title = f"{main.title}, per {bucket}"
    whole.params = {**whole.params, "per": bucket}
    return whole


def auto_bucket(since: float, until: float) -> str:
    """The bucket of a usage-over-time chart: days up to 62 days, weeks up to 2 years,
    else months (our choice: 9 to 104 bars)."""
    days = (until - since) / 86400.0
    return "day" if days <= 62 else "week" if days <= 730 else "month"


def usage_series(store, since: float, until: float, by: str, tz: tzinfo, cluster=None,
                 bucket: str | None = None) -> dict:
    """GPU-hours per time bucket and first ``by`` key, prorated at the bucket edges with
    the cost report's rule: ``{"bucket": "day", "periods": [label...], "groups": {group:
    [gpu_hours per period]}}``. One small aggregate per bucket, each bounded by the index
    that suits its window (:func:`gpuguard.reports.queries._usage_where`), so the whole
    series reads each job about once. Jobs of unknown GPU count add nothing (the cost
    table counts them). Raises :class:`ReportError`."""
    from gpuguard.reports.queries import _SECS, _flt, _group_sql, _groups, _usage_where, by_keys

    first = by_keys(by)[0]
    bucket = bucket or auto_bucket(since, until)
    wins = windows(since, until, bucket, tz)
    flt = _flt(cluster)
    fparams = flt.sql()[1]
    periods = [w[0] for w in wins]
    groups: dict[str, list[float]] = {}
    for i, (_lab, a, b) in enumerate(wins):
        rows = store.query(f"SELECT {_group_sql(first)} AS grp, SUM(gpus * {_SECS}) / 3600.0 AS gh FROM sacct_jobs "
                           f"WHERE {_usage_where(store, a, b, flt)} AND gpus > 0 GROUP BY 1",
                           {**fparams, "since": a, "until": b})
        for r in rows:
            g = _groups(first, r["grp"])["group"]
            groups.setdefault(g, [0.0] * len(periods))[i] += r["gh"] or 0.0
    return {"bucket": bucket, "periods": periods, "groups": groups}
