"""Benchmark: what the operations side adds to every Prolog/Epilog, and one
``gpuguard health`` run.

Per call (median of N, in-process, warm): the maintenance lookup the hooks make
(:func:`gpuguard.ops.maintenance.cached`), queueing alerts with no alerting finding (the
healthy path) and with one, the job-mapping files of a 4-GPU job (running record,
dcgm-exporter map, jobstats gpustat) at start and end. Then the median wall time of N
complete ``gpuguard health`` processes on an 8-GPU replay snapshot against a fake
``scontrol`` (node state, reservations), with metrics written, and of N ``gpuguard-prolog``
processes on the same node for scale. Figures and ratios, no asserted time.

    .venv/bin/python bench/ops_hook_overhead.py [N]
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import tempfile
import time

from benchnode import REPO, median_wall_s, replay_node
SCONTROL = """#!/bin/sh
case "$1 $2" in
  "show node") echo "NodeName=bench Arch=x86_64 State=IDLE Partitions=gpu";;
  "show reservation") echo "No reservations in the system";;
esac
"""


def per_call_us(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    sys.path.insert(0, REPO)
    from gpuguard import config as config_mod
    from gpuguard.model import Finding
    from gpuguard.ops import alert_spool, jobmap, maintenance

    log = logging.getLogger("bench")
    with tempfile.TemporaryDirectory() as tmp:
        os.makedirs(f"{tmp}/bin")
        with open(f"{tmp}/bin/scontrol", "w") as fh:
            fh.write(SCONTROL)
        os.chmod(f"{tmp}/bin/scontrol", 0o755)
        snap, kl = replay_node(tmp)
        path = os.path.join(tmp, "gpuguard.toml")
        with open(path, "w") as fh:
            fh.write(f'[node]\nname = "bench"\n[paths]\nstore = "{tmp}/node.db"\nlog_file = "{tmp}/g.log"\n'
                     f'state_dir = "{tmp}/state"\nrun_dir = "{tmp}/run"\n'
                     f'[gpu]\nsource = "replay"\nreplay_path = "{snap}"\n[xid]\nkernel_log = "{kl}"\n'
                     f'[slurm]\nbin_dir = "{tmp}/bin"\n[checks]\ndisabled = ["idle_throttle"]\n'
                     f'[alerts]\nsyslog_min_severity = ""\n'
                     f'[metrics]\ntextfile_dir = "{tmp}/prom"\ndcgm_job_map_dir = "{tmp}/dcgm"\n'
                     f'gpustat_dir = "{tmp}/gpustat"\n')
        cfg = config_mod.load(path)
        env = {"SLURM_JOB_ID": "42", "SLURM_JOB_GPUS": "0,1,2,3", "SLURM_JOB_USER": "u", "SLURM_JOB_UID": "1000",
               "SLURM_JOB_ACCOUNT": "a"}
        alert = [(Finding("xid.63", "warning", "remap", 1, None, {"count": 1}), "alert")]
        from gpuguard.gpu.replay import ReplaySource

        live = ReplaySource(snap).snapshot()  # what the Prolog hands the job map
        rows = [
            ("maintenance.cached (every hook)", per_call_us(lambda: maintenance.cached(cfg, "bench"), n * 10)),
            ("enqueue_from_hook, healthy", per_call_us(
                lambda: alert_spool.enqueue_from_hook(cfg, "bench", [], source="prolog", job_id="42", log=log), n * 10)),
            ("enqueue_from_hook, one alert", per_call_us(
                lambda: alert_spool.enqueue_from_hook(cfg, "bench", alert, source="prolog", job_id="42", log=log), n)),
            ("job_started + job_ended, 4 GPUs", per_call_us(
                lambda: (jobmap.job_started(cfg, env, log, snapshot=live), jobmap.job_ended(cfg, env, log)), n)),
        ]
        total = sum(us for _, us in rows[:2]) + rows[3][1]
        for name, us in rows:
            print(f"{name:36} {us:9.1f} us")
        print(f"{'healthy-path total per job':36} {total:9.1f} us")
        med = median_wall_s("gpuguard-health", {"GPUGUARD_CONFIG": path, "SLURMD_NODENAME": "bench"}, n)
        print(f"{'gpuguard-health process, median':36} {med * 1000:9.1f} ms  (budget 40 s: {med / 40 * 100:.2f} %; "
              f"slurmd waits 60 s)")
        pmed = median_wall_s("gpuguard-prolog", {"GPUGUARD_CONFIG": path, "SLURMD_NODENAME": "bench"}, n)
        print(f"{'gpuguard-prolog process, median':36} {pmed * 1000:9.1f} ms  (no job id: node checks only)")
        print(f"{'ops healthy-path share of a prolog':36} {total / 1e6 / pmed * 100:9.2f} %")


if __name__ == "__main__":
    main()
