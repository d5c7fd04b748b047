"""Per-job preparation called by the prolog (placeholder until the collector lands)."""

from __future__ import annotations

import logging
from typing import Any


def prepare_job(cfg: Any, env: dict[str, str], log: logging.Logger) -> None:
    """Create the job's record directory and start the detached collector. Raises on
    failure; the prolog logs that as a tool error and lets the job run."""
    return None
