"""Benchmark: training-record ingest of a long job, incremental (collector during the job,
Epilog the tail) against one read of everything at the end (the Epilog before).

Writes H hours of step records (default 168 = 7 days) of R ranks (default 1) at one step
a second, ~250 bytes each (phases, loss, grad norm: what the training API writes), in
``--chunk-s`` pieces (default 3600 s; the collector looks every liveness period, 15 s:
the per-record cost is the same, the per-call overhead is printed separately). After each
piece the collector's calls (:func:`gpuguard.collector.ingest_tail.ingest_new_records`,
``final=False``, with the collector's per-call caps) run until they have caught up; the last 15 s of records and an unterminated line are then
written and the Epilog's call (``final=True``) times the tail alone.

Reference, same files, one run: what the Epilog did before, :func:`read_job_records` +
``save_training_records`` of the whole directory at the end, caps lifted (with the
default caps it keeps the first 100,000 records and marks the job truncated).

Prints CPU seconds (the machine is shared; wall is printed too), the collector's share
of a core, the Epilog's tail against the 20 s budget, and the ratio. A figure, not a test.

    .venv/bin/python bench/ingest_long.py [--hours 168] [--ranks 1] [--chunk-s 3600] [--no-reference]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import tempfile
import time

import gpuguard.epilog.schema  # noqa: F401  (steps, checkpoints, train_offsets)
from gpuguard.collector.ingest import read_job_records
from gpuguard.collector.ingest_tail import TICK_MAX_BYTES, TICK_MAX_RECORDS, ingest_new_records
from gpuguard.epilog.training_rows import save_training_records
from gpuguard.store import open_store

T0 = 1_764_460_800.0
TAIL_S = 15


def _lines(rnd: random.Random, rank: int, k0: int, k1: int) -> str:
    out = []
    for k in range(k0, k1):
        st = 0.95 + rnd.random() * 0.1
        out.append(json.dumps({"v": 1, "kind": "step", "rank": rank, "t": T0 + k + 1, "step": k, "step_time_s": st,
                               "samples": 64, "tokens": 131072, "loss": 2.0 + rnd.random(), "grad_norm": 1.0,
                               "phases": {"data_wait_s": st * 0.05, "fwd_bwd_s": st * 0.7, "comm_s": st * 0.2,
                                          "optim_s": st * 0.05}}))
    return "\n".join(out) + "\n"


def _cpu() -> float:
    return time.process_time()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hours", type=float, default=168.0)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--chunk-s", type=int, default=3600)
    ap.add_argument("--no-reference", action="store_true")
    args = ap.parse_args()
    n = int(args.hours * 3600)
    rnd = random.Random(1)
    uid = os.getuid()
    with tempfile.TemporaryDirectory() as tmp:
        jd = os.path.join(tmp, "job")
        os.mkdir(jd)
        st = open_store(os.path.join(tmp, "node.db"))
        now = T0 + n + 3600
        coll_cpu = coll_wall = 0.0
        calls = 0
        written = 0
        body = n - TAIL_S
        for k0 in range(0, body, args.chunk_s):
            k1 = min(body, k0 + args.chunk_s)
            for r in range(args.ranks):
                with open(os.path.join(jd, f"train.rank{r}.jsonl"), "a") as fh:
                    written += fh.write(_lines(rnd, r, k0, k1))
            c, w = _cpu(), time.perf_counter()
            while True:  # the collector's ticks, with its per-call caps, until it has caught up
                calls += 1
                if not ingest_new_records(st, jd, "1", "n1", uid, final=False, now=now, max_records=TICK_MAX_RECORDS,
                                          max_total_bytes=TICK_MAX_BYTES, max_file_bytes=TICK_MAX_BYTES).steps:
                    break
            coll_cpu += _cpu() - c
            coll_wall += time.perf_counter() - w
        c = _cpu()
        for _ in range(20):  # a look with nothing new: the per-call overhead
            ingest_new_records(st, jd, "1", "n1", uid, final=False, now=now)
        idle_call_s = (_cpu() - c) / 20
        for r in range(args.ranks):
            with open(os.path.join(jd, f"train.rank{r}.jsonl"), "a") as fh:
                written += fh.write(_lines(rnd, r, body, n) + '{"v": 1, "kind": "step", "rank": ')
        c, w = _cpu(), time.perf_counter()
        res = ingest_new_records(st, jd, "1", "n1", uid, final=True, now=now)
        tail_cpu, tail_wall = _cpu() - c, time.perf_counter() - w
        stored = st.db.conn.execute("select count(*) from steps").fetchone()[0]
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        st.close()
        per_rec_us = coll_cpu / max(1, stored) * 1e6
        print(f"{args.hours:g} h x {args.ranks} rank(s) at 1 step/s: {n * args.ranks} records, "
              f"{written / 2**20:.0f} MiB of files")
        print(f"  collector (final=False), {calls} calls: CPU {coll_cpu:.1f} s (wall {coll_wall:.1f} s), "
              f"{per_rec_us:.1f} us/record; a look with nothing new {idle_call_s * 1e3:.2f} ms: every 15 s "
              f"with {args.ranks} rank(s) at 1 step/s = "
              f"{100 * (per_rec_us * 1e-6 * args.ranks + idle_call_s / 15):.3f} % of a core")
        print(f"  Epilog tail (final=True): {len(res.steps)} records + an unterminated line "
              f"(malformed {res.malformed}, truncated {res.truncated}): CPU {tail_cpu * 1e3:.1f} ms "
              f"(wall {tail_wall * 1e3:.1f} ms); stored {stored} of {n * args.ranks}; peak RSS {rss:.0f} MiB")
        if args.no_reference:
            return
        st2 = open_store(os.path.join(tmp, "ref.db"))
        c, w = _cpu(), time.perf_counter()
        full = read_job_records(jd, uid, max_file_bytes=2**40, max_total_bytes=2**40, max_records=2**40, now=now)
        save_training_records(st2, "1", "n1", full)
        ref_cpu, ref_wall = _cpu() - c, time.perf_counter() - w
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        st2.close()
        print(f"  reference, whole directory read at the end (caps lifted): {len(full.steps)} records, "
              f"CPU {ref_cpu:.1f} s (wall {ref_wall:.1f} s), peak RSS {rss:.0f} MiB")
        print(f"  Epilog ingest: tail {tail_cpu:.3f} s vs whole {ref_cpu:.1f} s CPU (ratio {ref_cpu / tail_cpu:.0f}x); "
              f"collector total / reference = {coll_cpu / ref_cpu:.2f} (load average {os.getloadavg()[0]:.1f} on "
              f"{os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
