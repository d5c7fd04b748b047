"""How the operations side drains and resumes: through the core's one actuator
(:class:`gpuguard.actuator.Actuator` when present), never a second implementation.

Results are ``(status, why)``: ``status`` is ``done`` | ``refused`` | ``failed``.
"""

from __future__ import annotations

import time
from typing import Any


def _actuator(cfg: Any, deadline: float | None, log: Any) -> Any:
    from gpuguard.actuator import Actuator

    return Actuator.from_config(cfg, deadline=deadline, log=log)


def drain(cfg: Any, node: str, reason: str, *, deadline: float | None = None, log: Any = None) -> tuple[str, str]:
    """Drain ``node`` with ``reason`` (starts with ``gpuguard:``)."""
    try:
        res = _actuator(cfg, deadline, log).drain(node, reason)
        return res.status, res.why
    except ImportError:
        return _legacy(cfg, deadline, lambda s, t: s.drain_node(node, reason))


def resume(cfg: Any, node: str, *, deadline: float | None = None, log: Any = None) -> tuple[str, str]:
    """Resume ``node`` when its current reason is gpuguard's (refused otherwise)."""
    try:
        res = _actuator(cfg, deadline, log).resume(node)
        return res.status, res.why
    except ImportError:
        from gpuguard.slurm import REASON_PREFIX

        def go(s: Any, t: float) -> None:
            cur = s.node_reason(node)
            if not cur or not cur.startswith(REASON_PREFIX):
                raise _Refused(f"its reason {cur!r} is not gpuguard's")
            s.run("scontrol", "update", f"nodename={node}", "state=resume", timeout_s=t)
        return _legacy(cfg, deadline, go)


def force_resume(cfg: Any, node: str) -> tuple[str, str]:
    """Resume ``node`` whoever drained it (``gpuguard node resume --force``: a human's
    explicit choice). The raw Slurm command, behind the same dry-run switch."""
    if not cfg.get("slurm", "drain"):
        return "refused", "dry run"
    from gpuguard.slurm import SlurmCli, SlurmError

    try:
        SlurmCli(cfg.get("slurm", "bin_dir")).run("scontrol", "update", f"nodename={node}", "state=resume")
    except SlurmError as e:
        return "failed", str(e)
    return "done", ""


class _Refused(Exception):
    pass


def _legacy(cfg: Any, deadline: float | None, fn: Any) -> tuple[str, str]:
    # Until the core actuator is on this branch: the same rules, on gpuguard.slurm.
    if not cfg.get("slurm", "drain"):
        return "refused", "dry run"
    from gpuguard.slurm import SlurmCli, SlurmError

    left = 15.0 if deadline is None else deadline - time.monotonic()
    if left < 0.2:
        return "failed", "no time left in the budget"
    try:
        fn(SlurmCli(cfg.get("slurm", "bin_dir"), timeout_s=min(15.0, left)), min(15.0, left))
    except _Refused as e:
        return "refused", str(e)
    except (SlurmError, ValueError) as e:
        return "failed", str(e)
    return "done", ""
