"""Benchmark: the collector's CPU per sample of 8 GPUs through the fake pynvml, against a
minimal loop making the 9 NVML calls a sample row needs and writing the same rows.

Both sides run in their own process, the same number of ticks, flushing every 10 ticks
(``flush_s`` 10 at ``interval_s`` 1). To keep the run short the ticks follow each other
without sleeping; the CPU per tick is what a 1 s interval costs per second, so
``cpu_per_tick_s / 1 s`` is the share of a core at 1 s (extrapolated from back-to-back
ticks, stated so). The product side is the real :class:`Collector` (``sample_once`` +
``flush``, NVML telemetry path, the compact store, a host sample from a cgroup v2
directory of recorded files); the reference calls the fake module directly and
``executemany``s tuples into a plain SQLite table (no host sample). RSS is ru_maxrss.

    .venv/bin/python bench/collector_cpu.py [TICKS] [GPUS]   (default 3000 8)
"""

from __future__ import annotations

import json
import os
import resource
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def product(ticks: int, gpus: int, d: str) -> dict:
    import logging

    import fake_pynvml as fp

    import gpuguard.collector.schema  # noqa: F401  (the collector's store tables, as its process registers them)
    from gpuguard.collector.host import HostSampler
    from gpuguard.collector.run import Collector
    from gpuguard.gpu.nvml import NvmlSource
    from gpuguard.store import open_store

    cg = os.path.join(d, "cg")
    os.makedirs(cg, exist_ok=True)
    with open(os.path.join(cg, "cpu.stat"), "w") as f:
        f.write("usage_usec 123456789\nuser_usec 100000000\nsystem_usec 23456789\n")
    with open(os.path.join(cg, "memory.stat"), "w") as f:
        f.write("anon 21474836480\nfile 1073741824\n")
    with open(os.path.join(cg, "io.stat"), "w") as f:
        f.write("259:0 rbytes=1048576 wbytes=2097152 rios=10 wios=20 dbytes=0 dios=0\n")
    import gpuguard.gpu.telemetry as tele

    clock = [time.time()]

    def one_second_later() -> float:  # ticks run back to back; the store keys samples by ms
        clock[0] += 1.0
        return clock[0]

    tele.time = type("Clock", (), {"time": staticmethod(one_second_later)})
    fake = fp.FakeNvml(fp.h100_node())
    src = NvmlSource(pynvml_module=fake.module)
    db = os.path.join(d, "p.db")

    class Alive:
        def check(self):
            return True, "bench"

    c = Collector(job_id="1", node="n1", source=src, gpus=",".join(str(i) for i in range(gpus)),
                  host=HostSampler("1", "n1", dirs=[cg]), liveness=Alive(), open_store=lambda: open_store(db),
                  interval_s=1.0, flush_s=10.0, log=logging.getLogger("bench"))
    c.sample_once()
    c.flush()
    t = time.process_time()
    w = time.perf_counter()
    for i in range(ticks):
        c.sample_once()
        if i % 10 == 9:
            c.flush()
    c.flush()
    return {"cpu_s": time.process_time() - t, "wall_s": time.perf_counter() - w,
            "rows": open_store(db).query("select count(*) n from gpu_samples")[0]["n"]}


def reference(ticks: int, gpus: int, d: str) -> dict:
    import fake_pynvml as fp
    import pynvml

    fake = fp.FakeNvml(fp.h100_node())
    nv = fake.module
    nv.nvmlInit()
    hs = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(gpus)]
    conn = sqlite3.connect(os.path.join(d, "r.db"), isolation_level=None)
    conn.execute("pragma journal_mode=wal")
    conn.execute("create table s (gpu integer, at real, u integer, mu integer, mem integer, p integer, "
                 "t integer, sm integer, mask integer, ecc integer, replay integer)")
    batch = []
    t = time.process_time()
    w = time.perf_counter()
    for i in range(ticks):
        now = time.time()
        for k, h in enumerate(hs):
            u = nv.nvmlDeviceGetUtilizationRates(h)
            m = nv.nvmlDeviceGetMemoryInfo(h)
            batch.append((k, now, u.gpu, u.memory, m.used >> 20, nv.nvmlDeviceGetPowerUsage(h),
                          nv.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
                          nv.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                          nv.nvmlDeviceGetCurrentClocksEventReasons(h),
                          nv.nvmlDeviceGetTotalEccErrors(h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                         pynvml.NVML_VOLATILE_ECC),
                          nv.nvmlDeviceGetPcieReplayCounter(h)))
        if i % 10 == 9:
            conn.execute("begin")
            conn.executemany("insert into s values (?,?,?,?,?,?,?,?,?,?,?)", batch)
            conn.execute("commit")
            batch = []
    return {"cpu_s": time.process_time() - t, "wall_s": time.perf_counter() - w,
            "rows": conn.execute("select count(*) from s").fetchone()[0]}


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        side, ticks, gpus, d = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
        res = (product if side == "product" else reference)(ticks, gpus, d)
        res["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(res))
        return
    ticks = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    gpus = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    out: dict[str, list[dict]] = {"product": [], "reference": []}
    for _ in range(3):
        for side in out:
            with tempfile.TemporaryDirectory() as d:
                p = subprocess.run([sys.executable, __file__, "--child", side, str(ticks), str(gpus), d],
                                   capture_output=True, text=True, check=True)
                out[side].append(json.loads(p.stdout.strip().splitlines()[-1]))
    per = {s: statistics.median(r["cpu_s"] for r in rs) / ticks for s, rs in out.items()}
    rss = {s: max(r["rss_mib"] for r in rs) for s, rs in out.items()}
    print(f"{gpus} GPU(s), {ticks} ticks back to back, median of 3 runs each:")
    for s in out:
        print(f"  {s:9s}: {per[s] * 1e3:.3f} ms CPU per tick = {per[s] * 100:.3f} % of a core at 1 s; "
              f"peak RSS {rss[s]:.1f} MiB; rows {out[s][0]['rows']}")
    print(f"  ratio product/reference = {per['product'] / per['reference']:.2f} "
          f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
