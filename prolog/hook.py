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

``SLURM_JOB_ID`` must be 1 to 20 ASCII digits (``str.isdigit`` alone accepts ``'١٢٣'``);
anything else is logged as a tool error and the run is node checks only: no job is
failed, no job directory or collector is set up.

Whatever hangs, the process exits when the budget runs out: the work runs in a daemon
thread and the main thread leaves with ``os._exit`` (a hung NVML call cannot be
interrupted otherwise). Running out of budget is our fault: exit 0, no drain.
"""

from __future__ import annotations

import os

EXIT_OK = 0
EXIT_DRAIN = 1


def run(env: dict[str, str] | None = None, loaded: tuple | None = None) -> int:
    """The prolog's work; returns the exit status. ``loaded``: the result of
    :func:`gpuguard.hookrun.load_config` when the caller already read the config. Used by
    :func:`main` and the tests."""
    env = dict(os.environ) if env is None else env
    from gpuguard import log as log_mod
    from gpuguard.hookrun import load_config

    job_id = env.get("SLURM_JOB_ID")
    cfg, config_error = loaded or load_config()
    if config_error:
        # Our fault: never drain or fail the job for it. But a typo in a cluster-wide
        # config must not silently switch off every check either: run them on the
        # defaults, log what they find, and act on nothing.
        cfg.values["slurm"]["drain"] = False
    log = log_mod.setup(cfg.get("paths", "log_file"), "prolog", job_id)
    if config_error:
        log.error("tool error: config: %s (checking with defaults; no drain, job proceeds)", config_error)
    from gpuguard.hookrun import is_job_id

    if job_id is not None and not is_job_id(job_id):
        log.error("tool error: SLURM_JOB_ID %r is not a job id; node checks only", job_id)
        job_id = None
    from gpuguard.health import parse_job_gpus, run_health
    from gpuguard.store import StoreError, open_store

    store = None
    try:
        store = open_store(cfg.store_path)
    except StoreError as e:
        log.error("tool error: %s", e)
    job_gpus = parse_job_gpus(env.get("SLURM_JOB_GPUS"))
    res = run_health(cfg, hook="prolog", store=store, job_id=job_id, job_gpus=job_gpus,
                     budget_s=cfg.get("prolog", "time_budget_s") * 0.5)
    for err in res.tool_errors:
        log.error("tool error: %s", err)
    for f, action in res.decision.actions:
        log.info("finding %s %s %s gpu=%s: %s", f.code, f.severity, action, f.gpu_index, f.message)
    from gpuguard.ops.alert_spool import enqueue_from_hook

    enqueue_from_hook(cfg, cfg.node_name, res.decision.actions, source="prolog", job_id=job_id, log=log)
    outcome = res.decision.outcome
    if config_error and outcome != "proceed":
        log.warning("config broken: would %s: %s", outcome, res.decision.reason)
        _close(store)
        return EXIT_OK
    if outcome == "drain":
        node = cfg.node_name
        if cfg.get("slurm", "drain"):
            from gpuguard.slurm import SlurmCli, SlurmError

            try:
                SlurmCli(cfg.get("slurm", "bin_dir")).drain_node(node, res.decision.reason)
                log.warning("drained %s: %s", node, res.decision.reason)
            except SlurmError as e:
                log.error("tool error: drain failed (Slurm will drain with 'Prolog error'): %s", e)
        else:
            log.warning("dry run: would drain %s: %s", node, res.decision.reason)
        _close(store)
        return EXIT_DRAIN
    if outcome == "fail-job":
        # Slurm 22.05 drains the node on any non-zero Prolog exit, so the job is failed
        # through Slurm instead and the Prolog exits 0: the node keeps serving.
        if cfg.get("slurm", "drain") and job_id:
            from gpuguard.slurm import SlurmCli, SlurmError

            try:
                SlurmCli(cfg.get("slurm", "bin_dir")).fail_job(job_id, res.decision.reason)
                log.warning("failed job %s (node not drained): %s", job_id, res.decision.reason)
            except SlurmError as e:
                log.error("tool error: failing job %s: %s", job_id, e)
        else:
            log.warning("dry run: would fail job %s: %s", job_id, res.decision.reason)
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
