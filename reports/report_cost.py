"""The cost report: GPU-hours, CPU-hours and cost per group, failed/timed-out/node-fail
cost beside it.

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
    Rates,
    Report,
    Table,
    _fast,
    _group_sql,
    _groups,
    _params,
    _sort,
    _unknown_gpu_figures,
    _usage_where,
    group_columns,
)

if TYPE_CHECKING:
    from gpuguard.store import Store


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
