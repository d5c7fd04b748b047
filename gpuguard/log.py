"""Logging for the hooks: a file when it can be opened, else stderr. Never raises."""

from __future__ import annotations

import logging
import os
import sys

LOG = logging.getLogger("gpuguard")


def setup(log_file: str | None, hook: str, job_id: str | None = None) -> logging.Logger:
    """Log to ``log_file`` (created 0640, directory 0755) or stderr, prefixed with the
    hook and job id. Returns the ``gpuguard`` logger."""
    label = job_id or "-"
    if len(label) > 24 or not (label.isascii() and label.isprintable()) or " " in label:
        label = ascii(label[:24])  # a rejected SLURM_JOB_ID: one readable token, never a line break
    fmt = logging.Formatter(
        # '%' doubled: the label is part of a %-style format string
        f"%(asctime)s {hook}[%(process)d] job={label.replace('%', '%%')} %(levelname)s %(message)s",
        "%Y-%m-%dT%H:%M:%S%z",
    )
    handler: logging.Handler
    try:
        if not log_file:
            raise OSError("no log file configured")
        os.makedirs(os.path.dirname(os.path.abspath(log_file)), mode=0o755, exist_ok=True)
        fd = os.open(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o640)
        handler = logging.StreamHandler(os.fdopen(fd, "a", buffering=1))
    except OSError:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(fmt)
    LOG.handlers[:] = [handler]
    LOG.setLevel(logging.INFO)
    LOG.propagate = False
    return LOG
