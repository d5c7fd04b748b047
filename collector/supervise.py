"""The collector's supervisor: restart a collector that was killed, and say for how long
it was down.

The Prolog starts ``python -m gpuguard.collector.run --supervise ...``; that process (the
one the pid file names, detached in its own session) runs the real collector as its
child with the same arguments and waits for it:

* the child exits 0 (the job is gone, the liveness probe said so) or the supervisor gets
  SIGTERM/SIGINT (the Epilog stops it; forwarded to the child, whose exit status is
  then the supervisor's): done;
* the child dies any other way (SIGKILL by the OOM killer or a user with root, a crash):
  it is started again after :data:`RESTART_DELAY_S`, well within two sampling intervals
  of the death; the time from the death to the restart is added to the down time;
* more than :data:`MAX_RESTARTS` restarts, or :data:`MAX_QUICK_DEATHS` deaths in a row
  each within :data:`QUICK_DEATH_S` of its start (a crash loop): give up, exit 1.

After every restart the supervisor rewrites ``--restart-file`` (JSON: ``restarts``,
``down_s``, ``last_death``); the Epilog reads it into the job summary
(``collector_restarts``, ``collector_down_s``) and an ``events`` row.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

#: Seconds between a child's death and its restart (our choice: short against any
#: sampling interval; the collector samples as soon as it starts).
RESTART_DELAY_S = 0.2
#: Most restarts per job (our choice: a collector killed this often is being killed on
#: purpose; stop fighting it).
MAX_RESTARTS = 20
#: A death this soon after the start counts as quick (s) ...
QUICK_DEATH_S = 2.0
#: ... and this many quick deaths in a row end the supervision (a crash loop).
MAX_QUICK_DEATHS = 3

RUN_MODULE = "gpuguard.collector.run"


def restart_file_path(cfg: Any, job_id: str) -> str:
    """``{state_dir}/collector.{job_id}.restarts.json``: the restart record."""
    if not (job_id.isascii() and job_id.isdigit()):
        raise ValueError(f"not a job id: {job_id!r}")
    return os.path.join(cfg.get("paths", "state_dir"), f"collector.{job_id}.restarts.json")


def _pop_option(argv: list[str], name: str) -> str | None:
    """Remove ``name VALUE`` from ``argv``; return VALUE (None when absent)."""
    if name in argv:
        i = argv.index(name)
        if i + 1 < len(argv):
            value = argv[i + 1]
            del argv[i:i + 2]
            return value
        del argv[i]
    return None


def _describe(status: int) -> str:
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exit status {status}"


def write_restart_file(path: str | None, restarts: int, down_s: float, last_death: str) -> None:
    """Atomically replace ``path`` with the restart record (no-op without a path)."""
    if not path:
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as fh:
            json.dump({"restarts": restarts, "down_s": round(down_s, 3), "last_death": last_death}, fh)
        os.replace(tmp, path)
    except OSError:
        pass  # the summary then lacks the down time; sampling goes on


def read_restart_file(path: str) -> dict[str, Any] | None:
    """The restart record, or None when absent or unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as fh:
            doc = json.loads(fh.read(4096))
        return doc if isinstance(doc, dict) else None
    except (OSError, ValueError):
        return None


def supervise(argv: list[str]) -> int:
    """Run the collector with ``argv`` (``--supervise`` already removed) under supervision
    (module docstring). Returns the exit status."""
    argv = list(argv)
    restart_file = _pop_option(argv, "--restart-file")
    stopping: list[int] = []
    child: list[subprocess.Popen] = []

    def on_signal(signum: int, _frame: Any) -> None:
        stopping.append(signum)
        if child and child[0].poll() is None:
            try:
                child[0].send_signal(signal.SIGTERM)
            except OSError:
                pass

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    restarts = 0
    down_s = 0.0
    quick = 0
    cmd = [sys.executable, "-m", RUN_MODULE, *argv]
    while True:
        started = time.monotonic()
        child[:] = [subprocess.Popen(cmd, stdin=subprocess.DEVNULL)]
        if stopping:  # a SIGTERM that came while starting
            child[0].send_signal(signal.SIGTERM)
        while True:
            try:
                status = child[0].wait()
                break
            except InterruptedError:
                continue
        died_at = time.monotonic()
        if stopping or status == 0:
            return 0 if status in (0, -signal.SIGTERM) else (status if status > 0 else 1)
        how = _describe(status)
        quick = quick + 1 if died_at - started < QUICK_DEATH_S else 0
        if restarts >= MAX_RESTARTS or quick >= MAX_QUICK_DEATHS:
            print(f"gpuguard collector supervisor: collector {how}; giving up after {restarts} restart(s)",
                  file=sys.stderr)
            return 1
        time.sleep(RESTART_DELAY_S)
        if stopping:
            return 0
        restarts += 1
        down_s += time.monotonic() - died_at
        print(f"gpuguard collector supervisor: collector {how}; restart {restarts}", file=sys.stderr)
        write_restart_file(restart_file, restarts, down_s, how)
