"""``gpuguard-epilog-slurmctld``: the EpilogSlurmctld hook (once per job, on the controller,
as SlurmUser).

Waits (bounded by ``[epilog] slurmctld_wait_s``) for every node of the job to write its
summary to the spool directory, merges them and stores the result in the job's
AdminComment through ``sacctmgr modify job`` — ``scontrol update AdminComment`` is
refused once the job has finished (SLURM-FACTS.md §6c) — so ``sacct`` and every sacct-based
tool see it, under Slurm's own PrivateData rules. Retries a few times in case the job
record has not reached slurmdbd yet (Princeton jobstats sleeps first for the same reason).

Without ``[paths] spool_dir`` it does nothing. It always exits 0: a failing
EpilogSlurmctld only logs in Slurm 22.05, and our errors are ours to log.
"""

from __future__ import annotations

import os
import sys
import time


def _nodes(env: dict[str, str], bin_dir: str) -> list[str]:
    """Expand ``SLURM_JOB_NODELIST`` (``n[1-2]``) with ``scontrol show hostnames``."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    if not nodelist:
        return []
    from gpuguard.slurm import SlurmCli

    return SlurmCli(bin_dir).run("scontrol", "show", "hostnames", nodelist).split()


def run(env: dict[str, str] | None = None, retries: int = 3, retry_sleep_s: float = 2.0,
        loaded: tuple | None = None) -> int:
    """Merge the node summaries of ``SLURM_JOB_ID`` into its AdminComment; returns 0.
    ``loaded``: :func:`gpuguard.hookrun.load_config`'s result if already read."""
    env = dict(os.environ) if env is None else env
    from gpuguard import log as log_mod
    from gpuguard.hookrun import load_config

    job_id = env.get("SLURM_JOB_ID")
    cfg, config_error = loaded or load_config()
    if config_error:
        log_mod.setup(None, "epilog-slurmctld", job_id).error("tool error: config: %s", config_error)
        return 0
    log = log_mod.setup(cfg.get("paths", "log_file"), "epilog-slurmctld", job_id)
    spool = cfg.get("paths", "spool_dir")
    if not spool or not job_id:
        return 0
    from gpuguard.hookrun import is_job_id

    if not is_job_id(job_id):
        log.error("tool error: SLURM_JOB_ID %r is not a job id", job_id)
        return 0
    from gpuguard.epilog.spool import encode_admin_comment, wait_for_nodes
    from gpuguard.slurm import SlurmCli, SlurmError

    bin_dir = cfg.get("slurm", "bin_dir")
    try:
        nodes = _nodes(env, bin_dir)
    except SlurmError as e:
        log.error("tool error: node list: %s", e)
        nodes = []
    have = wait_for_nodes(spool, job_id, nodes, cfg.get("epilog", "slurmctld_wait_s"))
    missing = [n for n in nodes if n not in have]
    if missing:
        log.warning("no summary from node(s) %s after %.0f s", ",".join(missing), cfg.get("epilog", "slurmctld_wait_s"))
    if not have:
        return 0
    text = encode_admin_comment(job_id, have, missing)
    slurm = SlurmCli(bin_dir)
    for attempt in range(1, retries + 1):
        try:
            slurm.set_admin_comment(job_id, text)
            log.info("AdminComment set (%d bytes, %d node(s))", len(text.encode()), len(have))
            return 0
        except SlurmError as e:
            log.warning("AdminComment attempt %d/%d failed: %s", attempt, retries, e)
            time.sleep(retry_sleep_s)
    log.error("tool error: AdminComment not set for job %s", job_id)
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


def main() -> int:
    """Console script entry point. The hook itself returns at once: waiting here for the
    node summaries and slurmdbd would hold the job in COMPLETING, and on the testbed its
    GPUs were not handed to the next job until this hook ended (a held job started 15 s
    late). The work runs in a detached worker (``--worker``) under a time budget of
    ``slurmctld_wait_s`` + 30 s (:mod:`gpuguard.hookrun`). Always exits 0."""
    from gpuguard.hookrun import exit_hook

    os.environ.setdefault("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
    if "--worker" not in sys.argv[1:]:
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
