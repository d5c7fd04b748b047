"""A verdict's findings, their policy action and escalation.

:func:`verdict_findings` turns a verdict into ``verdict.<cause>`` findings;
:func:`act_on_verdict` maps them through the policy table with escalation (the same GPU
straggling in ``escalate_count`` jobs within ``escalate_window_s`` -> ``drain``) and
records them in ``findings``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from gpuguard import policy as policy_mod
from gpuguard.config import Config
from gpuguard.epilog.compare import Settings
from gpuguard.epilog.decide import FINDING_SEVERITY
from gpuguard.model import Finding
from gpuguard.rows import finding_row

if TYPE_CHECKING:
    from gpuguard.epilog.verdict import Verdict


def verdict_findings(v: Verdict) -> list[Finding]:
    """``verdict.<cause>`` findings (``-`` -> ``_``) for an anomalous verdict: one per
    straggling GPU for ``straggler-gpu``, one otherwise; none for healthy/learning.
    ``evidence`` carries ``job_id``, ``template``, ``node`` and the cause's numbers."""
    if not v.anomalous:
        return []
    code = "verdict." + v.cause.replace("-", "_")
    sev = FINDING_SEVERITY.get(v.cause, "warning")
    base = {"job_id": v.job_id, "template": v.template}
    if v.cause == "straggler-gpu":
        return [Finding(code, sev, f"job {v.job_id}: GPU {h['gpu_index']} {h['metric']} {h['value']} vs peers "
                        f"{h['peer_median']} ({h['rel_change']:+.0%})", gpu_index=h["gpu_index"],
                        gpu_uuid=h.get("gpu_uuid"), evidence=dict(base, **h))
                for h in v.evidence.get("gpus", [])]
    node = v.evidence.get("node") or (v.evidence.get("worst") or {}).get("node")
    if node is None and len(v.nodes) == 1:
        node = v.nodes[0]
    gpu_index = (v.evidence.get("worst") or {}).get("gpu_index") if v.cause == "memory-leak" else None
    return [Finding(code, sev, f"job {v.job_id}: {v.summary}", gpu_index=gpu_index,
                    evidence=dict(base, node=node, summary=v.summary))]


def _node_of(f: Finding) -> str | None:
    return f.evidence.get("node")


def escalation(store: Any, f: Finding, *, s: Settings, now: float) -> dict[str, Any] | None:
    """Whether ``f`` repeats: the same code on the same GPU (UUID, else node and index;
    node-level codes: the same node) in at least ``escalate_count`` distinct jobs, this
    one included, within ``escalate_window_s``. Returns ``{"jobs": [...], "window_s"}``
    or ``None``. Raises :class:`gpuguard.store.StoreError`."""
    if f.code not in s.escalate_codes:
        return None
    node = _node_of(f)
    job = f.evidence.get("job_id")
    sql = "select distinct job_id from findings where code = ? and at >= ? and job_id is not null"
    params: list[Any] = [f.code, now - s.escalate_window_s]
    if f.gpu_uuid:
        sql += " and gpu_uuid = ?"
        params.append(f.gpu_uuid)
    else:
        sql += " and node = ?"
        params.append(node)
        if f.gpu_index is not None:
            sql += " and gpu_index = ?"
            params.append(f.gpu_index)
    jobs = {r["job_id"] for r in store.query(sql, params)} - {job}
    if len(jobs) + 1 >= s.escalate_count:
        return {"jobs": [*sorted(jobs), job], "window_s": s.escalate_window_s}
    return None


def act_on_verdict(store: Any, v: Verdict, *, cfg: Config | None, node: str | None = None,
                   now: float | None = None, record: bool = True) -> policy_mod.Decision:
    """Map the verdict's findings through the policy table (``[policy]`` overrides, then
    :data:`gpuguard.policy.DEFAULT_ACTIONS`, then the severity fallback), escalate repeats
    to ``drain`` (:func:`escalation`), record them in ``findings`` (with ``record``) and
    return the decision for ``node`` (default: every node): ``drain`` only for findings
    on that node. Raises :class:`gpuguard.store.StoreError`."""
    s = Settings.from_config(cfg)
    now = time.time() if now is None else now
    acts: list[tuple[Finding, str]] = []
    for f in verdict_findings(v):
        action = policy_mod.action_for(f, cfg.policy if cfg else None, cfg.xid_policy if cfg else None)
        esc = escalation(store, f, s=s, now=now) if action != "drain" else None
        if esc:
            f.evidence["escalated"] = esc
            f.message += f" (repeated in {len(esc['jobs'])} jobs within {esc['window_s'] / 3600:g} h)"
            action = "drain"
        acts.append((f, action))
    if record and acts:
        store.insert_many("findings", [finding_row(f, a, node=_node_of(f) or node, at=now, job_id=v.job_id)
                                       for f, a in acts])
    mine = [(f, a) for f, a in acts if node is None or _node_of(f) in (None, node)]
    drains = [f for f, a in mine if a == "drain"]
    if drains:
        return policy_mod.Decision("drain", policy_mod.format_reason(drains), acts)
    return policy_mod.Decision("proceed", "", acts)
