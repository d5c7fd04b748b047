"""The job's record directory ``{paths.job_dir_root}/{job_id}``: created for the prolog
(:func:`ensure_job_dir`) and removed for the epilog (:func:`remove_job_dir`) as root,
without ever following a name a user could have planted (both work relative to a
``job_dir_root`` descriptor opened with ``O_NOFOLLOW``). Also the job-id check every
per-job path goes through and the preparation errors; :mod:`gpuguard.collector.launch`
re-exports them all.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from typing import Any

from gpuguard.hookenv import is_job_id


class PrepareError(Exception):
    """Job preparation failed; ``str()`` is one line."""


class JobDirError(PrepareError):
    """The job directory could not be created safely."""


def _check_job_id(job_id: str) -> str:
    job_id = str(job_id)
    # Slurm job ids are decimal; array/het ids reach the hooks as their own numeric ids.
    # ASCII digits only: str.isdigit() also accepts '١٢٣' and '²'.
    if not is_job_id(job_id):
        raise PrepareError(f"not a Slurm job id: {job_id!r}")
    return job_id


def job_dir_path(cfg: Any, job_id: str) -> str:
    """``{paths.job_dir_root}/{job_id}`` (the value the TaskProlog exports)."""
    return os.path.join(cfg.get("paths", "job_dir_root"), _check_job_id(job_id))


def _open_root(root: str) -> int:
    """Create ``root`` (0755) if missing and open it; it must be a real directory owned by
    us (root) and writable by nobody else, else users could swap entries under us."""
    try:
        os.makedirs(root, mode=0o755, exist_ok=True)
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise JobDirError(f"job_dir_root {root}: {e.strerror or e}") from None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        os.close(fd)
        raise JobDirError(
            f"job_dir_root {root}: must be owned by uid {os.geteuid()} and not group/other-writable "
            f"(uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})"
        )
    return fd


def ensure_job_dir(root: str, job_id: str, uid: int, gid: int,
                   log: logging.Logger | None = None) -> str:
    """Create ``{root}/{job_id}`` owned by ``uid:gid``, mode 0700, and return its path.

    Safe against a user who prepared the path in advance (run as root):

    * ``root`` must be a directory (not a symlink) owned by the caller and not writable by
      group or others; it is created 0755 when missing.
    * An existing entry at the path is kept only when it is a real directory already owned
      by ``uid`` (a requeued job keeps its id); its mode is reset to 0700. A symlink or
      any other non-directory is unlinked (never followed); a directory owned by someone
      else (a stale id after a state wipe) is removed with :func:`shutil.rmtree`, whose
      fd-based walk does not follow symlinks (``rmtree.avoids_symlink_attacks``).
    * The new directory is made with ``mkdir(dir_fd=root)``, opened with ``O_NOFOLLOW``
      and changed with ``fchown``/``fchmod`` on that descriptor, so nothing is ever
      followed through a name.

    Raises :class:`JobDirError`.
    """
    job_id = _check_job_id(job_id)
    log = log or logging.getLogger("gpuguard")
    rfd = _open_root(root)
    path = os.path.join(root, job_id)
    try:
        try:
            st = os.stat(job_id, dir_fd=rfd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None and stat.S_ISDIR(st.st_mode) and st.st_uid == uid:
            pass  # the job's own directory (requeue): keep its records
        elif st is not None and stat.S_ISDIR(st.st_mode):
            log.warning("job dir %s owned by uid %d, not %d: replacing it", path, st.st_uid, uid)
            shutil.rmtree(job_id, dir_fd=rfd)
            st = None
        elif st is not None:
            kind = "symlink" if stat.S_ISLNK(st.st_mode) else f"file type {stat.S_IFMT(st.st_mode):o}"
            log.warning("job dir %s is a %s (uid %d): replacing it, not following it", path, kind, st.st_uid)
            os.unlink(job_id, dir_fd=rfd)
            st = None
        if st is None:
            os.mkdir(job_id, 0o700, dir_fd=rfd)
        dfd = os.open(job_id, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=rfd)
        try:
            dst = os.fstat(dfd)
            if dst.st_uid not in (uid, os.geteuid()):
                raise JobDirError(f"job dir {path}: changed owner under us (uid {dst.st_uid})")
            os.fchown(dfd, uid, gid)
            os.fchmod(dfd, 0o700)
        finally:
            os.close(dfd)
    except OSError as e:
        raise JobDirError(f"job dir {path}: {e.strerror or e}") from None
    finally:
        os.close(rfd)
    return path


def remove_job_dir(root: str, job_id: str) -> bool:
    """Remove ``{root}/{job_id}`` and everything in it without following symlinks (for the
    epilog, after ingest). Returns ``False`` when it did not exist. Raises ``OSError``."""
    job_id = _check_job_id(job_id)
    rfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        try:
            st = os.stat(job_id, dir_fd=rfd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(job_id, dir_fd=rfd)
        else:
            os.unlink(job_id, dir_fd=rfd)
        return True
    finally:
        os.close(rfd)
