"""The epilog's store tables. A named migration set
(:class:`gpuguard.store.MigrationSet`): append steps, never edit a released one.

* ``job_records``: ``steps`` and ``checkpoints`` ingested from the job directory, and one
  ``job_summaries`` row per (job, node). ``summary`` holds the summary document as JSON
  (its declared shape: :mod:`gpuguard.epilog.summary_shape`); the scalar columns beside it
  are for SQL filters.
* ``baselines``: template baselines and verdicts: one row per template, the cached
  baseline per (template, metric), one verdict per job, one comparison per (job, metric).
  Raw MAD (unscaled); z and relative change as computed at judging time.
"""

from __future__ import annotations

import gpuguard.collector.schema  # noqa: F401  (registers the "collector" set this one requires)
from typing import TYPE_CHECKING

from gpuguard.store import MigrationSet, register_set

if TYPE_CHECKING:  # annotations only: the hooks do not import sqlite-utils (gpuguard.store)
    import sqlite_utils

#: Requires ``collector``: the summary is computed from its ``samples``.
MIGRATIONS = register_set(MigrationSet("epilog", requires=("collector",), legacy={"job_records": 2, "baselines": 3}))


@MIGRATIONS(name="job_records")
def _job_records(db: sqlite_utils.Database) -> None:
    db["steps"].create(
        {"job_id": str, "node": str, "rank": int, "step": int, "t": float, "step_time_s": float,
         "samples": int, "tokens": int, "loss": float, "loss_nonfinite": int, "grad_norm": float,
         "data_wait_s": float, "fwd_bwd_s": float, "comm_s": float, "optim_s": float},
    )
    db["steps"].create_index(["job_id", "node", "rank", "step"])
    db["checkpoints"].create(
        {"job_id": str, "node": str, "rank": int, "step": int, "t": float, "duration_s": float},
    )
    db["checkpoints"].create_index(["job_id", "node"])
    db["job_summaries"].create(
        {"job_id": str, "node": str, "created_at": float, "started_at": float, "ended_at": float,
         "exit_status_raw": int, "exit_code": int, "exit_signal": int, "collector_status": str,
         "sample_count": int, "step_records": int, "summary_version": int, "summary": str},
        pk=("job_id", "node"),
    )
    db["job_summaries"].create_index(["created_at"])


@MIGRATIONS(name="baselines")
def _baselines(db: sqlite_utils.Database) -> None:
    db["templates"].create(
        {"name": str, "source": str, "first_seen": float, "last_seen": float, "jobs": int, "reset_at": float},
        pk="name",
    )
    db["baselines"].create(
        {"template": str, "metric": str, "median": float, "mad": float, "n": int, "updated_at": float},
        pk=("template", "metric"),
    )
    db["verdicts"].create(
        {"job_id": str, "template": str, "at": float, "state": str, "cause": str, "summary": str,
         "evidence": str, "also": str, "context": str, "exit_code": int, "critical": int,
         "baseline_ok": int, "nodes": str, "start_at": float, "end_at": float},
        pk="job_id",
    )
    db["verdicts"].create_index(["template", "at"])
    db["comparisons"].create(
        {"job_id": str, "template": str, "metric": str, "value": float, "median": float, "mad": float,
         "n": int, "z": float, "rel_change": float, "flagged": int, "sustained_s": float, "at": float},
        pk=("job_id", "metric"),
    )
    db["comparisons"].create_index(["template", "metric"])


@MIGRATIONS(name="baseline_relearn")
def _baseline_relearn(db: sqlite_utils.Database) -> None:
    """When a template's baseline last re-learned by itself (:mod:`gpuguard.epilog.relearn`)
    and from which runs (JSON list of job ids)."""
    db["templates"].add_column("relearned_at", float)
    db["templates"].add_column("relearned_jobs", str)


@MIGRATIONS(name="cluster_jobs")
def _cluster_jobs(db: sqlite_utils.Database) -> None:
    """Cluster store (``gpuguard.epilog.judge``): one row per judged job (who, where, which
    nodes' parts were judged, the AdminComment written) and the drains the job judge made
    from the controller (so a re-judge never drains twice)."""
    db["cluster_jobs"].create(
        {"job_id": str, "user": str, "uid": int, "account": str, "partition": str, "job_name": str,
         "nodes": str, "parts": str, "missing": str, "gpus": int, "exit_code_raw": int, "state": str,
         "first_judged_at": float, "judged_at": float, "window_s": float, "cause": str,
         "admin_comment": str, "admin_comment_at": float},
        pk="job_id",
    )
    db["cluster_jobs"].create_index(["judged_at"])
    db["cluster_drains"].create(
        {"id": int, "job_id": str, "node": str, "at": float, "reason": str, "done": int},
        pk="id",
    )
    db["cluster_drains"].create_index(["job_id", "node"], unique=True)


@MIGRATIONS(name="train_offsets")
def _train_offsets(db: sqlite_utils.Database) -> None:
    """Incremental training-record ingest (:func:`gpuguard.collector.ingest_tail.ingest_new_records`):
    per (job, node, record file) the file's identity (``dev``, ``ino``), the byte ``offset``
    up to which its lines are stored in ``steps``/``checkpoints``, whether that offset is
    inside an over-long line being skipped, and the lines parsed, malformed lines and
    non-finite losses so far; ``truncated``: the job-wide record cap was reached."""
    db["train_offsets"].create(
        {"job_id": str, "node": str, "name": str, "dev": int, "ino": int, "offset": int, "skipping": int,
         "records": int, "malformed": int, "nonfinite": int, "truncated": int},
        pk=("job_id", "node", "name"),
    )
