"""Cluster mode's shared spool directory: names that are safe in it.

Node Epilogs (root) write one part per (job, node) into ``[paths] spool_dir``
(:mod:`gpuguard.epilog.part`); the controller's EpilogSlurmctld worker (SlurmUser) adds
the job's manifest, judges the job and removes what it judged
(:mod:`gpuguard.epilog.cluster`). This is the way Slurm's own HDF5 profiling shares
per-node data: a shared filesystem, no daemon of ours.
"""

from __future__ import annotations

import re

_SAFE = re.compile(r"^[A-Za-z0-9._+-]{1,128}$")


class SpoolError(Exception):
    """A spool path or file that cannot be used; one line."""


def check_name(kind: str, value: str) -> str:
    """``value`` when it is safe as one path component (``[A-Za-z0-9._+-]{1,128}``, not
    ``.``/``..``); raises :class:`SpoolError` otherwise."""
    if not _SAFE.match(value) or value in (".", ".."):
        raise SpoolError(f"unsafe {kind} for a spool path: {value!r}")
    return value
