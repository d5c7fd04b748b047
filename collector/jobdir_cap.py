"""The per-job size cap of a job's record directory, checked by the collector.

The job directory (``{job_dir_root}/{job_id}``) is the user's to write training records
into. Without a cap, one job filling it fills the filesystem it lives on, and if that is
the store's, every other job on the node loses its samples and summary. So the collector
checks the directory's size every liveness period (:func:`enforce_cap`): when the regular
files in it hold more than ``[paths] job_dir_max_mib`` on disk, each file is cut so that
the total stays at the cap (in name order: the first ranks keep their records). Only
files owned by the directory's owner (the job's user) count and are cut; symlinks,
FIFOs and other non-regular entries are skipped (never followed: the directory is opened
with ``O_NOFOLLOW`` and files relative to it).

What the collector has already stored (its ingest offsets, ``train_offsets``) is given
back to the filesystem first (:func:`release_ingested`: ``fallocate(2)``
``FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE`` on the ingested prefix, whole blocks), and
the cap counts the bytes a file holds on disk (``st_blocks``), so a long job that logs
every step keeps all its records while the directory stays small: the writer's appends
and the ingest's offsets are unchanged (the file keeps its size, its start reads as
zeros). The directory is gpuguard's (the Epilog removes it after its ingest). Where the
filesystem cannot punch holes (``EOPNOTSUPP``), the cap cuts as before.
"""

from __future__ import annotations

import functools
import logging
import os
import stat
from collections.abc import Callable
from typing import Any


def enforce_cap(job_dir: str, max_bytes: int) -> tuple[int, list[str]]:
    """Cut the regular files of ``job_dir`` to ``max_bytes`` on disk in all (a file's
    bytes on disk: its size less a released prefix). Returns ``(bytes on disk before,
    names of the files cut)``; ``(0, [])`` when the directory is missing or unreadable.
    Never raises ``OSError``."""
    try:
        dfd = os.open(job_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return 0, []
    try:
        # only the job user's own files: the collector is root, and a hard link the user
        # made to a file of someone else's (a root file where fs.protected_hardlinks is 0)
        # must never be cut
        owner = os.fstat(dfd).st_uid
        sizes: list[tuple[str, int]] = []
        for name in sorted(os.listdir(dfd)):
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_uid == owner:
                # bytes on disk: a released (hole-punched) prefix holds none
                sizes.append((name, st.st_size, min(st.st_size, st.st_blocks * 512)))
        total = sum(used for _, _, used in sizes)
        if total <= max_bytes:
            return total, []
        cut: list[str] = []
        room = max_bytes
        for name, size, used in sizes:
            keep = max(0, min(used, room))
            room -= keep
            if keep < used:
                try:
                    fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
                    try:
                        fst = os.fstat(fd)
                        if stat.S_ISREG(fst.st_mode) and fst.st_uid == owner:
                            os.ftruncate(fd, size - used + keep)  # after the released prefix
                            cut.append(name)
                    finally:
                        os.close(fd)
                except OSError:
                    continue
        return total, cut
    finally:
        os.close(dfd)


_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02  # linux/falloc.h


@functools.cache
def _fallocate() -> Any:
    """libc's ``fallocate(2)``, loaded once per process."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
    return libc.fallocate


def _punch_hole(fd: int, length: int) -> bool:
    """``fallocate(fd, PUNCH_HOLE | KEEP_SIZE, 0, length)``: True when the filesystem did it."""
    return _fallocate()(fd, _FALLOC_FL_KEEP_SIZE | _FALLOC_FL_PUNCH_HOLE, 0, length) == 0


def release_ingested(job_dir: str, offsets: list[tuple[str, int, int, int]]) -> int:
    """Give back the disk blocks of what the ingest has stored: for each ``(name, dev,
    ino, offset)`` of ``train_offsets``, punch a hole over the whole blocks before
    ``offset`` in ``job_dir/name`` when it is still that regular file (same device and
    inode) and at least that long (a file cut or rewritten since is left alone; its next
    ingest starts over). Returns the bytes released (0 where the filesystem cannot punch
    holes). Never raises ``OSError``."""
    try:
        dfd = os.open(job_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return 0
    released = 0
    try:
        for name, dev, ino, offset in offsets:
            try:
                fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (dev, ino) or st.st_size < offset:
                    continue
                length = offset - offset % max(st.st_blksize, 512)
                used_before = st.st_blocks * 512
                if length > 0 and used_before > st.st_size - length and _punch_hole(fd, length):
                    released += max(0, used_before - os.fstat(fd).st_blocks * 512)
            except OSError:
                continue
            finally:
                os.close(fd)
    finally:
        os.close(dfd)
    return released


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
