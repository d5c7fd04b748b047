"""The node check both hooks run: decide and act first, bookkeeping after.

Order (each step bounded by the hook's deadline, a :func:`time.monotonic` instant):

1. :meth:`gpuguard.drainq.PendingDrains.retry`: drains earlier runs could not confirm;
2. :func:`live_check`: snapshot + kernel log + checks **without the store** (a locked,
   corrupt, full or hung store cannot delay or change the verdict); on ``drain`` the
   decision is written to the pending-drain list, *then* the kernel-log cursor moves past
   the events, then the drain is tried and confirmed (:mod:`gpuguard.drainq`);
   without a drain the cursor moves at once. The kernel log is read under the cursor
   lock (:mod:`gpuguard.cursorlock`: one reader at a time, a bounded wait), released
   as soon as the cursor has moved, before any ``scontrol`` call;
3. :func:`record_with_store`: with the store open, the checks run again with history
   (counters, inventory, idle baseline), the run is recorded, and a drain that only the
   history shows (a site policy can make one) goes through the same pending list.

Kernel-log lines with an XID marker that were not accepted are in the result's
``tool_errors`` (with their reasons), which the hooks log.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from gpuguard.drainq import Outcome, PendingDrains, decision_recovery
from gpuguard.health import Collected, HealthResult, collect, judge, record_run, write_cursor_file


@dataclass
class LiveCheck:
    """What :func:`live_check` saw, decided and did."""

    collected: Collected
    result: HealthResult
    drain: Outcome | None = None
    #: the node is in maintenance (the hook set it): a drain or fail-job is recorded as
    #: ``suppressed`` (:func:`gpuguard.policy.done_outcome`)
    maintenance: bool = False


def pending_drains(cfg: Any, deadline: float | None, log: Any, *, allow_drain: bool = True) -> PendingDrains:
    """The pending-drain list acting through the hook's actuator
    (:meth:`gpuguard.actuator.Actuator.from_config`, calls capped by ``deadline``); a dry
    run when ``[slurm] drain`` is false or ``allow_drain`` is False (a broken config)."""
    from gpuguard.actuator import Actuator

    act = Actuator.from_config(cfg, deadline=deadline, log=log)
    if not allow_drain:
        act.dry_run = True
    return PendingDrains(cfg, act, log=log)


def _budget_left(deadline: float | None, share: float = 1.0) -> float | None:
    if deadline is None:
        return None
    return max(0.1, (deadline - time.monotonic()) * share)


def bound_store_waits(store: Any, deadline: float | None, share: float = 0.5) -> None:
    """Cap how long one store statement may wait for a lock (SQLite ``busy_timeout``) at
    ``share`` of the time left before ``deadline``, so a locked store costs a bounded part
    of the budget (the rest stays for the next steps) instead of the default 5 s each."""
    if deadline is None:
        return
    ms = int(max(0.05, (deadline - time.monotonic()) * share) * 1000)
    try:
        store.conn.execute(f"PRAGMA busy_timeout = {ms}")
    except Exception:
        pass  # a broken connection fails on its first statement anyway


def commit_cursor(cfg: Any, cursor: str | None, errors: list[str]) -> None:
    """Move the kernel-log cursor (files in state_dir and run_dir); errors appended."""
    if cursor is None:
        return
    try:
        write_cursor_file(cfg, cursor)
    except OSError as e:
        errors.append(f"cursor file: {e}")


def drain_then_commit(cfg: Any, pend: PendingDrains, col: Collected, res: HealthResult) -> Outcome:
    """Drain this node for ``res``'s decision: record it as pending first, move the
    kernel-log cursor only once it is recorded (otherwise the events are read again next
    run, so the fault is never lost), then drain and confirm. Returns the drain's outcome."""
    try:
        if pend.add(cfg.node_name, res.decision.reason, decision_recovery(res.decision)):
            commit_cursor(cfg, col.new_cursor, res.tool_errors)
        else:
            res.tool_errors.append("pending drains: not recorded; the kernel-log cursor stays, "
                                   "so these events are read again next run")
    finally:
        col.release_cursor()  # before scontrol: a slow slurmctld never holds the next reader
    return pend.settle(cfg.node_name, res.decision.reason)


def live_check(cfg: Any, pend: PendingDrains, *, hook: str, job_id: str | None, job_gpus: list[int] | None,
               deadline: float | None, commit: bool = True) -> LiveCheck:
    """Steps 1-2 of the module docstring. Never touches the store. ``commit=False``
    (a broken config: the shipped defaults stand in) decides but writes nothing: no
    pending drain, no cursor."""
    if not commit:
        col = collect(cfg, budget_s=_budget_left(deadline, 0.5))
        return LiveCheck(col, judge(cfg, col, hook=hook, store=None, job_id=job_id, job_gpus=job_gpus))
    pend.retry()
    # read under the cursor lock (gpuguard.cursorlock), released once the cursor moved
    col = collect(cfg, budget_s=_budget_left(deadline, 0.5), lock_cursor=True)
    try:
        res = judge(cfg, col, hook=hook, store=None, job_id=job_id, job_gpus=job_gpus)
        out = LiveCheck(col, res)
        if res.decision.outcome == "drain" and not pend.dry_run:
            out.drain = drain_then_commit(cfg, pend, col, res)
        else:
            if res.decision.outcome == "drain":  # logs "dry run: would drain"; kept for the record
                out.drain = pend.drain(cfg.node_name, res.decision.reason)
            commit_cursor(cfg, col.new_cursor, res.tool_errors)
    finally:
        col.release_cursor()
    return out


def record_with_store(cfg: Any, store: Any, live: LiveCheck, pend: PendingDrains, *, hook: str,
                      job_id: str | None, job_gpus: list[int] | None,
                      log: Any, extra_findings: list[Any] | None = None, acted: Any = None) -> HealthResult:
    """Step 3 of the module docstring. Returns the result with history (the live result
    when the store fails). ``extra_findings`` (the Prolog's NCCL probe) are recorded and
    decided with the run's. ``acted``: the :class:`gpuguard.policy.Decision` the hook acted
    on after the live check (a fail-job escalated to a drain, the NCCL probe's drain); it
    is what the run records (outcome, reason, and the action of each finding whose code it
    names), since it is what was done; held back by maintenance (``live.maintenance``) or a
    dry run it is recorded as ``suppressed`` / ``dry-run``, the policy's outcome beside it
    (:func:`gpuguard.health.record_run`). A drain only the history shows is made here, once
    (never a second time for a drain already made: ``live.drain``). The
    alerting findings only the history shows (a lifetime count on its first reading, a
    counter's growth: :func:`history_only`) are queued as alerts, as the live pass's were
    by the hook (:func:`gpuguard.ops.alert_spool.enqueue_from_hook`)."""
    from gpuguard.policy import done_outcome

    res = judge(cfg, live.collected, hook=hook, store=store, job_id=job_id, job_gpus=job_gpus,
                extra_findings=extra_findings)
    if acted is not None:
        res.decision = _as_acted(res.decision, acted)
    done = done_outcome(res.decision, maintenance=live.maintenance, dry_run=pend.dry_run)
    try:
        res.run_id = record_run(store, cfg, hook, job_id, live.collected.started, res, live.collected.new_cursor,
                                done=done)
    except Exception as e:  # locked, corrupt, read-only, full: the verdict is already acted on
        live.result.tool_errors.append(f"store: {e}")
        return live.result
    if res.decision.outcome == "drain" and live.result.decision.outcome != "drain" and live.drain is None:
        # pending first, drained even when the list cannot be written (PendingDrains.drain)
        live.drain = pend.drain(cfg.node_name, res.decision.reason, decision_recovery(res.decision))
    from gpuguard.ops.alert_spool import enqueue_from_hook

    enqueue_from_hook(cfg, cfg.node_name, history_only(live.result.decision.actions, res.decision.actions),
                      source=hook, job_id=job_id, log=log)
    return res


def history_only(live: list[tuple[Any, str]], with_history: list[tuple[Any, str]]) -> list[tuple[Any, str]]:
    """The ``(finding, action)`` pairs of ``with_history`` whose code and GPU no pair of
    ``live`` has: what only the stored history showed (the live pass reads none)."""
    seen = {(f.code, f.gpu_index) for f, _a in live}
    return [(f, a) for f, a in with_history if (f.code, f.gpu_index) not in seen]


def _as_acted(decision: Any, acted: Any) -> Any:
    """``decision`` (the checks' with history) as ``acted`` was done: its outcome and
    reason, and for each finding the acted action of its code (else its own)."""
    from gpuguard.policy import Decision

    by_code = {f.code: a for f, a in acted.actions}
    return Decision(acted.outcome, acted.reason, [(f, by_code.get(f.code, a)) for f, a in decision.actions],
                    policy_outcome=acted.policy_outcome)
