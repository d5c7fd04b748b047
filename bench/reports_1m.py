"""Reports on 1 M synthetic sacct rows: sync from a file, then time every report, and the
ratio against a straightforward pandas implementation of the same reports.

    .venv/bin/python bench/reports_1m.py [--jobs 1000000] [--keep DIR]

Prints figures; asserts nothing about time (the goal, issue 5: every report <= 2 s after
the sync). The pandas reference computes the same numbers from the same cache table and
the script checks that both agree.

Shape of the synthetic trace, after the published GPU-cluster traces:
* Jeon et al., "Analysis of Large-Scale Multi-Tenant GPU Clusters for DNN Training
  Workloads" (USENIX ATC 2019, Microsoft Philly): most jobs use 1 GPU; about 30 % of
  jobs end unsuccessfully (killed or failed); run times span seconds to weeks.
* Hu et al., "Characterization and Prediction of Deep Learning Workloads in Large-Scale
  GPU Datacenters" (SC 2021, SenseTime Helios): most GPU jobs are single-GPU, a few
  large jobs hold most GPU time, a small share of users/VCs submits most jobs, many jobs
  are short (minutes) with a heavy tail; queueing delay is heavy-tailed and grows with
  the GPU count.
Here: accounts Zipf(1.2) over 60 accounts, 600 users; GPUs 0 (5 %), 1 (70 %), 2, 4, 8,
16, 32, 64; durations log-normal (median 12 min, sigma 2.2, cap 7 days); waits log-normal
(median 45 s x GPU-count factor, sigma 2.5); states COMPLETED 62 %, CANCELLED 20 %,
FAILED 11 %, TIMEOUT 3 %, OUT_OF_MEMORY 1.5 %, PREEMPTED 1 %, NODE_FAIL 0.5 %, plus
1 % pending and 1 % running at the sync; a gpuguard summary for 30 % of GPU jobs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
from datetime import UTC, datetime
from zoneinfo import ZoneInfo

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from gpuguard.reports.queries import Rates, cost_report, efficiency_report, failures_report, wait_report  # noqa: E402
from gpuguard.reports.sacct import SACCT_FIELDS  # noqa: E402
from gpuguard.reports.sync import import_file  # noqa: E402
from gpuguard.store import open_store  # noqa: E402

T0 = datetime(2025, 1, 1, tzinfo=UTC).timestamp()
DAYS = 180
SYNC_AT = T0 + DAYS * 86400
RATES = Rates(gpu_hour_rate=1.0, cpu_hour_rate=0.01, gpu_hour_rates={"a100": 2.0, "h100": 3.5, "@debug": 0.5})
IDLE = 5.0
GPU_CHOICES = [(0, 5), (1, 70), (2, 8), (4, 7), (8, 6.5), (16, 2.3), (32, 0.9), (64, 0.3)]
STATES = [("COMPLETED", 62), ("CANCELLED", 20), ("FAILED", 11), ("TIMEOUT", 3), ("OUT_OF_MEMORY", 1.5),
          ("PREEMPTED", 1), ("NODE_FAIL", 0.5), ("PENDING", 1), ("RUNNING", 1)]


def _fmt(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S")


def generate(path: str, n: int, seed: int = 5) -> list[tuple[int, str]]:
    """Write ``n`` sacct -P rows (with header) to ``path``; return ``(job_id_raw, summary
    JSON)`` for the jobs given a gpuguard summary."""
    rnd = random.Random(seed)
    accounts = [f"acct{i:02d}" for i in range(60)]
    acct_w = [1 / (r + 1) ** 1.2 for r in range(60)]
    users = [(f"user{i:03d}", accounts[min(59, int(rnd.paretovariate(1.1)) - 1)]) for i in range(600)]
    user_w = [1 / (r + 1) ** 0.9 for r in range(600)]
    by_acct: dict[str, list[int]] = {}
    for i, (_u, a) in enumerate(users):
        by_acct.setdefault(a, []).append(i)
    gpus_v, gpus_w = zip(*GPU_CHOICES, strict=True)
    st_v, st_w = zip(*STATES, strict=True)
    accts = rnd.choices(accounts, acct_w, k=n)
    gpu_ks = rnd.choices(gpus_v, gpus_w, k=n)
    states = rnd.choices(st_v, st_w, k=n)
    summaries = []
    with open(path, "w") as fh:
        fh.write("|".join(SACCT_FIELDS) + "\n")
        for i in range(n):
            raw = 1_000_000 + i
            acct = accts[i]
            cand = by_acct.get(acct)
            user = users[rnd.choices(cand, [user_w[c] for c in cand])[0]][0] if cand else f"svc_{acct}"
            g = gpu_ks[i]
            part = "cpu" if g == 0 else ("debug" if rnd.random() < 0.05 else "gpu")
            gtype = "" if g == 0 else rnd.choice(("a100", "a100", "h100", ""))
            state = states[i]
            submit = T0 + rnd.random() * (DAYS * 86400 - 3600)
            eligible = submit + (rnd.expovariate(1 / 600) if rnd.random() < 0.1 else 0.0)
            wait = min(rnd.lognormvariate(math.log(45 * (1 + math.log2(max(g, 1)))), 2.5), 5 * 86400)
            dur = min(rnd.lognormvariate(math.log(720), 2.2), 7 * 86400)
            cpus = max(1, g * 8) if g else rnd.choice((1, 2, 4, 16))
            tres = f"billing={cpus},cpu={cpus},mem={cpus * 4}G,node={max(1, g // 8)}"
            if g:
                tres += f",gres/gpu={g}" + (f",gres/gpu:{gtype}={g}" if gtype else "")
            start_s = end_s = "Unknown"
            elapsed = 0
            if state == "PENDING":
                submit = SYNC_AT - rnd.random() * 86400
                eligible = submit
                tres = ""
            elif state == "RUNNING":
                start = SYNC_AT - rnd.random() * dur
                elapsed = int(SYNC_AT - start)
                start_s = _fmt(start)
                eligible = min(eligible, start)
                submit = min(submit, eligible)
            else:
                start = min(eligible + wait, SYNC_AT - 60)
                end = min(start + dur, SYNC_AT - 1)
                elapsed = int(end - start)
                start_s, end_s = _fmt(start), _fmt(end)
            if g and state not in ("PENDING",) and rnd.random() < 0.3:
                utils = [round(min(100.0, max(0.0, rnd.gauss(55, 35))), 1) for _ in range(min(g, 8))]
                summaries.append((raw, json.dumps({"gpus": [{"gpu_index": k, "gpu_util_mean_pct": u}
                                                            for k, u in enumerate(utils)]})))
            ec = "1:0" if state == "FAILED" else ("0:9" if state == "OUT_OF_MEMORY" else "0:0")
            tmpl = f"gpuguard:template=t{rnd.randrange(40)}" if rnd.random() < 0.4 else ""
            fh.write("|".join((str(raw), str(raw), "bench", f"job{i % 997}", user, acct, part, "normal",
                               _fmt(submit), _fmt(eligible), start_s, end_s, str(elapsed), state, ec, tres,
                               str(cpus), "1", "n001", tmpl, "", tres, "1440")) + "\n")
    return summaries


def sqlite_reports(store, since, until):
    out = {}
    for name, fn in (("cost", lambda: cost_report(store, since=since, until=until, rates=RATES)),
                     ("wait", lambda: wait_report(store, since=since, until=until)),
                     ("failures", lambda: failures_report(store, since=since, until=until)),
                     ("efficiency", lambda: efficiency_report(store, since=since, until=until, idle_util_pct=IDLE))):
        t = time.perf_counter()
        rep = fn()
        out[name] = (time.perf_counter() - t, rep)
    return out


# --- the pandas reference ---------------------------------------------------------------
def pandas_reports(df, summ, since, until):
    import numpy as np
    import pandas as pd

    out = {}
    t = time.perf_counter()
    j = df[df.start_at.notna() & (df.start_at < until) & ((df.usage_end_at > since) | (df.start_at >= since))].copy()
    overlap = (np.minimum(j.usage_end_at, until) - np.maximum(j.start_at, since)).clip(lower=0)
    j["secs"] = np.minimum(j.elapsed_s.fillna(j.usage_end_at - j.start_at), overlap)
    j["gpu_s"] = j.secs * j.gpus
    j["cpu_s"] = j.secs * j.cpus.fillna(0)

    def rate(row):
        return RATES.gpu_rate(row.gpu_type if isinstance(row.gpu_type, str) else None, row.partition)
    combos = j[["gpu_type", "partition"]].drop_duplicates()
    combos["rate"] = combos.apply(rate, axis=1)
    j = j.merge(combos, on=["gpu_type", "partition"], how="left")
    j["cost"] = j.gpu_s / 3600 * j.rate + j.cpu_s / 3600 * RATES.cpu_hour_rate
    cost = j.groupby("account").agg(jobs=("secs", "size"), gpu_hours=("gpu_s", "sum"), cost=("cost", "sum"))
    cost["gpu_hours"] /= 3600
    out["cost"] = (time.perf_counter() - t, cost)

    t = time.perf_counter()
    w = df[df.start_at.notna() & (df.start_at >= since) & (df.start_at < until)].copy()
    w["wait"] = (w.start_at - w.eligible_at.fillna(w.submit_at)).clip(lower=0)
    w = w.sort_values(["account", "wait"])
    w["rank"] = w.groupby("account").cumcount() + 1
    w["n"] = w.groupby("account")["wait"].transform("size")
    res = w.groupby("account")["wait"].agg(["size", "mean", "max"])
    for p in (50, 90, 99):
        sel = w[w["rank"] == np.ceil(p * w["n"] / 100).astype(int)]
        res[f"p{p}"] = sel.set_index("account")["wait"]
    out["wait"] = (time.perf_counter() - t, res)

    t = time.perf_counter()
    f = df[df.end_at.notna() & (df.end_at >= since) & (df.end_at < until)].copy()
    f["gh"] = f.elapsed_s.fillna(0) * f.gpus / 3600
    fail = f.pivot_table(index="account", columns="state", values="gh", aggfunc=["size", "sum"], fill_value=0)
    out["failures"] = (time.perf_counter() - t, fail)

    t = time.perf_counter()
    rows = []
    for jid, doc in zip(summ.job_id, summ.summary, strict=True):
        for g in json.loads(doc).get("gpus", []):
            rows.append((int(jid), g.get("gpu_util_mean_pct")))
    sg = pd.DataFrame(rows, columns=["jid", "u"]).dropna()
    sg["idle"] = (sg.u < IDLE).astype(float)
    per_job = sg.groupby("jid").agg(util=("u", "mean"), idle_frac=("idle", "mean"))
    e = j[j.gpus > 0].merge(per_job, left_on="job_id_raw", right_index=True, how="left")
    e["w"] = e.gpu_s * e.util / 100
    e["idle_s"] = e.gpu_s * e.idle_frac
    eff = e.groupby("account").agg(jobs=("gpu_s", "size"), gpu_hours=("gpu_s", "sum"), used=("w", "sum"),
                                   idle=("idle_s", "sum"), no_summary=("util", lambda s: s.isna().sum()))
    out["efficiency"] = (time.perf_counter() - t, eff)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1_000_000)
    ap.add_argument("--keep", metavar="DIR", help="keep the generated file and store here")
    a = ap.parse_args()
    d = a.keep or tempfile.mkdtemp(prefix="gg-bench-")
    os.makedirs(d, exist_ok=True)
    src, db = os.path.join(d, "sacct-1m.txt"), os.path.join(d, "cluster.db")
    for p in (db, db + "-wal", db + "-shm"):
        if os.path.exists(p):
            os.remove(p)
    print(f"cpus: {os.cpu_count()}  python {sys.version.split()[0]}  dir {d}")
    summ_path = os.path.join(d, f"summaries-{a.jobs}.json")
    if a.keep and os.path.exists(summ_path) and os.path.exists(src):
        summaries = [tuple(x) for x in json.load(open(summ_path))]
        print(f"reusing {src}")
    else:
        t = time.perf_counter()
        summaries = generate(src, a.jobs)
        print(f"generate {a.jobs:,} rows: {time.perf_counter() - t:6.2f} s  ({os.path.getsize(src) / 1e6:.0f} MB)")
        json.dump(summaries, open(summ_path, "w"))
    store = open_store(db)
    t = time.perf_counter()
    res = import_file(store, src, tz=ZoneInfo("UTC"), synced_at=SYNC_AT)
    print(f"sync --from-file:  {time.perf_counter() - t:6.2f} s  ({res.jobs:,} jobs, {len(res.malformed)} malformed)")
    if "job_summaries" in store.db.table_names():
        cols = {r["name"] for r in store.query("SELECT name FROM pragma_table_info('job_summaries')")}
        t = time.perf_counter()
        with store.tx():
            store.db.conn.executemany("INSERT INTO job_summaries (job_id, node, summary) VALUES (?, 'n001', ?)",
                                      [(str(j), s) for j, s in summaries])
        util = (store.query("SELECT COUNT(*) AS n FROM job_gpu_util")[0]["n"]
                if "job_gpu_util" in store.db.table_names() else None)
        print(f"gpuguard summaries stored: {len(summaries):,} in {time.perf_counter() - t:.2f} s "
              f"(job_summaries columns: {len(cols)}; per-GPU readings derived by trigger: {util})")
    else:
        print("no job_summaries table in this store: efficiency counts every job as 'no summary'")
    since, until = T0, SYNC_AT + 1
    import pandas as pd

    t = time.perf_counter()
    df = pd.read_sql("SELECT * FROM sacct_jobs", store.db.conn)
    summ = (pd.read_sql("SELECT job_id, summary FROM job_summaries", store.db.conn)
            if "job_summaries" in store.db.table_names() else pd.DataFrame({"job_id": [], "summary": []}))
    load = time.perf_counter() - t
    print(f"pandas: load the cache table into a DataFrame: {load:.2f} s (not counted below)")
    sq = sqlite_reports(store, since, until)
    pdr = pandas_reports(df, summ, since, until)
    print(f"\n{'report':12} {'sqlite s':>9} {'pandas s':>9} {'sqlite/pandas':>14}  {'<= 2 s':>6}")
    for name in ("cost", "wait", "failures", "efficiency"):
        ts, tp = sq[name][0], pdr[name][0]
        print(f"{name:12} {ts:9.3f} {tp:9.3f} {ts / tp:14.2f}  {'yes' if ts <= 2 else 'NO':>6}")
    total_s = sum(v[0] for v in sq.values())
    total_p = sum(v[0] for v in pdr.values())
    print(f"{'all':12} {total_s:9.3f} {total_p:9.3f} {total_s / total_p:14.2f}")
    # the two implementations agree
    c = sq["cost"][1].tables[0]
    agree = {
        "cost GPU-h": math.isclose(c.total["gpu_hours"], float(pdr["cost"][1].gpu_hours.sum()), rel_tol=1e-9),
        "cost": math.isclose(c.total["cost"], float(pdr["cost"][1].cost.sum()), rel_tol=1e-9),
        "wait p50/p90/p99 per account": all(
            r[f"p{p}_s"] == pdr["wait"][1].loc[r["group"], f"p{p}"] for r in sq["wait"][1].tables[0].rows
            for p in (50, 90, 99)),
        "failures jobs": sq["failures"][1].tables[0].total["jobs"] == int(pdr["failures"][1]["size"].to_numpy().sum()),
        "efficiency no-summary jobs": sq["efficiency"][1].tables[0].total["jobs_no_summary"]
        == int(pdr["efficiency"][1].no_summary.sum()),
        "idle GPU-h": math.isclose(sq["efficiency"][1].tables[0].total["idle_gpu_hours"],
                                   float(pdr["efficiency"][1].idle.sum()) / 3600, rel_tol=1e-9),
    }
    print("\nsqlite and pandas agree: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in agree.items()))
    grouped_and_bucketed(store, since, until)
    store.close()


def grouped_and_bucketed(store, since, until) -> None:
    """Time the grouping features: two keys, month buckets (one query per bucket plus the
    whole window), a filter, and the HTML usage-over-time series (one query)."""
    from gpuguard.reports.buckets import usage_series
    from gpuguard.reports.queries import Filters, run_reports

    utc = ZoneInfo("UTC")
    print(f"\n{'grouping':44} {'s':>7}")
    for label, kw in (("cost --by account,user", {"by": "account,user"}),
                      ("cost --by account --per month", {"per": "month"}),
                      ("cost --by account,user --per week", {"by": "account,user", "per": "week"}),
                      ("cost --user <one> (filter)", {"cluster": Filters(user=("user001",))})):
        t = time.perf_counter()
        (rep,) = run_reports(store, ["cost"], since=since, until=until, rates=RATES, tz=utc, **kw)
        print(f"{label:44} {time.perf_counter() - t:7.3f}  ({len(rep.tables[0].rows)} rows)")
    t = time.perf_counter()
    s = usage_series(store, since, until, "account", utc)
    print(f"{'usage over time (' + s['bucket'] + ', one query)':44} {time.perf_counter() - t:7.3f}  "
          f"({len(s['periods'])} periods x {len(s['groups'])} groups)")


if __name__ == "__main__":
    main()
