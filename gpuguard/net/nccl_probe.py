"""Run the NCCL probe (nccl-tests ``all_reduce_perf`` by default) under a hard timeout.

The command is an argument list (never a shell string), run in its own session so a
hang kills the whole process group (MPI launchers fork). The timeout is the configured
``[nccl] timeout_s`` capped by what the caller has left of its own budget; a probe that
cannot start, hangs, or prints nothing readable is a *tool fault*
(:data:`PROBE_FAILED`): recorded, never a drain.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Any

from gpuguard.net.nccl_parse import NcclLog, parse

PROBE_FAILED = "nccl.probe_failed"
#: Output kept from a probe (bytes): nccl-tests prints ~3 KB for a full sweep; NCCL_DEBUG
#: INFO can print megabytes, which must not fill memory of a hook.
MAX_OUTPUT_B = 4 * 2**20
#: Seconds a probe needs at least to be worth starting (our choice: CUDA context and NCCL
#: communicator set-up alone take 1-3 s on 8 GPUs).
MIN_TIMEOUT_S = 5.0


@dataclass
class ProbeRun:
    """One execution. ``error`` is set for a tool fault (not found, not executable, timed
    out); ``log`` is the parsed output (also for a non-zero exit: NCCL failures print)."""

    argv: list[str]
    started_at: float
    duration_s: float
    returncode: int | None
    log: NcclLog | None
    error: str | None = None
    output_tail: str = ""


def node_gpu_count(cfg: Any) -> int:
    """GPUs the probe spans: ``[nccl] gpus``, else ``[node] gpu_count``, else the
    ``/dev/nvidiaN`` device files (at least 1)."""
    n = cfg.get("nccl", "gpus") or cfg.get("node", "gpu_count")
    if n:
        return int(n)
    return max(1, len(glob.glob("/dev/nvidia[0-9]*")))


def build_argv(cfg: Any) -> list[str]:
    """``[nccl] command`` if set (``{gpus}`` replaced by :func:`node_gpu_count`), else
    ``all_reduce_perf -b MIN -e MAX -f 2 -g GPUS -n ITERS -w WARMUP -c 1``
    (nccl-tests README: ``-b/-e`` size range, ``-f`` multiplication factor, ``-g`` GPUs
    per thread, ``-n`` iterations, ``-w`` warm-up iterations, ``-c 1`` check results so
    ``#wrong`` is counted)."""
    gpus = str(node_gpu_count(cfg))
    custom = cfg.get("nccl", "command")
    if custom:
        return [str(a).replace("{gpus}", gpus) for a in custom]
    return [cfg.get("nccl", "binary"), "-b", str(cfg.get("nccl", "min_bytes")), "-e", str(cfg.get("nccl", "max_bytes")),
            "-f", "2", "-g", gpus, "-n", str(cfg.get("nccl", "iters")), "-w", str(cfg.get("nccl", "warmup_iters")),
            "-c", "1"]


def probe_timeout(cfg: Any, budget_left_s: float | None) -> float:
    """``[nccl] timeout_s``, capped at ``budget_left_s`` minus 2 s for parsing and the
    decision (our choice), never negative."""
    t = float(cfg.get("nccl", "timeout_s"))
    if budget_left_s is not None:
        t = min(t, budget_left_s - 2.0)
    return max(0.0, t)


def run_probe(argv: list[str], timeout_s: float, env: dict[str, str] | None = None) -> ProbeRun:
    """Run ``argv`` for at most ``timeout_s`` seconds and parse its output. Never raises
    for a probe fault (missing binary, hang, garbage): see :attr:`ProbeRun.error`."""
    started = time.time()
    if timeout_s < MIN_TIMEOUT_S:
        return ProbeRun(argv, started, 0.0, None, None, f"no time left to probe ({timeout_s:.1f} s < {MIN_TIMEOUT_S:.0f} s)")
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)
    except OSError as e:
        return ProbeRun(argv, started, time.time() - started, None, None, f"cannot run {argv[0]}: {e.strerror or e}")
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, _ = proc.communicate()
        text = out[-MAX_OUTPUT_B:].decode("utf-8", "replace")
        return ProbeRun(argv, started, time.time() - started, None, parse(text),
                        f"timed out after {timeout_s:.0f} s (hung; process group killed)", text[-2000:])
    text = out[-MAX_OUTPUT_B:].decode("utf-8", "replace")
    return ProbeRun(argv, started, time.time() - started, proc.returncode, parse(text), None, text[-2000:])


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
