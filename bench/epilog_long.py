"""Benchmark: the node Epilog's summary, part and single-host judge of a long 8-GPU job at 1 s, against numpy.

Builds (once per size, in a temp dir) a node store holding one job of H hours x 8 GPUs
sampled every second (the compact store, as the collector writes it), one training rank
with a step record per second, and a template baseline of 3 earlier runs whose step time
is 20 % lower, so the verdict flags the step time and walks every long window (its worst
case). Then, each in a fresh process so peak memory (ru_maxrss) is its own:

* ``product``: what the node Epilog does after the training-record ingest on a single
  host (epilog/hook.py step 6): :func:`summarize_job` + :func:`save_summary`, this node's
  part built from the store and encoded (:func:`gpuguard.epilog.handover.encode_part`),
  decoded and judged (:func:`gpuguard.epilog.judge.judge_parts`: verdict, comparisons,
  findings), the modules it imports lazily loaded before the clock starts;
* ``numpy``: the reference: read the same rows into numpy arrays (one query per GPU and
  one for the steps) and compute the same summary statistics (per-GPU and pooled means,
  maxima, p95 of utilisation, step-time percentiles). It does no part and no verdict.

Prints median wall and CPU seconds over N runs and peak RSS for both, and their ratios
(on a shared machine the CPU ratio is the steadier one). The product's CPU is the
process's, both of its threads (it reads the training steps on a second connection
beside the GPU series: :mod:`gpuguard.beside`); its wall time is what the Epilog waits.
The store is built as the collector leaves it: raw rows, the minutes it closed
(:mod:`gpuguard.live_minutes`) and the step sub-windows its ingest's triggers kept. Goal (issue 12): 24 h <= 1 s and
<= 1.5 x numpy; 7 days within the 20 s epilog budget; <= 300 MB. The training-record
ingest is measured by ``bench/ingest_long.py``.
A figure, not a test.

    .venv/bin/python bench/epilog_long.py [HOURS ...] [--runs N]   (default: 24 168, N=3)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import gpuguard.collector.schema
import gpuguard.epilog.schema  # noqa: F401  (steps, summaries, verdicts)
T0 = 1_764_460_800.0
GPUS = 8


def build(path: str, hours: float) -> None:
    from gpuguard import live_minutes, samples
    from gpuguard.store import open_store

    s = open_store(path)
    conn = s.db.conn
    n = int(hours * 3600)
    rnd = random.Random(1)
    s.insert("health_runs", {"node": "n1", "hook": "prolog", "job_id": "100", "started_at": T0 - 2,
                             "finished_at": T0 - 1, "decision": "proceed", "reason": ""})
    with s.tx():
        cache = samples.SeriesCache()
        for g in range(GPUS):
            sid, t0 = cache.get(conn, "100", "n1", g, f"GPU-{g}", T0)
            conn.executemany("insert into gpu_samples (sid, t_ms, gpu_util_pct, mem_util_pct, mem_used_mib, "
                             "power_w_x10, temp_c, sm_clock_mhz, clock_event_mask) values (?,?,?,?,?,?,?,?,?)",
                             ((sid, round((T0 + i - t0) * 1000) + rnd.randint(0, 3), 95 + rnd.randint(0, 5),
                               40 + rnd.randint(0, 10), 60000 + i // 100, 6000 + rnd.randint(0, 800),
                               65 + rnd.randint(0, 8), 1980 - (i // 300 % 2) * 15, 4 if i // 900 % 4 == 0 else 0)
                              for i in range(n)))
            conn.executemany("insert into gpu_slow (sid, t_ms, ecc_volatile_uncorrected, pcie_replay_count) "
                             "values (?,?,?,?)",
                             ((sid, i * 1000, 0, 0) for i in range(0, n, 60)))
            live_minutes.catch_up(conn, sid, t0)  # the minutes the collector closed as the job ran
        conn.executemany(
            "insert into steps (job_id, node, rank, step, t, step_time_s, samples, tokens, loss, loss_nonfinite, "
            "data_wait_s, fwd_bwd_s, comm_s, optim_s) values ('100','n1',0,?,?,?,64,131072,2.0,0,?,?,?,?)",
            ((k, T0 + k + 1, st, st * 0.05, st * 0.7, st * 0.2, st * 0.05)
             for k, st in ((k, 0.95 + rnd.random() * 0.1) for k in range(n))))
        conn.executemany("insert into host_samples (job_id, node, at, cpu_pct, rss_mib) values ('100','n1',?,?,?)",
                         ((T0 + 30 * i, 400.0, 20000.0 + i) for i in range(n // 30)))
        for b in range(3):
            jid = f"b{b}"
            conn.execute("insert into verdicts (job_id, template, at, state, cause, baseline_ok, start_at) "
                         "values (?, 'bench', ?, 'judged', 'healthy', 1, ?)", (jid, T0 - 86400 + b, T0 - 86400))
            vals = {"step_time_p50_s": 0.8 + 0.001 * b, "step_time_p95_s": 0.84 + 0.001 * b,
                    "throughput_per_s": 64 / 0.8, "data_wait_share": 0.05, "comm_share": 0.2,
                    "gpu_util_pct": 97.0, "mem_util_pct": 45.0, "power_w": 640.0, "sm_clock_mhz": 1980.0,
                    "temp_c": 69.0, "mem_peak_mib": 61000.0}
            conn.executemany("insert into comparisons (job_id, template, metric, value, at) values (?,?,?,?,?)",
                             [(jid, "bench", m, v, T0 - 86400) for m, v in vals.items()])
    s.close()


class _Drains:
    """Stands in for the Epilog's pending-drain list: records what the judge would drain."""

    actuator = None

    def __init__(self) -> None:
        self.made: list[tuple[str, str]] = []

    def drain(self, node: str, reason: str) -> object:
        self.made.append((node, reason))
        return type("Outcome", (), {"status": "done"})()


def product(path: str, hours: float) -> dict:
    """What the node Epilog does after ingest (epilog/hook.py step 6 and
    :func:`gpuguard.epilog.handover.hand_over` on a single host): the summary, saved; this
    node's part built from the store and encoded; decoded and judged by
    :func:`gpuguard.epilog.judge.judge_parts` in the same store. ``judge_here`` is
    mirrored only to pass a judgment time (the baselines are dated ``T0``)."""
    import logging

    from gpuguard.config import Config, load
    from gpuguard.epilog import handover
    from gpuguard.epilog import part as part_mod
    from gpuguard.epilog.judge import judge_parts
    from gpuguard.epilog.summary import save_summary, summarize_job
    from gpuguard.store import open_store

    # The modules the judge imports lazily (numpy among them), before the clock starts as
    # the reference's numpy import is: both sides time their work, not their imports
    # (~0.17 s CPU here; an Epilog pays them either way).
    import gpuguard.epilog.causes
    import gpuguard.epilog.compare
    import gpuguard.epilog.part_codec
    import gpuguard.epilog.steptable
    import gpuguard.epilog.verdict  # noqa: F401

    cfg: Config = load(None)
    cfg.values["paths"]["store"] = path
    cfg.values["paths"]["cluster_store"] = ""
    log = logging.getLogger("bench")
    s = open_store(path)
    with s.tx():  # a fresh judgment each run (the judge skips a job already judged)
        for table in ("cluster_jobs", "job_summaries"):
            s.db.execute(f"delete from {table} where job_id = '100'")
    job = {"user": "alice", "uid": 1000, "account": "a", "partition": "gpu", "comment": "gpuguard:template=bench",
           "num_nodes": 1, "nodelist": "n1", "exit_code_raw": 0}
    end = T0 + hours * 3600 + 5
    t = time.perf_counter()
    c0 = time.process_time()
    summ = summarize_job(s, "100", "n1", exit_status_raw=0, collector_status="ok", ended_at=end,
                         window_align_s=float(cfg.get("verdict", "short_window_s")))
    save_summary(s, summ)
    c_sum = time.process_time() - c0
    blob, _ws = handover.encode_part(s, "100", cfg, "n1", job, summ)
    c_part = time.process_time() - c0
    drains = _Drains()
    doc = part_mod.decode_part(blob)
    res = judge_parts(s, "100", {"n1": doc}, cfg=cfg, meta=dict(job, job_id="100", nodes=["n1"]),
                      slurm=None, log=log, set_comment=False, drainer=drains, now=end + 5)
    wall = time.perf_counter() - t
    cpu = time.process_time() - c0
    s.close()
    v = res.verdict or {}
    return {"wall_s": wall, "cpu_s": cpu, "summary_cpu_s": c_sum, "part_cpu_s": c_part - c_sum,
            "judge_cpu_s": cpu - c_part,
            "what": f"{summ.sample_count} samples, part {len(blob)} B at {doc.get('window_s'):g} s windows, "
                    f"cause {v.get('cause')}, drains {drains.made}"}


def numpy_ref(path: str, hours: float) -> dict:
    import sqlite3

    import numpy as np

    conn = sqlite3.connect(path)
    t = time.perf_counter()
    c0 = time.process_time()
    lo = T0 - 1
    hi = T0 + hours * 3600 + 5
    out = {}
    pooled_u = []
    for sid, t0 in conn.execute("select id, t0 from gpu_series where job_id = '100' and node = 'n1'").fetchall():
        a = np.array(conn.execute(
            "select t_ms, gpu_util_pct, mem_util_pct, mem_used_mib, power_w_x10, temp_c, sm_clock_mhz, "
            "clock_event_mask from gpu_samples where sid = ? and t_ms between ? and ?",
            (sid, (lo - t0) * 1000, (hi - t0) * 1000)).fetchall(), dtype=np.float64)
        out[sid] = (a[:, 1].mean(), a[:, 2].mean(), a[:, 3].max(), a[:, 4].mean() / 10, a[:, 5].max(),
                    a[:, 6].mean(), float(np.median(np.diff(a[:, 0]))))
        pooled_u.append(a[:, 1])
    u = np.concatenate(pooled_u)
    out["p95"] = float(np.percentile(u, 95, method="inverted_cdf"))
    st = np.array([r[0] for r in conn.execute("select step_time_s from steps where job_id = '100' and node = 'n1'")])
    out["steps"] = [float(np.percentile(st, p, method="inverted_cdf")) for p in (50, 95, 99)]
    wall = time.perf_counter() - t
    return {"wall_s": wall, "cpu_s": time.process_time() - c0, "what": f"{len(u)} samples"}


def child(mode: str, path: str, hours: float) -> None:
    res = (product if mode == "product" else numpy_ref)(path, hours)
    res["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(res))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], float(sys.argv[4]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("hours", nargs="*", type=float, default=[24.0, 168.0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    for hours in args.hours:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "node.db")
            t = time.perf_counter()
            build(path, hours)
            print(f"{hours:g} h x {GPUS} GPUs at 1 s: store built in {time.perf_counter() - t:.0f} s "
                  f"({os.path.getsize(path) / 2**20:.0f} MiB)")
            res: dict[str, list[dict]] = {"product": [], "numpy": []}
            for _ in range(args.runs):
                for mode in ("product", "numpy"):
                    p = subprocess.run([sys.executable, __file__, "--child", mode, path, str(hours)],
                                       capture_output=True, text=True, check=True)
                    res[mode].append(json.loads(p.stdout.strip().splitlines()[-1]))
            med = {m: statistics.median(r["wall_s"] for r in rs) for m, rs in res.items()}
            cpu = {m: statistics.median(r["cpu_s"] for r in rs) for m, rs in res.items()}
            rss = {m: max(r["rss_mib"] for r in rs) for m, rs in res.items()}
            stage = {k: statistics.median(r[f"{k}_cpu_s"] for r in res["product"]) for k in ("summary", "part", "judge")}
            print(f"  product (summary + part + judge): median wall {med['product']:.2f} s, "
                  f"CPU {cpu['product']:.2f} s (summary {stage['summary']:.2f} s, part {stage['part']:.2f} s, judge "
                  f"{stage['judge']:.2f} s), peak RSS {rss['product']:.0f} MiB  [{res['product'][0]['what']}]")
            print(f"  numpy reference (summary only): median wall {med['numpy']:.2f} s, CPU {cpu['numpy']:.2f} s, "
                  f"peak RSS {rss['numpy']:.0f} MiB")
            print(f"  ratio product/numpy = {med['product'] / med['numpy']:.2f} wall, "
                  f"{cpu['product'] / cpu['numpy']:.2f} CPU, over {args.runs} runs (load average "
                  f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
