"""Benchmark: bytes per GPU-sample in the store file, product and references side by side.

Writes H hours of 1 s samples of 8 GPUs the way the collector does (one transaction per
10 s flush, through ``Store.insert_many("samples", ...)``, which also closes whole minutes:
:mod:`gpuguard.live_minutes`), checkpoints the WAL and divides the file size by the number
of GPU-samples: while the job runs, and after its Epilog dropped the closed minutes (the
pages in use; the free ones take the next job's rows). References in the same run, same values:

* ``wide``: the pre-compaction ``samples`` table (float columns, GPU UUID, job and node
  repeated on every row, two secondary indexes) — what the store used before;
* ``lean``: a plain rowid table of integer columns with one (sid, at) index.

Then folds everything into per-minute aggregates (``gpuguard.retention.prune``) and prints
bytes per GPU-second of the minute tier. A figure, not a test.

    .venv/bin/python bench/store_bytes.py [HOURS]   (default 6)
"""

from __future__ import annotations

import os
import random
import sqlite3
import sys
import tempfile

import gpuguard.collector.schema
import gpuguard.epilog.schema  # noqa: F401  (steps, summaries, verdicts)
from gpuguard import live_minutes
from gpuguard.retention import prune
from gpuguard.store import open_store

T0 = 1_764_460_800.0
GPUS = 8


def rows_at(i: int, rnd: random.Random) -> list[dict]:
    out = []
    for g in range(GPUS):
        out.append({"job_id": "123456", "node": "gpu-node-017", "at": T0 + i + rnd.random() * 0.004, "gpu_index": g,
                    "gpu_uuid": f"GPU-3a9e1c52-7b4f-d0a8-61e2-0f5c9b8d4e0{g}",
                    "gpu_util_pct": float(rnd.choice((97, 98, 99, 100, 100, 35))),
                    "mem_util_pct": float(rnd.randint(30, 60)), "mem_used_mib": 61000.0 + rnd.randint(0, 2000),
                    "power_w": 550 + rnd.random() * 150, "temp_c": float(rnd.randint(55, 75)),
                    "sm_clock_mhz": float(rnd.choice((1980, 1980, 1965, 1755))),
                    "clock_event_mask": rnd.choice((0, 0, 0, 4)),
                    "ecc_volatile_uncorrected": 0 if i % 60 == 0 else None,
                    "pcie_replay_count": 0 if i % 60 == 0 else None})
    return out


def size(path: str, conn: sqlite3.Connection) -> int:
    conn.execute("pragma wal_checkpoint(truncate)")
    return os.path.getsize(path)


def main() -> None:
    hours = float(sys.argv[1]) if len(sys.argv) > 1 else 6.0
    n_ticks = int(hours * 3600)
    n = n_ticks * GPUS
    with tempfile.TemporaryDirectory() as tmp:
        prod = open_store(os.path.join(tmp, "prod.db"))
        base = size(prod.path, prod.db.conn)
        wide = sqlite3.connect(os.path.join(tmp, "wide.db"), isolation_level=None)
        wide.execute("pragma journal_mode=wal")
        wide.execute("create table samples (job_id text, node text, at float, gpu_index integer, gpu_uuid text, "
                     "gpu_util_pct float, mem_util_pct float, mem_used_mib float, power_w float, temp_c float, "
                     "sm_clock_mhz float, mem_clock_mhz float, clock_event_mask integer, "
                     "ecc_volatile_uncorrected integer, pcie_replay_count integer)")
        wide.execute("create index i1 on samples (job_id, at)")
        wide.execute("create index i2 on samples (job_id, node, gpu_index, at)")
        lean = sqlite3.connect(os.path.join(tmp, "lean.db"), isolation_level=None)
        lean.execute("pragma journal_mode=wal")
        lean.execute("create table s (sid integer, at integer, u integer, mu integer, mem integer, p integer, "
                     "t integer, sm integer, mask integer)")
        lean.execute("create index i on s (sid, at)")
        rnd = random.Random(1)
        batch: list[dict] = []
        for i in range(n_ticks):
            batch += rows_at(i, rnd)
            if len(batch) >= 10 * GPUS:
                prod.insert_many("samples", batch)
                wide.execute("begin")
                wide.executemany("insert into samples values (?,?,?,?,?,?,?,?,?,?,?,2619.0,?,?,?)",
                                 [(r["job_id"], r["node"], r["at"], r["gpu_index"], r["gpu_uuid"], r["gpu_util_pct"],
                                   r["mem_util_pct"], r["mem_used_mib"], r["power_w"], r["temp_c"], r["sm_clock_mhz"],
                                   r["clock_event_mask"], r["ecc_volatile_uncorrected"], r["pcie_replay_count"])
                                  for r in batch])
                wide.execute("commit")
                lean.execute("begin")
                lean.executemany("insert into s values (?,?,?,?,?,?,?,?,?)",
                                 [(r["gpu_index"] + 1, int(r["at"]), int(r["gpu_util_pct"]), int(r["mem_util_pct"]),
                                   int(r["mem_used_mib"]), int(r["power_w"] * 10), int(r["temp_c"]),
                                   int(r["sm_clock_mhz"]), r["clock_event_mask"]) for r in batch])
                lean.execute("commit")
                batch = []
        p = (size(prod.path, prod.db.conn) - base) / n
        w = size(os.path.join(tmp, "wide.db"), wide) / n
        ln = size(os.path.join(tmp, "lean.db"), lean) / n
        # the Epilog drops the job's closed minutes once its summary and part are written
        # (gpuguard.live_minutes.drop_job): their pages are free for the next job's rows
        conn = prod.db.conn
        with prod.tx():
            live_minutes.drop_job(conn, "123456", "gpu-node-017")
        in_use = size(prod.path, conn) - conn.execute("pragma freelist_count").fetchone()[0] * \
            conn.execute("pragma page_size").fetchone()[0]
        kept = (in_use - base) / n
        print(f"{hours:g} h x {GPUS} GPUs at 1 s = {n} GPU-samples")
        print(f"  gpuguard compact store : {kept:6.1f} B per GPU-sample (goal <= 32), after the Epilog; "
              f"{p:.1f} B while the job runs (its closed minutes included)")
        print(f"  old wide table+indexes : {w:6.1f} B   ratio product/old  = {kept / w:.2f}")
        print(f"  lean integer table     : {ln:6.1f} B   ratio product/lean = {kept / ln:.2f}")
        before = size(prod.path, prod.db.conn)
        prune(prod, now=T0 + 400 * 86400, raw_days=14, minutes_days=10_000)
        prod.db.conn.execute("vacuum")
        after = size(prod.path, prod.db.conn)
        mins = prod.query("select count(*) n from gpu_minutes")[0]["n"]
        per_s = (after - base) / (n_ticks * GPUS)
        print(f"  after folding into {mins} GPU-minutes: {after - base} B = {per_s:.2f} B per GPU-second "
              f"(goal <= 1; raw was {before - base} B)")
        prod.close()


if __name__ == "__main__":
    main()
