"""``gpuguard-prolog``: the Slurm Prolog (runs as root on every node of every job).

What it does, in order, inside ``[prolog] time_budget_s``:

1. load the config (errors: logged, exit 0 — our fault never blocks a job);
2. retry drains earlier runs could not confirm, then run the health checks on live state
   and act on a drain, all before any store I/O (:mod:`gpuguard.nodecheck`; a drain is
   kept in the pending-drain list until Slurm shows it: :mod:`gpuguard.drainq`); when
   ``[nccl] prolog`` asks for it (multi-node jobs, or always) the NCCL probe runs next,
   within half of the budget, and its findings are decided the same way;
3. act on the decision: ``drain`` -> ``scontrol update state=drain reason="gpuguard: ..."``
   then exit 1 so Slurm requeues the job elsewhere (Slurm 22.05 then also marks the node
   drained and holds the requeued batch job: SLURM-FACTS.md §5; in a dry run, ``[slurm]
   drain = false``, exit 0 and the job runs); ``fail-job`` -> note the
   reason in the job's AdminComment, ``scancel`` the job and exit 0 (any non-zero Prolog
   exit would drain the node in Slurm 22.05);
   ``proceed`` -> create the job's record directory and start the collector
   (:func:`gpuguard.collector.launch.prepare_job`) and exit 0;
4. open the node store and record the run with history (errors: tool errors; a locked
   store delays nothing the verdict needs).

The Slurm variables are read and range-checked by :func:`gpuguard.hookenv.read_hook_env`;
a ``SLURM_JOB_ID`` that is not 1 to 20 ASCII digits is logged as a tool error and the run
is node checks only: no job is failed, no job directory or collector is set up. Drain and
fail-job go through :class:`gpuguard.actuator.Actuator`, whose Slurm calls are capped by
what is left of the budget.

Whatever hangs, the process exits when the budget runs out (:mod:`gpuguard.hookrun`: the
work runs in a child process the watchdog parent abandons). Running out of budget is our
fault: exit 0 — unless the verdict was already ``drain`` (announced to the watchdog
before any store I/O), then exit 1 as decided.
"""

from __future__ import annotations

import os
import time

# -- Import budget: the one place that says where gpuguard imports lazily -------------------
# The hook entry points (this module, gpuguard.hookrun, gpuguard.epilog.hook,
# gpuguard.epilog.slurmctld, gpuguard.collector.taskprolog) import gpuguard modules inside
# their functions, because:
#  * a module-level import runs before the watchdog (gpuguard.hookrun) starts; inside run()
#    it counts against [prolog] time_budget_s, so a slow or hung import (site-packages on
#    NFS, a cold page cache) ends with the budget instead of holding the job;
#  * the healthy path loads only what it uses: the store (sqlite-utils, about half of the
#    Prolog's import time: bench/prolog_healthy.py) after the verdict was acted on;
#    gpuguard.collector.launch only when the job proceeds; the NVML binding only for
#    [gpu] source = "nvml" (gpuguard.gpu.open_source); the XID catalog only when the
#    kernel log has XID lines (gpuguard.checks.xid, gpuguard.health.record_run).
# Outside these, modules import at module level; the remaining function-level imports
# break an import cycle (config <-> checks) or keep a heavy library (matplotlib, jinja2,
# the epilog's verdict) off CLI commands that do not use it.

EXIT_OK = 0
EXIT_DRAIN = 1


def run(env: dict[str, str] | None = None, loaded: tuple | None = None) -> int:
    """The prolog's work; returns the exit status. ``loaded``: the result of
    :func:`gpuguard.hookrun.load_config` when the caller already read the config. Used by
    :func:`main` and the tests."""
    started = time.monotonic()
    from gpuguard.hookenv import clean_env

    env = clean_env(os.environ if env is None else env)
    cfg, config_error, henv, log = _start(env, loaded)
    deadline = started + float(cfg.get("prolog", "time_budget_s")) * DEADLINE_SHARE
    job_id = henv.job_id
    from gpuguard.hookrun import announce
    from gpuguard.nodecheck import live_check, pending_drains
    from gpuguard.ops.maintenance import cached as maintenance_now

    maint = maintenance_now(cfg, cfg.node_name)  # the last health run's view: no Slurm call here
    pend = pending_drains(cfg, deadline, log, allow_drain=not config_error and not maint.active)
    # the verdict and the drain come first, from live state only: no store I/O before them
    live = live_check(cfg, pend, hook="prolog", job_id=job_id, job_gpus=henv.job_gpus, deadline=deadline,
                      commit=not config_error)
    live.maintenance = maint.active  # a drain/fail-job held back is recorded as suppressed
    res = live.result
    outcome = _unless_maintenance(cfg, maint, res.decision.outcome, res.decision.reason, log)
    announce(_drain_exit(cfg) if outcome == "drain" and not config_error else EXIT_OK)
    _log_result(log, res)
    from gpuguard.ops.alert_spool import enqueue_from_hook

    enqueue_from_hook(cfg, cfg.node_name, res.decision.actions, source="prolog", job_id=job_id, log=log)
    if config_error and outcome != "proceed":
        log.warning("config broken: would %s: %s", outcome, res.decision.reason)
        return EXIT_OK
    if outcome == "drain":
        if live.drain is not None and live.drain.status not in ("confirmed", "dry-run"):
            log.error("tool error: drain not confirmed (%s); Slurm will drain with 'Prolog error' when this "
                      "prolog exits %d, and the drain stays pending", live.drain.why, EXIT_DRAIN)
        _record(cfg, live, pend, job_id, henv.job_gpus, log)
        return _drain_exit(cfg, log)
    if outcome == "fail-job":
        return _fail_job(cfg, live, pend, henv, res.decision, log)
    nccl = [] if config_error else _nccl_probe(cfg, env, job_id, started, log)
    rc = _act_on_nccl(cfg, live, pend, henv, nccl, maint, log) if nccl else None
    if rc is not None:
        return rc
    return _proceed(cfg, env, config_error, live, pend, henv, nccl, maint, log)


def _start(env: dict[str, str], loaded: tuple | None) -> tuple:
    """Config, hook environment and log: ``(cfg, config_error, hook_env, log)``."""
    from gpuguard import log as log_mod
    from gpuguard.hookenv import read_hook_env
    from gpuguard.hookrun import load_config

    cfg, config_error = loaded or load_config()
    if config_error:
        # Our fault: never drain or fail the job for it. But a typo in a cluster-wide
        # config must not silently switch off every check either: run them on the
        # defaults, log what they find, and act on nothing.
        cfg.values["slurm"]["drain"] = False
    henv = read_hook_env(env)
    log = log_mod.setup(cfg.get("paths", "log_file"), "prolog", henv.job_id or env.get("SLURM_JOB_ID"))
    if config_error:
        log.error("tool error: config: %s (checking with defaults; no drain, job proceeds)", config_error)
    for problem in henv.problems:  # a bad job id costs the job's bookkeeping; others read as unset
        if problem.startswith("SLURM_JOB_ID"):
            log.error("tool error: %s; node checks only", problem)
        elif problem.startswith("SLURM_JOB_GPUS"):  # bad input from slurmd: judged as no GPU list, never a drain
            log.error("tool error: %s; the job's GPUs are not checked by index", problem)
        else:
            log.warning("hook environment: %s; treated as unset", problem)
    return cfg, config_error, henv, log


def _unless_maintenance(cfg, maint, outcome: str, reason: str, log) -> str:
    """``outcome``, or ``proceed`` when ``maint`` is active and it would drain or fail the
    job: a node in maintenance is neither drained nor failing jobs, whatever check (the
    live one or the NCCL probe) decided it; the suppression is logged and recorded."""
    if maint.active and outcome in ("drain", "fail-job"):
        from gpuguard.ops.maintenance import record_suppressed

        record_suppressed(cfg, maint, outcome, reason, by="prolog", log=log)
        return "proceed"
    return outcome


def _act_on_nccl(cfg, live, pend, henv, nccl, maint, log) -> int | None:
    """Decide again with the NCCL probe's findings; the exit status when that drains or
    fails the job, else None (the job proceeds; also in maintenance, exactly as for the
    live check: the node's drain is suppressed and recorded as such)."""
    from gpuguard.drainq import decision_recovery
    from gpuguard.policy import decide

    d = decide(live.result.findings + nccl, cfg.policy, cfg.xid_policy)
    if _unless_maintenance(cfg, maint, d.outcome, d.reason, log) == "proceed":
        return None
    if d.outcome == "drain":
        return _drain_now(cfg, live, pend, henv, d, decision_recovery(d), log, nccl)
    if d.outcome == "fail-job" and henv.job_id:
        return _fail_job(cfg, live, pend, henv, d, log, nccl)
    return None


def _fail_job(cfg, live, pend, henv, decision, log, nccl=None) -> int:
    """Act on a ``fail-job`` decision: fail the job (Slurm 22.05 drains the node on any
    non-zero Prolog exit, so the job is cancelled through Slurm and the Prolog exits 0:
    the node keeps serving), unless the same code has now failed
    ``[prolog] fail_job_escalate_count`` jobs in a row (:mod:`gpuguard.failstreak`): then
    drain the node through the pending-drain list and exit 1, so Slurm requeues the job
    elsewhere as for any drain. Returns the exit status."""
    from gpuguard import failstreak
    from gpuguard.recovery import recovery_of_findings

    job_id = henv.job_id
    if not job_id:  # no job to fail: nothing counts either way
        log.warning("no job id: cannot fail the job: %s", decision.reason)
        _record(cfg, live, pend, job_id, henv.job_gpus, log, nccl)
        return EXIT_OK
    hits = [f for f, a in decision.actions if a == "fail-job"]
    esc = _note_fail_streak(cfg, list(dict.fromkeys(f.code for f in hits)), job_id, log)
    if esc is not None:
        from gpuguard.policy import Decision

        code, n = esc
        first = next(f for f in hits if f.code == code)
        reason = failstreak.reason(code, n, float(cfg.get("prolog", "fail_job_escalate_window_s")), first.message)
        log.warning("fail-job escalated to drain after %d jobs: %s", n, reason)
        # what is done, as it is recorded: the node is drained for this code (no job is failed)
        acted = Decision("drain", reason, [(f, "drain" if f.code == code and a == "fail-job" else a)
                                           for f, a in decision.actions], policy_outcome=decision.decided)
        return _drain_now(cfg, live, pend, henv, acted, recovery_of_findings([{"code": code, "action": "drain"}]),
                          log, nccl)
    done = pend.actuator.fail_job(job_id, decision.reason)
    if done.status == "failed":  # logged by the actuator; the run's record says so too
        live.collected.tool_errors.append(f"fail-job of job {job_id} not done: {done.why}")
    _record(cfg, live, pend, job_id, henv.job_gpus, log, nccl)
    return EXIT_OK


def _drain_now(cfg, live, pend, henv, acted, recovery, log, nccl) -> int:
    """Drain this node for ``acted``, a :class:`gpuguard.policy.Decision` taken after the
    live check (the NCCL probe's, or a fail-job escalation): announce the exit, drain
    through the pending-drain list (:meth:`gpuguard.drainq.PendingDrains.drain`: a dry run
    only logs; a list that cannot be written still drains), keep the outcome in ``live.drain``
    (the ``node_actions`` row), and record the run with ``acted`` as its decision (what
    was done, not the live check's fail-job/proceed). Returns :func:`_drain_exit`'s status."""
    from gpuguard.hookrun import announce

    announce(_drain_exit(cfg))
    # pending first, drained even when the list cannot be written; the outcome is logged
    live.drain = pend.drain(cfg.node_name, acted.reason, recovery)
    _record(cfg, live, pend, henv.job_id, henv.job_gpus, log, nccl, acted=acted)
    return _drain_exit(cfg, log)


def _note_fail_streak(cfg, codes: list[str], job_id: str | None, log) -> tuple[str, int] | None:
    """:func:`gpuguard.failstreak.note` (``codes`` empty: the job proceeds, every count
    starts afresh); a count file that cannot be written is our fault: logged, nothing
    escalates."""
    from gpuguard import failstreak

    try:
        return failstreak.note(cfg, codes, job_id)
    except OSError as e:
        log.error("tool error: fail-job streak: %s", e)
        return None


def _proceed(cfg, env, config_error, live, pend, henv, nccl, maint, log) -> int:
    """The job proceeds: its directory and collector, then the run recorded with history
    (a drain only the history shows still drains)."""
    job_id = henv.job_id
    if job_id and not config_error:
        try:
            from gpuguard.collector.launch import prepare_job

            prepare_job(cfg, env, log)
        except Exception as e:  # our fault: the job runs unmonitored, never fails
            log.error("tool error: job preparation (job dir, collector): %s: %s", type(e).__name__, e)
        from gpuguard.ops.jobmap import job_started

        # exporters' GPU -> job files, named through the live snapshot (MIG); fails open
        job_started(cfg, env, log, snapshot=live.collected.snapshot)
    if config_error:  # nothing is written on the shipped defaults' paths
        log.info("proceed (%d finding(s); config broken: nothing recorded)", len(live.result.findings))
        return EXIT_OK
    if not maint.active:  # in maintenance no job was failed: the counts stand
        _note_fail_streak(cfg, [], None, log)
    later = _record(cfg, live, pend, job_id, henv.job_gpus, log, nccl)
    if later is not None and later.decision.outcome == "drain" and not maint.active:
        # a drain only the history shows (a site policy on a trend): acted on in _record
        log.warning("drain from history: %s", later.decision.reason)
        return _drain_exit(cfg, log)
    log.info("proceed (%d finding(s))", len(live.result.findings))
    return EXIT_OK


def _drain_exit(cfg, log=None) -> int:
    """The Prolog's exit status for a drain: :data:`EXIT_DRAIN` (Slurm requeues the job
    elsewhere), or :data:`EXIT_OK` in a dry run (``[slurm] drain = false``): any non-zero
    Prolog exit makes Slurm 22.05 drain the node itself with "Prolog error"
    (SLURM-FACTS.md §5), which a run that only logs its drain decisions must not do; the
    job runs. ``log``: where that is said (None: while only announcing the exit)."""
    if cfg.get("slurm", "drain"):
        return EXIT_DRAIN
    if log is not None:
        log.warning("dry run: the prolog exits 0 and the job runs (with [slurm] drain = true it would exit %d "
                    "and Slurm would requeue the job)", EXIT_DRAIN)
    return EXIT_OK


#: Share of ``[prolog] time_budget_s`` the work plans with; the rest is the margin for
#: the exit (our choice: 10 %).
DEADLINE_SHARE = 0.9


def _log_result(log, res) -> None:
    for err in res.tool_errors:
        log.error("tool error: %s", err)
    for f, action in res.decision.actions:
        log.info("finding %s %s %s gpu=%s: %s", f.code, f.severity, action, f.gpu_index, f.message)


def _nccl_probe(cfg, env, job_id, started, log) -> list:
    """The NCCL probe when ``[nccl] prolog`` asks for it (multi-node jobs, or always),
    within half of the Prolog budget (:func:`gpuguard.net.nccl_check.prolog_probe`); its
    findings, [] when not wanted. The store is opened for the node's NCCL baseline only
    after the live verdict was acted on."""
    from gpuguard.net.nccl_check import prolog_probe, prolog_wants_probe

    if not prolog_wants_probe(cfg, env):
        return []
    from gpuguard.store import StoreError, open_store

    try:
        store = open_store(cfg.store_path)
    except StoreError as e:
        log.error("tool error: %s (NCCL probe judged without its baseline)", e)
        store = None
    try:
        found, errors = prolog_probe(cfg, store, env, job_id, time.monotonic() - started)
    finally:
        _close(store)
    for err in errors:
        log.error("tool error: %s", err)
    for f in found:
        log.info("finding %s %s gpu=%s: %s", f.code, f.severity, f.gpu_index, f.message)
    return found


def _record(cfg, live, pend, job_id, job_gpus, log, extra=None, acted=None):
    """Open the store and record the run with history (after the verdict was acted on),
    with ``extra`` findings (the NCCL probe's) and ``acted``, the decision acted on after
    the live check (:func:`_drain_now`). Returns the result with history, or None when
    the store could not be opened."""
    from gpuguard.nodecheck import bound_store_waits, record_with_store
    from gpuguard.ops.nodes import record_hook_drain  # also registers the "ops" tables
    from gpuguard.store import StoreError, open_store

    try:
        store = open_store(cfg.store_path)
    except StoreError as e:
        log.error("tool error: %s", e)
        return None
    bound_store_waits(store, pend.deadline)
    try:
        n_err = len(live.result.tool_errors)
        res = record_with_store(cfg, store, live, pend, hook="prolog", job_id=job_id, job_gpus=job_gpus,
                                extra_findings=extra, acted=acted, log=log)
        for err in live.result.tool_errors[n_err:]:
            log.error("tool error: %s", err)
        record_hook_drain(store, cfg.node_name, live, by="prolog", run_id=getattr(res, "run_id", None), log=log,
                          decision=res.decision)
        return res
    finally:
        store.close()


def _close(store) -> None:
    if store is not None:
        store.close()


def run_with_budget(budget_s: float, env: dict[str, str] | None = None, loaded: tuple | None = None) -> int:
    """Run :func:`run` under the watchdog :func:`gpuguard.hookrun.run_watched` (exit 0 on
    a crash or an overrun, unless a verdict was announced)."""
    from gpuguard.hookrun import run_watched as guarded

    log_file = loaded[0].get("paths", "log_file") if loaded else None
    return guarded(lambda: run(env, loaded), budget_s, "prolog", log_file=log_file)


def main() -> int:
    """Console script entry point: reads the config once, runs within ``[prolog]
    time_budget_s`` and leaves through ``os._exit`` (:mod:`gpuguard.hookrun`)."""
    from gpuguard.hookrun import exit_hook, load_config

    os.environ.setdefault("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
    rc = EXIT_OK
    try:
        loaded = load_config()
        rc = run_with_budget(float(loaded[0].get("prolog", "time_budget_s")), loaded=loaded)
    finally:
        exit_hook(rc)
    return rc


if __name__ == "__main__":
    main()
