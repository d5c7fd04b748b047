"""Node state as Slurm shows it, and gpuguard's record of drains and resumes.

Every drain and resume gpuguard makes — from ``gpuguard health``, from a hook, or by hand
with ``gpuguard node drain|resume`` — is a row of ``node_actions`` (schema:
:mod:`gpuguard.ops.schema`) with the time, who, the reason, the findings as evidence and
the recovery kind (:mod:`gpuguard.recovery`). ``gpuguard node show`` reads them back.
"""

from __future__ import annotations

import getpass
import json
import os
import time
from dataclasses import dataclass
from typing import Any

from gpuguard.slurm import REASON_PREFIX
from gpuguard.ops import schema as _schema  # noqa: F401  (registers the "ops" store migration set)


@dataclass(frozen=True)
class NodeInfo:
    """One node from ``scontrol show node -o``.

    ``state``: e.g. ``IDLE+DRAIN``; ``reason``: the reason text without the stamp (None
    when unset); ``stamp``: ``user@time`` Slurm appended when the reason was set (changes
    whenever anyone sets a reason again, even the same text); ``reservation``: the node
    is in a reservation (``+RESERVED``/``MAINT`` state flags).
    """

    name: str
    state: str
    reason: str | None
    stamp: str | None

    @property
    def flags(self) -> set[str]:
        return set(self.state.split("+"))

    @property
    def drained(self) -> bool:
        """Drained or draining (``DRAIN`` flag; ``DRAINED``/``DRAINING`` base states)."""
        f = self.flags
        return "DRAIN" in f or any(s.startswith("DRAIN") for s in f)

    @property
    def ours(self) -> bool:
        """The reason on the node was written by gpuguard."""
        return bool(self.reason and self.reason.startswith(REASON_PREFIX))

    @property
    def full_reason(self) -> str | None:
        """The reason with its stamp, exactly as Slurm shows it."""
        if self.reason is None:
            return None
        return f"{self.reason} [{self.stamp}]" if self.stamp else self.reason


def parse_node(text: str) -> NodeInfo:
    """``scontrol show node -o NODE`` output -> :class:`NodeInfo`, read by
    :func:`gpuguard.slurm.node_line` (no reason, comment or extra text can set the name,
    the state or the stamp). Raises ``ValueError`` when there is no ``NodeName=`` field."""
    from gpuguard.slurm import node_line

    line = node_line(text)
    if "NodeName" not in line.fields:
        raise ValueError("no NodeName= in scontrol output")
    return NodeInfo(line.fields["NodeName"], line.fields.get("State", ""), line.reason, line.stamp)


def read_node(slurm: Any, node: str, timeout_s: float | None = None) -> NodeInfo:
    """Read ``node`` through ``slurm`` (:class:`gpuguard.slurm.SlurmCli`). Raises
    :class:`gpuguard.slurm.SlurmError` or ``ValueError``."""
    args = ("scontrol", "show", "node", "-o", node)
    out = slurm.run(*args, timeout_s=timeout_s) if timeout_s else slurm.run(*args)
    return parse_node(out)


#: ``node_actions.why`` of an action a dry run held back, after ``would drain: `` /
#: ``would resume: `` (as maintenance's ``would drain: in maintenance (...)``).
DRY_RUN = "dry run ([slurm] drain = false)"


def who() -> str:
    """The human behind a by-hand action: ``$SUDO_USER`` when run through sudo, else the
    login name."""
    try:
        return os.environ.get("SUDO_USER") or getpass.getuser()
    except (KeyError, OSError):
        return f"uid {os.getuid()}"


def record_action(store: Any, *, node: str, action: str, by: str, outcome: str, reason: str = "",
                  why: str = "", slurm_reason: str | None = None, recovery: str = "",
                  evidence: Any = None, user: str | None = None, run_id: int | None = None,
                  at: float | None = None, policy_decision: str | None = None) -> int:
    """Append one ``node_actions`` row; returns its id.

    ``action`` is what was done: ``drain`` | ``resume`` | ``suppressed`` (maintenance
    kept a drain, fail-job or resume from happening) | ``dry-run`` (``[slurm] drain =
    false`` did; ``why`` ``would drain: ``:data:`DRY_RUN`); ``policy_decision`` what
    gpuguard's rules decided (``drain``, ``fail-job``, ``resume``; ``fail-job`` on a drain
    the Prolog's fail streak escalated; None by hand); ``by``: ``health`` | ``prolog`` |
    ``epilog`` | ``hand``; ``outcome``: ``done`` | ``refused`` | ``failed``. Raises
    :class:`gpuguard.store.StoreError`."""
    return store.insert("node_actions", {
        "node": node, "at": time.time() if at is None else at, "action": action, "by": by,
        "user": user if user is not None else ("root" if by != "hand" else who()),
        "outcome": outcome, "why": why, "reason": reason, "slurm_reason": slurm_reason,
        "recovery": recovery, "evidence": json.dumps(evidence, default=str) if evidence is not None else None,
        "run_id": run_id, "policy_decision": policy_decision,
    })


def last_drain(store: Any, node: str) -> dict[str, Any] | None:
    """The latest successful drain of ``node`` recorded in the store, or None."""
    rows = store.query("select * from node_actions where node = ? and action = 'drain' and outcome = 'done' "
                       "order by at desc, id desc limit 1", [node])
    return rows[0] if rows else None


def clean_runs_since(store: Any, node: str, since: float) -> int:
    """Consecutive clean ``gpuguard health`` runs of ``node`` after ``since`` (epoch s),
    counted back from the newest. A run is clean when it decided ``proceed`` *and* read
    the GPUs (a run whose GPU source failed checked nothing and is not clean)."""
    rows = store.query("select decision, source from health_runs where node = ? and hook = 'health' "
                       "and started_at > ? order by started_at desc, id desc", [node, since])
    n = 0
    for r in rows:
        if r["decision"] != "proceed" or not r["source"] or r["source"] == "none":
            break
        n += 1
    return n


def drain_recovery_since(store: Any, node: str, since: float) -> list[str]:
    """Recovery kinds of every finding with action ``drain`` recorded for ``node`` (by
    any hook) at or after ``since``: a second fault while the node was already drained
    (XID 79 on a node drained for an idle slowdown) must block a resume the first fault
    alone would allow."""
    from gpuguard.recovery import recovery_of

    rows = store.query("select distinct code from findings where node = ? and at >= ? and action = 'drain'",
                       [node, since])
    return [recovery_of(r["code"])[0] for r in rows]


def effective_recovery(store: Any, node: str, rec: dict[str, Any]) -> str:
    """What it takes to bring back a node drained by ``rec`` (a ``node_actions`` drain
    row): the worst of its own recovery kind and those of later drain findings."""
    from gpuguard.recovery import worst

    return worst([rec.get("recovery") or "manual", *drain_recovery_since(store, node, rec["at"])])


def drain_run(store: Any, node: str, reason_text: str) -> dict[str, Any] | None:
    """The newest health run (any hook) of ``node`` that decided to drain with exactly
    ``reason_text``: how a drain made by the Prolog/Epilog is traced to its findings."""
    rows = store.query("select * from health_runs where node = ? and decision = 'drain' and reason = ? "
                       "order by started_at desc, id desc limit 1", [node, reason_text])
    return rows[0] if rows else None


def run_findings(store: Any, run_id: int) -> list[dict[str, Any]]:
    """Findings of one health run as dicts (code, severity, action, gpu_index, message,
    evidence decoded)."""
    rows = store.query("select code, severity, action, gpu_index, gpu_uuid, message, evidence from findings "
                       "where run_id = ? order by id", [run_id])
    for r in rows:
        try:
            r["evidence"] = json.loads(r["evidence"]) if r["evidence"] else {}
        except ValueError:
            r["evidence"] = {}
    return rows


def history(store: Any, node: str, since: float = 0.0, limit: int = 200) -> list[dict[str, Any]]:
    """``node``'s drains, resumes, suppressions and findings (action above ``record``)
    since ``since``, newest first, as ``{"at", "kind", "what", "detail"}`` dicts."""
    out: list[dict[str, Any]] = []
    for a in store.query("select * from node_actions where node = ? and at >= ? order by at desc limit ?",
                         [node, since, limit]):
        detail = a["reason"] or ""
        if a["outcome"] != "done":
            detail = f"{a['outcome']}: {a['why']}" + (f" ({detail})" if detail else "")
        out.append({"at": a["at"], "kind": a["action"], "what": f"by {a['by']} ({a['user']})",
                    "detail": detail, "recovery": a["recovery"] or ""})
    for f in store.query("select f.at, f.code, f.severity, f.action, f.gpu_index, f.message, r.hook "
                         "from findings f left join health_runs r on r.id = f.run_id "
                         "where f.node = ? and f.at >= ? and f.action != 'record' order by f.at desc limit ?",
                         [node, since, limit]):
        gpu = "" if f["gpu_index"] is None else f" gpu{f['gpu_index']}"
        out.append({"at": f["at"], "kind": "finding", "what": f"{f['code']}{gpu} {f['severity']} -> {f['action']}",
                    "detail": f"{f['message']} (by {f['hook'] or '?'})", "recovery": ""})
    out.sort(key=lambda r: -r["at"])
    return out[:limit]


def record_hook_drain(store: Any, node: str, live: Any, *, by: str, run_id: int | None, log: Any,
                      decision: Any = None) -> None:
    """After a Prolog/Epilog recorded its run: the drain it made (``live.drain``, a
    :class:`gpuguard.drainq.Outcome`; a dry run's as action ``dry-run``, refused) as a
    ``node_actions`` row, with ``decision``'s policy outcome and the drain findings
    of ``decision`` (the recorded run's; default the live check's) as evidence and their
    recovery kind. The stamped Slurm reason is filled in by the next ``gpuguard health``
    run (no extra Slurm call inside the hook). Never raises."""
    try:
        o = getattr(live, "drain", None)
        if o is None:
            return
        from gpuguard.recovery import recovery_of_findings

        d = decision if decision is not None else live.result.decision
        drains = [dict(f.to_dict(), action=a) for f, a in d.actions if a == "drain"]
        if o.status == "dry-run":  # held back: recorded as gpuguard health records it
            if getattr(live, "maintenance", False):
                return  # maintenance held it back: its "suppressed" row says so
            record_action(store, node=node, action="dry-run", by=by, outcome="refused", why=f"would drain: {DRY_RUN}",
                          reason=o.reason, recovery=recovery_of_findings(drains), evidence=drains, run_id=run_id,
                          user="root", policy_decision=d.decided)
            return
        outcome = {"confirmed": "done", "refused": "refused"}.get(o.status, "failed")
        record_action(store, node=node, action="drain", by=by, outcome=outcome, why=o.why, reason=o.reason,
                      recovery=recovery_of_findings(drains), evidence=drains, run_id=run_id, user="root",
                      policy_decision=d.decided)
    except Exception as e:
        log.error("tool error: recording the drain: %s: %s", type(e).__name__, e)
