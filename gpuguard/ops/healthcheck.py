"""``gpuguard health`` / ``gpuguard-health``: Slurm's ``HealthCheckProgram``.

slurmd runs it as root every ``HealthCheckInterval`` seconds, whether or not a job is on
the node, with ``SLURMD_NODENAME`` as its whole environment (no ``PATH``, no
``SLURM_CONF``), and waits at most 60 s for it (slurmd.c ``run_script_health_check``:
``max_wait = 60 * 1000``; both seen on the testbed). One run, inside ``[health] time_budget_s``:

1. takes a lock, so a slow run never overlaps the next one;
2. reads the node's Slurm state and maintenance (:mod:`gpuguard.ops.maintenance`);
3. runs the node checks (:func:`gpuguard.health.run_health`, the same GPU checks as the
   Prolog, without the per-job ones) plus the registered steps (:mod:`gpuguard.ops.steps`).
   On a node with jobs the kernel log is left to the job's Epilog, which ties the XIDs to
   the job; the GPU state checks still run. The kernel-log cursor lock
   (:mod:`gpuguard.cursorlock`) is held only from the read to the cursor's move, as in
   the hooks (:mod:`gpuguard.nodecheck`): the slow steps run after it is released;
4. acts (:func:`act_on`): drains on a hardware fault with a ``gpuguard:`` reason; resumes
   a node *gpuguard* drained once its fault has cleared for ``[health]
   resume_after_clean_runs`` consecutive runs — only when the fault's recovery kind is
   ``auto`` (:mod:`gpuguard.recovery`: never XID 79, a row-remap failure...), only when
   the reason on the node is still exactly the one gpuguard set (an admin who re-drained
   it, even with the same text, gets a new ``[user@time]`` stamp: NHC issue #134), and
   never in maintenance;
5. queues alerts for findings and resumes, then sends the queue (``gpuguard alert send``)
   and rewrites the Prometheus textfile, with what is left of the budget.

It always exits 0: slurmd only logs the exit status, and gpuguard's own faults never drain.
"""

from __future__ import annotations

import fcntl
import os
import time
from dataclasses import dataclass, field
from typing import Any

from gpuguard.recovery import RECOVERY_TEXT, recovery_of, recovery_of_findings
from gpuguard.ops.nodes import DRY_RUN
from gpuguard.ops import schema as _schema  # noqa: F401  (registers the "ops" store migration set)

BUSY_FLAGS = {"ALLOCATED", "MIXED", "COMPLETING"}


@dataclass
class HealthOutcome:
    """One run: the :class:`gpuguard.health.HealthResult`, the maintenance state, the
    node actions taken (``node_actions`` rows as dicts) and the tool errors."""

    result: Any
    maintenance: Any
    actions: list[dict[str, Any]] = field(default_factory=list)
    tool_errors: list[str] = field(default_factory=list)
    skipped: str = ""


def _lock(cfg: Any) -> Any:
    d = cfg.get("paths", "state_dir")
    os.makedirs(d, mode=0o755, exist_ok=True)
    fd = os.open(os.path.join(d, "health.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def run(cfg: Any, *, store: Any, log: Any, deadline: float, slurm: Any = None,
        kernel_log: str | None = None, now: float | None = None) -> HealthOutcome:
    """One health run (see the module docstring). ``slurm``: a
    :class:`gpuguard.slurm.SlurmCli` (built from the config when None); ``store``: an
    open store or None (then nothing is recorded and nothing resumed).

    The order is the hooks' (:mod:`gpuguard.nodecheck`): the kernel log is read under
    the cursor lock and judged on the live state alone; a drain is written to the
    pending-drain list (:mod:`gpuguard.drainq`), the cursor moves and the lock is
    released; only then are the drain tried, the store read and written and the slow
    registered steps (the NCCL probe: tens of seconds) run, so a Prolog or Epilog that
    starts meanwhile reads its kernel log instead of skipping it. The run and its kernel-log
    events are recorded before the steps start, so a step that crashes, hangs or is
    killed with the run loses nothing the kernel log showed. A drain that only the
    history or the steps show goes through the same pending list, without the cursor."""
    from gpuguard import health as health_mod
    from gpuguard.drainq import decision_recovery
    from gpuguard.nodecheck import commit_cursor, drain_then_commit, pending_drains
    from gpuguard.ops import maintenance as maint_mod
    from gpuguard.ops.nodes import read_node
    from gpuguard.slurm import SlurmCli, SlurmError

    now = time.time() if now is None else now
    node = cfg.node_name
    slurm = slurm or SlurmCli(cfg.get("slurm", "bin_dir"), timeout_s=10.0)
    errors: list[str] = []
    info = None
    try:
        info = read_node(slurm, node)
    except (SlurmError, ValueError) as e:
        errors.append(f"node state: {e}")
    try:
        maint, errs = maint_mod.status(cfg, node, slurm=slurm, now=now)
        errors += errs
        maint_mod.save(cfg, maint)
    except (maint_mod.MaintenanceError, OSError) as e:
        errors.append(f"maintenance: {e}")
        maint = maint_mod.Maintenance(False)
    pend = pending_drains(cfg, deadline, log, allow_drain=not maint.active)
    retried = pend.retry()
    busy = bool(info and info.flags & BUSY_FLAGS)
    col = health_mod.collect(cfg, budget_s=max(1.0, (deadline - time.monotonic()) * 0.5), kernel_log=kernel_log,
                             scan_xid=not busy, store=store, lock_cursor=True)
    drained = None
    try:
        live = health_mod.judge(cfg, col, hook="health", store=None)
        if live.decision.outcome == "drain" and not maint.active and not pend.dry_run:
            drained = drain_then_commit(cfg, pend, col, live)  # releases the lock before scontrol
        else:
            commit_cursor(cfg, col.new_cursor, live.tool_errors)
    finally:
        col.release_cursor()
    held = {"maintenance": maint.active, "dry_run": pend.dry_run}  # what keeps a drain from happening
    res = live if store is None else _judge_and_record(cfg, store, col, live, held)
    added = _run_steps(cfg, store, node, col, res, deadline, log, now=now)
    if res.decision.outcome == "drain" and drained is None and not maint.active:
        # the history or a step: through the pending list, no cursor; a dry run keeps
        # nothing pending (it would fire once [slurm] drain is switched on)
        drained = pend.drain(node, res.decision.reason, decision_recovery(res.decision))
    elif drained is not None:
        res.decision.reason = drained.reason  # what is on the node, how act_on and drain_run trace it
    if added and store is not None and res.run_id is not None:
        try:
            _record_steps(store, cfg, res, added, held)
        except Exception as e:
            res.tool_errors.append(f"store: {e}")
    out = HealthOutcome(res, maint, tool_errors=errors + res.tool_errors)
    if store is not None:
        try:
            out.actions = act_on(cfg, store, node, info, res, maint, drained=drained,
                                 retried=[o for o in retried if o.node == node], deadline=deadline, log=log)
        except Exception as e:  # the store or a bug: never leave the hook on it
            out.tool_errors.append(f"acting: {type(e).__name__}: {e}")
    _alerts_and_metrics(cfg, store, node, res, maint, out, deadline, log)
    return out


def _judge_and_record(cfg: Any, store: Any, col: Any, live: Any, held: dict[str, bool]) -> Any:
    """Judge ``col`` again with the store's history and record the run with its kernel-log
    events (before the slow steps: a run killed in them keeps what the log showed), as
    done (``held``: maintenance / dry run, :func:`gpuguard.policy.done_outcome`).
    Returns the result (with ``live``'s tool errors: the cursor's, the pending list's)."""
    from gpuguard import health as health_mod
    from gpuguard.policy import done_outcome

    res = health_mod.judge(cfg, col, hook="health", store=store)
    res.tool_errors += [e for e in live.tool_errors if e not in res.tool_errors]
    try:
        res.run_id = health_mod.record_run(store, cfg, "health", None, col.started, res, col.new_cursor,
                                           done=done_outcome(res.decision, **held))
    except Exception as e:
        res.tool_errors.append(f"store: {e}")
    return res


def _run_steps(cfg: Any, store: Any, node: str, col: Any, res: Any, deadline: float, log: Any, *,
               now: float) -> list[Any]:
    """Run the registered steps (:mod:`gpuguard.ops.steps`) after the cursor moved; add
    their findings and tool errors to ``res`` and decide again. Returns the findings
    added. A bug in the step runner itself is a tool error, like a step's own crash."""
    from gpuguard import policy as policy_mod
    from gpuguard.ops.steps import StepContext, run_steps

    try:
        more, errs = run_steps(StepContext(cfg, store, node, col.snapshot, deadline, log),
                               cfg.get("health", "disabled_steps"), now=now)
    except Exception as e:
        more, errs = [], [f"health steps: {type(e).__name__}: {e}"]
    res.tool_errors += errs
    if more:
        res.findings += more
        res.decision = policy_mod.decide(res.findings, cfg.policy, cfg.xid_policy)
    return more


def _record_steps(store: Any, cfg: Any, res: Any, added: list[Any], held: dict[str, bool]) -> None:
    """Add the steps' findings to the run recorded before they ran, with the decision
    taken on all findings, as done (``held``; the run's row is what clean-run counts and
    drain tracing read)."""
    import json

    from gpuguard.policy import done_outcome
    from gpuguard.rows import finding_row

    at = time.time()
    ids = {id(f) for f in added}
    rows = [finding_row(f, a, node=cfg.node_name, at=at, job_id=None, run_id=res.run_id)
            for f, a in res.decision.actions if id(f) in ids]

    def go() -> None:
        with store.tx():
            store.conn.execute("update health_runs set decision = ?, policy_decision = ?, reason = ?, tool_errors = ? "
                               "where id = ?", [done_outcome(res.decision, **held), res.decision.decided,
                                                res.decision.reason, json.dumps(res.tool_errors), res.run_id])
            store.insert_many("findings", rows)
    store._guard("health run update", go)


def _clean(res: Any) -> bool:
    return res.decision.outcome != "drain" and res.snapshot is not None


def _latest_action(store: Any, node: str) -> dict[str, Any] | None:
    rows = store.query("select * from node_actions where node = ? order by at desc, id desc limit 1", [node])
    return rows[0] if rows else None


def _record_once(store: Any, node: str, **row: Any) -> dict[str, Any] | None:
    """Record a refusal/suppression unless the node's latest action already says the same
    (every health run would otherwise add the same row)."""
    from gpuguard.ops.nodes import record_action

    last = _latest_action(store, node)
    if last and all(last.get(k) == row.get(k) for k in ("action", "outcome", "why")):
        return None
    row_id = record_action(store, node=node, **row)
    return dict(row, id=row_id, node=node)


#: drain outcome of :mod:`gpuguard.drainq` -> ``node_actions.outcome`` (a dry run is
#: recorded as action ``dry-run``, outcome ``refused``: :data:`gpuguard.ops.nodes.DRY_RUN`)
_DRAIN_OUTCOME = {"confirmed": "done", "pending": "failed", "refused": "refused"}


def act_on(cfg: Any, store: Any, node: str, info: Any, res: Any, maint: Any, *, deadline: float,
           drained: Any = None, retried: list[Any] | None = None, log: Any = None) -> list[dict[str, Any]]:
    """Record the drain of this run (``drained``: its :class:`gpuguard.drainq.Outcome`)
    and earlier drains confirmed now (``retried``), or resume ``node`` (see the module
    docstring). ``info``: the node's :class:`gpuguard.ops.nodes.NodeInfo` as it was
    before this run (None when Slurm could not be read: nothing is resumed). Returns the
    ``node_actions`` rows written."""
    from gpuguard.ops.nodes import drain_run, effective_recovery, record_action, run_findings

    done: list[dict[str, Any]] = []
    for o in retried or []:
        if o.status == "confirmed":
            run = drain_run(store, node, o.reason)
            findings = [f for f in run_findings(store, run["id"]) if f["action"] == "drain"] if run else []
            row = dict(action="drain", by="health", outcome="done", why="pending drain retried and confirmed",
                       reason=o.reason, slurm_reason=_stamped(cfg, node),
                       recovery=recovery_of_findings(findings) if findings else "manual", evidence=findings,
                       run_id=run["id"] if run else None)
            done.append(dict(row, id=record_action(store, node=node, **row), node=node))
    if res.decision.outcome == "drain":
        return done + _record_drain(cfg, store, node, info, res, maint, drained)
    if not _clean(res) or info is None or not (info.drained and info.ours):
        return done
    rec = _drain_record(store, node, info)
    if rec.get("recovery") != "auto" or not cfg.get("health", "resume"):
        return done
    later = effective_recovery(store, node, rec)
    if later != "auto":
        r = _record_once(store, node, action="resume", by="health", outcome="refused",
                         why=f"a later fault while drained needs: {RECOVERY_TEXT[later]}",
                         reason=info.reason or "", recovery=later)
        return done + ([r] if r else [])
    if rec.get("slurm_reason") and rec["slurm_reason"] != info.full_reason:
        r = _record_once(store, node, action="resume", by="health", outcome="refused",
                         why=f"the reason was set again since gpuguard's drain ({info.full_reason})",
                         reason=info.reason or "", recovery=rec.get("recovery", ""))
        return done + ([r] if r else [])
    need = cfg.get("health", "resume_after_clean_runs")
    clean = _clean_runs(store, node, rec["at"])
    if clean < need:
        return done
    if maint.active:
        r = _record_once(store, node, action="suppressed", by="health", outcome="refused",
                         why=f"would resume: {maint.line()}", reason=info.reason or "", recovery="auto",
                         policy_decision="resume")
        return done + ([r] if r else [])
    from gpuguard.ops import act

    status, why = act.resume(cfg, node, deadline=deadline, log=log)
    evidence = {"clean_runs": clean, "drained_at": rec["at"]}
    if (status, why) == ("refused", "dry run"):  # held back, recorded once as maintenance's is
        r = _record_once(store, node, action="dry-run", by="health", outcome="refused",
                         why=f"would resume: {DRY_RUN}", reason=info.reason or "", recovery="auto",
                         evidence=evidence, run_id=res.run_id, policy_decision="resume")
        return done + ([r] if r else [])
    row = dict(action="resume", by="health", outcome=status, why=why, reason=info.reason or "",
               recovery="auto", evidence=evidence, run_id=res.run_id, policy_decision="resume")
    done.append(dict(row, id=record_action(store, node=node, **row), node=node))
    return done


def _record_drain(cfg: Any, store: Any, node: str, info: Any, res: Any, maint: Any,
                  drained: Any) -> list[dict[str, Any]]:
    """:func:`act_on` for a run that decided to drain: the ``node_actions`` row of what
    was done (``suppressed`` in maintenance, ``dry-run``, or the drain's outcome; none
    while the drain on record stands). Returns the rows written."""
    from gpuguard.ops.nodes import record_action

    drains = [dict(f.to_dict(), action=a) for f, a in res.decision.actions if a == "drain"]
    recovery = recovery_of_findings(drains)
    if maint.active:
        r = _record_once(store, node, action="suppressed", by="health", outcome="refused",
                         why=f"would drain: {maint.line()}", reason=res.decision.reason,
                         recovery=recovery, evidence=drains, run_id=res.run_id, policy_decision="drain")
        return [r] if r else []
    if drained is None or (drained.status == "confirmed" and info is not None and info.drained and info.ours):
        return []  # still faulty; the drain on record stands
    if drained.status == "dry-run":  # held back, as maintenance holds it: recorded as such
        r = _record_once(store, node, action="dry-run", by="health", outcome="refused", why=f"would drain: {DRY_RUN}",
                         reason=res.decision.reason, recovery=recovery, evidence=drains, run_id=res.run_id,
                         policy_decision="drain")
        return [r] if r else []
    status = _DRAIN_OUTCOME.get(drained.status, "failed")
    row = dict(action="drain", by="health", outcome=status, why=drained.why, reason=res.decision.reason,
               slurm_reason=_stamped(cfg, node) if status == "done" else None, recovery=recovery,
               evidence=drains, run_id=res.run_id, policy_decision=res.decision.decided)
    if status == "done":
        return [dict(row, id=record_action(store, node=node, **row), node=node)]
    r = _record_once(store, node, **row)
    return [r] if r else []


def _stamped(cfg: Any, node: str) -> str | None:
    """The node's reason with Slurm's ``[user@time]`` stamp, read right after our drain
    (None when it cannot be read: a later resume then compares the text only)."""
    from gpuguard.ops.nodes import read_node

    try:
        return read_node(cfg_slurm(cfg), node).full_reason
    except Exception:
        return None


def cfg_slurm(cfg: Any) -> Any:
    from gpuguard.slurm import SlurmCli

    return SlurmCli(cfg.get("slurm", "bin_dir"), timeout_s=10.0)


def _clean_runs(store: Any, node: str, since: float) -> int:
    from gpuguard.ops.nodes import clean_runs_since

    return clean_runs_since(store, node, since)


def _drain_record(store: Any, node: str, info: Any) -> dict[str, Any]:
    """The record of the gpuguard drain now on ``node``. A drain made by the Prolog or
    Epilog (or on a store since lost) is recorded here once, traced to the health run
    that decided it; one that cannot be traced is ``manual`` (never resumed by itself)."""
    from gpuguard.ops.nodes import drain_run, last_drain, record_action, run_findings

    rec = last_drain(store, node)
    if rec is not None and rec["reason"] == info.reason:
        if not rec.get("slurm_reason"):  # recorded by a hook: keep the stamp as first seen
            store._guard("node action update", lambda: _set_stamp(store, rec["id"], info.full_reason))
            rec = dict(rec, slurm_reason=info.full_reason)
        return rec
    run = drain_run(store, node, info.reason or "")
    if run is not None:
        findings = [f for f in run_findings(store, run["id"]) if f["action"] == "drain"]
        row = dict(action="drain", by=run["hook"], outcome="done", reason=info.reason or "",
                   slurm_reason=info.full_reason, recovery=recovery_of_findings(findings), evidence=findings,
                   run_id=run["id"], at=run["finished_at"], why="recorded by health from the hook's run")
    else:
        code = (info.reason or "").split()[1] if len((info.reason or "").split()) > 1 else ""
        row = dict(action="drain", by="unknown", outcome="done", reason=info.reason or "",
                   slurm_reason=info.full_reason, recovery="manual" if not code else recovery_of(code)[0],
                   why="gpuguard reason found on the node without a record", at=time.time())
        if row["recovery"] == "auto":
            row["recovery"] = "manual"  # no evidence of what drained it: a human decides
    row_id = record_action(store, node=node, user="root", **row)
    return dict(row, id=row_id, node=node)


def _set_stamp(store: Any, row_id: int, stamped: str | None) -> None:
    with store.tx():
        store.db["node_actions"].update(row_id, {"slurm_reason": stamped})


def _alerts_and_metrics(cfg: Any, store: Any, node: str, res: Any, maint: Any, out: HealthOutcome,
                        deadline: float, log: Any) -> None:
    from gpuguard.ops import alert_spool

    if not maint.active:
        try:
            alert_spool.enqueue_findings(cfg, node, res.decision.actions, source="health")
            for a in out.actions:
                if a["action"] == "resume" and a["outcome"] == "done":
                    alert_spool.enqueue(cfg, alert_spool.Alert(
                        node=node, code="node.resumed", severity="info", source="health",
                        message=f"{node} resumed by gpuguard health after {a['evidence']['clean_runs']} clean runs"
                                f" (was: {a['reason']})"))
        except Exception as e:
            out.tool_errors.append(f"alert queue: {type(e).__name__}: {e}")
    if cfg.get("health", "send_alerts") and store is not None:
        try:
            from gpuguard.ops.alert_send import send

            send(cfg, store, deadline=deadline, log=log)
        except Exception as e:
            out.tool_errors.append(f"alert send: {type(e).__name__}: {e}")
    if cfg.get("health", "write_metrics") and cfg.get("metrics", "textfile_dir"):
        try:
            from gpuguard.ops.metrics import write_textfile

            write_textfile(cfg, store, health=out)
        except Exception as e:
            out.tool_errors.append(f"metrics: {type(e).__name__}: {e}")


def main_run(cfg: Any, log: Any, *, kernel_log: str | None = None) -> HealthOutcome:
    """Lock, open the store, run, log; what ``gpuguard-health`` and ``gpuguard health`` do.
    Returns the outcome (``skipped`` set when another run holds the lock)."""
    from gpuguard.store import StoreError, open_store

    started = time.monotonic()
    deadline = started + float(cfg.get("health", "time_budget_s")) * 0.9
    fd = _lock(cfg)
    if fd is None:
        log.warning("health: the previous run still holds the lock; skipping this one")
        return HealthOutcome(None, None, skipped="previous run still running")
    store = None
    try:
        try:
            store = open_store(cfg.store_path)
        except StoreError as e:
            log.error("tool error: %s", e)
        out = run(cfg, store=store, log=log, deadline=deadline, kernel_log=kernel_log)
        for e in out.tool_errors:
            log.error("tool error: %s", e)
        for f, a in out.result.decision.actions:
            log.info("finding %s %s %s gpu=%s: %s", f.code, f.severity, a, f.gpu_index, f.message)
        for a in out.actions:
            log.warning("node %s %s by health: %s%s", a["action"], a["outcome"], a.get("reason", ""),
                        f" ({a['why']})" if a.get("why") else "")
        log.info("health: %s in %.2f s (%s)", out.result.decision.outcome, time.monotonic() - started,
                 out.maintenance.line())
        return out
    finally:
        if store is not None:
            store.close()
        os.close(fd)


def main() -> int:
    """Console script for slurm.conf's ``HealthCheckProgram`` (a bare path, no
    arguments): config, the hooks' watchdog at ``[health] time_budget_s``
    (:func:`gpuguard.hookrun.run_watched`), always exit 0."""
    from gpuguard import log as log_mod
    from gpuguard.hookrun import exit_hook, load_config, run_watched

    os.environ.setdefault("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
    rc = 0
    try:
        cfg, config_error = load_config()
        log = log_mod.setup(cfg.get("paths", "log_file"), "health")
        if config_error:
            # A broken config must not drain or resume a whole cluster on the defaults.
            log.error("tool error: config: %s (health run skipped)", config_error)
        else:
            budget = float(cfg.get("health", "time_budget_s"))
            # forked under the hooks' watchdog: a store or scontrol stuck in
            # uninterruptible sleep cannot keep slurmd's health check waiting
            rc = run_watched(lambda: (main_run(cfg, log), 0)[1], budget, "health",
                             log_file=cfg.get("paths", "log_file"))
    finally:
        exit_hook(0)
    return rc
