"""Which job owns which GPU, told to the exporters a site already runs, and kept for
gpuguard's own Prometheus labels.

The Prolog calls :func:`job_started`, the Epilog :func:`job_ended` (one call each, both
fail open: any error is logged as a tool error and the hook goes on):

* ``{state_dir}/running/{jobid}.json``: job id, user, uid, account, partition, GPU
  indices — the labels of :mod:`gpuguard.ops.metrics`.
* ``[metrics] dcgm_job_map_dir``: dcgm-exporter's HPC job mapping
  (``--hpc-job-mapping-dir``): one file per GPU index holding the ids of the jobs on that
  GPU, one per line (dcgm-exporter README, "HPC job mapping"); a GPU shared by several
  jobs lists each.
* ``[metrics] gpustat_dir``: Princeton jobstats' ownership files (``/run/gpustat``): one
  file per GPU index holding ``JOBID UID`` (jobstats docs, "GPU Job Ownership Helper").

GPU indices are ``SLURM_JOB_GPUS`` (the gres index, which equals the NVIDIA index when
gres.conf lists ``/dev/nvidia[0-N]`` in order; SLURM-FACTS.md §4), else
``CUDA_VISIBLE_DEVICES`` as the Prolog/Epilog see it (global, not renumbered).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from contextlib import contextmanager
from typing import Any

from gpuguard.ops.files import atomic_write


def job_gpus(env: dict[str, str]) -> list[int]:
    """The job's GPU indices on this node (see the module docstring), each once, in
    order. A value naming an index no node can have (above
    :data:`gpuguard.hookenv.MAX_GPU_INDEX`) is not used: one file per index is written,
    so ``SLURM_JOB_GPUS=0,1,...,999999`` must not make a million of them."""
    from gpuguard.hookenv import parse_job_gpus

    for var in ("SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"):
        try:
            out = parse_job_gpus(env.get(var))
        except ValueError:
            continue
        if out:
            return list(dict.fromkeys(out))
    return []


def running_dir(cfg: Any) -> str:
    return os.path.join(cfg.get("paths", "state_dir"), "running")


@contextmanager
def _map_lock(cfg: Any):
    """Serialise read-modify-write of the dcgm files between concurrent Prologs/Epilogs.
    The lock lives in gpuguard's state dir: dcgm-exporter reads every file of its
    directory as a GPU index."""
    d = cfg.get("paths", "state_dir")
    os.makedirs(d, mode=0o755, exist_ok=True)
    fd = os.open(os.path.join(d, "jobmap.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _read_small(path: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return ""
    with os.fdopen(fd, encoding="utf-8", errors="replace") as fh:
        return fh.read(65536)


def _dcgm_update(d: str, gpu: int, job_id: str, add: bool) -> None:
    path = os.path.join(d, str(gpu))
    ids = [x for x in _read_small(path).split() if x != job_id]
    if add:
        ids.append(job_id)
    if ids:
        atomic_write(path, "".join(f"{x}\n" for x in ids))
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def job_started(cfg: Any, env: dict[str, str], log: Any) -> None:
    """Prolog side: record the job's GPUs and labels (see the module docstring)."""
    from gpuguard.hookrun import is_job_id

    job_id = env.get("SLURM_JOB_ID")
    if not is_job_id(job_id):
        return
    try:
        gpus = job_gpus(env)
        doc = {"job_id": job_id, "user": env.get("SLURM_JOB_USER", ""), "uid": env.get("SLURM_JOB_UID", ""),
               "account": env.get("SLURM_JOB_ACCOUNT", ""), "partition": env.get("SLURM_JOB_PARTITION", ""),
               "gpus": gpus, "started_at": time.time()}
        atomic_write(os.path.join(running_dir(cfg), f"{job_id}.json"), json.dumps(doc) + "\n")
        d = cfg.get("metrics", "dcgm_job_map_dir")
        if d and gpus:
            with _map_lock(cfg):
                for g in gpus:
                    _dcgm_update(d, g, job_id, add=True)
        d = cfg.get("metrics", "gpustat_dir")
        uid = env.get("SLURM_JOB_UID", "")
        if d and gpus and uid.isascii() and uid.isdigit():
            for g in gpus:
                atomic_write(os.path.join(d, str(g)), f"{job_id} {uid}\n")
    except Exception as e:  # our fault: the job runs, the exporters lack its labels
        log.error("tool error: job mapping files: %s: %s", type(e).__name__, e)


def job_ended(cfg: Any, env: dict[str, str], log: Any) -> None:
    """Epilog side: undo :func:`job_started` for this job only (a file now naming
    another job is left alone)."""
    from gpuguard.hookrun import is_job_id

    job_id = env.get("SLURM_JOB_ID")
    if not is_job_id(job_id):
        return
    try:
        gpus = job_gpus(env)
        d = cfg.get("metrics", "dcgm_job_map_dir")
        if d and gpus:
            with _map_lock(cfg):
                for g in gpus:
                    _dcgm_update(d, g, job_id, add=False)
        d = cfg.get("metrics", "gpustat_dir")
        if d:
            for g in gpus:
                p = os.path.join(d, str(g))
                if _read_small(p).split()[:1] == [job_id]:
                    os.unlink(p)
        try:
            os.unlink(os.path.join(running_dir(cfg), f"{job_id}.json"))
        except FileNotFoundError:
            pass
    except Exception as e:
        log.error("tool error: job mapping files: %s: %s", type(e).__name__, e)


def running_jobs(cfg: Any) -> list[dict[str, Any]]:
    """The jobs the Prolog recorded and the Epilog has not removed yet."""
    out = []
    d = running_dir(cfg)
    try:
        names = sorted(os.listdir(d))
    except FileNotFoundError:
        return []
    for n in names:
        if n.endswith(".json"):
            try:
                out.append(json.loads(_read_small(os.path.join(d, n))))
            except ValueError:
                continue
    return out
