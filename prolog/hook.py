"""``gpuguard-prolog``: the Slurm Prolog (runs as root on every node of every job).

What it does, in order, inside ``[prolog] time_budget_s``:

1. load the config (errors: logged, exit 0 — our fault never blocks a job);
2. open the node store (errors: logged as tool errors, the run still decides from live
   checks);
3. run the health checks (:func:`gpuguard.health.run_health`) on the job's node;
4. act on the decision: ``drain`` -> ``scontrol update state=drain reason="gpuguard: ..."``
   then exit 1 so Slurm requeues the job elsewhere (Slurm 22.05 then also marks the node
   drained and holds the requeued batch job: SLURM-FACTS.md §5); ``fail-job`` -> note the
   reason in the job's AdminComment, ``scancel`` the job and exit 0 (any non-zero Prolog
   exit would drain the node in Slurm 22.05);
   ``proceed`` -> create the job's record directory and start the collector
   (:func:`gpuguard.collector.launch.prepare_job`) and exit 0.

The Slurm variables are read and range-checked by :func:`gpuguard.hookenv.read_hook_env`;
a ``SLURM_JOB_ID`` that is not 1 to 20 ASCII digits is logged as a tool error and the run
is node checks only: no job is failed, no job directory or collector is set up. Drain and
fail-job go through :class:`gpuguard.actuator.Actuator`, whose Slurm calls are capped by
what is left of the budget.

Whatever hangs, the process exits when the budget runs out: the work runs in a daemon
thread and the main thread leaves with ``os._exit`` (a hung NVML call cannot be
interrupted otherwise). Running out of budget is our fault: exit 0, no drain.
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
    env = dict(os.environ) if env is None else env
    from gpuguard import log as log_mod
    from gpuguard.hookenv import read_hook_env
    from gpuguard.hookrun import load_config

    cfg, config_error = loaded or load_config()
    budget = float(cfg.get("prolog", "time_budget_s"))
    deadline = time.monotonic() + budget
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
    from gpuguard.health import run_health
    from gpuguard.store import StoreError, open_store

    store = None
    try:
        store = open_store(cfg.store_path)
    except StoreError as e:
        log.error("tool error: %s", e)
    res = run_health(cfg, hook="prolog", store=store, job_id=job_id, job_gpus=henv.job_gpus,
                     budget_s=budget * 0.5)
    for err in res.tool_errors:
        log.error("tool error: %s", err)
    for f, action in res.decision.actions:
        log.info("finding %s %s %s gpu=%s: %s", f.code, f.severity, action, f.gpu_index, f.message)
    from gpuguard.ops.alert_spool import enqueue_from_hook

    enqueue_from_hook(cfg, cfg.node_name, res.decision.actions, source="prolog", job_id=job_id, log=log)
    outcome = res.decision.outcome
    from gpuguard.ops.maintenance import suppresses

    if suppresses(cfg, cfg.node_name, outcome, res.decision.reason, log, store=store, by="prolog"):
        outcome = "proceed"  # a node in maintenance is neither drained nor failing jobs
    if config_error and outcome != "proceed":
        log.warning("config broken: would %s: %s", outcome, res.decision.reason)
        _close(store)
        return EXIT_OK
    if outcome in ("drain", "fail-job"):
        from gpuguard.actuator import Actuator

        act = Actuator.from_config(cfg, deadline=deadline, log=log)
        if outcome == "drain":
            if act.drain(cfg.node_name, res.decision.reason).status == "failed":
                log.error("tool error: Slurm will drain with 'Prolog error' when this prolog exits %d", EXIT_DRAIN)
            _close(store)
            return EXIT_DRAIN
        # Slurm 22.05 drains the node on any non-zero Prolog exit, so the job is failed
        # through Slurm instead and the Prolog exits 0: the node keeps serving.
        if job_id:
            act.fail_job(job_id, res.decision.reason)
        else:
            log.warning("no job id: cannot fail the job: %s", res.decision.reason)
        _close(store)
        return EXIT_OK
    if job_id and not config_error:
        try:
            from gpuguard.collector.launch import prepare_job

            prepare_job(cfg, env, log)
        except Exception as e:  # our fault: the job runs unmonitored, never fails
            log.error("tool error: job preparation (job dir, collector): %s: %s", type(e).__name__, e)
        from gpuguard.ops.jobmap import job_started

        job_started(cfg, env, log)  # exporters' GPU -> job files; fails open
    _close(store)
    log.info("proceed (%d finding(s))", len(res.findings))
    return EXIT_OK


def _close(store) -> None:
    if store is not None:
        store.close()


def run_with_budget(budget_s: float, env: dict[str, str] | None = None, loaded: tuple | None = None) -> int:
    """Run :func:`run` under :func:`gpuguard.hookrun.run_with_budget` (exit 0 on a crash
    or an overrun)."""
    from gpuguard.hookrun import run_with_budget as guarded

    return guarded(lambda: run(env, loaded), budget_s, "prolog")


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
