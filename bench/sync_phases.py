"""Benchmark: where the wall time of a parallel ``report sync --from-file`` of N synthetic
sacct -P jobs goes, and the floor the store's own work sets.

Two runs on the same file (bench/reports_1m.py's trace, as bench/sync_1m.py):

1. **the import** (:func:`gpuguard.reports.sync.import_file`, parallel path), with its
   phases timed through wrappers around :mod:`gpuguard.reports.sync_bulk`: the workers'
   CPU (parse and staging, summed over chunks), the importing process's wait for the next
   chunk, its upserts, each index rebuild, and the commit;
2. **the store alone**: every chunk parsed first (in the same worker pool), then only the
   importing process's work timed on an empty store (deserialize, upsert, index rebuilds,
   commit) with nothing else running. However fast the parse were, the import could not
   take less wall time than this on the same machine.

A figure, not a test. Goal (issue 12): 1 M jobs <= 20 s.

Measured 2026-12-01 22:12 UTC (load average 2.3): import wall 45.4 s; the workers' parse and
staging 47.2 s of CPU (2 workers), the index rebuilds after the last chunk 10.6 s (start
2.3, end 1.9, usage end 1.9, by_account 4.1, pending 0.4); the store's work alone 21.3 s
(upserts 7.9 s, index rebuilds 9.5 s, commit 3.9 s).

    .venv/bin/python bench/sync_phases.py [--jobs 1000000]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from zoneinfo import ZoneInfo

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from reports_1m import SYNC_AT, generate  # noqa: E402

import gpuguard.reports.sync_bulk as sb  # noqa: E402
from gpuguard.reports.sync import import_file  # noqa: E402
from gpuguard.store import open_store  # noqa: E402

PHASES: dict[str, float] = {}


def _add(key: str, seconds: float) -> None:
    PHASES[key] = PHASES.get(key, 0.0) + seconds


def _instrument() -> None:
    """Wrap the parallel import's steps so each one's time lands in :data:`PHASES`."""
    parse, rebuild, load = sb.parse_chunk, sb.rebuild_indexes, sb.load_chunks

    def timed_parse(task):  # runs in a worker: its CPU travels back on the chunk
        c = time.process_time()
        chunk = parse(task)
        chunk.tally.bench_cpu_s = time.process_time() - c
        return chunk

    def timed_rebuild(conn, indexes):
        for name, sql in indexes:
            t = time.perf_counter()
            rebuild(conn, [(name, sql)])
            _add(f"index {name}", time.perf_counter() - t)

    def timed_chunks(chunks):
        it = iter(chunks)
        while True:
            t = time.perf_counter()
            try:
                chunk = next(it)
            except StopIteration:
                return
            _add("wait for a chunk", time.perf_counter() - t)
            _add("workers' CPU (parse + staging)", chunk.tally.bench_cpu_s)
            yield chunk

    def timed_load(store, chunks, *args, **kw):
        t = time.perf_counter()
        out = load(store, timed_chunks(chunks), *args, **kw)
        _add("load (all of the importing process's part)", time.perf_counter() - t)
        return out

    sb.parse_chunk, sb.rebuild_indexes, sb.load_chunks = timed_parse, timed_rebuild, timed_load


def store_alone(src: str, db: str) -> dict[str, float]:
    """Parse every chunk of ``src`` first, then time only the store's work into ``db``."""
    fd = os.open(src, os.O_RDONLY)
    try:
        tasks = sb.file_tasks(src, os.path.getsize(src), ZoneInfo("UTC"), "", fd)
        with sb.ChunkPool(tasks, max(2, sb.workers())) as pool:
            chunks = list(pool.chunks())
    finally:
        os.close(fd)
    store = open_store(db)
    conn = store.db.conn
    conn.execute(f"PRAGMA cache_size = {-sb.STORE_CACHE_KIB}")
    conn.execute(f"ATTACH DATABASE ':memory:' AS {sb.STAGE}")
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    conn.execute("BEGIN IMMEDIATE")
    indexes = sb.set_indexes_aside(conn)
    upsert = sb.staged_upsert_sql()
    t = time.perf_counter()
    for n, chunk in enumerate(chunks):
        conn.deserialize(chunk.data, name=sb.STAGE)
        conn.execute(upsert + f" /* chunk {n} */", {"synced_at": SYNC_AT, "source": src})
    out["upserts"] = time.perf_counter() - t
    t = time.perf_counter()
    sb.rebuild_indexes(conn, indexes)
    out["index rebuilds"] = time.perf_counter() - t
    t = time.perf_counter()
    conn.execute("COMMIT")
    out["commit"] = time.perf_counter() - t
    out["total"] = time.perf_counter() - t0
    conn.execute(f"DETACH DATABASE {sb.STAGE}")
    store.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=1_000_000)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as d:
        src = os.path.join(d, f"sacct-{a.jobs}.txt")
        generate(src, a.jobs)
        _instrument()
        store = open_store(os.path.join(d, "import.db"))
        t = time.perf_counter()
        res = import_file(store, src, tz=ZoneInfo("UTC"), synced_at=SYNC_AT)
        wall = time.perf_counter() - t
        store.close()
        assert res.jobs == a.jobs and not res.malformed, (res.jobs, res.malformed[:3])
        print(f"{a.jobs:,} jobs, {sb.workers()} workers: import wall {wall:.2f} s "
              f"(load average {os.getloadavg()[0]:.1f})")
        own = PHASES["load (all of the importing process's part)"] - PHASES["wait for a chunk"]
        PHASES["its upserts and commit"] = own - sum(v for k, v in PHASES.items() if k.startswith("index "))
        for key, seconds in PHASES.items():
            print(f"  {key:<44} {seconds:6.2f} s")
        alone = store_alone(src, os.path.join(d, "alone.db"))
        print("the store's work alone (chunks parsed beforehand): "
              + ", ".join(f"{k} {v:.2f} s" for k, v in alone.items())
              + f"; {100 * alone['total'] / wall:.0f} % of the import's wall time")


if __name__ == "__main__":
    main()
