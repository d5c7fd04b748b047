"""``gpuguard-epilog-slurmctld``: the EpilogSlurmctld hook (once per job, on the controller,
as SlurmUser) and its detached worker: the job judge's home.

The hook returns at once; the worker (:func:`run`)

1. writes the job's manifest (``{spool_dir}/{job_id}/job.json``: user, account,
   partition, name, comment, node list, exit code — what only this hook's environment
   has, SLURM-FACTS.md §4) so that ``gpuguard cluster ingest`` can finish the job if the
   worker dies;
2. waits (``[epilog] slurmctld_wait_s``) until every allocated node's part is in the spool;
3. judges the job once, with every node's part, in the cluster store
   (:func:`gpuguard.epilog.cluster.judge_from_spool`): verdict, findings, escalation
   drains, and the AdminComment through ``sacctmgr modify job`` (``scontrol`` refuses a
   finished job: SLURM-FACTS §6c), retried a few times in case the job record has not
   reached slurmdbd yet (Princeton jobstats sleeps first for the same reason).

EpilogSlurmctld gets no ``SLURM_CONF``: the config and the slurm.conf that ``scontrol`` and
``sacctmgr`` need are found through slurmctld's command line (:mod:`gpuguard.config`) and
handed to the worker in its environment. Without ``[paths] spool_dir`` it does nothing.
It always exits 0: a failing EpilogSlurmctld only logs in Slurm 22.05, and our errors are
ours to log.
"""

from __future__ import annotations

import os
import sys
import time


def _nodes(env: dict[str, str], bin_dir: str) -> list[str]:
    """Expand ``SLURM_JOB_NODELIST`` (``n[1-2]``) with ``scontrol show hostnames``."""
    from gpuguard.hookenv import read_hook_env
    from gpuguard.slurm import SlurmCli

    nodelist = read_hook_env(env).job_nodelist
    if not nodelist:
        return []

    return SlurmCli(bin_dir).run("scontrol", "show", "hostnames", nodelist).split()


def run(env: dict[str, str] | None = None, retries: int = 3, retry_sleep_s: float = 2.0,
        loaded: tuple | None = None) -> int:
    """The worker's work for ``SLURM_JOB_ID`` (module docstring); returns 0.
    ``loaded``: :func:`gpuguard.hookrun.load_config`'s result if already read."""
    from gpuguard.hookenv import clean_env

    env = clean_env(os.environ if env is None else env)
    from gpuguard import log as log_mod
    from gpuguard.hookrun import load_config

    job_id = env.get("SLURM_JOB_ID")
    cfg, config_error = loaded or load_config()
    if config_error:
        log_mod.setup(cfg.get("paths", "log_file"), "epilog-slurmctld", job_id).error(
            "tool error: config: %s", config_error)
        return 0
    log = log_mod.setup(cfg.get("paths", "log_file"), "epilog-slurmctld", job_id)
    spool = cfg.get("paths", "spool_dir")
    if not spool or not job_id:
        return 0
    from gpuguard.hookrun import is_job_id

    if not is_job_id(job_id):
        log.error("tool error: SLURM_JOB_ID %r is not a job id", job_id)
        return 0
    from gpuguard.epilog.cluster import judge_from_spool, wait_for_parts, write_manifest
    from gpuguard.epilog.judge import meta_from_env
    from gpuguard.slurm import SlurmCli, SlurmError
    from gpuguard.store import StoreError, open_store

    bin_dir = cfg.get("slurm", "bin_dir")
    try:
        nodes = _nodes(env, bin_dir)
    except SlurmError as e:
        log.error("tool error: node list: %s", e)
        nodes = []
    meta = meta_from_env(env, nodes)
    try:
        write_manifest(spool, job_id, meta)
    except Exception as e:  # the judge below still runs; only a dead worker's job loses its meta
        log.error("tool error: manifest: %s: %s", type(e).__name__, e)
    wait_s = float(cfg.get("epilog", "slurmctld_wait_s"))
    parts = wait_for_parts(spool, job_id, nodes, wait_s, log)
    if not parts:
        log.warning("no part from any node of job %s after %.0f s; cluster ingest judges it if one comes", job_id,
                    wait_s)
        return 0
    try:
        store = open_store(cfg.cluster_store_path)
    except StoreError as e:
        log.error("tool error: %s", e)
        return 0
    try:
        judge_from_spool(cfg, store, job_id, log=log, slurm=SlurmCli(bin_dir), parts=parts, meta=meta,
                         retries=retries, retry_sleep_s=retry_sleep_s)
    except Exception as e:
        log.error("tool error: job judge: %s: %s", type(e).__name__, e)
    finally:
        store.close()
    return 0


def detach() -> int | None:
    """Re-run this module as a worker in its own session with stdio on /dev/null and
    return its pid once it has left the hook's process group (Slurm kills that group when
    the hook exits: SLURM-FACTS §6e). None when the worker could not be started."""
    import subprocess

    try:
        p = subprocess.Popen([sys.executable, "-m", "gpuguard.epilog.slurmctld", "--worker"],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True, close_fds=True)
    except OSError:
        return None
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        try:
            if os.getpgid(p.pid) == p.pid:
                return p.pid
        except ProcessLookupError:
            return p.pid  # already done
        time.sleep(0.005)
    return p.pid


def _hand_config_to_worker() -> bool:
    """Find the config and slurm.conf *here*, while slurmscriptd is our parent (the
    detached worker is re-parented and cannot), and pass both in the environment. A
    config that cannot be found or read -- or is not read within
    :data:`gpuguard.hookrun.CONFIG_READ_TIMEOUT_S` (a hung mount: the job would stay
    COMPLETING while this hook waits) -- is one error line in syslog (LOG_DAEMON) and on
    stderr, never a silent run on the defaults; then no worker is started. Returns
    whether the config is usable."""
    from gpuguard.hookrun import load_config

    cfg, error = load_config()  # in a child, timed; sets SLURM_CONF as export_slurm_conf does
    if error is None:
        if cfg.path:
            os.environ["GPUGUARD_CONFIG"] = os.path.abspath(cfg.path)
        return True
    import syslog

    syslog.openlog("gpuguard-epilog-slurmctld", syslog.LOG_PID, syslog.LOG_DAEMON)
    syslog.syslog(syslog.LOG_ERR, f"tool error: config: {error}")
    print(f"gpuguard-epilog-slurmctld: tool error: config: {error}", file=sys.stderr)
    return False


def main() -> int:
    """Console script entry point. The hook itself returns at once: waiting here for the
    node summaries and slurmdbd would hold the job in COMPLETING, and on the testbed its
    GPUs were not handed to the next job until this hook ended (a held job started 15 s
    late). The work runs in a detached worker (``--worker``) under a time budget of
    ``slurmctld_wait_s`` + 30 s (:mod:`gpuguard.hookrun`). Always exits 0."""
    from gpuguard.hookrun import exit_hook

    os.environ.setdefault("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
    if "--worker" not in sys.argv[1:]:
        if _hand_config_to_worker():
            detach()
        exit_hook(0)
    from gpuguard.hookrun import load_config, run_with_budget

    rc = 0
    try:
        loaded = load_config()
        wait = float(loaded[0].get("epilog", "slurmctld_wait_s"))
        rc = run_with_budget(lambda: run(loaded=loaded), wait + 30.0, "epilog-slurmctld")
    finally:
        exit_hook(rc)
    return rc


if __name__ == "__main__":
    sys.exit(main())
