"""Which cause is primary: the cause table.

:data:`CAUSE_TABLE` lists every cause once, in precedence order (the first that shows is
primary), with its detector (:mod:`gpuguard.epilog.causes`) and, as data:

``needs_baseline``
    judged only when the template's baseline is ready; a learning template still gets
    the baseline-free causes (hardware fault, stragglers, hard throttling, memory leak).
``explains``
    causes this one explains when primary: they are left out of ``also``. A straggler
    or a throttled GPU makes the other ranks wait in the all-reduce, so their
    communication share rises as a consequence, not as a second cause.
``group``
    causes of one group share the precedence of the group's first row and are ordered
    among themselves by the detectors' ``strength`` (data-pipeline vs communication:
    the share that rose more wins).
A cause may have several rows (detectors) at different precedences: ``job-changed``
when samples per step changed comes before the phase shares (a smaller batch raises the
communication share for the job's own reason); otherwise it is the fallback.

``fallback``
    tried only when no other cause showed (``job-changed``: the job differs and nothing
    on the machine's side explains it).
``severity``
    the ``verdict.<cause>`` finding's severity; with no ``[policy]`` line the policy
    table falls back by severity (warning -> alert, info -> record, never drain).

Precedence (our choice): machine-side causes before job-side ones, the most specific
first — a hardware fault explains everything after it; a straggler node before a
straggler GPU (most of a node's GPUs straggling is the node); throttling before a leak
and before the phase shares it can move.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpuguard.epilog import causes as C

LEARNING = "learning"


@dataclass(frozen=True)
class Cause:
    """One row of the cause table (module docstring)."""

    name: str
    detect: Callable[[C.Context], C.Found | None]
    severity: str
    needs_baseline: bool = False
    explains: tuple[str, ...] = ()
    group: str | None = None
    fallback: bool = False


#: The cause table, in precedence order.
CAUSE_TABLE: tuple[Cause, ...] = (
    Cause("hardware-fault", C.hardware_fault, "critical"),  # the XID/ECC finding itself drains
    Cause("straggler-node", C.straggler_node, "warning", explains=("communication",)),
    Cause("straggler-gpu", C.straggler_gpu, "warning", explains=("communication",)),
    Cause("gpu-throttling", C.gpu_throttling, "warning", explains=("communication",)),
    Cause("memory-leak", C.memory_leak, "warning"),
    Cause("job-changed", C.batch_changed, "info", needs_baseline=True),
    Cause("data-pipeline", C.data_pipeline, "info", needs_baseline=True, group="phase"),
    Cause("communication", C.communication, "warning", needs_baseline=True, group="phase"),
    Cause("job-changed", C.job_changed, "info", needs_baseline=True, fallback=True),
)

#: Every cause a judged run can get ("learning" is the state of a template, not a cause).
CAUSES = ("healthy", *dict.fromkeys(c.name for c in CAUSE_TABLE))
#: Finding severity per cause (from the table).
FINDING_SEVERITY = {c.name: c.severity for c in CAUSE_TABLE}


def _rank(table: tuple[Cause, ...]) -> dict[int, int]:
    """Row (by id) -> its precedence: its index, or its group's first index."""
    first: dict[str, int] = {}
    out = {}
    for i, c in enumerate(table):
        out[id(c)] = first.setdefault(c.group, i) if c.group else i
    return out


def decide(ctx: C.Context, table: tuple[Cause, ...] = CAUSE_TABLE) -> tuple[str, str, dict[str, Any], list[str]]:
    """Run the table's detectors and name the primary cause.

    Returns ``(cause, summary, evidence, also)``: ``cause`` is a table row's name,
    ``healthy``, or ``learning`` (nothing showed and the baseline is not ready);
    ``evidence`` is the primary detector's, plus ``flagged`` (metrics flagged against
    the baseline); ``also``: the other causes that showed, in precedence order, minus
    those the primary explains. Flagged metrics that no cause explains are listed as
    ``unexplained`` on a healthy run.
    """
    rank = _rank(table)
    found: list[tuple[Cause, C.Found]] = []
    for row in table:
        if row.fallback or (row.needs_baseline and not ctx.judged):
            continue
        hit = row.detect(ctx)
        if hit is not None:
            found.append((row, hit))
    if not found:
        for row in table:
            if row.fallback and (ctx.judged or not row.needs_baseline):
                hit = row.detect(ctx)
                if hit is not None:
                    found.append((row, hit))
                    break
    flagged = [c.metric for c in ctx.flagged()]
    if found:
        found.sort(key=lambda rh: (rank[id(rh[0])], -rh[1].strength))
        primary, hit = found[0]
        also = [r.name for r, _ in found[1:] if r.name != primary.name and r.name not in primary.explains]
        ev = dict(hit.evidence)
        ev["flagged"] = flagged
        return primary.name, hit.summary, ev, list(dict.fromkeys(also))
    ev = {"flagged": [], "unexplained": flagged} if flagged else {"flagged": []}
    if not ctx.judged:
        return LEARNING, "template still learning: nothing judged against a baseline", ev, []
    msg = "as usual: every metric within its baseline"
    if flagged:
        msg = "no cause: " + ", ".join(flagged) + " moved without a performance effect"
    return "healthy", msg, ev, []
