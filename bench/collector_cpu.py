"""Benchmark: the collector's CPU at a 1 s interval through the fake pynvml, against the
minimal loop that makes the same NVML calls and stores the same rows.

Both sides run in their own process, alternately, three times each, for the same number
of ticks of a simulated clock (one tick = one second; nothing sleeps, so the CPU time of
the process per tick is what a 1 s interval costs per second: ``cpu_per_tick / 1 s`` is
the share of one core; the per-tick wake-up of a real sleep is not included on either
side).

* **product**: the real :meth:`Collector.run`: its sampler thread's ticks (the NVML
  telemetry path of :class:`NvmlSource`, :class:`HostSampler` on a cgroup v2 directory of
  recorded files, rows into the buffer) and its main thread's flushes, liveness checks
  every 15 s (the real :class:`JobLiveness` on that directory) and watch of the sampler;
  the store as the collector opens it. The main thread's waits block until the simulated
  clock reaches their time (:class:`FakeStop`), so it wakes as often as it would for
  real. No XID-event thread (the fake has no blocking wait).
* **reference**: a plain loop: per tick, per job GPU, the 6 NVML calls a sample row
  needs (``nvmlDeviceGetUtilizationRates``, ``...MemoryInfo``, ``...PowerUsage``,
  ``...Temperature``, ``...ClockInfo``, ``...CurrentClocksEventReasons``) and, every
  60th tick, the metric table's slow counters in one ``nvmlDeviceGetFieldValues`` per
  GPU, as the product does; the same three cgroup files read with ``os.open``/``os.read`` and parsed;
  rows built as tuples already in the stored shape (series id, ms, integer-scaled values)
  and written with one ``executemany`` per table per flush, in the same tables of a store
  opened the same way (:func:`gpuguard.store.open_store`), flushing every 10 ticks like the
  product (``flush_s`` 10); every 10 whole minutes per GPU the same closed-minute rows
  (:mod:`gpuguard.live_minutes`) by one ``INSERT ... SELECT`` and a chunk row.

Both sides pay NVML init, the handle look-up and the store open inside the timed region.
The fake's call log is switched off on both sides (it would grow by 48 entries a tick).
After each run the stored rows are counted and their values summed per column; the
bench stops if the two sides stored different rows. RSS is ``ru_maxrss``.

    .venv/bin/python bench/collector_cpu.py [TICKS] [GPUS]   (default 3000 8; also runs 1 GPU)
"""

from __future__ import annotations

import collections
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

INTERVAL_S = 1.0
FLUSH_TICKS = 10
SLOW_TICKS = 60
CG_FILES = {
    "cpu.stat": "usage_usec 123456789\nuser_usec 100000000\nsystem_usec 23456789\n",
    "memory.stat": "anon 21474836480\nfile 1073741824\n",
    "io.stat": "259:0 rbytes=1048576 wbytes=2097152 rios=10 wios=20 dbytes=0 dios=0\n",
}


class FakeClock:
    """``time.time``/``monotonic``/``monotonic_ns`` of both sides: advanced only by waits,
    so a run of N ticks is N simulated seconds whatever the machine's load."""

    def __init__(self) -> None:
        self.mono = 1000.0
        self.wall = float(int(time.time()))

    def advance(self, s: float) -> None:
        self.mono += s
        self.wall += s

    def install(self) -> None:
        time.time = lambda: self.wall
        time.monotonic = lambda: self.mono
        time.monotonic_ns = lambda: int(self.mono * 1e9)


class FakeStop:
    """The collector's stop event: set once ``ticks`` samples are due. The sampler thread's
    ``wait`` advances the clock instead of sleeping (a plain loop's, the reference's, is
    :meth:`FakeClock.advance`); the main thread's ``wait`` blocks until the clock reaches
    its wake-up time, and is woken only then, as a timer would."""

    SAMPLER = "gpuguard-sampler"

    def __init__(self, clock: FakeClock, ticks: int) -> None:
        self.clock = clock
        self.end = clock.mono + (ticks - 0.5) * INTERVAL_S
        self._set = False
        self._cond = threading.Condition()
        self._main_wake = float("inf")

    def is_set(self) -> bool:
        return self._set or self.clock.mono >= self.end

    def set(self) -> None:
        with self._cond:
            self._set = True
            self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        dt = timeout or 0.0
        me = threading.current_thread().name
        if me != self.SAMPLER and any(t.name == self.SAMPLER for t in threading.enumerate()):
            with self._cond:
                self._main_wake = self.clock.mono + dt
                self._cond.notify_all()  # the sampler may go on: this thread waits again
                while not self.is_set() and self.clock.mono < self._main_wake:
                    if not self._cond.wait(10.0):
                        sys.exit("bench: the main thread was never woken")
                self._main_wake = float("inf")
            return self.is_set()
        self.clock.advance(dt)
        if self.clock.mono >= self._main_wake or self.is_set():
            with self._cond:
                self._cond.notify_all()
                # A real sampler sleeps a whole interval while the main thread's flush
                # takes milliseconds: the next tick waits until the main thread waits
                # again, or this never-sleeping sampler would run ahead of the flushes and
                # the buffered rows (up to MAX_BUFFERED_ROWS) would show as the collector's RSS.
                while not self.is_set() and not self.clock.mono < self._main_wake < float("inf"):
                    if not self._cond.wait(10.0):
                        break  # the main thread has stopped waiting (it is finishing)
        return self.is_set()


def _setup(d: str, gpus: int):
    import fake_pynvml as fp

    import gpuguard.collector.schema  # noqa: F401  (the collector's store tables, as its process registers them)
    from gpuguard.store import open_store

    cg = os.path.join(d, "cg")
    os.makedirs(cg, exist_ok=True)
    for name, text in CG_FILES.items():
        with open(os.path.join(cg, name), "w") as f:
            f.write(text)
    db = os.path.join(d, "node.db")
    open_store(db).close()  # schema created beforehand on both sides
    fake = fp.FakeNvml(fp.h100_node())
    fake.calls = collections.deque(maxlen=0)  # the test double's call log, not the product's memory
    clock = FakeClock()
    clock.install()
    return fake, cg, db, clock


def product(ticks: int, gpus: int, d: str) -> dict:
    import logging

    from gpuguard.collector.host import HostSampler
    from gpuguard.collector.liveness import JobLiveness
    from gpuguard.collector.run import Collector
    from gpuguard.gpu.nvml import NvmlSource
    from gpuguard.store import open_store

    fake, cg, db, clock = _setup(d, gpus)
    t = time.process_time()
    src = NvmlSource(pynvml_module=fake.module, call_timeout_s=5.0)
    host = HostSampler("1", "n1", dirs=[cg])
    c = Collector(job_id="1", node="n1", source=src, gpus=",".join(str(i) for i in range(gpus)), host=host,
                  liveness=JobLiveness(host, job_id="1", scontrol=None, clock=time.monotonic),
                  open_store=lambda: open_store(db), interval_s=INTERVAL_S, flush_s=FLUSH_TICKS * INTERVAL_S,
                  liveness_s=15.0, log=logging.getLogger("bench"))
    c.stop_event = FakeStop(clock, ticks)
    c.run()
    src.close()
    return {"cpu_s": time.process_time() - t, "db": db}


def reference(ticks: int, gpus: int, d: str) -> dict:
    import pynvml

    from gpuguard import live_minutes, samples
    from gpuguard.metrics import GPU_SAMPLED, GPU_SLOW, stored_column
    from gpuguard.model import CLOCK_EVENT_REASONS
    from gpuguard.store import open_store

    fake, cg, db, clock = _setup(d, gpus)
    known = 0
    for bit, _label in CLOCK_EVENT_REASONS.values():
        known |= bit
    fast_ins = (f"insert or replace into gpu_samples (sid, t_ms, {', '.join(stored_column(m) for m in GPU_SAMPLED)})"
                f" values ({', '.join('?' * (len(GPU_SAMPLED) + 2))})")
    slow_ins = (f"insert or replace into gpu_slow (sid, t_ms, {', '.join(stored_column(m) for m in GPU_SLOW)}) "
                f"values ({', '.join('?' * (len(GPU_SLOW) + 2))})")
    host_ins = ("insert into host_samples (job_id, node, at, cpu_pct, rss_mib, io_read_mib, io_write_mib) "
                "values (?,?,?,?,?,?,?)")
    paths = [os.path.join(cg, n) for n in CG_FILES]
    mib = 1024 * 1024

    t = time.process_time()
    nv = fake.module
    nv.nvmlInit()
    hs = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(gpus)]
    uuids = [nv.nvmlDeviceGetUUID(h) for h in hs]
    [nv.nvmlDeviceGetPciInfo(h) for h in hs]
    fids = [getattr(pynvml, m.nvml.field_id) for m in GPU_SLOW]  # the table's slow counters
    per = [m.nvml.raw_per_unit * 1.0 for m in GPU_SLOW]
    store = open_store(db)
    conn = store.db.conn
    cache = samples.SeriesCache()
    t0 = time.time()
    sids = [cache.get(conn, "1", "n1", i, uuids[i], t0)[0] for i in range(gpus)]
    t0 = cache.get(conn, "1", "n1", 0, uuids[0], t0)[1]
    # the closed minutes (gpuguard.live_minutes): per series, every 10 whole minutes, one
    # INSERT ... SELECT of the minute rows and one chunk row with the percentile histograms
    t0_ms = round(t0 * 1000)
    base = t0_ms // 60000
    col = {m.name: stored_column(m) for m in GPU_SAMPLED}
    start = f"(({base} + m) * 60000 - {t0_ms})"
    live_ins = (
        f"insert into gpu_live_minutes (sid, minute, mask, n, t_first, t_last, t_sum, "
        f"{', '.join(live_minutes.minute_columns())}) select sid, m, coalesce({col['clock_event_mask']}, -1), "
        f"count(*), min(t_ms) - {start}, max(t_ms) - {start}, sum(t_ms) - count(*) * {start}, "
        + ", ".join(f"sum({col[n]}), nullif(count({col[n]}), count(*))" for n in samples.SUMMED) + ", "
        + ", ".join(f"max({col[n]})" for n in samples.MAXED)
        + f" from (select *, (t_ms + {t0_ms}) / 60000 - {base} as m from gpu_samples where sid = ? and t_ms "
        f"between ? and ?) group by m, {col['clock_event_mask']}")
    closed = [0] * gpus
    fast, slow, hostrows = [], [], []
    prev = None
    for i in range(ticks):
        at = time.time()
        t_ms = round((at - t0) * 1000)
        for k, h in enumerate(hs):
            u = nv.nvmlDeviceGetUtilizationRates(h)
            m = nv.nvmlDeviceGetMemoryInfo(h)
            fast.append((sids[k], t_ms, u.gpu, u.memory, round(m.used / mib), round(nv.nvmlDeviceGetPowerUsage(h) / 100),
                         nv.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
                         nv.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                         nv.nvmlDeviceGetCurrentClocksEventReasons(h) & known))
            if i % SLOW_TICKS == 0:
                v = nv.nvmlDeviceGetFieldValues(h, fids)
                slow.append((sids[k], t_ms, *[round(x.value.ullVal / d) for x, d in zip(v, per, strict=True)]))
        texts = []
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            texts.append(os.read(fd, 65536).decode())
            os.close(fd)
        cpu_ns = int(texts[0].split()[1]) * 1000
        anon = int(texts[1].split()[1])
        kv = dict(x.split("=") for x in texts[2].split()[1:])
        mono = time.monotonic_ns()
        cpu_pct = None if prev is None else round((cpu_ns - prev[1]) * 100.0 / (mono - prev[0]), 2)
        prev = (mono, cpu_ns)
        hostrows.append(("1", "n1", at, cpu_pct, anon / mib, int(kv["rbytes"]) / mib, int(kv["wbytes"]) / mib))
        if i % FLUSH_TICKS == FLUSH_TICKS - 1 or i == ticks - 1:
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(fast_ins, fast)
            if slow:
                conn.executemany(slow_ins, slow)
            conn.executemany(host_ins, hostrows)
            cur = (t_ms + t0_ms) // 60000 - base
            for k, sid in enumerate(sids):
                while cur - closed[k] >= live_minutes.CHUNK_MIN:
                    a, b = closed[k], closed[k] + live_minutes.CHUNK_MIN
                    lo, hi = (base + a) * 60000 - t0_ms, (base + b) * 60000 - t0_ms - 1
                    conn.execute(live_ins, (sid, lo, hi))
                    hist = {n: conn.execute(f"select {col[n]}, count(*) from gpu_samples where sid = ? and t_ms "
                                            f"between ? and ? and {col[n]} is not null group by 1",
                                            (sid, lo, hi)).fetchall() for n in samples.PCT_SAMPLED}
                    n = conn.execute("select count(*) from gpu_samples where sid = ? and t_ms between ? and ?",
                                     (sid, lo, hi)).fetchone()[0]
                    conn.execute("insert into gpu_live_chunks values (?, ?, ?, ?, ?)",
                                 (sid, a, b, n, json.dumps(hist, separators=(",", ":"))))
                    closed[k] = b
            conn.execute("COMMIT")
            fast, slow, hostrows = [], [], []
        clock.advance(INTERVAL_S)
    store.close()
    nv.nvmlShutdown()
    return {"cpu_s": time.process_time() - t, "db": db}


def stored(db: str) -> dict:
    """Rows and per-column value sums of what a side stored (times left out: the two
    sides stamp the same simulated seconds, but a checksum of them says nothing more)."""
    import sqlite3

    from gpuguard.metrics import GPU_SAMPLED, GPU_SLOW, stored_column

    conn = sqlite3.connect(db)
    fast = ", ".join(f"total({stored_column(m)})" for m in GPU_SAMPLED)
    slow = ", ".join(f"total({stored_column(m)})" for m in GPU_SLOW)
    out = {"gpu_samples": conn.execute(f"select count(*), {fast} from gpu_samples").fetchone(),
           "gpu_slow": conn.execute(f"select count(*), {slow} from gpu_slow").fetchone(),
           "host_samples": conn.execute("select count(*), total(rss_mib), total(io_read_mib), "
                                        "total(io_write_mib), count(cpu_pct) from host_samples").fetchone(),
           # closed minutes: rows and samples they cover (which minutes close depends on
           # where the epoch minutes fall on each side's simulated timeline: not compared)
           "live": conn.execute("select (select count(*) from gpu_live_minutes), count(*), total(n) "
                                "from gpu_live_chunks").fetchone()}
    conn.close()
    return {k: list(v) for k, v in out.items()}


def run_side(side: str, ticks: int, gpus: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        p = subprocess.run([sys.executable, __file__, "--child", side, str(ticks), str(gpus), d],
                           capture_output=True, text=True, check=False)
        if p.returncode != 0:
            sys.exit(f"{side} run failed:\n{p.stderr}")
        return json.loads(p.stdout.strip().splitlines()[-1])


def compare(ticks: int, gpus: int, runs: int = 3) -> dict[str, float]:
    out: dict[str, list[dict]] = {"product": [], "reference": []}
    for _ in range(runs):
        for side in out:
            out[side].append(run_side(side, ticks, gpus))
    live = {side: rs[0]["stored"].pop("live") for side, rs in out.items()}
    for rs in out.values():
        for r in rs[1:]:
            r["stored"].pop("live")
    if out["product"][0]["stored"] != out["reference"][0]["stored"]:
        sys.exit(f"the two sides stored different rows:\n  product   {out['product'][0]['stored']}\n"
                 f"  reference {out['reference'][0]['stored']}")
    per = {s: statistics.median(r["cpu_s"] for r in rs) / ticks for s, rs in out.items()}
    rss = {s: max(r["rss_mib"] for r in rs) for s, rs in out.items()}
    rows = out["product"][0]["stored"]
    print(f"{gpus} GPU(s), {ticks} ticks of 1 s, median of {runs} runs each; both stored "
          f"{rows['gpu_samples'][0]} GPU rows, {rows['gpu_slow'][0]} slow-counter rows, "
          f"{rows['host_samples'][0]} host rows (same values); closed minutes (rows, chunks, samples): "
          f"product {live['product']}, reference {live['reference']}")
    for s in out:
        print(f"  {s:9s}: {per[s] * 1e6:7.1f} us CPU per tick = {per[s] * 100:.4f} % of a core at 1 s; "
              f"peak RSS {rss[s]:.1f} MiB")
    print(f"  ratio product/reference = {per['product'] / per['reference']:.2f}")
    return per


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        side, ticks, gpus, d = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
        res = (product if side == "product" else reference)(ticks, gpus, d)
        res["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        res["stored"] = stored(res.pop("db"))
        print(json.dumps(res))
        return
    ticks = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    gpus = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    many = compare(ticks, gpus)
    if gpus > 1:
        one = compare(ticks, 1)
        print(f"1 GPU / {gpus} GPUs: product {one['product'] / many['product']:.3f}, "
              f"reference {one['reference'] / many['reference']:.3f} (1/{gpus} = {1 / gpus:.3f})")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
