"""``gpuguard-prolog``: the Slurm Prolog (runs as root on every node of every job).

What it does, in order, inside ``[prolog] time_budget_s``:

1. load the config (errors: logged, exit 0 — our fault never blocks a job);
2. retry drains earlier runs could not confirm, then run the health checks on live state
   and act on a drain, all before any store I/O (:mod:`gpuguard.nodecheck`; a drain is
   kept in the pending-drain list until Slurm shows it: :mod:`gpuguard.drainq`);
3. act on the decision: ``drain`` -> ``scontrol update state=drain reason="gpuguard: ..."``
   then exit 1 so Slurm requeues the job elsewhere (Slurm 22.05 then also marks the node
   drained and holds the requeued batch job: SLURM-FACTS.md §5); ``fail-job`` -> note the
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

EXIT_OK = 0
EXIT_DRAIN = 1


def run(env: dict[str, str] | None = None, loaded: tuple | None = None) -> int:
    """The prolog's work; returns the exit status. ``loaded``: the result of
    :func:`gpuguard.hookrun.load_config` when the caller already read the config. Used by
    :func:`main` and the tests."""
    started = time.monotonic()
    env = dict(os.environ) if env is None else env
    from gpuguard import log as log_mod
    from gpuguard.hookenv import read_hook_env
    from gpuguard.hookrun import announce, load_config

    cfg, config_error = loaded or load_config()
    budget = float(cfg.get("prolog", "time_budget_s"))
    deadline = started + budget * DEADLINE_SHARE
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
        else:
            log.warning("hook environment: %s; treated as unset", problem)
    job_id = henv.job_id
    from gpuguard.nodecheck import live_check, pending_drains

    pend = pending_drains(cfg, deadline, log, allow_drain=not config_error)
    # the verdict and the drain come first, from live state only: no store I/O before them
    live = live_check(cfg, pend, hook="prolog", job_id=job_id, job_gpus=henv.job_gpus, deadline=deadline)
    res = live.result
    outcome = res.decision.outcome
    announce(EXIT_DRAIN if outcome == "drain" and not config_error else EXIT_OK)
    _log_result(log, res)
    if config_error and outcome != "proceed":
        log.warning("config broken: would %s: %s", outcome, res.decision.reason)
        return EXIT_OK
    if outcome == "drain":
        if live.drain is not None and live.drain.status not in ("confirmed", "dry-run"):
            log.error("tool error: drain not confirmed (%s); Slurm will drain with 'Prolog error' when this "
                      "prolog exits %d, and the drain stays pending", live.drain.why, EXIT_DRAIN)
        _record(cfg, live, pend, job_id, henv.job_gpus, log)
        return EXIT_DRAIN
    if outcome == "fail-job":
        # Slurm 22.05 drains the node on any non-zero Prolog exit, so the job is failed
        # through Slurm instead and the Prolog exits 0: the node keeps serving.
        if job_id:
            pend.actuator.fail_job(job_id, res.decision.reason)
        else:
            log.warning("no job id: cannot fail the job: %s", res.decision.reason)
        _record(cfg, live, pend, job_id, henv.job_gpus, log)
        return EXIT_OK
    if job_id and not config_error:
        try:
            from gpuguard.collector.launch import prepare_job

            prepare_job(cfg, env, log)
        except Exception as e:  # our fault: the job runs unmonitored, never fails
            log.error("tool error: job preparation (job dir, collector): %s: %s", type(e).__name__, e)
    later = _record(cfg, live, pend, job_id, henv.job_gpus, log)
    if later is not None and later.decision.outcome == "drain" and not config_error:
        # a drain only the history shows (a site policy on a trend): acted on in _record
        log.warning("drain from history: %s", later.decision.reason)
        return EXIT_DRAIN
    log.info("proceed (%d finding(s))", len(res.findings))
    return EXIT_OK


#: Share of ``[prolog] time_budget_s`` the work plans with; the rest is the margin for
#: the exit (our choice: 10 %).
DEADLINE_SHARE = 0.9


def _log_result(log, res) -> None:
    for err in res.tool_errors:
        log.error("tool error: %s", err)
    for f, action in res.decision.actions:
        log.info("finding %s %s %s gpu=%s: %s", f.code, f.severity, action, f.gpu_index, f.message)


def _record(cfg, live, pend, job_id, job_gpus, log):
    """Open the store and record the run with history (after the verdict was acted on).
    Returns the result with history, or None when the store could not be opened."""
    from gpuguard.nodecheck import record_with_store
    from gpuguard.store import StoreError, open_store

    try:
        store = open_store(cfg.store_path)
    except StoreError as e:
        log.error("tool error: %s", e)
        return None
    try:
        n_err = len(live.result.tool_errors)
        res = record_with_store(cfg, store, live, pend, hook="prolog", job_id=job_id, job_gpus=job_gpus)
        for err in live.result.tool_errors[n_err:]:
            log.error("tool error: %s", err)
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
