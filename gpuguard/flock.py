"""One non-blocking exclusive ``flock`` on a lock file: who judges a job, who ingests.

A lock that cannot be had because the file cannot be opened, or because the filesystem
has no locks, is no reason to skip the work it guards (the store's own checks follow):
the caller then goes on unlocked."""

from __future__ import annotations

import os

#: :func:`try_flock`'s answer when the lock file cannot be opened: go on unlocked.
UNLOCKED = -1


def try_flock(path: str, mode: int = 0o600) -> int | None:
    """Take an exclusive ``flock`` on ``path`` (created with ``mode``, opened
    ``O_NOFOLLOW``: a planted symlink is not followed) without waiting. Returns the
    descriptor holding it (close it to release), :data:`UNLOCKED` when the file cannot
    be opened, or None when another process holds the lock. A filesystem without locks
    returns the descriptor unlocked."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError:
        return UNLOCKED
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError:
        pass  # a filesystem without locks: unlocked
    return fd
