"""Find and stop a job's collectors through ``/proc``, without the config.

The Epilog normally stops the collector through its pid file
(:func:`gpuguard.collector.launch.stop_collector`). When that cannot work -- the config
broke between Prolog and Epilog, so the pid file's directory is unknown, or the
supervisor named in it was killed and left its child -- the collectors are found by
their command line: ``-m gpuguard.collector.run ... --job-id N`` (:func:`is_collector`),
narrowed to this node's ``--node`` and ``--config`` so another slurmd on the same host
(or another test) never loses its collector.
"""

from __future__ import annotations

import contextlib
import os
import signal

from gpuguard.collector.launch import StopResult, _signal, _wait_gone, is_collector


def _argv(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().split(b"\0")
    except OSError:
        return []


def _arg_value(argv: list[bytes], name: bytes) -> bytes | None:
    try:
        return argv[argv.index(name) + 1]
    except (ValueError, IndexError):
        return None


def find_collector_pids(job_id: str, *, node: str | None = None, config: str | None = None) -> list[int]:
    """Pids of the live collectors (and collector supervisors) of ``job_id`` on this host,
    found through ``/proc/PID/cmdline`` (:func:`is_collector`), without any config: the
    epilog stops them even when the config broke after the prolog. ``node`` / ``config``
    narrow it to collectors started with that ``--node`` / ``--config`` (several slurmd
    on one host run the same job id's collectors side by side)."""
    out = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not (name.isdigit() and is_collector(int(name), job_id)):
            continue
        argv = _argv(int(name))
        if node is not None and _arg_value(argv, b"--node") != node.encode():
            continue
        if config is not None and _arg_value(argv, b"--config") != os.path.abspath(config).encode():
            continue
        out.append(int(name))
    return sorted(out)


def stop_collector_by_scan(job_id: str, timeout_s: float = 5.0, *, node: str | None = None,
                           config: str | None = None) -> list[StopResult]:
    """SIGTERM, wait, SIGKILL every collector of ``job_id`` found by
    :func:`find_collector_pids` (same ``node`` / ``config`` filters). Never raises for a
    process that is already gone."""
    results = []
    for pid in find_collector_pids(job_id, node=node, config=config):
        pidfd = None
        with contextlib.suppress(OSError, AttributeError, OverflowError, ValueError):
            pidfd = os.pidfd_open(pid)
        try:
            if not is_collector(pid, job_id):
                continue
            sent = _signal(pid, pidfd, signal.SIGTERM)
            exited = _wait_gone(pid, job_id, pidfd, timeout_s)
            if not exited:
                sent = _signal(pid, pidfd, signal.SIGKILL) or sent
                exited = _wait_gone(pid, job_id, pidfd, 1.0)
            results.append(StopResult(pid, True, exited, sent))
        finally:
            if pidfd is not None:
                os.close(pidfd)
    return results
