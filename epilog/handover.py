"""Hand an Epilog's per-node part to the job judge: the spool in cluster mode, the judge
itself on a single host (the flow is in :func:`hand_over`'s docstring; the Epilog's order
of work is in :mod:`gpuguard.epilog.hook`).

Our errors here are tool errors: logged, never a drain.
"""

from __future__ import annotations

import os
from typing import Any


def hand_over(store: Any, job_id: str, cfg: Any, env: dict[str, str], node: str, summary: Any,
               log: Any, pend: Any) -> None:
    """Build this node's part (:mod:`gpuguard.epilog.part`) and hand it to the job judge:
    with ``[paths] spool_dir`` (cluster mode) write it to the spool, where the
    controller's EpilogSlurmctld worker judges the job once with every node's part; without
    one (single host) judge it here, on the store that is node and cluster store at once —
    the same judge, from the same encoded part. A multi-node job without a spool is not
    judged: half of its data would give a verdict that contradicts the other half's.
    Our errors here are tool errors; they never drain."""
    from gpuguard.epilog import part as part_mod
    from gpuguard.epilog.template import from_comment, gpus_allocated, inventory_gpu_name
    from gpuguard.hookenv import read_hook_env
    from gpuguard.slurm import SlurmCli

    spool = cfg.get("paths", "spool_dir")
    h = read_hook_env(env)
    job = {"user": h.job_user, "uid": h.job_uid, "account": env.get("SLURM_JOB_ACCOUNT"),
           "partition": h.job_partition, "comment": h.job_comment, "num_nodes": h.job_num_nodes,
           "nodelist": h.job_nodelist, "exit_code_raw": h.exit_status_raw,
           # the derived template's facts, read here where they are known (epilog.judge._template)
           "gpus": gpus_allocated(h.job_gpus_raw), "gpu_name": inventory_gpu_name(store, node)}
    # the template lookup (SlurmCli.show_job: two squeue calls) is capped by what is left of the budget
    slurm = SlurmCli(cfg.get("slurm", "bin_dir"), timeout_s=3.0,
                     deadline=getattr(getattr(pend, "actuator", None), "deadline", None))
    if not spool and (job["num_nodes"] or 1) > 1:
        log.warning("multi-node job not judged: set [paths] spool_dir so the controller judges it once "
                    "with every node's data")
        return
    try:
        blob, window_s = encode_part(store, job_id, cfg, node, job, summary)
        if spool:
            path = part_mod.write_part(spool, job_id, node, blob)
            log.info("part %s written (%d bytes, %g s windows)", path, len(blob), window_s)
            return
    except Exception as e:
        log.error("tool error: part: %s: %s", type(e).__name__, e)
        return
    if from_comment(job["comment"]) is None:
        try:  # the Epilog has no SLURM_JOB_NAME (SLURM-FACTS §4); a derived template needs it
            job["name"] = slurm.show_job(job_id).get("JobName")
        except Exception:
            job["name"] = None
    judge_here(store, job_id, cfg, node, job, part_mod.decode_part(blob), pend, log)


def encode_part(store: Any, job_id: str, cfg: Any, node: str, job: dict[str, Any], summary: Any) -> tuple[bytes, float]:
    """This node's part of ``job_id`` encoded (:func:`gpuguard.epilog.part.encode_part`):
    ``(blob, window_s)``: windows start at ``[verdict] short_window_s`` and double until the
    part fits. Built straight from the store (:func:`gpuguard.epilog.nodepart.build_node_part`),
    reusing the summary's bucketed pass when the summary was made with ``window_align_s``
    = ``short_window_s``. Raises :class:`gpuguard.epilog.part.SpoolError` when a day's
    window does not fit."""
    from gpuguard.epilog import part as part_mod
    from gpuguard.epilog.nodepart import build_node_part

    names = {r["uuid"]: r["name"] for r in store.query("select uuid, name from inventory where node = ?", [node])}
    sdict = summary.to_dict()
    align_s = float(cfg.get("verdict", "short_window_s"))
    return part_mod.encode_part(
        lambda ws: build_node_part(store, job_id, node, window_s=ws, job=job, summary=sdict, gpu_names=names,
                                   align_s=align_s),
        align_s)


def judge_here(store: Any, job_id: str, cfg: Any, node: str, job: dict[str, Any], part: dict[str, Any],
               pend: Any, log: Any) -> None:
    """Single host: the job judge on this node's own part, in this store; its drains go
    through this Epilog's pending-drain list (:mod:`gpuguard.drainq`)."""
    from gpuguard.epilog.judge import judge_parts

    meta = dict(job, job_id=job_id, nodes=[node])
    cluster = None
    try:
        from gpuguard.store import open_store

        same = os.path.abspath(cfg.cluster_store_path) == os.path.abspath(cfg.store_path)
        cluster = store if same else open_store(cfg.cluster_store_path)
        res = judge_parts(cluster, job_id, {node: part}, cfg=cfg, meta=meta, slurm=None, log=log,
                          set_comment=False, drainer=pend)
    except Exception as e:
        log.error("tool error: verdict: %s: %s", type(e).__name__, e)
        return
    finally:
        if cluster is not None and cluster is not store:
            cluster.close()
    v = res.verdict or {}
    log.info("verdict %s (template %s): %s", v.get("cause"), v.get("template"), v.get("summary"))
