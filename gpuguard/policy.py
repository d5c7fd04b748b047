"""Policy: finding -> action, and the hook's decision (DESIGN.md, "Detection is separate
from decision").

Actions, mildest first: ``record`` (store only), ``alert`` (store and report to the
operator), ``fail-job`` (the prolog notes the reason in the job's AdminComment and
cancels the job; the node stays up), ``drain`` (``scontrol update state=drain`` with a ``gpuguard:``
reason, then the prolog exits non-zero so Slurm requeues the job).

The shipped default for every finding code, with its source, is declared by the code's
family (:func:`gpuguard.model.declare_codes` in ``gpuguard.checks.*`` and
``gpuguard.epilog.finding_codes``); :func:`default_actions` collects them. ``[policy]`` in
the config overrides per code and ``[policy.xid]`` per XID number.
XID findings (``xid.N``/``sxid.N``) default to the XID catalog's action.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from gpuguard.checks import load_all
from gpuguard.model import FINDING_CODES, SEVERITY_RANK, Finding

ACTION_RANK = {"record": 0, "alert": 1, "fail-job": 2, "drain": 3}

def default_actions() -> dict[str, tuple[str, str]]:
    """``code -> (default action, source)`` for every declared finding code: the hardware
    families' (``gpuguard.checks.*``, loaded here) and those of stages already imported
    (the verdict's ``verdict.*`` codes come with ``gpuguard.epilog``)."""
    load_all()
    return {c.code: (c.action, c.source) for c in FINDING_CODES.values()}


#: Modules declaring finding codes outside ``gpuguard.checks`` (which :func:`default_actions`
#: loads itself); tests/test_config_hostile.py fails when a ``declare_codes`` call lives in
#: a module not listed here (its codes could not be named in ``[policy]``).
CODE_MODULES = ("gpuguard.epilog.finding_codes", "gpuguard.net.nccl_check", "gpuguard.net.dcgm_triage")


def known_codes() -> set[str]:
    """Every finding code a ``[policy]`` key may name: the declared codes of every family
    (hardware checks, and :data:`CODE_MODULES`: verdict, NCCL probe, DCGM triage), loaded here. ``xid.N``/``sxid.N`` are keyed by
    number instead (:func:`is_known_code`)."""
    import importlib

    for mod in CODE_MODULES:
        importlib.import_module(mod)
    return set(default_actions())


def is_known_code(code: str) -> bool:
    """Whether ``code`` is a finding code gpuguard can raise (:func:`known_codes`, or
    ``xid.N``/``sxid.N``): a ``[policy]`` override of any other name would never apply, so a
    typo such as ``pcie.width_degrade = "drain"`` would leave a degraded node in service.
    The codes already declared (the hardware checks every hook loads) are looked at first;
    :data:`CODE_MODULES` (the NCCL probe and its parser, DCGM triage: tens of ms) are imported
    only for a code not among them, so a site policy naming hardware codes costs a hook nothing."""
    import re

    if re.fullmatch(r"s?xid\.[0-9]{1,6}", code) or code in default_actions():
        return True
    return code in known_codes()


def __getattr__(name: str) -> Any:
    # DEFAULT_ACTIONS is computed from the declarations, so that a family imported later
    # (a stage) is in it too.
    if name == "DEFAULT_ACTIONS":
        return default_actions()
    raise AttributeError(name)


@dataclass
class Decision:
    """The hook's decision.

    ``outcome`` is ``proceed``, ``drain`` or ``fail-job``: what the hook acts on;
    ``reason`` is the drain reason (starts with ``gpuguard:``, at most
    :data:`REASON_MAX` characters) or the fail-job message; ``actions`` pairs each
    finding with its action. ``policy_outcome``: the policy table's outcome for the
    findings when the hook acts on another one (``fail-job`` alerted after the job,
    :func:`after_job`; ``fail-job`` escalated to a drain by the Prolog's fail streak);
    ``""`` = ``outcome``.
    """

    outcome: str
    reason: str = ""
    actions: list[tuple[Finding, str]] = field(default_factory=list)
    policy_outcome: str = ""

    @property
    def fail_job_alerted(self) -> bool:
        """A fail-job turned into alerts because the job had ended (:func:`after_job`: the
        hook proceeds where the policy said fail-job); what the Epilog logs, never read
        from the reason text."""
        return self.outcome == "proceed" and self.policy_outcome == "fail-job"

    @property
    def decided(self) -> str:
        """The policy table's outcome: ``policy_outcome``, else ``outcome``."""
        return self.policy_outcome or self.outcome

    @property
    def exit_code(self) -> int:
        """Prolog exit status: 1 for drain (Slurm requeues the job elsewhere), else 0
        (``fail-job`` cancels the job through Slurm: a non-zero exit would drain)."""
        return 1 if self.outcome == "drain" else 0


#: ``sinfo -R -o %E`` shows the whole reason; keep it one readable line.
REASON_MAX = 200


def action_for(f: Finding, policy: dict[str, str] | None = None, xid_policy: dict[int, str] | None = None) -> str:
    """The action for finding ``f``: config override by code, then (XID) by number, then
    the shipped default; an unknown code falls back by severity (critical -> alert,
    never drain: a new code must be given a drain action on purpose)."""
    action = _configured_action(f, policy or {}, xid_policy or {})
    if f.evidence.get("untrusted_source") and ACTION_RANK[action] > ACTION_RANK["alert"]:
        # read from a text file any user can write to (logger -t kernel): never drain on it
        return "alert"
    return action


def _configured_action(f: Finding, policy: dict[str, str], xid_policy: dict[int, str]) -> str:
    if f.code in policy:
        return policy[f.code]
    if f.code.startswith(("xid.", "sxid.")):
        if f.code.startswith("xid."):
            try:
                n = int(f.code.split(".", 1)[1])
            except ValueError:
                n = -1
            if n in xid_policy:
                return xid_policy[n]
        return f.evidence.get("catalog_action", "alert")
    declared = FINDING_CODES.get(f.code)
    if declared is None:
        load_all()  # a hardware family not imported yet
        declared = FINDING_CODES.get(f.code)
    if declared is not None:
        return declared.action
    return "alert" if SEVERITY_RANK[f.severity] >= SEVERITY_RANK["warning"] else "record"


def decide(findings: Iterable[Finding], policy: dict[str, str] | None = None,
           xid_policy: dict[int, str] | None = None) -> Decision:
    """Map findings to actions and pick the strongest: drain > fail-job > proceed.

    The drain reason names the code, the GPU and the evidence of the first (most severe)
    draining finding, e.g. ``gpuguard: xid.79 gpu2 XID 79 GPU has fallen off the bus``,
    plus ``(+N more)`` when several findings drain.
    """
    acts = [(f, action_for(f, policy, xid_policy)) for f in findings]
    acts.sort(key=lambda fa: (-ACTION_RANK[fa[1]], -SEVERITY_RANK[fa[0].severity]))
    for outcome in ("drain", "fail-job"):
        hits = [f for f, a in acts if a == outcome]
        if hits:
            return Decision(outcome, format_reason(hits), acts)
    return Decision("proceed", "", acts)


#: What a fail-job finding becomes after the job: there is no job left to cancel, so an
#: Epilog does what it can, alert (store, log, alert spool); drain stays drain.
AFTER_JOB_NOTE = " (fail-job after the job ended: alerted only)"


def after_job(decision: Decision) -> Decision:
    """``decision`` as an Epilog can act on it: the job has ended, so nothing is failed.
    Each finding's ``fail-job`` becomes ``alert``; a ``fail-job`` outcome becomes
    ``proceed`` whose reason is the fail-job reason with :data:`AFTER_JOB_NOTE` (cut to
    :data:`REASON_MAX`), so the recorded run says what was done and why; that decision
    carries ``policy_outcome="fail-job"``, hence ``fail_job_alerted`` (what callers test:
    the note is text for people and may change). A ``drain`` outcome (an Epilog drains)
    and every other action are kept; so is the finding's own severity. Returns a new
    :class:`Decision`."""
    acts = [(f, "alert" if a == "fail-job" else a) for f, a in decision.actions]
    if decision.outcome != "fail-job":
        return Decision(decision.outcome, decision.reason, acts, decision.policy_outcome)
    reason = decision.reason
    if len(reason) + len(AFTER_JOB_NOTE) > REASON_MAX:
        reason = reason[: REASON_MAX - len(AFTER_JOB_NOTE) - 3] + "..."
    return Decision("proceed", reason + AFTER_JOB_NOTE, acts, policy_outcome="fail-job")


#: What a run records as done when its drain or fail-job was held back
#: (``health_runs.decision``; the policy's outcome goes to ``policy_decision``).
HELD_BACK = {"maintenance": "suppressed", "dry-run": "dry-run"}


def done_outcome(decision: Decision, *, maintenance: bool, dry_run: bool) -> str:
    """What a hook or health run did with ``decision``: its ``outcome``, except that a
    ``drain`` or ``fail-job`` is ``suppressed`` in maintenance (nothing drained or failed,
    :mod:`gpuguard.ops.maintenance`) and ``dry-run`` when ``[slurm] drain = false`` (the
    actuator refuses every drain and fail-job). ``decision.decided`` keeps the policy's."""
    if decision.outcome in ("drain", "fail-job"):
        if maintenance:
            return HELD_BACK["maintenance"]
        if dry_run:
            return HELD_BACK["dry-run"]
    return decision.outcome


def _control(c: str) -> bool:
    o = ord(c)
    return o < 32 or 127 <= o <= 159 or 0x202A <= o <= 0x202E or 0x2066 <= o <= 0x2069


def format_reason(hits: list[Finding]) -> str:
    """``gpuguard: CODE MESSAGE [(+N more)]`` cut to :data:`REASON_MAX` characters.

    Characters Slurm or a shell could mangle (newlines, ``"``) are replaced: the reason is
    passed as one argv element, but it is echoed by sinfo/scontrol in one line."""
    first = hits[0]
    more = f" (+{len(hits) - 1} more)" if len(hits) > 1 else ""
    text = f"gpuguard: {first.code} {first.message}"
    # Control characters (NUL, ESC, C1 such as CSI U+009B, bidi overrides) could come from
    # a replay file or a kernel line (an XID's process name is the user's); NUL would even
    # make the scontrol argv invalid and lose the drain, the others drive or reorder the
    # terminal of the admin reading sinfo -R.
    text = "".join(" " if _control(c) else c for c in text)
    text = " ".join(text.replace('"', "'").split())
    if len(text) + len(more) > REASON_MAX:
        text = text[: REASON_MAX - len(more) - 3] + "..."
    return text + more


def summarize(decision: Decision) -> dict[str, Any]:
    """JSON-ready form of a decision."""
    return {
        "outcome": decision.outcome,
        "reason": decision.reason,
        "findings": [dict(f.to_dict(), action=a) for f, a in decision.actions],
    }
