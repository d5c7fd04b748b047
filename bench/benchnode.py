"""A replay node for the hook benches: an 8-GPU H100 snapshot recorded from the real
``nvidia-smi -q`` dump in tests/data, a 2,000-line kernel log without XIDs, and a timer
for whole hook processes (imported by bench/prolog_healthy.py and
bench/ops_hook_overhead.py)."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BIN = os.path.dirname(sys.executable)
DUMP = os.path.join(REPO, "tests/data/nvsmi-q-h100x8-535.183.01-full.txt")


def replay_node(tmp: str) -> tuple[str, str]:
    """Write ``tmp/gpus.json`` (replay snapshot) and ``tmp/kern.log``; returns their paths."""
    snap = os.path.join(tmp, "gpus.json")
    subprocess.run([os.path.join(BIN, "gpuguard"), "--config", "/dev/null", "gpu", "snapshot", "-o", snap,
                    "--from-nvidia-smi", DUMP], check=True, capture_output=True)
    kl = os.path.join(tmp, "kern.log")
    with open(kl, "w") as fh:
        fh.write("[  1.0] Linux version 6.1\n" * 2000)
    return snap, kl


def median_wall_s(program: str, env: dict[str, str], n: int) -> float:
    """Median wall time in seconds of ``n`` runs of the venv's ``program`` with ``env``;
    exits with its stderr when a run fails."""
    walls = []
    for _ in range(n):
        t = time.perf_counter()
        p = subprocess.run([os.path.join(BIN, program)], env=env, capture_output=True)
        walls.append(time.perf_counter() - t)
        if p.returncode != 0:
            sys.exit(f"{program} exited {p.returncode}: {p.stderr.decode()[-500:]}")
    return statistics.median(walls)
