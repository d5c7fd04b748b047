"""One reader of the kernel log at a time: the lock around read-cursor .. move-cursor.

A Prolog, an Epilog and a ``gpuguard health`` run can start together on one node. Each
reads the kernel log from the stored cursor, acts on the events, and moves the cursor
(:mod:`gpuguard.nodecheck`). Without a lock, two of them read the same events: the XIDs
are recorded twice and the node may be drained twice for one fault.

The rule:

* the cursor is read only under an exclusive ``flock(2)`` on :data:`LOCK_FILE` in the
  first state directory that takes it (:func:`gpuguard.durable.state_dirs`: the disk
  ``state_dir``, then ``run_dir`` on tmpfs when the disk is read-only), and the lock is
  held until the cursor has moved (after the pending drain is recorded, before any
  ``scontrol`` call or store I/O), so a hung store or slurmctld cannot hold it;
* the wait is bounded: at most :data:`WAIT_S`, and never more than the share of the
  caller's budget it passes in, so a lock never holds a hook past its budget;
* not getting the lock is *our* fault, never the node's: the run skips the kernel log
  (the holder reads those events and acts on them; later ones are read by the next run),
  logs one tool error and judges the GPUs' live state as usual. It never drains for it;
* a holder stuck longer than :data:`STALE_S` (a process hung in the kernel keeps its
  lock) is not waited for again: the run reads the kernel log without the lock and says
  so, because missing every later XID is worse than reading one event twice;
* no state directory can hold the lock file (both unwritable and no file there yet):
  the run reads without the lock and says so. Nothing can then store the cursor either,
  so every run reads the same events anyway; skipping them would lose the fault.

The lock is released when the process exits whatever happens (``flock`` locks belong to
the open file), so a crashed or killed hook never leaves it held.
"""

from __future__ import annotations

import fcntl
import os
import time
from dataclasses import dataclass
from typing import Any

from gpuguard import durable

LOCK_FILE = "kernel_log.cursor.lock"
#: Longest wait for the lock (s) (our choice: a holder keeps it for one kernel-log read
#: and the checks, 0.1-0.5 s in the fault matrix, plus one pending-drain write; a Prolog
#: should not give more of its 20 s budget to waiting).
WAIT_S = 3.0
#: A holder older than this (s) is taken as stuck (our choice: longer than any hook's
#: default budget, the 40 s of ``gpuguard health`` included, with margin).
STALE_S = 120.0
#: Poll interval while waiting (s) (our choice: ``flock`` has no timeout of its own).
POLL_S = 0.05


@dataclass
class CursorLock:
    """A held cursor lock (``fd`` of the lock file; None: read without the lock, ``why``
    says why: a stale holder or no directory for the lock file). :meth:`release` is
    idempotent."""

    fd: int | None
    path: str
    why: str = ""

    def release(self) -> None:
        """Let the next reader in."""
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)


class LockNotTaken(Exception):
    """The cursor lock could not be taken in time or at all; ``str()`` is one line."""


def _open(dirs: list[str]) -> tuple[int, str]:
    last: OSError | None = None
    for d in dirs:
        path = os.path.join(d, LOCK_FILE)
        for flags in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):  # read-only media: an existing file still locks
            try:
                if flags & os.O_CREAT:
                    os.makedirs(d, mode=0o755, exist_ok=True)
                return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600), path
            except OSError as e:
                last = e
    raise LockNotTaken(f"cursor lock: cannot open {LOCK_FILE} in {', '.join(dirs)}: {last}")


def _holder(fd: int) -> tuple[int | None, float | None]:
    """(pid, since) the holder wrote into the lock file, or (None, None)."""
    try:
        words = os.pread(fd, 100, 0).decode("ascii", "replace").split()
        return int(words[0]), float(words[1])
    except (OSError, ValueError, IndexError):
        return None, None


def acquire(cfg: Any, wait_s: float | None = None, *, now=time.monotonic) -> CursorLock:
    """Take the cursor lock of ``cfg``'s node, waiting at most ``min(WAIT_S, wait_s)``
    seconds. Returns the held lock, or a lock with ``fd=None`` (and ``why``) when the
    holder is stale or no directory can hold the lock file (see the module docstring).
    Raises :class:`LockNotTaken` (one line naming the holder) when it is held and not
    stale after the wait. The holder's age
    is measured on ``CLOCK_MONOTONIC`` (one clock for every process of the host, since
    boot), so a wall-clock step never makes a live holder look stuck."""
    dirs = durable.state_dirs(cfg)
    try:
        fd, path = _open(dirs)
    except LockNotTaken as e:
        return CursorLock(None, "", f"{e}; read without it")
    limit = time.monotonic() + max(0.0, min(WAIT_S, WAIT_S if wait_s is None else wait_s))
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= limit:
                pid, since = _holder(fd)
                os.close(fd)
                held = f"{now() - since:.1f} s" if since is not None else "an unknown time"
                if since is not None and now() - since > STALE_S:
                    return CursorLock(None, path, f"cursor lock {path} held longer than {STALE_S:.0f} s by a stuck "
                                                  "process; read without it")
                raise LockNotTaken(f"cursor lock {path} held by pid {pid} for {held}") from None
            time.sleep(POLL_S)
        except OSError as e:
            os.close(fd)
            raise LockNotTaken(f"cursor lock {path}: {e}") from None
    try:  # who holds it, for a waiter's message and its stale test: one fixed-width record
        # overwritten in place (an ftruncate costs milliseconds on some filesystems)
        os.pwrite(fd, f"{os.getpid()} {now():.3f}".ljust(63).encode() + b"\n", 0)
    except OSError:
        pass  # opened read-only: the lock holds all the same
    return CursorLock(fd, path)
