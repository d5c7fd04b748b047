"""The job judge: each job judged once, with every node's data, against its template's
cluster-wide baseline.

Where it runs (DESIGN.md, "Cluster mode"): in EpilogSlurmctld's detached worker on the
controller as soon as every node's spool part is in (or at ``[epilog] slurmctld_wait_s``,
judging what arrived and naming the nodes that are missing), and in ``gpuguard cluster
ingest`` for jobs whose parts came late or whose worker died. On a single host without a
spool the node Epilog calls it with its own part, on the one store that is both node and
cluster store: the same code path.

What :func:`judge_parts` does, in order, against the *cluster store*:

1. the node summaries of the parts go to ``job_summaries`` (reports read them);
2. the verdict (:func:`gpuguard.epilog.verdict.judge_job` on
   :func:`gpuguard.epilog.part.to_job_data`): ``verdicts``, ``comparisons``, baseline;
3. the job's ``verdict.*`` findings are replaced and mapped through the policy with
   escalation (:func:`gpuguard.epilog.verdict.act_on_verdict`): escalation counts *jobs*
   per GPU UUID / node, because each job writes its findings once, here;
4. escalation drains, made from here with the ``gpuguard:`` reason, at most once per
   (job, node) (``cluster_drains``);
5. the AdminComment (:mod:`gpuguard.epilog.admincomment`), one ``sacctmgr`` call per
   judgment, none when the text is unchanged;
6. the ``cluster_jobs`` row, last: a judge killed before it is judged again by ``cluster
   ingest``.

**Idempotent.** The judgment time is the first judgment's (kept in ``cluster_jobs``), the
verdict row and findings of the job are replaced, drains and the AdminComment are not
repeated; a job whose set of parts has not changed since its last judgment is not judged
again at all. Twice gives one verdict row and the same findings.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: EpilogSlurmctld environment -> manifest key (SLURM-FACTS.md §4: what the hook sees).
MANIFEST_ENV = {"SLURM_JOB_USER": "user", "SLURM_JOB_UID": "uid", "SLURM_JOB_ACCOUNT": "account",
                "SLURM_JOB_PARTITION": "partition", "SLURM_JOB_NAME": "name", "SLURM_JOB_COMMENT": "comment",
                "SLURM_JOB_NUM_NODES": "num_nodes", "SLURM_JOB_NODELIST": "nodelist",
                "SLURM_JOB_EXIT_CODE": "exit_code_raw"}


@dataclass
class JudgeResult:
    """What one call of :func:`judge_parts` did. ``skipped``: nothing changed since the
    last judgment (no work done); ``verdict``: :meth:`Verdict.to_dict` or None;
    ``drains``: ``(node, reason)`` made; ``comment_set``: sacctmgr was called and worked."""

    job_id: str
    nodes: list[str]
    missing: list[str]
    skipped: bool = False
    verdict: dict[str, Any] | None = None
    drains: list[tuple[str, str]] = field(default_factory=list)
    comment_set: bool = False
    comment: str | None = None


def meta_from_env(env: Mapping[str, str], nodes: list[str]) -> dict[str, Any]:
    """The job's manifest from a hook environment: :data:`MANIFEST_ENV` keys plus the
    expanded ``nodes``. Numbers stay strings where Slurm gave odd values."""
    m: dict[str, Any] = {"job_id": env.get("SLURM_JOB_ID"), "nodes": list(nodes), "written_at": time.time()}
    for k, name in MANIFEST_ENV.items():
        v = env.get(k)
        if v is not None:
            m[name] = v
    for k in ("uid", "num_nodes", "exit_code_raw"):
        v = m.get(k)
        if isinstance(v, str) and v.isascii() and v.isdigit() and len(v) <= 10:
            m[k] = int(v)
        elif k in m:
            m[k] = None
    return m


def meta_from_parts(job_id: str, parts: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """A manifest when EpilogSlurmctld never wrote one: the first part's job fields."""
    m: dict[str, Any] = {"job_id": str(job_id), "nodes": sorted(parts)}
    for node in sorted(parts):
        j = parts[node].get("job") or {}
        for k, v in j.items():
            m.setdefault(k, v)
        break
    return m


def _allocated_gpus(part: Mapping[str, Any]) -> int:
    """GPUs Slurm allocated the job on the part's node: the node Epilog's ``job.gpus``
    (:func:`gpuguard.epilog.template.gpus_allocated`); a part of an earlier release,
    without it, counts its sampled GPUs as before."""
    n = (part.get("job") or {}).get("gpus")
    if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
        return n
    return len(part.get("gpus") or [])


def _template(meta: Mapping[str, Any], parts: Mapping[str, Mapping[str, Any]]) -> Any:
    """The job's template from the same facts the node side reads: the GPUs *allocated*
    per node (``SLURM_JOB_GPUS`` on the node, in the part's ``job.gpus``), not the GPUs
    sampled (none on a MIG node: ``collector/mig.py``), and the node's inventory GPU name
    (``job.gpu_name``) before a sampled GPU's. Partition, job name and node count come
    from the manifest (EpilogSlurmctld's environment, SLURM-FACTS.md §4)."""
    from gpuguard.epilog.template import job_template

    gpus_per_node = max((_allocated_gpus(p) for p in parts.values()), default=0)
    gpu_name = next((n for p in parts.values() for n in [(p.get("job") or {}).get("gpu_name")]
                     if isinstance(n, str) and n), None)
    gpu_name = gpu_name or next((g.get("name") for p in parts.values() for g in p.get("gpus") or []
                                 if g.get("name")), None)
    env = {"SLURM_JOB_ID": str(meta.get("job_id") or "")}
    for key, name in (("SLURM_JOB_COMMENT", "comment"), ("SLURM_JOB_PARTITION", "partition"),
                      ("SLURM_JOB_NAME", "name"), ("SLURM_JOB_NUM_NODES", "num_nodes")):
        if meta.get(name) is not None:
            env[key] = str(meta[name])
    if "SLURM_JOB_NUM_NODES" not in env:
        env["SLURM_JOB_NUM_NODES"] = str(len(meta.get("nodes") or parts) or 1)
    if gpus_per_node:
        env["SLURM_JOB_GPUS"] = ",".join(str(i) for i in range(gpus_per_node))
    return job_template(env, job_info={"JobName": str(meta.get("name") or "")}, gpu_name=gpu_name)


def _prev(store: Any, job_id: str) -> dict[str, Any] | None:
    rows = store.query("select * from cluster_jobs where job_id = ?", [str(job_id)])
    return rows[0] if rows else None


def _drain(store: Any, drainer: Any, job_id: str, node: str, reason: str, now: float) -> bool:
    """Drain ``node`` once for this job through ``drainer`` (the controller's
    :class:`gpuguard.actuator.Actuator`, or a node Epilog's pending-drain list); returns
    whether Slurm took it. Logged by the drainer, recorded in ``cluster_drains``."""
    if store.query("select 1 from cluster_drains where job_id = ? and node = ?", [job_id, node]):
        return False
    res = drainer.drain(node, reason)
    done = getattr(res, "status", "") in ("done", "confirmed")
    store.insert("cluster_drains", {"job_id": job_id, "node": node, "at": now, "reason": reason, "done": int(done)})
    return done


def _set_comment(slurm: Any, job_id: str, text: str, log: Any, retries: int, retry_sleep_s: float) -> bool:
    from gpuguard.slurm import SlurmError

    for attempt in range(1, retries + 1):
        try:
            slurm.set_admin_comment(job_id, text)
            log.info("AdminComment set (%d bytes)", len(text.encode()))
            return True
        except (SlurmError, ValueError) as e:
            log.warning("AdminComment attempt %d/%d failed: %s", attempt, retries, e)
            if attempt < retries:
                time.sleep(retry_sleep_s)
    log.error("tool error: AdminComment not set for job %s", job_id)
    return False


def _save_part_summaries(store: Any, parts: Mapping[str, Mapping[str, Any]], present: list[str],
                         log: Any) -> None:
    """Store each present node's job summary from its part; a malformed one is logged and skipped."""
    from gpuguard.epilog.summary import JobSummary, save_summary

    for node in present:
        s = parts[node].get("summary")
        if isinstance(s, dict):
            try:
                save_summary(store, JobSummary.from_dict(s))
            except (TypeError, ValueError) as e:
                log.warning("summary of %s in its part is malformed: %s", node, e)


def _drain_escalations(store: Any, decision: Any, v: Any, *, cfg: Any, drainer: Any, job_id: str,
                       t: float, log: Any) -> list[tuple[str, str]]:
    """Drain each node the verdict's ``drain`` actions name (the finding's ``node``, else the
    job's only node), one reason per node; returns the (node, reason) pairs drained."""
    from gpuguard import policy as policy_mod

    by_node: dict[str, list[Any]] = {}
    for f, action in decision.actions:
        if action == "drain":
            node = f.evidence.get("node") or (v.nodes[0] if len(v.nodes) == 1 else None)
            if node:
                by_node.setdefault(node, []).append(f)
    if by_node and drainer is None:
        from gpuguard.actuator import Actuator

        drainer = Actuator.from_config(cfg, log=log)
    drained = []
    for node, fs in sorted(by_node.items()):
        reason = policy_mod.format_reason(fs)
        if _drain(store, drainer, job_id, node, reason, t):
            drained.append((node, reason))
    return drained


def judge_parts(store: Any, job_id: str, parts: Mapping[str, Mapping[str, Any]], *, cfg: Any,
                meta: Mapping[str, Any], slurm: Any, log: Any, now: float | None = None,
                set_comment: bool = True, retries: int = 3, retry_sleep_s: float = 2.0,
                drainer: Any = None) -> JudgeResult:
    """Judge job ``job_id`` from ``parts`` (node -> decoded part) in the cluster ``store``
    (module docstring). ``meta``: the job's manifest (:func:`meta_from_env`, else
    :func:`meta_from_parts`); its ``nodes`` are the nodes expected. ``slurm``: a
    :class:`gpuguard.slurm.SlurmCli` for the AdminComment; ``set_comment`` False leaves
    the AdminComment alone (single host without slurmdbd access). ``drainer``: what
    escalation drains go through (default: :meth:`gpuguard.actuator.Actuator.from_config`:
    ``gpuguard:`` reasons only, never over someone else's reason, dry run unless
    ``[slurm] drain``).

    Raises :class:`gpuguard.store.StoreError` and :class:`gpuguard.config.ConfigError`;
    callers log them as tool errors (nothing is drained for them)."""
    from gpuguard.epilog import admincomment
    from gpuguard.epilog.part import to_job_data
    from gpuguard.epilog.verdict import act_on_verdict, judge_job

    job_id = str(job_id)
    present = sorted(parts)
    expected = sorted(set(meta.get("nodes") or []) | set(present))
    missing = [n for n in expected if n not in parts]
    prev = _prev(store, job_id)
    res = JudgeResult(job_id, present, missing)
    if prev and json.loads(prev["parts"] or "[]") == present and json.loads(prev["missing"] or "[]") == missing \
            and (prev["admin_comment_at"] is not None or not set_comment):
        res.skipped = True
        return res
    t = float(prev["first_judged_at"]) if prev and prev["first_judged_at"] is not None else (
        time.time() if now is None else now)
    _save_part_summaries(store, parts, present, log)
    exit_raw = meta.get("exit_code_raw")
    v = judge_job(store, job_id, cfg=cfg, template=_template(meta, parts),
                  exit_code=exit_raw if isinstance(exit_raw, int) else None, now=t,
                  data=to_job_data(job_id, parts))
    if missing:
        v.evidence["missing_nodes"] = missing
    store.db.execute("delete from findings where job_id = ? and code like 'verdict.%'", [job_id])
    decision = act_on_verdict(store, v, cfg=cfg, node=None, now=t)
    res.verdict = v.to_dict()
    res.drains += _drain_escalations(store, decision, v, cfg=cfg, drainer=drainer, job_id=job_id, t=t, log=log)
    summaries = {n: parts[n].get("summary") for n in present}
    text = admincomment.encode(admincomment.build(job_id, res.verdict, summaries, missing))
    res.comment = text
    comment_at = prev["admin_comment_at"] if prev and prev["admin_comment"] == text else None
    if set_comment and comment_at is None and _set_comment(slurm, job_id, text, log, retries, retry_sleep_s):
        res.comment_set = True
        comment_at = time.time()
    window = next((p.get("window_s") for p in parts.values() if p.get("window_s")), None)
    gpus = sum(_allocated_gpus(p) for p in parts.values())  # as sacct's AllocTRES gres/gpu counts
    row = {"job_id": job_id, "user": meta.get("user"), "uid": meta.get("uid"), "account": meta.get("account"),
           "partition": meta.get("partition"), "job_name": meta.get("name"), "nodes": json.dumps(expected),
           "parts": json.dumps(present), "missing": json.dumps(missing), "gpus": gpus,
           "exit_code_raw": exit_raw if isinstance(exit_raw, int) else None,
           "state": "partial" if missing else "complete", "first_judged_at": t, "judged_at": time.time(),
           "window_s": window, "cause": v.cause, "admin_comment": text if comment_at else None,
           "admin_comment_at": comment_at}

    def go() -> None:
        with store.tx():
            store.db["cluster_jobs"].upsert(row, pk="job_id")
    store._guard("cluster_jobs upsert", go)
    return res
