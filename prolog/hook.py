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

``SLURM_JOB_ID`` must be 1 to 20 ASCII digits (``str.isdigit`` alone accepts ``'١٢٣'``);
anything else is logged as a tool error and the run is node checks only: no job is
failed, no job directory or collector is set up.

Whatever hangs, the process exits when the budget runs out (:mod:`gpuguard.hookrun`: the
work runs in a child process the watchdog parent abandons). Running out of budget is our
fault: exit 0 — unless the verdict was already ``drain`` (announced to the watchdog
before any store I/O), then exit 1 as decided.
"""

from __future__ import annotations

import os

EXIT_OK = 0
EXIT_DRAIN = 1


def run(env: dict[str, str] | None = None, loaded: tuple | None = None) -> int:
    """The prolog's work; returns the exit status. ``loaded``: the result of
    :func:`gpuguard.hookrun.load_config` when the caller already read the config. Used by
    :func:`main` and the tests."""
    import time

    started = time.monotonic()
    env = dict(os.environ) if env is None else env
    from gpuguard import log as log_mod
    from gpuguard.hookrun import announce, load_config

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
    from gpuguard.health import parse_job_gpus
    from gpuguard.nodecheck import live_check, pending_drains

    deadline = started + float(cfg.get("prolog", "time_budget_s")) * DEADLINE_SHARE
    job_gpus = parse_job_gpus(env.get("SLURM_JOB_GPUS"))
    pend = pending_drains(cfg, deadline, log, allow_drain=not config_error)
    # the verdict and the drain come first, from live state only: no store I/O before them
    live = live_check(cfg, pend, hook="prolog", job_id=job_id, job_gpus=job_gpus, deadline=deadline)
    res = live.result
    outcome = res.decision.outcome
    announce(EXIT_DRAIN if outcome == "drain" and not config_error else EXIT_OK)
    _log_result(log, res)
    if config_error and outcome != "proceed":
        log.warning("config broken: would %s: %s", outcome, res.decision.reason)
        return EXIT_OK
    if outcome == "drain":
        if live.drain is not None and live.drain.status != "confirmed":
            log.error("tool error: drain failed (Slurm will drain with 'Prolog error'): %s", live.drain.why)
        _record(cfg, live, pend, job_id, job_gpus, log)
        return EXIT_DRAIN
    if outcome == "fail-job":
        # Slurm 22.05 drains the node on any non-zero Prolog exit, so the job is failed
        # through Slurm instead and the Prolog exits 0: the node keeps serving.
        _fail_job(cfg, job_id, res.decision.reason, deadline, log)
        _record(cfg, live, pend, job_id, job_gpus, log)
        return EXIT_OK
    if job_id and not config_error:
        try:
            from gpuguard.collector.launch import prepare_job

            prepare_job(cfg, env, log)
        except Exception as e:  # our fault: the job runs unmonitored, never fails
            log.error("tool error: job preparation (job dir, collector): %s: %s", type(e).__name__, e)
    later = _record(cfg, live, pend, job_id, job_gpus, log)
    if later is not None and later.decision.outcome == "drain" and not config_error:
        # a drain only the history shows (a site policy on a trend): acted on in _record
        log.warning("drain from history: %s", later.decision.reason)
        return EXIT_DRAIN
    log.info("proceed (%d finding(s))", len(res.findings))
    return EXIT_OK


#: Share of ``[prolog] time_budget_s`` the work may plan with; the rest is the margin
#: for the exit (our choice: 10 %).
DEADLINE_SHARE = 0.9


def _log_result(log, res) -> None:
    for err in res.tool_errors:
        log.error("tool error: %s", err)
    for f, action in res.decision.actions:
        log.info("finding %s %s %s gpu=%s: %s", f.code, f.severity, action, f.gpu_index, f.message)


def _fail_job(cfg, job_id, reason, deadline, log) -> None:
    if not (cfg.get("slurm", "drain") and job_id):
        log.warning("dry run: would fail job %s: %s", job_id, reason)
        return
    import time

    from gpuguard.slurm import SlurmCli, SlurmError

    left = max(0.2, deadline - time.monotonic())
    try:
        SlurmCli(cfg.get("slurm", "bin_dir"), timeout_s=min(15.0, left / 2)).fail_job(job_id, reason)
        log.warning("failed job %s (node not drained): %s", job_id, reason)
    except SlurmError as e:
        log.error("tool error: failing job %s: %s", job_id, e)


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
