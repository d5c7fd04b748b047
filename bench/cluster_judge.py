"""Cluster mode: spool part size, the job judge at scale, cluster ingest throughput.

Prints figures and ratios against the issue's bounds; asserts nothing about time.

1. one node's spool part for a 24 h job (8 GPUs sampled every 10 s, 8 ranks at one
   step per second): bytes (bound 1 MB) and build time, beside the previous format's
   (version 1, gzip JSON, still read) size and decode time as the reference;
2. the job judge of an N-node x 8-GPU x 24 h job from its N parts (``--judge-nodes``,
   default 64; a comma list measures several), in a child process (decode every part,
   build the judge's view, judge, record): wall and CPU seconds (bound 5 s) and the
   child's peak RSS (bound 1 GB), with the load average (the machine may be shared);
3. the AdminComment of 1, 8 and 64 nodes x 8 GPUs: bytes (typical jobs <= 1 kB);
4. ``cluster ingest`` over N queued single-node jobs (``--jobs``, default 10,000; 4 GPUs,
   30 min each): jobs/s, cluster store growth per job, and ``sacctmgr`` calls per job
   (a stub that counts its calls; bound: exactly 1).

    python bench/cluster_judge.py [--jobs 10000] [--judge-nodes 64|1,8,64] [--judge-runs 4]
                                  [--skip-judge] [--skip-ingest]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import resource
import subprocess
import sys
import tempfile
import time

from gpuguard.epilog import admincomment
from gpuguard.epilog import part as part_mod
from gpuguard.epilog.jobdata import GpuSeries, JobData, StepRec

LOG = logging.getLogger("bench")
T0 = 1767225600.0
DAY = 86400.0


def node_data(job_id: str, node: str, *, hours: float = 24.0, gpus: int = 8, ranks: int = 8,
              interval_s: float = 10.0, step_s: float = 1.0, seed: int = 0, clock: float = 1755.0) -> JobData:
    """A busy training job on one node, as :func:`gpuguard.epilog.jobdata.load_job` returns it."""
    rng = random.Random(seed)
    span = hours * 3600.0
    n = int(span / interval_s)
    gl = []
    for g in range(gpus):
        s = GpuSeries(node, g, f"GPU-{node}-{g}")
        s.t = [T0 + i * interval_s for i in range(n)]
        s.util = [96.0 + rng.uniform(-2, 2) for _ in range(n)]
        s.mem = [52000.0 + rng.uniform(-50, 50) for _ in range(n)]
        s.power = [560.0 + rng.uniform(-15, 15) for _ in range(n)]
        s.temp = [64.0 + rng.uniform(-1.5, 1.5) for _ in range(n)]
        s.clock = [clock + rng.uniform(-15, 15) for _ in range(n)]
        s.mask = [0] * n
        s.ecc_unc = [0] * n
        gl.append(s)
    steps = []
    ns = int(span / step_s)
    for r in range(ranks):
        for i in range(ns):
            st = step_s * (1 + rng.gauss(0, 0.03))
            steps.append(StepRec(node, r, T0 + (i + 1) * step_s, st, 32.0, 32.0 * 2048, 0.02 * st, 0.8 * st,
                                 0.12 * st, 0.05 * st))
    steps.sort(key=lambda s: s.t)
    return JobData(job_id, [node], T0, T0 + span, gl, steps, [s.t for s in steps], {}, [25.0] * 24, [], [],
                   {s.key: 81559.0 for s in gl})


def encode(data: JobData, node: str, window_s: float = 60.0) -> tuple[bytes, float]:
    job = {"comment": "gpuguard:template=bench", "num_nodes": 64, "exit_code_raw": 0}
    return part_mod.encode_part(lambda ws: part_mod.build_part(data, node, window_s=ws, job=job, summary=None),
                                window_s)


def encode_v1(doc: dict) -> bytes:
    """The previous release's encoding of a part dict (gzip JSON, version 1): the reference."""
    import gzip

    return gzip.compress(json.dumps(dict(doc, v=1), separators=(",", ":"), allow_nan=False).encode(),
                         compresslevel=6, mtime=0)


def bench_part() -> bytes:
    t = time.perf_counter()
    data = node_data("1", "gpu001")
    t_data = time.perf_counter() - t
    t = time.perf_counter()
    blob, ws = encode(data, "gpu001")
    dt = time.perf_counter() - t
    print(f"part, 24 h x 8 GPUs (10 s samples) x 8 ranks (1 step/s): {len(blob):,} bytes at {ws:g} s windows "
          f"(bound 1,000,000: {len(blob) / 1e6:.2f}x); built and compressed in {dt:.2f} s "
          f"(synthetic series {t_data:.1f} s)")
    v1 = encode_v1(part_mod.build_part(data, "gpu001", window_s=ws, job={}, summary=None))
    t = time.perf_counter()
    part_mod.decode_part(blob)
    d2 = time.perf_counter() - t
    t = time.perf_counter()
    part_mod.decode_part(v1)
    d1 = time.perf_counter() - t
    print(f"  reference, version 1 (gzip JSON) of the same part: {len(v1):,} bytes (v2/v1 {len(blob) / len(v1):.2f}); "
          f"decoded in {d2 * 1000:.0f} ms (v2) vs {d1 * 1000:.0f} ms (v1, to the same arrays): {d1 / d2:.1f}x")
    return blob


def peak_rss_bytes() -> int:
    """This process's peak resident set: ``VmHWM`` of its own memory map (``ru_maxrss``
    would carry over the forking parent's peak across ``exec``: Linux keeps the larger)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _judge_child(spool: str, store_path: str, job_id: str, nodes: list[str]) -> None:
    """Runs in a fresh process: what the controller's worker does for one job."""
    from gpuguard.config import from_dict
    from gpuguard.epilog.judge import judge_parts
    from gpuguard.store import open_store

    cfg = from_dict({"slurm": {"drain": False}, "cluster": {"admin_comment": False}})
    store = open_store(store_path)
    t, c = time.perf_counter(), time.process_time()
    parts = part_mod.read_parts(spool, job_id)
    t_read = time.perf_counter() - t
    res = judge_parts(store, job_id, parts, cfg=cfg, meta={"job_id": job_id, "nodes": nodes, "exit_code_raw": 0},
                      slurm=None, log=LOG, set_comment=False)
    dt, cpu = time.perf_counter() - t, time.process_time() - c
    rss = peak_rss_bytes()
    print(json.dumps({"s": dt, "cpu_s": cpu, "read_s": t_read, "rss": rss, "cause": res.verdict["cause"],
                      "state": res.verdict["state"]}))


def bench_judge(tmp: str, n_nodes: int = 64, runs: int = 4) -> None:
    nodes = [f"gpu{i:03d}" for i in range(1, n_nodes + 1)]
    spool = os.path.join(tmp, "spool")
    os.makedirs(spool)
    store_path = os.path.join(tmp, "cluster.db")
    print(f"judge, {n_nodes} nodes x 8 GPUs x 24 h ({runs} runs of one template: the first 3 learning, then "
          "judged):")
    from gpuguard.epilog import part_codec

    for k in range(runs):
        job_id = str(1000 + k)
        # one node's part built as its Epilog would, then given each node's name (building
        # 64 x 24 h of synthetic series would take the bench half an hour)
        doc = part_mod.decode_part(encode(node_data(job_id, "x", seed=k), "x")[0])
        for node in nodes:
            doc["node"] = node
            part_mod.write_part(spool, job_id, node, part_codec.encode(doc))
        out = subprocess.run([sys.executable, __file__, "--judge-child", spool, store_path, job_id, ",".join(nodes)],
                             capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
        print(f"  run {k + 1}: {r['state']}/{r['cause']}: {r['s']:.2f} s wall, {r['cpu_s']:.2f} s CPU (reading "
              f"{n_nodes} parts {r['read_s']:.2f} s; bound 5 s: wall {r['s'] / 5:.2f}x, CPU {r['cpu_s'] / 5:.2f}x), "
              f"peak RSS {r['rss'] / 2**20:.0f} MiB (bound 1 GiB: {r['rss'] / 2**30:.2f}x); load average {load}")


def bench_admin_comment() -> None:
    v = {"cause": "straggler-node", "state": "judged", "template": "llama-70b-pretrain", "baseline_runs": 20,
         "summary": "node gpu017 compute time per step 41% above the median of the other nodes",
         "evidence": {"node": "gpu017"}, "comparisons": [
             {"metric": "step_time_p50_s", "value": 1.61, "median": 1.2, "rel_change": 0.34, "flagged": True}]}
    s = {"gpu_util_mean_pct": 93.25, "power_mean_w": 612.4, "sm_clock_mean_mhz": 1755.2, "temp_max_c": 71.0,
         "mem_used_peak_mib": 61234.0, "step_time_p50_s": 1.2345,
         "gpus": [{"gpu_util_mean_pct": 90.0 + g * 0.7} for g in range(8)]}
    rng = random.Random(1)

    def node(i: int) -> dict:  # every node's figures differ, as they do (identical ones compress away)
        return {k: (x * rng.uniform(0.97, 1.03) if isinstance(x, float) else
                    [{"gpu_util_mean_pct": rng.uniform(85, 99)} for _ in range(8)]) for k, x in s.items()}
    sizes = {n: len(admincomment.encode(admincomment.build("123456", v, {f"gpu{i:03d}": node(i) for i in range(n)},
                                                           []))) for n in (1, 8, 64)}
    print("AdminComment (v2, base32 of zlib JSON): " + ", ".join(f"{n} node(s) x 8 GPUs {b:,} bytes"
                                                             for n, b in sizes.items())
          + f" (typical bound 1 kB: 8 nodes {sizes[8] / 1000:.2f}x; slurmdbd keeps 65,535)")


def bench_ingest(tmp: str, jobs: int) -> None:
    from gpuguard.config import from_dict
    from gpuguard.epilog.cluster import ingest, write_manifest
    from gpuguard.slurm import SlurmCli
    from gpuguard.store import open_store

    spool = os.path.join(tmp, "ispool")
    bindir = os.path.join(tmp, "bin")
    os.makedirs(bindir)
    counter = os.path.join(tmp, "sacctmgr.calls")
    with open(os.path.join(bindir, "sacctmgr"), "w") as fh:
        fh.write(f"#!/bin/sh\necho \"$5\" >> {counter}\n")
    os.chmod(os.path.join(bindir, "sacctmgr"), 0o755)
    from gpuguard.epilog import part_codec

    t = time.perf_counter()
    docs = {}
    for seed in range(8):  # eight distinct runs, reused: the judge's cost does not depend on which
        data = node_data("x", "n1", hours=0.5, gpus=4, ranks=4, interval_s=10.0, step_s=1.0, seed=seed)
        # built once as a node Epilog builds it, then given each job's id and node (as
        # bench_judge does): building 10,000 parts from series would take the bench an hour
        docs[seed] = part_mod.decode_part(encode(data, "n1")[0])
    for j in range(jobs):
        job_id = str(100000 + j)
        node = f"n{j % 97 + 1}"
        doc = docs[j % 8]
        doc["job_id"], doc["node"] = job_id, node
        part_mod.write_part(spool, job_id, node, part_codec.encode(doc))
        write_manifest(spool, job_id, {"job_id": job_id, "nodes": [node], "user": "u", "account": "a",
                                       "comment": "gpuguard:template=ingest", "exit_code_raw": 0})
    t_prep = time.perf_counter() - t
    old = time.time() - 3600
    for name in os.listdir(spool):
        for f in os.listdir(os.path.join(spool, name)):
            os.utime(os.path.join(spool, name, f), (old, old))
    cfg = from_dict({"paths": {"spool_dir": spool}, "slurm": {"bin_dir": bindir, "drain": False}})
    store_path = os.path.join(tmp, "ingest.db")
    store = open_store(store_path)
    store.db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    size0 = os.path.getsize(store_path)
    t = time.perf_counter()
    res = ingest(cfg, store, log=LOG, slurm=SlurmCli(bindir), retry_sleep_s=0)
    dt = time.perf_counter() - t
    store.db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.close()
    growth = (os.path.getsize(store_path) - size0) / max(1, res.judged)
    with open(counter) as fh:
        calls = fh.read().split()
    per_job = {c: calls.count(c) for c in set(calls)}
    print(f"cluster ingest: {jobs:,} queued single-node jobs (4 GPUs, 30 min; spool prepared in {t_prep:.0f} s): "
          f"{res.line()}; {dt:.1f} s = {res.judged / dt:.1f} jobs/s")
    print(f"  cluster store growth {growth:,.0f} bytes/job; sacctmgr calls {len(calls):,} for {res.judged:,} jobs, "
          f"per job min {min(per_job.values())} max {max(per_job.values())} (bound: exactly 1)")
    t = time.perf_counter()
    store = open_store(store_path)
    res2 = ingest(cfg, store, log=LOG, slurm=SlurmCli(bindir), retry_sleep_s=0)
    store.close()
    with open(counter) as fh:
        calls2 = len(fh.read().split())
    print(f"  second pass: {res2.line()} in {time.perf_counter() - t:.2f} s; sacctmgr calls now {calls2:,}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--judge-child":
        _judge_child(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5].split(","))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=10000)
    ap.add_argument("--skip-judge", action="store_true")
    ap.add_argument("--skip-ingest", action="store_true")
    ap.add_argument("--judge-nodes", default="64",
                    help="nodes of the judged job (the issue's case: 64); a comma list (1,8,64) measures each")
    ap.add_argument("--judge-runs", type=int, default=4, help="runs of its template (4: the last is judged)")
    a = ap.parse_args()
    bench_part()
    bench_admin_comment()
    with tempfile.TemporaryDirectory() as tmp:
        if not a.skip_judge:
            for n in (int(x) for x in a.judge_nodes.split(",")):
                sub = os.path.join(tmp, f"judge{n}")
                os.makedirs(sub)
                bench_judge(sub, n, a.judge_runs)
        if not a.skip_ingest:
            bench_ingest(tmp, a.jobs)


if __name__ == "__main__":
    main()
