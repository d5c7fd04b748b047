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

Which GPU a file names (:func:`resolve_gpus`, from the Prolog's GPU snapshot):

* on a node with no GPU in MIG mode: ``SLURM_JOB_GPUS`` (the gres index, which equals
  the NVIDIA index when gres.conf lists ``/dev/nvidia[0-N]`` in order; SLURM-FACTS.md
  §4), else ``CUDA_VISIBLE_DEVICES`` as the Prolog/Epilog see it (global, not
  renumbered), and ``GPU-<uuid>`` entries mapped to their index through the snapshot;
* on a node with a GPU in MIG mode (or whose MIG mode could not be read) no Slurm index
  is used: with ``AutoDetect=nvml`` each MIG device is a gres device of its own, so
  Slurm's index counts MIG devices (Slurm gres.conf(5), "MIG") and file ``1`` would
  label NVML GPU 1, another tenant's (the collector's rule, :mod:`gpuguard.collector.mig`).
  ``GPU-<uuid>`` entries of GPUs not in MIG mode still map to their index;
* a MIG device (``MIG-<uuid>`` in ``CUDA_VISIBLE_DEVICES``, R470+ drivers): jobstats
  gets a file named by that UUID, which its exporter reads first for each MIG device
  (``/run/gpustat/<uuid>``; jobstats docs: "named ... in the case of MIG cards,
  MIG-UUID"). dcgm-exporter gets nothing: its HPC mapper takes only file names that are
  integers and matches them to the metric's whole-GPU index, which every MIG instance
  of that GPU carries (dcgm-exporter ``internal/pkg/transformation/hpc.go``,
  ``getGPUFiles`` / ``metric.GPU``), so a file for the parent GPU would label the other
  tenants' instances with this job. A pre-R470 ``MIG-GPU-<uuid>/<gi>/<ci>`` id names no
  file either (a ``/`` cannot be in a file name; jobstats' ``<index>.<gi>`` fallback is
  shared by every compute instance of that GPU instance).
* no snapshot (the GPU source failed): the numbering cannot be known, so no index file.

What cannot be written is one warning line per reason and job; never a file that may
name another tenant's GPU.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import time
from contextlib import contextmanager
from typing import Any

from gpuguard.ops.files import atomic_write

#: A MIG device id of R470+ drivers as ``nvmlDeviceGetUUID`` gives it for a MIG handle and
#: Slurm puts it in ``CUDA_VISIBLE_DEVICES``: the one MIG id that is a file name.
_MIG_UUID = re.compile(r"MIG-[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}")


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


def resolve_gpus(env: dict[str, str], snapshot: Any) -> tuple[list[int], list[str], list[str]]:
    """The job's GPUs as the exporters name them (the module docstring): ``(indices,
    mig_uuids, warnings)``. ``indices``: NVML indices of whole GPUs the job holds, each
    once; ``mig_uuids``: the job's ``MIG-<uuid>`` devices (R470+ ids), as given;
    ``warnings``: one line per reason something the job holds gets no file. ``snapshot``:
    the Prolog's :class:`~gpuguard.model.NodeSnapshot`, or None when it has none (then no
    index is used)."""
    from gpuguard.collector.mig import parse_mig_entries

    warnings: list[str] = []
    indices = job_gpus(env)
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    uuids = [x for x in (s.strip() for s in (cvd or "").split(",")) if x[:4].upper() == "GPU-"]
    migs = parse_mig_entries(cvd)
    mig_uuids = [m for m in dict.fromkeys(migs) if _MIG_UUID.fullmatch(m)]
    if len(mig_uuids) < len(set(migs)):
        warnings.append(f"MIG device(s) {','.join(m for m in dict.fromkeys(migs) if m not in mig_uuids)}: a "
                        "pre-R470 MIG id names no file: no job mapping file written")
    if migs:
        warnings.append(f"MIG device(s) {','.join(dict.fromkeys(migs))}: dcgm-exporter's HPC job mapping names "
                        "whole GPUs only (every MIG instance of a GPU carries its index): no dcgm job mapping "
                        "file written")
    if snapshot is None or getattr(snapshot, "error", None):
        if indices or uuids:
            warnings.append(f"job GPU(s) {','.join([str(i) for i in indices] + uuids)}: no GPU snapshot, so "
                            "whether Slurm's GPU index is NVML's (no GPU in MIG mode) is unknown: no GPU-index "
                            "job mapping file written")
        return [], mig_uuids, warnings
    mig_gpus = sorted(g.index for g in snapshot.gpus if g.mig_or_unknown)
    if indices and mig_gpus:
        warnings.append(f"job GPU index(es) {','.join(map(str, indices))}: GPU(s) {','.join(map(str, mig_gpus))} "
                        "of this node are in MIG mode (or their MIG mode is unreadable), where Slurm's GPU index "
                        "counts MIG devices, not NVML's GPUs: no GPU-index job mapping file written")
        indices = []
    by_uuid = {g.uuid.lower(): g.index for g in snapshot.gpus if g.uuid}
    for u in uuids:
        i = by_uuid.get(u.lower())
        if i is None:
            warnings.append(f"job GPU {u}: not found on this node: no job mapping file written")
        elif i in mig_gpus:
            warnings.append(f"job GPU {u} (GPU {i}) is in MIG mode: its readings are shared with its MIG "
                            "tenants: no GPU-index job mapping file written")
        elif i not in indices:
            indices.append(i)
    return indices, mig_uuids, warnings


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


def job_started(cfg: Any, env: dict[str, str], log: Any, *, snapshot: Any) -> None:
    """Prolog side: record the job's GPUs and labels (see the module docstring).
    ``snapshot``: the Prolog's GPU snapshot (None: none was taken; then no GPU-index file
    is written). The running record keeps ``gpus`` (NVML indices) and ``mig_devices``
    (the MIG UUIDs given a jobstats file), which :func:`job_ended` removes."""
    from gpuguard.hookrun import is_job_id

    job_id = env.get("SLURM_JOB_ID")
    if not is_job_id(job_id):
        return
    try:
        gpus, migs, warnings = resolve_gpus(env, snapshot)
        for w in warnings:
            log.warning("job mapping files: %s", w)
        doc = {"job_id": job_id, "user": env.get("SLURM_JOB_USER", ""), "uid": env.get("SLURM_JOB_UID", ""),
               "account": env.get("SLURM_JOB_ACCOUNT", ""), "partition": env.get("SLURM_JOB_PARTITION", ""),
               "gpus": gpus, "mig_devices": migs, "started_at": time.time()}
        atomic_write(os.path.join(running_dir(cfg), f"{job_id}.json"), json.dumps(doc) + "\n")
        d = cfg.get("metrics", "dcgm_job_map_dir")
        if d and gpus:
            with _map_lock(cfg):
                for g in gpus:
                    _dcgm_update(d, g, job_id, add=True)
        d = cfg.get("metrics", "gpustat_dir")
        uid = env.get("SLURM_JOB_UID", "")
        if d and uid.isascii() and uid.isdigit():
            for name in [str(g) for g in gpus] + migs:
                atomic_write(os.path.join(d, name), f"{job_id} {uid}\n")
    except Exception as e:  # our fault: the job runs, the exporters lack its labels
        log.error("tool error: job mapping files: %s: %s", type(e).__name__, e)


def _recorded(cfg: Any, job_id: str) -> dict[str, Any]:
    try:
        doc = json.loads(_read_small(os.path.join(running_dir(cfg), f"{job_id}.json")) or "{}")
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def job_ended(cfg: Any, env: dict[str, str], log: Any) -> None:
    """Epilog side: undo :func:`job_started` for this job only (a file now naming
    another job is left alone)."""
    from gpuguard.hookrun import is_job_id

    job_id = env.get("SLURM_JOB_ID")
    if not is_job_id(job_id):
        return
    try:
        # what the Prolog wrote, and what the environment names (an older record, or none):
        # only this job's entries are removed, so a name that was never written costs nothing
        doc = _recorded(cfg, job_id)
        gpus = list(dict.fromkeys([g for g in doc.get("gpus") or [] if isinstance(g, int)] + job_gpus(env)))
        from gpuguard.collector.mig import parse_mig_entries

        migs = [m for m in dict.fromkeys([*(doc.get("mig_devices") or []),
                                          *parse_mig_entries(env.get("CUDA_VISIBLE_DEVICES"))])
                if isinstance(m, str) and _MIG_UUID.fullmatch(m)]
        d = cfg.get("metrics", "dcgm_job_map_dir")
        if d and gpus:
            with _map_lock(cfg):
                for g in gpus:
                    _dcgm_update(d, g, job_id, add=False)
        d = cfg.get("metrics", "gpustat_dir")
        if d:
            for name in [str(g) for g in gpus] + migs:
                p = os.path.join(d, name)
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
