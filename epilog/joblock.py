"""One Epilog at a time per job and node: a lock file held with ``flock``.

Slurm can run the Epilog of one job twice (a requeue, a node that re-registers, an
administrator re-running it by hand) and, rarely, twice at once. The bookkeeping (ingest,
summary, verdict) must then happen once: the second run waits for the first to finish
(up to the hook's deadline) and then sees its records (the summary is stored and the job
directory is gone) and keeps them instead of rewriting them from nothing.

The lock file is ``epilog.<job_id>.lock`` in ``[paths] run_dir`` (a tmpfs; it needs no
cleanup after a reboot), else ``state_dir``. ``flock`` locks die with their process, so a
killed Epilog never leaves the job locked. When no lock file can be created at all the
run goes ahead unlocked (our own fault must not cost the job its summary).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from typing import Any

#: Poll interval while waiting for another Epilog's lock (s).
POLL_S = 0.05


@contextlib.contextmanager
def job_lock(cfg: Any, job_id: str | None, deadline: float | None) -> Iterator[bool]:
    """Hold the job's lock for the ``with`` block; yields True when held (or when no lock
    is possible: no job id, no writable directory), False when another Epilog still held
    it at ``deadline`` (a :func:`time.monotonic` value)."""
    fd = _open(cfg, job_id) if job_id else None
    if fd is None:
        yield True
        return
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if deadline is not None and time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(POLL_S)
        yield True
    finally:
        os.close(fd)  # releases the flock


def _open(cfg: Any, job_id: str) -> int | None:
    for key in ("run_dir", "state_dir"):
        d = cfg.get("paths", key)
        if not d:
            continue
        try:
            os.makedirs(d, mode=0o755, exist_ok=True)
            return os.open(os.path.join(d, f"epilog.{job_id}.lock"),
                           os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError:
            continue
    return None
