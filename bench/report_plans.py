"""Which indexes the reports' queries use: run every report (cost, wait, failures,
efficiency) over a store's ``sacct_jobs`` for seven ``--by`` keys, with and without
``--per month``, over three windows (all, the last week, the first week) and two filters,
plus the usage-over-time series; trace every statement (``set_trace_callback``) and count,
over the distinct statements, the ``EXPLAIN QUERY PLAN`` lines that use each index and
those that scan the table. A figure, not a test: an index no line uses is one a bulk load
(``report sync``) rebuilds for nothing.

    .venv/bin/python bench/reports_1m.py --keep DIR     # a store of the trace: DIR/cluster.db
    .venv/bin/python bench/report_plans.py DIR/cluster.db

Measured 2026-12-01 on a 200,000-job store of the trace (imported in Europe/Berlin time):
start index 236 plan lines, end 65, usage end 60, by_account 37, pending 12,
job_gpu_util_jid 65; 16 lines scan sacct_jobs. Every index of sacct_jobs is used.
"""

from __future__ import annotations

import collections
import os
import re
import sqlite3
import sys
import time
from zoneinfo import ZoneInfo

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from reports_1m import RATES, SYNC_AT, T0  # noqa: E402

from gpuguard.reports.buckets import usage_series  # noqa: E402
from gpuguard.reports.queries import Filters, run_reports  # noqa: E402
from gpuguard.store import open_store  # noqa: E402


def main() -> None:
    s = open_store(sys.argv[1])
    stmts: list[str] = []
    s.db.conn.set_trace_callback(stmts.append)
    utc = ZoneInfo("UTC")
    cases = [dict(by=by, per=per, since=a, until=b)
             for by in ("account", "user", "partition", "account,user", "gpu_type", "template", "qos")
             for per in (None, "month")
             for a, b in ((T0, SYNC_AT + 1), (SYNC_AT - 7 * 86400, SYNC_AT + 1), (T0, T0 + 7 * 86400))]
    cases += [dict(by="account", per=None, since=T0, until=SYNC_AT + 1, cluster=Filters(user=("user001",))),
              dict(by="account", per=None, since=T0, until=SYNC_AT + 1, cluster=Filters(state=("FAILED",)))]
    seconds: dict[str, float] = collections.defaultdict(float)
    for kw in cases:
        for rep in ("cost", "wait", "failures", "efficiency"):
            t = time.perf_counter()
            run_reports(s, [rep], rates=RATES, tz=utc, **kw)
            seconds[rep] += time.perf_counter() - t
    usage_series(s, T0, SYNC_AT + 1, "account", utc)
    s.db.conn.set_trace_callback(None)
    used: collections.Counter = collections.Counter()
    for q in set(stmts):
        if "sacct_jobs" not in q or q.lstrip().upper().startswith(("PRAGMA", "EXPLAIN")):
            continue
        try:
            plan = s.db.conn.execute("EXPLAIN QUERY PLAN " + q).fetchall()
        except sqlite3.Error:  # a statement with parameters the trace shows unbound
            continue
        for row in plan:
            for m in re.findall(r"INDEX (\w+)", row[3]):
                used[m] += 1
            if "SCAN sacct_jobs" in row[3] and "INDEX" not in row[3]:
                used["<table scan>"] += 1
    print(f"{len(cases)} option sets x 4 reports; plan lines per index over the distinct statements:", dict(used))
    print("report seconds over all option sets:", {k: round(v, 2) for k, v in seconds.items()})


if __name__ == "__main__":
    main()
