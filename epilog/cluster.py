"""The controller side of cluster mode: the job manifest, waiting for parts, judging a
job from the spool, and ``gpuguard cluster ingest``.

Spool layout (``[paths] spool_dir``, a directory shared by the nodes and the controller,
owned by SlurmUser)::

    {spool_dir}/{job_id}/job.json              manifest: EpilogSlurmctld's view of the job
    {spool_dir}/{job_id}/{node}.part.npz       one part per node (gpuguard.epilog.part_codec;
                                               the previous release's {node}.part.json.gz is read too)

A job directory is removed once the job was judged with every node's part and its
AdminComment is set; a job judged with parts missing keeps its directory (a late part
makes ``cluster ingest`` judge it again) until ``[cluster] spool_keep_days``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

from gpuguard.inputs import json_loads

MANIFEST = "job.json"
MAX_MANIFEST_BYTES = 1024 * 1024


def write_manifest(spool_dir: str, job_id: str, meta: dict[str, Any]) -> str:
    """Write the job's manifest atomically; returns its path. Raises ``OSError`` and
    :class:`gpuguard.epilog.spool.SpoolError`."""
    from gpuguard.epilog.part import job_dir, write_file_atomic

    d = job_dir(spool_dir, job_id, create=True)
    return write_file_atomic(d, MANIFEST, json.dumps(meta, separators=(",", ":"), default=str).encode())


def read_manifest(spool_dir: str, job_id: str) -> dict[str, Any] | None:
    """The manifest, or None when absent or unreadable (never follows a symlink)."""
    from gpuguard.epilog.part import _read_bounded, job_dir

    blob = _read_bounded(os.path.join(job_dir(spool_dir, job_id), MANIFEST), MAX_MANIFEST_BYTES)
    if blob is None:
        return None
    try:
        doc = json_loads(blob)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and str(doc.get("job_id")) == str(job_id) else None


def wait_for_parts(spool_dir: str, job_id: str, nodes: list[str], timeout_s: float, log: Any = None,
                   poll_s: float = 0.5) -> dict[str, dict[str, Any]]:
    """Poll until every node in ``nodes`` has its part in the spool or ``timeout_s``
    passes (EpilogSlurmctld starts with, or before, the node Epilogs: SLURM-FACTS §3).
    Returns the parts there are. Only new files are decoded on each poll."""
    from gpuguard.epilog.part import job_dir, part_node, read_parts

    deadline = time.monotonic() + timeout_s
    d = job_dir(spool_dir, job_id)
    while True:
        try:
            have = {part_node(n) for n in os.listdir(d)}
        except OSError:
            have = set()
        if all(n in have for n in nodes) or time.monotonic() >= deadline:
            return read_parts(spool_dir, job_id, log)
        time.sleep(poll_s)


def remove_job(spool_dir: str, job_id: str, log: Any = None) -> bool:
    """Remove the job's spool directory (``shutil.rmtree`` works by file descriptor and
    never follows a symlink out of it); returns whether it is gone."""
    from gpuguard.epilog.part import job_dir

    d = job_dir(spool_dir, job_id)
    try:
        shutil.rmtree(d)
        return True
    except FileNotFoundError:
        return True
    except OSError as e:
        if log is not None:
            log.warning("spool: cannot remove %s: %s", d, e)
        return False


def _parts_of_job_nodes(parts: dict[str, dict[str, Any]], meta: dict[str, Any], job_id: str,
                        log: Any) -> dict[str, dict[str, Any]]:
    """``parts`` less those of nodes the manifest does not list (when it lists any): a part
    left by an earlier attempt of a requeued job on other nodes, or written for a job its
    node did not run, is not this job's data; judged with it, the verdict could name (and
    escalation drain) a node the job never ran on."""
    nodes = meta.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        return parts
    foreign = sorted(n for n in parts if n not in nodes)
    if foreign:
        log.warning("job %s: part(s) of %s left out: not among the job's nodes %s", job_id, ",".join(foreign),
                    ",".join(str(n) for n in nodes))
    return {n: p for n, p in parts.items() if n in nodes}


#: Held (``flock``) by whoever judges a job from the spool: the EpilogSlurmctld worker, or
#: ``cluster ingest`` once the worker's wait is over. A worker slowed past that wait (a
#: slurmdbd that does not answer its sacctmgr retries) would otherwise be judging the same
#: job as the ingest. A name starting with ``.`` is no part (:func:`part.part_node`).
JUDGE_LOCK = ".judge.lock"


def _judge_lock(spool_dir: str, job_id: str) -> int | None:
    """The job's judge lock taken (a descriptor to close), -1 when it cannot be opened (no
    job directory: judged unlocked), None when another judge holds it."""
    from gpuguard.epilog.part import job_dir
    from gpuguard.flock import try_flock

    return try_flock(os.path.join(job_dir(spool_dir, job_id), JUDGE_LOCK), 0o644)


def judge_from_spool(cfg: Any, store: Any, job_id: str, *, log: Any, slurm: Any,
                     parts: dict[str, dict[str, Any]] | None = None, meta: dict[str, Any] | None = None,
                     retries: int = 3, retry_sleep_s: float = 2.0) -> Any:
    """Judge one job from what the spool holds (or the ``parts``/``meta`` given), then
    remove its spool directory when it was judged complete with its AdminComment set.
    Returns the :class:`gpuguard.epilog.judge.JudgeResult`, or None without any part or
    while another judge holds the job (:data:`JUDGE_LOCK`)."""
    spool = cfg.get("paths", "spool_dir")
    lock = _judge_lock(spool, job_id)
    if lock is None:
        log.info("job %s: another judge is at it; left to it", job_id)
        return None
    try:
        return _judge_locked(cfg, store, job_id, log=log, slurm=slurm, parts=parts, meta=meta, retries=retries,
                             retry_sleep_s=retry_sleep_s)
    finally:
        if lock >= 0:
            os.close(lock)


def _judge_locked(cfg: Any, store: Any, job_id: str, *, log: Any, slurm: Any,
                  parts: dict[str, dict[str, Any]] | None, meta: dict[str, Any] | None,
                  retries: int, retry_sleep_s: float) -> Any:
    """:func:`judge_from_spool` under the job's judge lock."""
    from gpuguard.epilog.judge import judge_parts
    from gpuguard.epilog.part import read_parts

    spool = cfg.get("paths", "spool_dir")
    parts = read_parts(spool, job_id, log) if parts is None else parts
    if not parts:
        return None
    meta = meta or read_manifest(spool, job_id) or _meta_without_manifest(job_id, parts, slurm, log)
    parts = _parts_of_job_nodes(parts, meta, job_id, log)
    if not parts:
        return None
    res = judge_parts(store, job_id, parts, cfg=cfg, meta=meta, slurm=slurm, log=log,
                      set_comment=bool(cfg.get("cluster", "admin_comment")), retries=retries,
                      retry_sleep_s=retry_sleep_s)
    if res.missing:
        log.warning("job %s judged without node(s) %s: no part in %s", job_id, ",".join(res.missing), spool)
    if not res.skipped and res.verdict:
        log.info("verdict %s (template %s) from %d node(s)%s: %s", res.verdict["cause"], res.verdict["template"],
                 len(res.nodes), f", {len(res.missing)} missing" if res.missing else "", res.verdict["summary"])
    done = not res.missing and (res.comment_set or res.skipped or not cfg.get("cluster", "admin_comment"))
    if done:
        row = store.query("select admin_comment_at from cluster_jobs where job_id = ?", [str(job_id)])
        if not cfg.get("cluster", "admin_comment") or (row and row[0]["admin_comment_at"] is not None):
            remove_job(spool, job_id, log)
    return res


def _meta_without_manifest(job_id: str, parts: dict[str, dict[str, Any]], slurm: Any, log: Any) -> dict[str, Any]:
    """The manifest of a job EpilogSlurmctld never wrote one for (its worker died, or it
    is not configured): the first part's job fields (:func:`~gpuguard.epilog.judge.meta_from_parts`)
    and, when the template is derived (no ``gpuguard:template=`` in the comment), the job
    name from slurmdbd (:meth:`gpuguard.slurm.SlurmCli.job_name`): the node Epilog has no
    ``SLURM_JOB_NAME`` (SLURM-FACTS §4), and without it the derived template would differ
    from the one the same job gets with its manifest. A failed lookup is logged and the
    name left out (the template then has ``_`` for it, as before)."""
    from gpuguard.epilog.judge import meta_from_parts
    from gpuguard.epilog.template import from_comment

    meta = meta_from_parts(job_id, parts)
    comment = meta.get("comment")
    if slurm is None or meta.get("name") or from_comment(comment if isinstance(comment, str) else None):
        return meta
    try:
        name = slurm.job_name(job_id)
    except Exception as e:  # a tool error: the job is judged with a nameless template
        log.warning("job %s: no manifest, and its name could not be read: %s", job_id, e)
        return meta
    if name:
        meta["name"] = name
    return meta


@dataclass
class IngestResult:
    """What one ``cluster ingest`` pass did (counts of jobs)."""

    judged: int = 0
    unchanged: int = 0
    waiting: int = 0
    removed: int = 0
    errors: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (f"{self.judged} judged, {self.unchanged} unchanged, {self.waiting} still within the "
                f"worker's wait, {self.removed} old spool dir(s) removed, {len(self.errors)} error(s)")


def _newest_mtime(d: str) -> float:
    newest = 0.0
    try:
        with os.scandir(d) as it:
            for e in it:
                try:
                    newest = max(newest, e.stat(follow_symlinks=False).st_mtime)
                except OSError:
                    continue
    except OSError:
        pass
    return newest


def ingest(cfg: Any, store: Any, *, log: Any, slurm: Any, now: float | None = None,
           max_jobs: int = 0, retry_sleep_s: float = 2.0) -> IngestResult:
    """One pass over the spool: judge every job whose parts changed since its last
    judgment (late parts) or that has no judgment yet (the worker died), once the
    worker's own wait is over (``[epilog] slurmctld_wait_s`` + ``[cluster]
    ingest_grace_s`` after the newest file of the job), so worker and ingest never judge
    the same job at the same time. Removes job directories older than ``[cluster]
    spool_keep_days``. ``max_jobs`` > 0 bounds the jobs judged in one pass. A job whose
    judgment raises is counted in ``errors`` and the pass goes on with the next job (the
    spool is taken in job order: one such job would otherwise hold up every later one)."""
    from gpuguard.hookrun import is_job_id
    from gpuguard.store import StoreError

    spool = cfg.get("paths", "spool_dir")
    now = time.time() if now is None else now
    res = IngestResult()
    grace = float(cfg.get("epilog", "slurmctld_wait_s")) + float(cfg.get("cluster", "ingest_grace_s"))
    keep_s = float(cfg.get("cluster", "spool_keep_days")) * 86400.0
    try:
        names = sorted((n for n in os.listdir(spool) if is_job_id(n)), key=int)
    except OSError as e:
        res.errors.append(f"spool {spool}: {e.strerror or e}")
        return res
    for name in names:
        d = os.path.join(spool, name)
        newest = _newest_mtime(d)
        if now - newest < grace:
            res.waiting += 1
            continue
        if newest and now - newest > keep_s:
            if remove_job(spool, name, log):
                res.removed += 1
            continue
        try:
            r = judge_from_spool(cfg, store, name, log=log, slurm=slurm, retry_sleep_s=retry_sleep_s)
        except (StoreError, OSError, ValueError) as e:
            res.errors.append(f"job {name}: {e}")
            log.error("tool error: cluster ingest: job %s: %s", name, e)
            continue
        except Exception as e:  # a fault of ours in one job's judgment never stops the jobs after it
            res.errors.append(f"job {name}: {type(e).__name__}: {e}")
            log.exception("tool error: cluster ingest: job %s: %s: %s", name, type(e).__name__, e)
            continue
        if r is None or r.skipped:
            res.unchanged += 1
        else:
            res.judged += 1
            if max_jobs and res.judged >= max_jobs:
                break
    return res
