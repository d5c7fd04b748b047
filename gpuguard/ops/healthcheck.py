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
   the job; the GPU state checks still run;
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
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from gpuguard.recovery import recovery_of, recovery_of_findings

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
    open store or None (then nothing is recorded and nothing resumed)."""
    from gpuguard import health as health_mod
    from gpuguard.ops import maintenance as maint_mod
    from gpuguard.ops.nodes import read_node
    from gpuguard.ops.steps import StepContext, run_steps
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
    busy = bool(info and info.flags & BUSY_FLAGS)

    def extra(snap: Any) -> tuple[list[Any], list[str]]:
        ctx = StepContext(cfg, store, node, snap, deadline, log)
        return run_steps(ctx, cfg.get("health", "disabled_steps"), now=now)

    left = deadline - time.monotonic()
    res = health_mod.run_health(cfg, hook="health", store=store, kernel_log=kernel_log, scan_xid=not busy,
                                budget_s=max(1.0, left * 0.5), extra_checks=extra)
    out = HealthOutcome(res, maint, tool_errors=errors + res.tool_errors)
    if store is not None:
        try:
            out.actions = act_on(cfg, store, node, info, res, maint, deadline=deadline, log=log)
        except Exception as e:  # the store or a bug: never leave the hook on it
            out.tool_errors.append(f"acting: {type(e).__name__}: {e}")
    _alerts_and_metrics(cfg, store, node, res, maint, out, deadline, log)
    return out


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


def act_on(cfg: Any, store: Any, node: str, info: Any, res: Any, maint: Any, *, deadline: float,
           log: Any = None) -> list[dict[str, Any]]:
    """Drain or resume ``node`` after health result ``res`` (see the module docstring).
    ``info``: the node's :class:`gpuguard.ops.nodes.NodeInfo` (None when Slurm could not
    be read: then a fault still drains — a dying GPU outweighs the doubt — and nothing is
    resumed). Returns the ``node_actions`` rows written."""
    from gpuguard.ops import act
    from gpuguard.ops.nodes import read_node, record_action

    done: list[dict[str, Any]] = []
    if res.decision.outcome == "drain":
        drains = [dict(f.to_dict(), action=a) for f, a in res.decision.actions if a == "drain"]
        recovery = recovery_of_findings(drains)
        if maint.active:
            r = _record_once(store, node, action="suppressed", by="health", outcome="refused",
                             why=f"would drain: {maint.line()}", reason=res.decision.reason,
                             recovery=recovery, evidence=drains, run_id=res.run_id)
            return [r] if r else []
        if info is not None and info.drained and not info.ours:
            r = _record_once(store, node, action="drain", by="health", outcome="refused",
                             why=f"already drained by someone else: {info.full_reason}",
                             reason=res.decision.reason, recovery=recovery, evidence=drains, run_id=res.run_id)
            return [r] if r else []
        if info is not None and info.drained and info.ours:
            return []  # still faulty; the drain on record stands
        status, why = act.drain(cfg, node, res.decision.reason, deadline=deadline, log=log)
        stamped = None
        if status == "done":
            try:
                stamped = read_node(cfg_slurm(cfg), node).full_reason
            except Exception:  # the drain is done; without the stamp a resume compares text only
                stamped = None
        row = dict(action="drain", by="health", outcome=status, why=why, reason=res.decision.reason,
                   slurm_reason=stamped, recovery=recovery, evidence=drains, run_id=res.run_id)
        done.append(dict(row, id=record_action(store, node=node, **row), node=node))
        return done
    if info is not None and not info.drained and not maint.active:
        retry = _failed_drain(store, node)
        if retry is not None:
            status, why = act.drain(cfg, node, retry["reason"], deadline=deadline, log=log)
            row = dict(action="drain", by="health", outcome=status, why=why or "retry of a drain that failed",
                       reason=retry["reason"], recovery=retry["recovery"],
                       evidence=json.loads(retry["evidence"] or "[]"), run_id=retry["run_id"])
            done.append(dict(row, id=record_action(store, node=node, **row), node=node))
            return done
    if not _clean(res) or info is None or not (info.drained and info.ours):
        return done
    rec = _drain_record(store, node, info)
    if rec.get("recovery") != "auto" or not cfg.get("health", "resume"):
        return done
    if rec.get("slurm_reason") and rec["slurm_reason"] != info.full_reason:
        r = _record_once(store, node, action="resume", by="health", outcome="refused",
                         why=f"the reason was set again since gpuguard's drain ({info.full_reason})",
                         reason=info.reason or "", recovery=rec.get("recovery", ""))
        return [r] if r else []
    need = cfg.get("health", "resume_after_clean_runs")
    clean = _clean_runs(store, node, rec["at"])
    if clean < need:
        return done
    if maint.active:
        r = _record_once(store, node, action="suppressed", by="health", outcome="refused",
                         why=f"would resume: {maint.line()}", reason=info.reason or "", recovery="auto")
        return [r] if r else []
    status, why = act.resume(cfg, node, deadline=deadline, log=log)
    row = dict(action="resume", by="health", outcome=status, why=why, reason=info.reason or "",
               recovery="auto", evidence={"clean_runs": clean, "drained_at": rec["at"]}, run_id=res.run_id)
    done.append(dict(row, id=record_action(store, node=node, **row), node=node))
    return done


#: A drain that failed (Slurm down, no time left) is retried by later runs for this long:
#: the XID that caused it is already past the kernel-log cursor and would not come back
#: (our choice: a day; after that the finding in the store and its alert remain).
DRAIN_RETRY_S = 86400.0


def _failed_drain(store: Any, node: str) -> dict[str, Any] | None:
    """The newest drain of ``node`` that failed, when nothing was done since (no drain
    or resume succeeded after it) and it is younger than :data:`DRAIN_RETRY_S`."""
    rows = store.query("select * from node_actions where node = ? and action in ('drain', 'resume') "
                       "order by at desc, id desc limit 1", [node])
    if rows and rows[0]["action"] == "drain" and rows[0]["outcome"] == "failed" and rows[0]["reason"] \
            and time.time() - rows[0]["at"] < DRAIN_RETRY_S:
        return rows[0]
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
    arguments): config, budget, always exit 0 (:mod:`gpuguard.hookrun`)."""
    from gpuguard import log as log_mod
    from gpuguard.hookrun import exit_hook, load_config, run_with_budget

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
            rc = run_with_budget(lambda: (main_run(cfg, log), 0)[1], budget, "health")
    finally:
        exit_hook(0)
    return rc
