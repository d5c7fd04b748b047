"""Cluster mode's shared spool directory: names that are safe in it.

Node Epilogs (root) write one part per (job, node) into ``[paths] spool_dir``
(:mod:`gpuguard.epilog.part`); the controller's EpilogSlurmctld worker (SlurmUser) adds
the job's manifest, judges the job and removes what it judged
(:mod:`gpuguard.epilog.cluster`). This is the way Slurm's own HDF5 profiling shares
per-node data: a shared filesystem, no daemon of ours.
"""

from __future__ import annotations

import os
import re
import stat

_SAFE = re.compile(r"^[A-Za-z0-9._+-]{1,128}$")


class SpoolError(Exception):
    """A spool path or file that cannot be used; one line."""


def check_name(kind: str, value: str) -> str:
    """``value`` when it is safe as one path component (``[A-Za-z0-9._+-]{1,128}``, not
    ``.``/``..``); raises :class:`SpoolError` otherwise."""
    if not _SAFE.match(value) or value in (".", ".."):
        raise SpoolError(f"unsafe {kind} for a spool path: {value!r}")
    return value


def check_job_dir(spool_dir: str, d: str) -> None:
    """Raise :class:`SpoolError` when ``d`` exists and is not a real directory, or, in a
    spool others may write (group or world write bit), when it is owned by another user
    than root, the spool's owner or us. Root writes parts into it and SlurmUser reads and
    removes it: a symlink planted in such a spool would send root's part (and the rename
    over ``{node}.part.npz``) into any directory the link names. In a spool only its owner
    can write (the documented 0755 SlurmUser directory), any owner is trusted: an NFS
    ``root_squash`` export makes root's directories ``nobody``'s."""
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        return
    except OSError as e:
        raise SpoolError(f"spool directory {d}: {e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise SpoolError(f"spool directory {d} is not a directory (a symlink or a file): not used")
    try:
        sp = os.stat(spool_dir)
    except OSError:
        return
    if not sp.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return  # only its owner and root can make entries in the spool: any owner is theirs
    if st.st_uid not in {0, os.geteuid(), sp.st_uid}:
        raise SpoolError(f"spool directory {d} belongs to uid {st.st_uid}, not root or the spool's owner: "
                         "not used")
