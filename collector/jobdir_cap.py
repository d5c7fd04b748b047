"""The per-job size cap of a job's record directory, checked by the collector.

The job directory (``{job_dir_root}/{job_id}``) is the user's to write training records
into. Without a cap, one job filling it fills the filesystem it lives on, and if that is
the store's, every other job on the node loses its samples and summary. So the collector
checks the directory's size every liveness period (:func:`enforce_cap`): when the regular
files in it hold more than ``[paths] job_dir_max_mib``, each file is cut so that the
total stays at the cap (in name order: the first ranks keep their records) -- the ingest
reads at most :data:`gpuguard.collector.ingest.MAX_TOTAL_BYTES` anyway, so nothing
usable is lost. Symlinks, FIFOs and other non-regular entries are skipped (never
followed: the directory is opened with ``O_NOFOLLOW`` and files relative to it).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable
from typing import Any


def enforce_cap(job_dir: str, max_bytes: int) -> tuple[int, list[str]]:
    """Cut the regular files of ``job_dir`` to ``max_bytes`` in all. Returns ``(bytes
    before, names of the files cut)``; ``(0, [])`` when the directory is missing or
    unreadable. Never raises ``OSError``."""
    try:
        dfd = os.open(job_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return 0, []
    try:
        sizes: list[tuple[str, int]] = []
        for name in sorted(os.listdir(dfd)):
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                sizes.append((name, st.st_size))
        total = sum(s for _, s in sizes)
        if total <= max_bytes:
            return total, []
        cut: list[str] = []
        room = max_bytes
        for name, size in sizes:
            keep = max(0, min(size, room))
            room -= keep
            if keep < size:
                try:
                    fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
                    try:
                        if stat.S_ISREG(os.fstat(fd).st_mode):
                            os.ftruncate(fd, keep)
                            cut.append(name)
                    finally:
                        os.close(fd)
                except OSError:
                    continue
        return total, cut
    finally:
        os.close(dfd)


def job_dir_cap_check(cfg: Any, job_id: str, log: logging.Logger) -> Callable[[], None]:
    """The cap of ``{job_dir_root}/{job_id}`` at ``[paths] job_dir_max_mib`` as a callable
    the collector runs every liveness period (logs what it cut)."""
    job_dir = os.path.join(cfg.get("paths", "job_dir_root"), job_id)
    cap = int(cfg.get("paths", "job_dir_max_mib") * 2**20)

    def check() -> None:
        total, cut = enforce_cap(job_dir, cap)
        if cut:
            log.warning("job directory %s held %d bytes, over the %d-byte cap: cut %s", job_dir, total, cap,
                        ", ".join(cut))
    return check
