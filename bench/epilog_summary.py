"""Benchmark: the epilog's job summary of a 1-hour, 4-GPU job sampled every second.

Builds a store with 14,400 ``samples`` rows (4 GPUs x 3,600 s, throttle reasons that
change every few minutes, a slow ECC rise), 120 ``host_samples``, the training records of
3,600 steps (1 rank; then 4 ranks = 14,400 step records), 12 checkpoints and a few
events, then prints the median wall time of :func:`summarize_job` + :func:`save_summary`
over N runs. Goal (issue 3): <= 2 s. A figure, not a test: nothing here asserts a time.

    .venv/bin/python bench/epilog_summary.py [N]
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import tempfile
import time

from gpuguard.epilog.summary import save_summary, summarize_job
from gpuguard.store import open_store

T0 = 1_764_460_800.0
HOUR_S = 3600
GPUS = 4


def build(path: str, ranks: int) -> None:
    rnd = random.Random(1)
    s = open_store(path)
    s.insert("health_runs", {"node": "n1", "hook": "prolog", "job_id": "1", "started_at": T0 - 2,
                             "finished_at": T0 - 1, "decision": "proceed", "reason": ""})
    rows = []
    for g in range(GPUS):
        for i in range(HOUR_S):
            rows.append({"job_id": "1", "node": "n1", "at": T0 + i + rnd.random() * 0.01, "gpu_index": g,
                         "gpu_uuid": f"GPU-{g}", "gpu_util_pct": 90 + rnd.random() * 10, "mem_util_pct": 40.0,
                         "mem_used_mib": 60000 + i, "power_w": 600 + rnd.random() * 50, "temp_c": 70 + rnd.random() * 5,
                         "sm_clock_mhz": 1980 - (i // 300 % 2) * 200, "mem_clock_mhz": 2619,
                         "clock_event_mask": (0x4 if i // 300 % 2 else 0) | (0x20 if i // 900 % 2 else 0),
                         "ecc_volatile_uncorrected": i // 1800, "pcie_replay_count": 0})
    s.insert_many("samples", rows)
    s.insert_many("host_samples", [{"job_id": "1", "node": "n1", "at": T0 + 30 * i, "cpu_pct": 400.0,
                                    "rss_mib": 20000 + i, "io_read_mib": 0.0, "io_write_mib": 0.0} for i in range(120)])
    steps = []
    for r in range(ranks):
        for k in range(HOUR_S):
            st = 0.9 + rnd.random() * 0.2
            steps.append({"job_id": "1", "node": "n1", "rank": r, "step": k, "t": T0 + k, "step_time_s": st,
                          "samples": 64, "tokens": 64 * 2048, "loss": 2.0, "loss_nonfinite": 0, "grad_norm": 1.0,
                          "data_wait_s": st * 0.05, "fwd_bwd_s": st * 0.7, "comm_s": st * 0.2, "optim_s": st * 0.05})
    s.insert_many("steps", steps)
    s.insert_many("checkpoints", [{"job_id": "1", "node": "n1", "rank": r, "step": 300 * c, "t": T0 + 300 * c,
                                   "duration_s": 12.0} for r in range(ranks) for c in range(12)])
    s.insert_many("events", [{"node": "n1", "at": T0 + 100 * i, "kind": "xid", "code": 13, "job_id": "1",
                              "action": "record", "source": "kernel_log"} for i in range(5)])
    s.close()


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    for ranks in (1, 4):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "node.db")
            build(path, ranks)
            times = []
            for _ in range(n):
                s = open_store(path)
                t = time.perf_counter()
                summ = summarize_job(s, "1", "n1", exit_status_raw=0, collector_status="ok", ended_at=T0 + HOUR_S)
                save_summary(s, summ)
                times.append(time.perf_counter() - t)
                s.close()
            print(f"summary of {summ.sample_count} samples, {summ.step_records} step records ({ranks} rank(s)), "
                  f"{GPUS} GPUs: median {statistics.median(times):.3f} s over {n} runs "
                  f"(min {min(times):.3f}, max {max(times):.3f}); goal <= 2 s")


if __name__ == "__main__":
    main()
