"""``gpuguard-epilog``: the Slurm Epilog (runs as root on every node of every job, after
the job, with an almost empty environment: SLURM-FACTS.md §3-4).

What it does, in order of importance, inside ``[epilog] time_budget_s``:

1. load the config (errors: logged, exit 0; the job's collector is still stopped, found
   through ``/proc`` instead of the broken config's pid file);
2. stop the job's collector (:func:`gpuguard.collector.launch.stop_collector`: SIGTERM,
   a bounded wait, SIGKILL); a pid file whose process was already gone means the
   collector died: an ``events`` row of kind ``collector_died`` is recorded and the
   summary says ``died``;
3. retry pending drains and run the post-job health checks on live state before any
   store I/O (:mod:`gpuguard.nodecheck`: new XIDs since the prolog's kernel-log cursor,
   uncorrectable ECC, lost GPUs, ...); on ``drain`` the decision goes to the
   pending-drain list and stays there until Slurm shows the ``gpuguard:`` reason
   (:mod:`gpuguard.drainq`), so a slow store or a failing ``scontrol`` cannot cost the
   drain;
4. take the job's lock (:mod:`gpuguard.epilog.joblock`): a second or concurrent Epilog of
   the same job waits, then finds the first one's summary and keeps it;
5. open the store, record the run; ingest the training records of
   ``{job_dir_root}/{job_id}`` into ``steps`` and ``checkpoints``: only the tail the
   collector has not stored during the job
   (:func:`gpuguard.collector.ingest_tail.ingest_new_records`; a new attempt of the job
   replaces the job's earlier rows on this node, nothing never wipes them);
6. write the job summary (:func:`gpuguard.epilog.summary.summarize_job`,
   :func:`~gpuguard.epilog.summary.save_summary`) and this node's *part* (summary plus
   per-window series, :mod:`gpuguard.epilog.part`): in cluster mode to the spool for the
   job judge on the controller (:mod:`gpuguard.epilog.judge`), on a single host straight
   to the judge here;
7. delete the job directory.

**Always exit 0.** A non-zero Epilog makes Slurm drain the node with the reason
``Epilog error`` (SLURM-FACTS.md §5); gpuguard drains by itself, with a reason that
says what is wrong, and its own failures (config, store, a bug, the budget) never drain.
A ``fail-job`` finding means nothing after the job: the decision is
:func:`gpuguard.policy.after_job`'s (its action ``alert``, the run's decision ``proceed``
with the reason saying so), which is what the run records.

**The job directory is deleted after ingest**, once its records are committed to the
store: the store is the record from then on, and the directory (user-writable, on the
node's disk) must not pile up. It is kept only when the records could not be stored
(``SLURM_JOB_UID`` unset, the store write failed, a bug in the reader), so that they
are not lost. A file the ingest rejected (a symlink, FIFO, hard link or other file the
user planted) does not keep it: the rejection is logged and in the summary
(``rejected_files``), and the directory goes like any other, so a user cannot pin
directories on the node's disk. The deletion goes through
:func:`gpuguard.collector.launch.remove_job_dir`, which works relative to a
``job_dir_root`` file descriptor opened with ``O_NOFOLLOW`` and never follows a
symlink (a symlinked job dir or file is unlinked, not its target).

Environment values are read and range-checked by :func:`gpuguard.hookenv.read_hook_env`;
a rejected value counts as unset and is logged (job id: post-job checks only; exit code:
``unknown`` in the summary). Drains go through one :class:`gpuguard.actuator.Actuator`
per run (wrapped by the pending-drain list), so the health checks and the verdict drain
at most once, within the budget.
"""

from __future__ import annotations

import os
import time
from typing import Any

# Cheap to import (their own imports are lazy). save_training_records stays a name of this
# module (the scenario generators store records with it); _encode_part is what the cluster
# tests build parts with.
from gpuguard.epilog.handover import encode_part as _encode_part  # noqa: F401
from gpuguard.epilog.handover import hand_over
from gpuguard.epilog.training_rows import save_training_records  # noqa: F401

EXIT_OK = 0

#: Share of the budget the collector stop may take (SIGTERM wait; SIGKILL adds 1 s).
COLLECTOR_STOP_SHARE = 0.2
COLLECTOR_STOP_MAX_S = 5.0


# -- seams to the collector (tests replace these) -----------------------------------------
def stop_collector(cfg: Any, job_id: str, timeout_s: float) -> Any:
    """:func:`gpuguard.collector.launch.stop_collector`."""
    from gpuguard.collector.launch import stop_collector as stop

    return stop(cfg, job_id, timeout_s)


def read_job_records(job_dir: str, expected_uid: int) -> Any:
    """:func:`gpuguard.collector.ingest.read_job_records`."""
    from gpuguard.collector.ingest import read_job_records as read

    return read(job_dir, expected_uid)


def ingest_records(store: Any, job_dir: str, job_id: str, node: str, expected_uid: int) -> Any:
    """The Epilog's (final) call of :func:`gpuguard.collector.ingest_tail.ingest_new_records`:
    the records the collector has not stored yet. Raises :class:`gpuguard.store.StoreError`."""
    from gpuguard.collector.ingest_tail import ingest_new_records

    return ingest_new_records(store, job_dir, job_id, node, expected_uid, final=True)


def forget_ingest_offsets(store: Any, job_id: str, node: str) -> None:
    """:func:`gpuguard.collector.ingest_tail.forget_offsets`."""
    from gpuguard.collector.ingest_tail import forget_offsets

    forget_offsets(store, job_id, node)


def remove_job_dir(root: str, job_id: str) -> bool:
    """:func:`gpuguard.collector.launch.remove_job_dir` (never follows symlinks)."""
    from gpuguard.collector.launch import remove_job_dir as remove

    return remove(root, job_id)


def collector_status(stop: Any) -> str:
    """Map a ``StopResult(pid, was_running, exited, signal_sent)`` to a
    :data:`gpuguard.epilog.summary.COLLECTOR_STATUSES` value."""
    if stop is None:
        return "unknown"
    if stop.pid is None:
        return "never_started"
    if not stop.was_running:
        return "died"
    return "ok" if stop.exited else "did_not_exit"


def record_collector_death(store: Any, node: str, job_id: str, pid: int | None) -> None:
    """An ``events`` row ``kind = "collector_died"`` (source ``epilog``). Raises
    :class:`gpuguard.store.StoreError`."""
    from gpuguard.rows import event_row

    store.insert("events", event_row(
        node=node, at=time.time(), kind="collector_died", pid=pid, job_id=job_id, source="epilog",
        process="gpuguard-collector",
        message=f"collector pid {pid} was gone before the epilog; samples end at its last flush"))


# -- the hook ---------------------------------------------------------------------------------
def run(env: dict[str, str] | None = None, loaded: tuple | None = None) -> int:
    """The epilog's work (module docstring); returns the exit status, always 0.
    ``loaded``: :func:`gpuguard.hookrun.load_config`'s result when the caller already read
    the config. Used by :func:`main` and the tests."""
    from gpuguard.hookenv import clean_env, read_hook_env

    env = clean_env(os.environ if env is None else env)
    from gpuguard import log as log_mod
    from gpuguard.hookrun import load_config

    started = time.monotonic()
    henv = read_hook_env(env)
    # one reading of the exit code for the summary and the verdict: an out-of-range or
    # non-ASCII value is unknown
    exit_raw = henv.exit_status_raw
    if exit_raw is None:
        env.pop("SLURM_JOB_EXIT_CODE", None)
    else:
        env["SLURM_JOB_EXIT_CODE"] = str(exit_raw)
    cfg, config_error = loaded or load_config()
    log = log_mod.setup(cfg.get("paths", "log_file"), "epilog", henv.job_id or env.get("SLURM_JOB_ID"))
    for problem in henv.problems:  # a bad job id costs the job's bookkeeping; others read as unset
        if problem.startswith("SLURM_JOB_ID"):
            log.error("tool error: %s; post-job checks only", problem)
        elif problem.startswith("SLURM_JOB_GPUS"):  # bad input from slurmd: judged as no GPU list, never a drain
            log.error("tool error: %s; the job's GPUs are not checked by index", problem)
        else:
            log.warning("hook environment: %s; treated as unset", problem)
    job_id = henv.job_id
    if config_error:
        # Our fault: nothing is judged or drained on it, but the job's collector is still
        # stopped (found through /proc, not through the broken config's paths).
        log.error("tool error: config: %s", config_error)
        if job_id:
            from gpuguard.config import find_config_path

            _stop_without_config(job_id, log, node=env.get("SLURMD_NODENAME"), config=find_config_path()[0])
        return EXIT_OK
    budget = float(cfg.get("epilog", "time_budget_s"))
    deadline = started + budget * DEADLINE_SHARE
    node = cfg.node_name

    stop, status, restarts = _stop_job_collector(cfg, job_id, budget, node, log)
    live, pend = _post_job_checks(cfg, env, job_id, henv.job_gpus, node, deadline, log)

    # 4. one epilog at a time per job: a second or concurrent one never undoes the first
    from gpuguard.epilog.joblock import job_lock

    with job_lock(cfg, job_id, deadline) as locked:
        if job_id and not locked:
            log.error("tool error: another epilog of job %s holds its lock; records left to it", job_id)
            return EXIT_OK
        _bookkeeping(cfg, env, job_id, node, stop, status, live, pend, henv.job_gpus, exit_raw, log, restarts,
                     henv.job_uid)
    return EXIT_OK


def _stop_job_collector(cfg: Any, job_id: str | None, budget: float, node: str, log: Any) -> tuple:
    """Step 2: stop the job's collector (pid file, then any left in /proc for this node and
    config). Returns ``(StopResult or None, collector status, restart record or None)``."""
    stop = None
    if job_id:
        try:
            stop = stop_collector(cfg, job_id, min(COLLECTOR_STOP_MAX_S, budget * COLLECTOR_STOP_SHARE))
            if stop.was_running and not stop.exited:
                log.error("tool error: collector pid %s did not exit after %s", stop.pid, stop.signal_sent)
        except Exception as e:  # our fault: the summary says "unknown"
            log.error("tool error: collector stop: %s: %s", type(e).__name__, e)
        # a collector left behind (its supervisor killed, a pid file lost) is found in /proc
        _stop_without_config(job_id, log, node=node, config=cfg.path)
    restarts = _collector_restarts(cfg, job_id, log) if job_id else None
    return stop, collector_status(stop), restarts


def _post_job_checks(cfg: Any, env: dict[str, str], job_id: str | None, job_gpus: Any, node: str,
                     deadline: float, log: Any) -> tuple:
    """Step 3: pending drains, the post-job checks on live state and the drain, before any
    store I/O; alerts queued. Returns ``(LiveCheck, PendingDrains)``."""
    from gpuguard.nodecheck import live_check, pending_drains
    from gpuguard.ops.maintenance import cached as maintenance_now

    maint = maintenance_now(cfg, node)  # the last health run's view: no Slurm call here
    pend = pending_drains(cfg, deadline, log, allow_drain=not maint.active)
    live = live_check(cfg, pend, hook="epilog", job_id=job_id, job_gpus=job_gpus, deadline=deadline)
    live.maintenance = maint.active  # a drain held back is recorded as suppressed
    res = live.result
    for err in res.tool_errors:
        log.error("tool error: %s", err)
    for f, action in res.decision.actions:
        log.info("finding %s %s %s gpu=%s: %s", f.code, f.severity, action, f.gpu_index, f.message)
    if res.decision.outcome == "drain" and live.drain is not None and live.drain.status not in ("confirmed",
                                                                                               "dry-run"):
        log.error("tool error: drain failed: %s", live.drain.why)
    elif res.decision.fail_job_alerted:  # policy.after_job's flag, never the reason's wording
        log.warning("post-job finding with action fail-job, alerted (the job has ended; nothing to fail): %s",
                    res.decision.reason)
    if maint.active and res.decision.outcome == "drain":
        from gpuguard.ops.maintenance import record_suppressed

        record_suppressed(cfg, maint, "drain", res.decision.reason, by="epilog", log=log)
    from gpuguard.ops.alert_spool import enqueue_from_hook
    from gpuguard.ops.jobmap import job_ended

    enqueue_from_hook(cfg, node, res.decision.actions, source="epilog", job_id=job_id, log=log)
    job_ended(cfg, env, log)  # exporters' GPU -> job files; fails open
    return live, pend


#: Share of ``[epilog] time_budget_s`` the work plans with (the rest: exit margin).
DEADLINE_SHARE = 0.9


def _collector_restarts(cfg: Any, job_id: str, log: Any) -> dict | None:
    """The supervisor's restart record of the job (and the file removed), or None."""
    from gpuguard.collector.supervise import read_restart_file, restart_file_path

    path = restart_file_path(cfg, job_id)
    doc = read_restart_file(path)
    try:
        os.unlink(path)
    except OSError:
        pass
    if doc:
        log.warning("collector was restarted %s time(s) by its supervisor, down %.1f s in all (last: %s)",
                    doc.get("restarts"), float(doc.get("down_s") or 0), doc.get("last_death"))
    return doc


def _load_spill(store: Any, cfg: Any, job_id: str, log: Any) -> None:
    """Rows the collector could not store at exit (a locked store) go in now."""
    from gpuguard.collector.spill import load_spill
    from gpuguard.store import StoreError

    path = os.path.join(cfg.get("paths", "state_dir"), f"collector.{job_id}.spill.jsonl")
    try:
        n = load_spill(store, path)
        if n:
            log.info("loaded %d row(s) the collector could not store at exit", n)
    except StoreError as e:
        log.error("tool error: collector spill %s kept: %s", path, e)


def _stop_without_config(job_id: str, log: Any, *, node: str | None, config: str | None) -> None:
    """Stop the job's collectors found through /proc, those of this node and config
    file only (``--node`` / ``--config`` on their command line); used when the pid file
    cannot be trusted or read (a broken config, a killed supervisor)."""
    if not node:
        return  # without a node name the scan could hit another slurmd's collector
    try:
        from gpuguard.collector.scan import stop_collector_by_scan

        for r in stop_collector_by_scan(job_id, COLLECTOR_STOP_MAX_S, node=node, config=config):
            log.warning("collector pid %s of job %s stopped without a config (%s)", r.pid, job_id,
                        "exited" if r.exited else "did not exit")
    except Exception as e:
        log.error("tool error: collector stop: %s: %s", type(e).__name__, e)


def _already_done(store: Any, job_id: str, node: str, job_dir: str, stop: Any) -> bool:
    """True when an earlier epilog of this job finished its bookkeeping: its summary is
    stored, the job directory is gone and no collector was left to stop."""
    if stop is not None and stop.pid is not None:
        return False
    if os.path.lexists(job_dir):
        return False
    rows = store.query("select 1 from job_summaries where job_id = ? and node = ?", [job_id, node])
    return bool(rows)


def _bookkeeping(cfg: Any, env: dict[str, str], job_id: str | None, node: str, stop: Any, status: str,
                 live: Any, pend: Any, job_gpus: Any, exit_raw: int | None, log: Any,
                 restarts: dict | None = None, uid: int | None = None) -> None:
    from gpuguard.ops import schema as _ops_schema  # noqa: F401  (the "ops" tables: record_hook_drain)
    from gpuguard.store import StoreError, open_store

    store = None
    try:
        store = open_store(cfg.store_path)
    except StoreError as e:
        log.error("tool error: %s", e)
    if store is None:
        log.info("epilog done without a summary (no store)")
        return
    from gpuguard.nodecheck import bound_store_waits

    bound_store_waits(store, pend.deadline, share=0.3)
    try:
        _bookkeeping_in(store, cfg, env, job_id, node, stop, status, live, pend, job_gpus, exit_raw, log,
                        restarts, uid)
    finally:
        store.close()


def _bookkeeping_in(store: Any, cfg: Any, env: dict[str, str], job_id: str | None, node: str, stop: Any,
                    status: str, live: Any, pend: Any, job_gpus: Any, exit_raw: int | None, log: Any,
                    restarts: dict | None = None, uid: int | None = None) -> None:
    from gpuguard.nodecheck import record_with_store
    from gpuguard.store import StoreError

    job_dir = os.path.join(cfg.get("paths", "job_dir_root"), job_id) if job_id else ""
    try:
        repeat = bool(job_id) and _already_done(store, job_id, node, job_dir, stop)
    except StoreError as e:
        log.error("tool error: %s", e)
        return
    n_err = len(live.result.tool_errors)
    rec = record_with_store(cfg, store, live, pend, hook="epilog", job_id=job_id, job_gpus=job_gpus, log=log)
    for err in live.result.tool_errors[n_err:]:
        log.error("tool error: %s", err)
    from gpuguard.ops.nodes import record_hook_drain

    record_hook_drain(store, node, live, by="epilog", run_id=getattr(rec, "run_id", None), log=log,
                      decision=rec.decision)
    if not job_id:
        log.info("epilog done without a summary (no job id)")
        return
    if repeat:
        log.info("epilog of job %s already done: its records and summary are kept", job_id)
        return
    _load_spill(store, cfg, job_id, log)
    if status == "died":
        log.warning("collector pid %s died before the epilog", stop.pid)
        try:
            record_collector_death(store, node, job_id, stop.pid)
        except StoreError as e:
            log.error("tool error: %s", e)

    # 5. training records
    ingest, keep_dir = _ingest(store, job_dir, job_id, node, uid, log)

    # 6. the summary
    from gpuguard.epilog.summary import save_summary, summarize_job

    try:
        # buckets aligned on the part's windows: the part reuses the summary's pass
        summary = summarize_job(store, job_id, node, exit_status_raw=exit_raw,
                                collector_status=status, ingest=ingest,
                                window_align_s=float(cfg.get("verdict", "short_window_s")))
        if restarts:
            summary.collector_restarts = int(restarts.get("restarts") or 0)
            summary.collector_down_s = float(restarts.get("down_s") or 0.0)
            from gpuguard.rows import event_row

            store.insert("events", event_row(
                node=node, at=time.time(), kind="collector_restarted", job_id=job_id, source="epilog",
                process="gpuguard-collector",
                message=f"collector restarted {summary.collector_restarts} time(s), down "
                        f"{summary.collector_down_s:.1f} s in all (last: {restarts.get('last_death')})"))
        save_summary(store, summary)
        log.info("summary: %s, collector %s, %d sample(s), %d step record(s)", summary.exit_text,
                 summary.collector_status, summary.sample_count, summary.step_records)
    except Exception as e:
        log.error("tool error: job summary: %s: %s", type(e).__name__, e)
        summary = None
    if summary is not None:
        hand_over(store, job_id, cfg, env, node, summary, log, pend)
    if store is not None:  # 6b-c. upkeep: the job's working rows, then retention
        from gpuguard.epilog.upkeep import auto_prune, drop_working_rows

        drop_working_rows(store, job_id, node, log)
        deadline = getattr(getattr(pend, "actuator", None), "deadline", None)
        auto_prune(store, cfg, float(cfg.get("store", "prune_budget_s")) * 2 if deadline is None
                   else deadline - time.monotonic(), log)

    # 7. the job directory
    _remove_job_dir(store, cfg, job_id, node, job_dir, keep_dir, log)


def _remove_job_dir(store: Any, cfg: Any, job_id: str, node: str, job_dir: str, keep_dir: bool, log: Any) -> None:
    """Step 7: delete the job directory (unless kept for a look) and, once it is gone,
    the job's training-record offsets. Our errors are logged only."""
    if keep_dir:
        log.info("job directory kept: %s", job_dir)
        return
    try:
        remove_job_dir(cfg.get("paths", "job_dir_root"), job_id)
    except FileNotFoundError:
        pass  # no job_dir_root: the job never had a directory
    except Exception as e:
        log.error("tool error: removing %s: %s: %s", job_dir, type(e).__name__, e)
        return
    try:  # the directory is gone: a requeued attempt of the job starts its ingest afresh
        forget_ingest_offsets(store, job_id, node)
    except Exception as e:
        log.error("tool error: training-record offsets: %s: %s", type(e).__name__, e)


def _ingest(store: Any, job_dir: str, job_id: str, node: str, uid: int | None, log: Any) -> tuple:
    """Step 5: read the job's training records into the store. Returns ``(IngestResult or
    None, keep the job directory)``."""
    ingest = None
    keep_dir = False
    if uid is None:
        log.error("tool error: SLURM_JOB_UID unset: training records not read")
        keep_dir = True
    else:
        try:
            ingest = ingest_records(store, job_dir, job_id, node, uid)
            for path, why in ingest.rejected_files:
                log.warning("training records: %s rejected: %s", path, why)
            if ingest.malformed:
                log.warning("training records: %d malformed line(s) skipped", ingest.malformed)
            if ingest.truncated:
                n_steps, n_ckpt = (store.db.conn.execute(f"select count(*) from {t} where job_id = ? and node = ?",
                                                         (job_id, node)).fetchone()[0]
                                   for t in ("steps", "checkpoints"))
                log.warning("training records: truncated at the ingest caps; the summary covers the "
                            "first %d step and %d checkpoint record(s)", n_steps, n_ckpt)
            # a rejected file (symlink, FIFO, hard link: planted by the user) is logged and
            # in the summary; it does not keep the directory (users could pin dirs forever)
            if ingest.steps or ingest.checkpoints:
                log.info("ingested %d step and %d checkpoint record(s) (the rest during the job)",
                         len(ingest.steps), len(ingest.checkpoints))
        except Exception as e:  # StoreError, a bug in the reader: keep the dir for a look
            log.error("tool error: training records: %s: %s", type(e).__name__, e)
            keep_dir = True
    return ingest, keep_dir


def _close(store: Any) -> None:
    if store is not None:
        store.close()


def run_with_budget(budget_s: float, env: dict[str, str] | None = None, loaded: tuple | None = None) -> int:
    """Run :func:`run` under the watchdog :func:`gpuguard.hookrun.run_watched` (exit 0 on
    a crash or an overrun, unless a verdict was announced)."""
    from gpuguard.hookrun import run_watched as guarded

    log_file = loaded[0].get("paths", "log_file") if loaded else None
    return guarded(lambda: run(env, loaded), budget_s, "epilog", log_file=log_file)


def main() -> int:
    """Console script entry point: reads the config once, runs within ``[epilog]
    time_budget_s`` and leaves through ``os._exit`` (:mod:`gpuguard.hookrun`)."""
    from gpuguard.hookrun import exit_hook, load_config

    os.environ.setdefault("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
    rc = EXIT_OK
    try:
        loaded = load_config()
        rc = run_with_budget(float(loaded[0].get("epilog", "time_budget_s")), loaded=loaded)
    finally:
        exit_hook(rc)
    return rc


if __name__ == "__main__":
    main()
