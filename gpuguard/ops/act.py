"""How the operations side drains and resumes: through the core's one actuator
(:class:`gpuguard.actuator.Actuator`: ``gpuguard:`` reasons only, someone else's drain
never touched, dry run, budget-capped Slurm calls), never a second implementation.

Results are ``(status, why)``: ``status`` is ``done`` | ``refused`` | ``failed``.
"""

from __future__ import annotations

from typing import Any


def _actuator(cfg: Any, deadline: float | None, log: Any) -> Any:
    from gpuguard.actuator import Actuator

    return Actuator.from_config(cfg, deadline=deadline, log=log)


def drain(cfg: Any, node: str, reason: str, *, deadline: float | None = None, log: Any = None) -> tuple[str, str]:
    """Drain ``node`` with ``reason`` (starts with ``gpuguard:``)."""
    res = _actuator(cfg, deadline, log).drain(node, reason)
    return res.status, res.why


def resume(cfg: Any, node: str, *, deadline: float | None = None, log: Any = None) -> tuple[str, str]:
    """Resume ``node`` when its current reason is gpuguard's (refused otherwise)."""
    res = _actuator(cfg, deadline, log).resume(node)
    return res.status, res.why


def force_resume(cfg: Any, node: str) -> tuple[str, str]:
    """Resume ``node`` whoever drained it: ``gpuguard node resume --force``, a human's
    explicit choice, so the actuator's "gpuguard's drains only" rule is deliberately
    stepped over (the raw :meth:`gpuguard.slurm.SlurmCli.resume_node`), behind the same
    dry-run switch."""
    if not cfg.get("slurm", "drain"):
        return "refused", "dry run"
    from gpuguard.slurm import SlurmCli, SlurmError

    try:
        SlurmCli(cfg.get("slurm", "bin_dir")).resume_node(node)
    except SlurmError as e:
        return "failed", str(e)
    return "done", ""
