"""The interconnect's ``gpuguard health`` step: the NCCL probe on idle nodes.

Registered with :mod:`gpuguard.ops.steps` (at most every ``[nccl] interval_s``; between
probes the step's last findings are reported again, so a node with a confirmed low
reading stays unclean until a probe passes). The probe runs only when:

* ``[nccl] health`` is true and the probe is installed: with the default command a
  missing ``[nccl] binary`` means nccl-tests is not deployed on this node (nothing to
  report); an explicitly configured ``command`` that cannot run is ``nccl.probe_failed``;
* the node's GPUs are idle (utilisation under ``[checks] idle_util_pct`` and under 5 %
  of their memory in use, our choice): a probe must never take the GPUs of a job
  (slurmd runs the HealthCheckProgram on allocated nodes too). A GPU whose utilisation or
  memory use is unknown is not idle (nor busy): the probe is skipped with that reason.

Otherwise the step raises :class:`gpuguard.ops.steps.Skip`: its last findings stand
and it tries again at the next health run, not an interval later.
* there is time left in the health run's budget (the probe's timeout is capped by it).
"""

from __future__ import annotations

import os
from typing import Any

from gpuguard.model import Finding
from gpuguard.ops.steps import Skip, StepContext, step

#: A GPU using more than this share of its memory is busy (our choice: an idle GPU holds
#: a few hundred MiB of context at most).
BUSY_MEM_FRAC = 0.05


def _interval(cfg: Any) -> float:
    return float(cfg.get("nccl", "interval_s"))


def gpus_busy(snapshot: Any, cfg: Any) -> list[int]:
    """Indices of GPUs that look in use in ``snapshot``: utilisation above ``[checks]
    idle_util_pct`` or more than :data:`BUSY_MEM_FRAC` of memory in use (each judged only
    when known; :func:`gpus_unknown` lists the GPUs that cannot be judged)."""
    idle_pct = float(cfg.get("checks", "idle_util_pct"))
    busy = []
    for g in getattr(snapshot, "gpus", None) or []:
        u, used, total = g.gpu_util_pct, g.mem_used_mib, g.mem_total_mib
        if (u is not None and u > idle_pct) or (used is not None and total and used / total > BUSY_MEM_FRAC):
            busy.append(g.index)
    return busy


def gpus_unknown(snapshot: Any) -> list[tuple[int, str]]:
    """``(index, what)`` for each GPU whose utilisation or memory use is unknown
    (``what``: ``"utilisation"``, ``"memory use"`` or ``"utilisation and memory use"``):
    such a GPU is not known to be idle, so the probe does not take it."""
    out = []
    for g in getattr(snapshot, "gpus", None) or []:
        missing = [w for w, v in (("utilisation", g.gpu_util_pct),
                                  ("memory use", g.mem_used_mib if g.mem_total_mib else None)) if v is None]
        if missing:
            out.append((g.index, " and ".join(missing)))
    return out


@step("nccl_probe", every_s=_interval)
def nccl_probe(ctx: StepContext) -> list[Finding]:
    """Run and judge one NCCL probe (:func:`gpuguard.net.nccl_check.probe_node`)."""
    cfg = ctx.cfg
    if not cfg.get("nccl", "health"):
        return []
    if not cfg.get("nccl", "command") and not os.access(cfg.get("nccl", "binary"), os.X_OK):
        raise Skip("nccl-tests not installed")
    busy = gpus_busy(ctx.snapshot, cfg)
    if busy:
        if ctx.log is not None:
            ctx.log.info("nccl probe skipped: GPU(s) %s in use", ",".join(map(str, busy)))
        raise Skip(f"GPU(s) {','.join(map(str, busy))} in use")
    unknown = gpus_unknown(ctx.snapshot)
    if unknown:
        why = "; ".join(f"GPU {i}: {what} unknown" for i, what in unknown)
        if ctx.log is not None:
            ctx.log.info("nccl probe skipped, GPUs not judged idle: %s", why)
        raise Skip(f"not judged idle ({why})")
    from gpuguard.net.nccl_check import probe_node

    out = probe_node(cfg, ctx.store, hook="health", budget_left_s=ctx.time_left_s() - 1.0)
    if ctx.log is not None:
        for e in out.tool_errors:
            ctx.log.error("tool error: %s", e)
        ctx.log.info("nccl probe: %s (%s)", out.state, ", ".join(f.code for f in out.findings) or "no findings")
    return out.findings
