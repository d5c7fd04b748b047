"""Shared by the kernel-log tests: run ``gpuguard check`` on a healthy nvidia-smi -q of one
A100 with a kernel log, and keep its XID findings."""

from __future__ import annotations

import pathlib

from click.testing import CliRunner

from gpuguard.cli import main

DATA = pathlib.Path(__file__).parent / "data"
HEALTHY_NVSMI = str(DATA / "nvsmi-q-a100-525.60.13-single-gpu-with-process.txt")


def check_kernel_log(log: pathlib.Path) -> tuple[int, list[str], str]:
    """``gpuguard check --format csv --from-nvidia-smi HEALTHY --kernel-log log``: its exit
    status, its CSV rows that name an XID, and its whole output."""
    r = CliRunner().invoke(main, ["--config", "/dev/null", "check", "--format", "csv", "--from-nvidia-smi",
                                  HEALTHY_NVSMI, "--kernel-log", str(log)])
    return r.exit_code, [row for row in r.output.splitlines() if "xid" in row], r.output
