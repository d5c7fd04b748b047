"""The main job on the embedded default: gpuguard around real Slurm jobs.

Brings up the single-host Slurm testbed (tests/testbed: slurmctld, two slurmd with four
fake GPUs each, slurmdbd, MariaDB, munge) with gpuguard's hooks and the replay GPU
source, then runs three jobs and prints what gpuguard made of each:

1. a healthy training job (a real training loop reporting through the training API);
2. a job sent to a node whose kernel log holds XID 79 (GPU fallen off the bus): the
   Prolog drains the node with a ``gpuguard:`` reason and Slurm requeues the job, held;
3. a training job whose GPUs start throttling (HW thermal slowdown, SM clock halved).

Then ``gpuguard job show`` for each and ``sinfo -R``. The testbed stays up for a look
around; ``tests/testbed/testbed.sh down`` stops it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from conftest import node_snapshot  # noqa: E402
from testbed.slurmtb import JobHeld, Testbed  # noqa: E402

from gpuguard.gpu.replay import dump_snapshot  # noqa: E402

PY = REPO / ".venv" / "bin" / "python"
GG = REPO / ".venv" / "bin" / "gpuguard"


def banner(text: str) -> None:
    print(f"\n=== {text}", flush=True)


def main() -> int:
    tb = Testbed()
    banner("bringing up Slurm (tests/testbed/testbed.sh up)")
    cp = tb.testbed_sh("up", timeout=900)
    if cp.returncode != 0:
        print(cp.stdout, cp.stderr, file=sys.stderr)
        return 1
    tb.reset()
    root = tb.root / "demo"
    tb.install_gpuguard(root, dump_snapshot(node_snapshot(4), t0=time.time()),
                        extra="[verdict]\nwarmup_s = 0.0\nlong_window_s = 2.0\nshort_window_s = 1.0\n")
    train = f"#!/bin/bash\nexec {PY} {REPO}/scripts/train_demo.py --steps 40 {{}}\n"
    shown = []

    banner("job 1: healthy training job on n1 (2 GPUs)")
    j1 = tb.submit(train.format(""), gres="gpu:2", nodelist="n1", comment="gpuguard:template=demo")
    print(tb.wait_job(j1, timeout=180))
    shown.append(("n1", j1))

    banner("job 2: a job sent to n2, whose kernel log holds XID 79 on GPU 0")
    (root / "n2" / "kern.log").write_text(
        "[ 912.345678] NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n")
    j2 = tb.submit("#!/bin/bash\ntrue\n", gres="gpu:1", nodelist="n2")
    try:
        tb.wait_job(j2, timeout=60)
    except JobHeld as e:
        print(f"job {j2} requeued and held by Slurm after the Prolog drained n2:", str(e).splitlines()[0])
    shown.append(("n2", j2))

    banner("job 3: training job on n1 whose GPUs throttle (HW thermal slowdown, SM clock halved)")
    hot = {"gpu_util_pct": 97.0, "sm_clock_mhz": 990.0, "power_w": 380.0, "temp_c": 88.0,
           "clock_event_reasons": ["hw_thermal_slowdown"]}
    (root / "n1" / "gpus.json").write_text(dump_snapshot(
        node_snapshot(4), steps=[{"after_s": 1.5, "gpus": {"0": hot, "1": hot}}], t0=time.time()))
    j3 = tb.submit(train.format("--compute-s 0.2"), gres="gpu:2", nodelist="n1", comment="gpuguard:template=demo")
    print(tb.wait_job(j3, timeout=180))
    shown.append(("n1", j3))

    for node, jid in shown:
        banner(f"gpuguard job show {jid}   (store of {node})")
        subprocess.run([str(GG), "--config", str(tb.gpuguard_toml), "job", "show", str(jid)],
                       env=dict(os.environ, SLURMD_NODENAME=node))
    banner("sinfo -R -o '%E|%U|%H|%N'   (full drain reasons)")
    print(tb.run(["sinfo", "-R", "-o", "%E|%U|%H|%N"]).stdout)
    print("testbed left up: eval \"$(tests/testbed/testbed.sh env)\" to use sinfo/sbatch; "
          "tests/testbed/testbed.sh down to stop it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
