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

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpuguard.store import Store

BY_CHOICES = ("account", "user", "partition", "qos", "template", "gpus", "gpu_type")
#: Most grouping keys one report takes (``--by account,user``).
MAX_BY_KEYS = 2
#: Filters a report takes (``--user alice,bob``...): option name -> column.
FILTER_COLUMNS = {"user": "user", "account": "account", "partition": "partition", "qos": "qos", "state": "state",
                  "gpu_type": "gpu_type"}
REPORTS = ("cost", "wait", "failures", "efficiency")
FAILURE_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")
PERCENTILES = (50, 90, 99)

# NULL (sacct printed nothing) is labelled "(none)" after aggregation, so grouping is on the
# bare column: no per-row function call.
_GROUP_SQL = {
    "account": "account", "user": "user", "partition": "partition", "qos": "qos", "template": "template",
    "gpu_type": "gpu_type",
    "gpus": ("CASE WHEN gpus <= 0 THEN '0' WHEN gpus = 1 THEN '1' WHEN gpus <= 4 THEN '2-4' "
             "WHEN gpus <= 8 THEN '5-8' WHEN gpus <= 16 THEN '9-16' ELSE '17+' END"),
}
_GPU_BUCKET_ORDER = {"0": 0, "1": 1, "2-4": 2, "5-8": 3, "9-16": 4, "17+": 5}
NONE_LABEL = "(none)"

# seconds of a job's usage inside [:since, :until): the whole charge when the job lies inside
# (nearly every job), else the overlap (capped by the charge, which excludes suspended time)
_SECS = ("(CASE WHEN start_at >= :since AND usage_end_at <= :until THEN charge_s "
         "ELSE MIN(charge_s, MAX(0, MIN(usage_end_at, :until) - MAX(start_at, :since))) END)")
#: Above this share of the table inside the window, a report scans the table instead of
#: walking an index (an index walk fetches each row by a random lookup: slower past ~1/4).
FULL_SCAN_SHARE = 0.25


def _label(v: Any) -> str:
    return NONE_LABEL if v is None or v == "" else str(v)


#: Separator of the two keys of a two-key group inside SQL (ASCII unit separator: no
#: account, user or partition name holds it).
_SEP = "\x1f"


def by_keys(by: str) -> list[str]:
    """``"account,user"`` -> ``["account", "user"]``; raises :class:`ReportError` for an
    unknown key, a repeated one or more than :data:`MAX_BY_KEYS`."""
    keys = [k.strip() for k in str(by).split(",") if k.strip()]
    if not keys:
        raise ReportError(f"--by: expected one of {', '.join(BY_CHOICES)}")
    if len(keys) > MAX_BY_KEYS:
        raise ReportError(f"--by {by!r}: at most {MAX_BY_KEYS} keys")
    if len(set(keys)) != len(keys):
        raise ReportError(f"--by {by!r}: a key is repeated")
    for k in keys:
        if k not in _GROUP_SQL:
            raise ReportError(f"--by {k!r}: expected one of {', '.join(BY_CHOICES)}")
    return keys


def _groups(by: str, grp: Any) -> dict[str, str]:
    """The aggregated ``grp`` value -> ``{"group": ..., "group2": ...}`` (labels)."""
    keys = by_keys(by)
    if len(keys) == 1:
        return {"group": _label(grp)}
    a, _, b = ("" if grp is None else str(grp)).partition(_SEP)
    return {"group": _label(a), "group2": _label(b)}


def group_columns(by: str) -> list[Column]:
    """The leading label column(s) of a table grouped ``by``."""
    keys = by_keys(by)
    return [Column("group", keys[0])] + ([Column("group2", keys[1])] if len(keys) > 1 else [])


@dataclass
class Filters:
    """Row filters of every report: each a tuple of accepted values (empty = all);
    ``cluster`` one cluster name or None. ``gpu_type`` matches a job holding that type
    (jobs of several types list them joined by ``,``)."""

    cluster: str | Filters | None = None
    user: tuple[str, ...] = ()
    account: tuple[str, ...] = ()
    partition: tuple[str, ...] = ()
    qos: tuple[str, ...] = ()
    state: tuple[str, ...] = ()
    gpu_type: tuple[str, ...] = ()

    def sql(self) -> tuple[str, dict[str, Any]]:
        """`` AND ...`` conditions (parameterised) and their parameters."""
        conds, params = [], {}
        if self.cluster is not None:
            conds.append("cluster = :cluster")
            params["cluster"] = self.cluster
        for name, col in FILTER_COLUMNS.items():
            vals = getattr(self, name)
            if not vals:
                continue
            marks = []
            for i, v in enumerate(vals):
                params[f"f_{name}{i}"] = v.upper() if name == "state" else v
                marks.append(f":f_{name}{i}")
            if name == "gpu_type":
                conds.append("(" + " OR ".join(f"(',' || gpu_type || ',') LIKE ('%,' || {m} || ',%')"
                                               for m in marks) + ")")
            else:
                conds.append(f"{col} IN ({', '.join(marks)})")
        return "".join(f" AND {c}" for c in conds), params

    def describe(self) -> str:
        """``user=alice,bob; state=FAILED`` (empty when nothing is filtered)."""
        parts = [f"{n}={','.join(getattr(self, n))}" for n in FILTER_COLUMNS if getattr(self, n)]
        if self.cluster is not None:
            parts.insert(0, f"cluster={self.cluster}")
        return "; ".join(parts)


def _flt(cluster: str | Filters | None) -> Filters:
    return cluster if isinstance(cluster, Filters) else Filters(cluster=cluster)


def _usage_where(store: Store, since: float, until: float, cluster: str | Filters | None) -> str:
    """WHERE clause for jobs with usage in the window (cost, efficiency): ``start_at <
    until`` and (``usage_end_at > since`` or a zero-length job starting in the window).

    Every such job has ``usage_end_at >= since`` too, so either index bounds the scan:
    ``start_at`` (rows starting before the end) suits a window early in the table,
    ``usage_end_at`` (rows ending after the start) one late in it; a window in the middle
    of a long history (a day or week bucket) would walk half the table through the wrong
    one. Two index-only counts pick the smaller range, or a plain scan when both are
    large (:data:`FULL_SCAN_SHARE`)."""
    span = _max_span(store)
    low = since - span  # no job overlapping the window started before this
    n = store.query("SELECT (SELECT COUNT(*) FROM sacct_jobs WHERE start_at < ?) AS by_start, "
                    "(SELECT COUNT(*) FROM sacct_jobs WHERE usage_end_at >= ?) AS by_end, "
                    "(SELECT COUNT(*) FROM sacct_jobs WHERE start_at >= ? AND start_at < ?) AS by_span, "
                    "(SELECT MAX(rowid) FROM sacct_jobs) AS n", [until, since, low, until])[0]
    total = n["n"] or 0
    by_start, by_end, by_span = n["by_start"] or 0, n["by_end"] or 0, n["by_span"] or 0
    cond = "(+usage_end_at > :since OR +start_at >= :since)"
    best = min(by_start, by_end, by_span)
    if best > FULL_SCAN_SHARE * total:
        w = f"+start_at < :until AND {cond}"
    elif best == by_span and by_span < by_start:
        w = f"start_at >= {float(low)!r} AND start_at < :until AND {cond}"
    elif by_end < by_start:
        w = f"usage_end_at >= :since AND +start_at < :until AND {cond}"
    else:
        w = f"start_at < :until AND {cond}"
    return w + _flt(cluster).sql()[0]


_SPAN_CACHE: dict[tuple, float] = {}


def _max_span(store: Store) -> float:
    """The longest ``usage_end_at - start_at`` in the table (seconds): one scan, cached
    while the table is unchanged (same connection changes, same ``PRAGMA data_version``
    for other connections' commits, same row count), so the buckets of one report pay it
    once."""
    conn = store.db.conn
    key = (id(conn), conn.total_changes, conn.execute("PRAGMA data_version").fetchone()[0],
           conn.execute("SELECT MAX(rowid) FROM sacct_jobs").fetchone()[0])
    if key not in _SPAN_CACHE:
        _SPAN_CACHE.clear()
        v = conn.execute("SELECT MAX(usage_end_at - start_at) FROM sacct_jobs").fetchone()[0]
        _SPAN_CACHE[key] = float(v or 0.0)
    return _SPAN_CACHE[key]


def _narrow(store: Store, column: str, since: float, until: float) -> bool:
    """Whether few enough rows have ``column`` in the window for an index walk to pay
    (two index-only counts)."""
    n = store.query(f"SELECT (SELECT COUNT(*) FROM sacct_jobs WHERE {column} >= ? AND {column} < ?) AS hit, "
                    "(SELECT MAX(rowid) FROM sacct_jobs) AS n", [since, until])[0]
    return bool(n["n"]) and (n["hit"] or 0) <= FULL_SCAN_SHARE * n["n"]


def _fast(store: Store) -> None:
    """Per-connection settings for big aggregations: a multi-threaded sorter and temp
    structures in memory (sorts of a million rows would otherwise spill to temp files)."""
    import os

    store.db.conn.execute(f"PRAGMA threads = {min(4, os.cpu_count() or 1)}")
    store.db.conn.execute("PRAGMA temp_store = MEMORY")


class ReportError(ValueError):
    """Bad report parameters (unknown --by, empty window, bad rate table); one line."""


@dataclass
class Column:
    """A table column: ``key`` in each row dict, ``label`` for people, ``kind`` one of
    ``text``, ``count``, ``hours``, ``seconds``, ``money``, ``share`` (a fraction 0..1),
    ``pct``, ``time`` (UTC epoch)."""

    key: str
    label: str
    kind: str = "text"


@dataclass
class Table:
    """Rows (dicts keyed by column key) with their columns; ``total`` is the same shape
    as a row for the whole selection (None where a total makes no sense)."""

    name: str
    title: str
    columns: list[Column]
    rows: list[dict[str, Any]]
    total: dict[str, Any] | None = None


@dataclass
class Report:
    """One report: parameters, tables (the first is the main one), notes for readers."""

    name: str
    title: str
    since: float
    until: float
    by: str
    tables: list[Table]
    notes: list[str] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    #: Usage over time for the HTML chart (:func:`gpuguard.reports.buckets.usage_series`).
    series: dict[str, Any] | None = None


@dataclass
class Rates:
    """Prices from config ``[reports]``: ``gpu_hour_rates`` keys ``TYPE``, ``@PARTITION``
    or ``TYPE@PARTITION`` -> price per GPU-hour; ``gpu_hour_rate`` for GPUs none of them
    matches; ``cpu_hour_rate`` per CPU-hour; ``currency`` a label only."""

    gpu_hour_rate: float = 0.0
    gpu_hour_rates: dict[str, float] = field(default_factory=dict)
    cpu_hour_rate: float = 0.0
    currency: str = ""

    def __post_init__(self) -> None:
        for k, v in self.gpu_hour_rates.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ReportError(f"reports.gpu_hour_rates.{k} must be a number >= 0, got {v!r}")
        for name in ("gpu_hour_rate", "cpu_hour_rate"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ReportError(f"reports.{name} must be a number >= 0, got {v!r}")

    def gpu_rate(self, gpu_type: str | None, partition: str | None) -> float:
        """Most specific match first: ``TYPE@PARTITION``, ``TYPE``, ``@PARTITION``, default."""
        r = self.gpu_hour_rates
        for key in ((f"{gpu_type}@{partition}" if gpu_type and partition else None), gpu_type,
                    (f"@{partition}" if partition else None)):
            if key and key in r:
                return float(r[key])
        return float(self.gpu_hour_rate)


def _group_sql(by: str) -> str:
    keys = by_keys(by)
    if len(keys) == 1:
        return _GROUP_SQL[keys[0]]
    return " || char(31) || ".join(f"COALESCE({_GROUP_SQL[k]}, '')" for k in keys)


def _params(since: float, until: float, cluster: str | Filters | None, **kw: Any) -> dict[str, Any]:
    if not until > since:
        raise ReportError("empty window: --until must be after --since")
    return {"since": float(since), "until": float(until), **_flt(cluster).sql()[1], **kw}


def _sort(rows: list[dict], by: str, key: str) -> list[dict]:
    """Largest ``key`` first (GPU-count buckets in bucket order); with two keys, the first
    key's groups by their summed ``key``, and inside each its second-key rows."""
    keys = by_keys(by)

    def order(r: dict, field: str, k: str) -> tuple:
        if k == "gpus":
            return (_GPU_BUCKET_ORDER.get(r[field], 99),)
        return ()

    if len(keys) == 1:
        if keys[0] == "gpus":
            return sorted(rows, key=lambda r: order(r, "group", "gpus"))
        return sorted(rows, key=lambda r: (-(r.get(key) or 0), r["group"]))
    first: dict[str, float] = {}
    for r in rows:
        first[r["group"]] = first.get(r["group"], 0) + (r.get(key) or 0)
    return sorted(rows, key=lambda r: (order(r, "group", keys[0]) or (-first[r["group"]],), r["group"],
                                       order(r, "group2", keys[1]) or (-(r.get(key) or 0),), r["group2"]))


# --- cost -------------------------------------------------------------------------------
GPU_UNKNOWN_NOTE = ("GPU usage unknown for {n} job(s): no accounting field carries their GPUs (AllocTRES/ReqTRES "
                    "without gres/gpu: AccountingStorageTRES lacks gres/gpu, or the file was saved without "
                    "AllocTRES); their GPU-hours and GPU cost are not in the figures")


def _unknown_gpu_figures(r: dict[str, Any], keys: tuple[str, ...]) -> None:
    """A group whose jobs all have unknown GPUs has unknown (None) GPU figures, not 0."""
    if r.get("gpu_unknown_jobs") and r["gpu_unknown_jobs"] == r["jobs"]:
        for k in keys:
            r[k] = None
def _rate_sql(rates: Rates) -> tuple[str, dict[str, Any]]:
    """The per-GPU-hour price of a row as a parameterised CASE (most specific key first)."""
    whens, params = [], {}
    keys = sorted(rates.gpu_hour_rates, key=lambda k: (0 if "@" in k and not k.startswith("@") else
                                                       1 if "@" not in k else 2, k))
    for i, k in enumerate(keys):
        params[f"r{i}"] = float(rates.gpu_hour_rates[k])
        gtype, _, part = k.partition("@")
        if gtype and part:
            params[f"t{i}"], params[f"p{i}"] = gtype, part
            whens.append(f"WHEN gpu_type = :t{i} AND partition = :p{i} THEN :r{i}")
        elif gtype:
            params[f"t{i}"] = gtype
            whens.append(f"WHEN gpu_type = :t{i} THEN :r{i}")
        else:
            params[f"p{i}"] = part
            whens.append(f"WHEN partition = :p{i} THEN :r{i}")
    params["rate_default"] = float(rates.gpu_hour_rate)
    if not whens:
        return ":rate_default", params
    return f"(CASE {' '.join(whens)} ELSE :rate_default END)", params


_OUTCOMES = {"failed": ("FAILED", "OUT_OF_MEMORY", "BOOT_FAIL"), "timeout": ("TIMEOUT", "DEADLINE"),
             "node_fail": ("NODE_FAIL",)}


def cost_report(store: Store, *, since: float, until: float, by: str = "account", rates: Rates | None = None,
                cluster: str | Filters | None = None) -> Report:
    """GPU-hours, CPU-hours, cost and job count per group; the cost of jobs that failed
    (FAILED, OUT_OF_MEMORY, BOOT_FAIL), timed out (TIMEOUT, DEADLINE) or hit a node
    failure (NODE_FAIL) is shown separately (it is included in ``cost``).
    Raises :class:`ReportError`, :class:`gpuguard.store.StoreError`."""
    rates = rates or Rates()
    g = _group_sql(by)
    params = _params(since, until, cluster)
    rate, rparams = _rate_sql(rates)
    params.update(rparams, cpu_rate=float(rates.cpu_hour_rate))
    _fast(store)
    outcome_sums = ", ".join(
        f"SUM(CASE WHEN state IN ({', '.join(repr(s) for s in states)}) THEN gc + cs * :cpu_rate END) / 3600.0 "
        f"AS {name}_cost" for name, states in _OUTCOMES.items())
    agg = store.query(f"""
        SELECT grp, COUNT(*) AS jobs, SUM(gs) / 3600.0 AS gpu_hours, SUM(cs) / 3600.0 AS cpu_hours,
               SUM(gs IS NULL) AS gpu_unknown_jobs, SUM(CASE WHEN gs IS NULL THEN s END) / 3600.0 AS gpu_unknown_hours,
               SUM(gc) / 3600.0 AS gpu_cost, SUM(cs) * :cpu_rate / 3600.0 AS cpu_cost, {outcome_sums}
        FROM (SELECT {g} AS grp, state, s, gpus * s AS gs, COALESCE(cpus, 0) * s AS cs, gpus * s * {rate} AS gc
              FROM (SELECT *, {_SECS} AS s FROM sacct_jobs WHERE {_usage_where(store, since, until, cluster)}))
        GROUP BY grp
    """, params)
    keys = ("jobs", "gpu_hours", "cpu_hours", "gpu_cost", "cpu_cost", "cost", "failed_cost",
            "timeout_cost", "node_fail_cost")
    keys += ("gpu_unknown_jobs", "gpu_unknown_hours")
    rows = []
    for a in agg:
        r = {**_groups(by, a.pop("grp")), **{k: (a.get(k) or 0.0) for k in keys if k != "cost"}}
        r["jobs"], r["gpu_unknown_jobs"] = int(r["jobs"]), int(r["gpu_unknown_jobs"])
        r["cost"] = r["gpu_cost"] + r["cpu_cost"]
        rows.append(r)
    total: dict[str, Any] = {"group": "TOTAL", **{k: sum(r[k] for r in rows) for k in keys}}
    for r in [*rows, total]:
        _unknown_gpu_figures(r, ("gpu_hours", "gpu_cost", "cost"))
    cur = f" ({rates.currency})" if rates.currency else ""
    cols = [*group_columns(by), Column("jobs", "jobs", "count"), Column("gpu_hours", "GPU-h", "hours"),
            Column("cpu_hours", "CPU-h", "hours"), Column("gpu_cost", f"GPU cost{cur}", "money"),
            Column("cpu_cost", f"CPU cost{cur}", "money"), Column("cost", f"cost{cur}", "money"),
            Column("failed_cost", f"failed{cur}", "money"), Column("timeout_cost", f"timeout{cur}", "money"),
            Column("node_fail_cost", f"node fail{cur}", "money")]
    if total["gpu_unknown_jobs"]:
        n = len(group_columns(by))
        cols.insert(n + 2, Column("gpu_unknown_jobs", "jobs, GPU usage unknown", "count"))
        cols.insert(n + 3, Column("gpu_unknown_hours", "their job-hours", "hours"))
    else:
        for r in [*rows, total]:
            del r["gpu_unknown_jobs"], r["gpu_unknown_hours"]
    notes = ["usage inside the window (jobs overlapping its edges are prorated); running jobs up to the last sync",
             "failed/timeout/node fail: cost of jobs ending FAILED, OUT_OF_MEMORY or BOOT_FAIL / TIMEOUT or "
             "DEADLINE / NODE_FAIL; included in cost"]
    if total.get("gpu_unknown_jobs"):
        notes.append(GPU_UNKNOWN_NOTE.format(n=total["gpu_unknown_jobs"]))
    if not rates.gpu_hour_rate and not rates.gpu_hour_rates and not rates.cpu_hour_rate:
        notes.append("no rates configured ([reports] gpu_hour_rate, gpu_hour_rates, cpu_hour_rate): costs are 0")
    return Report("cost", "Cost", since, until, by,
                  [Table("cost", f"Cost per {by}", cols, _sort(rows, by, "gpu_hours"), total)],
                  notes, {"currency": rates.currency})


# --- wait -------------------------------------------------------------------------------
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


# --- failures ---------------------------------------------------------------------------
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


# --- efficiency -------------------------------------------------------------------------
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
