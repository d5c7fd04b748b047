"""What every report query shares: grouping keys (``--by``), filters, the window
predicates on the ``sacct_jobs`` cache, sorting, and the result types
(:class:`Report`, :class:`Table`, :class:`Column`, :class:`Rates`).

Which jobs each report counts is in the docstring of :mod:`gpuguard.reports.queries`,
which re-exports the public names.
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


GPU_UNKNOWN_NOTE = ("GPU usage unknown for {n} job(s): no accounting field carries their GPUs (AllocTRES/ReqTRES "
                    "without gres/gpu: AccountingStorageTRES lacks gres/gpu, or the file was saved without "
                    "AllocTRES); their GPU-hours and GPU cost are not in the figures")


def _unknown_gpu_figures(r: dict[str, Any], keys: tuple[str, ...]) -> None:
    """A group whose jobs all have unknown GPUs has unknown (None) GPU figures, not 0."""
    if r.get("gpu_unknown_jobs") and r["gpu_unknown_jobs"] == r["jobs"]:
        for k in keys:
            r[k] = None
