"""The epilog's store tables. A named migration set
(:class:`gpuguard.store.MigrationSet`): append steps, never edit a released one.

* ``job_records``: ``steps`` and ``checkpoints`` ingested from the job directory, and one
  ``job_summaries`` row per (job, node). ``summary`` holds the summary document as JSON
  (its declared shape: :mod:`gpuguard.epilog.summary_shape`); the scalar columns beside it
  are for SQL filters.
* ``baselines``: template baselines and verdicts: one row per template, the cached
  baseline per (template, GPU model, metric) (step ``baseline_gpu_model``), one verdict
  per job (with its GPU model), one comparison per (job, metric). Raw MAD (unscaled); z
  and relative change as computed at judging time. ``baseline_resets``: when one GPU
  model's runs of a template were last forgotten (step ``baseline_model_resets``).
"""

from __future__ import annotations

import json

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


#: Width (s) of the step sub-windows ``step_windows`` keeps: the part's step quantiles are
#: taken over the means of ``nodepart.SUB_WINDOWS`` (8) sub-windows of each window, and
#: the default window is ``[verdict] short_window_s`` = 60 s, so 7.5 s; a part window of
#: ``60 * 2**k`` s (a long job) merges ``2**k`` of them. Any other width reads ``steps``.
STEP_SUBWINDOW_S = 7.5

#: ``step_windows.rank`` for records without a rank (a primary key column is never NULL).
NO_RANK = -(2**63)


@MIGRATIONS(name="step_windows")
def _step_windows(db: sqlite_utils.Database) -> None:
    """Per (job, node, rank, 7.5 s sub-window) sums of the step records with a time, kept
    by triggers on ``steps`` as the collector ingests them during the job, so the
    Epilog's part reads one row per sub-window instead of every record
    (:func:`gpuguard.epilog.nodepart._rank_windows_sql`): the record count, first and
    summed time, and over the records with a positive step time their count, summed
    step time and summed samples, tokens and phase times (NULL when none reported it).
    Any delete or update of a job's steps drops the job's rows (the part then reads
    ``steps``; the part also checks the record count). Steps stored before this step
    have no rows."""
    conn = db.conn
    conn.execute(
        "create table step_windows (job_id text not null, node text not null, rank integer not null, "
        "sw integer not null, nrec integer not null, t_min real not null, t_sum real not null, "
        "st_n integer not null, st_sum real, samples real, tokens real, data_wait_s real, fwd_bwd_s real, "
        "comm_s real, optim_s real, primary key (job_id, node, rank, sw)) without rowid")
    pos = "case when new.step_time_s > 0 then new.{} end"
    summed = ("st_sum", "samples", "tokens", "data_wait_s", "fwd_bwd_s", "comm_s", "optim_s")
    values = [pos.format(c) for c in ("step_time_s", "samples", "tokens", "data_wait_s", "fwd_bwd_s", "comm_s",
                                      "optim_s")]
    add = ", ".join(f"{c} = case when excluded.{c} is null then {c} when {c} is null then excluded.{c} "
                    f"else {c} + excluded.{c} end" for c in summed)  # SQL sum(): NULL only when all are
    conn.execute(
        "create trigger step_windows_insert after insert on steps when new.t is not null begin "
        f"insert into step_windows values (coalesce(new.job_id, ''), coalesce(new.node, ''), "
        f"coalesce(new.rank, {NO_RANK}), cast(new.t / {STEP_SUBWINDOW_S!r} as integer), 1, new.t, new.t, "
        f"case when new.step_time_s > 0 then 1 else 0 end, {', '.join(values)}) "
        "on conflict do update set nrec = nrec + 1, t_min = min(t_min, excluded.t_min), "
        f"t_sum = t_sum + excluded.t_sum, st_n = st_n + excluded.st_n, {add}; end")
    for event, row in (("delete", "old"), ("update", "old")):
        conn.execute(
            f"create trigger step_windows_{event} after {event} on steps begin "
            f"delete from step_windows where job_id = coalesce({row}.job_id, '') and node = coalesce({row}.node, ''); "
            "end")


@MIGRATIONS(name="baseline_gpu_model")
def _baseline_gpu_model(db: sqlite_utils.Database) -> None:
    """A template's baseline is kept per GPU model (:mod:`gpuguard.epilog.baseline`): a
    named template can run on several partitions, and an A100 run judged against H100
    history reads as a throttled GPU. ``verdicts.gpu_model``: the judged run's NVML
    product name(s) (:attr:`gpuguard.epilog.jobdata.JobData.gpu_model`; ``''`` = not
    known); ``baselines`` gains ``gpu_model`` in its key (template, gpu_model, metric).

    Verdicts stored before this step get their model from the store's ``inventory`` where
    it has their nodes (a single host, where node and cluster store are one file): the
    names of the GPUs first seen on the job's nodes before the job ended, when each node
    had one name; else ``''`` (a cluster store has no inventory: such a template learns
    again on its known model). Cached baseline rows are kept under ``''``; the next run of
    each (template, model) rewrites its own."""
    conn = db.conn
    conn.execute("alter table verdicts add column gpu_model text not null default ''")
    has_inv = conn.execute("select 1 from sqlite_master where type = 'table' and name = 'inventory'").fetchone()
    if has_inv:
        inv: dict[str, list[tuple[float | None, str]]] = {}
        for node, name, first in conn.execute("select node, name, first_seen from inventory where name is not null "
                                              "and trim(name) != ''"):
            inv.setdefault(node, []).append((first, name.strip()))
        updates = []
        for job_id, nodes_json, end_at in conn.execute("select job_id, nodes, end_at from verdicts").fetchall():
            try:
                nodes = json.loads(nodes_json or "[]")
            except ValueError:
                continue
            names: set[str] = set()
            for node in nodes if isinstance(nodes, list) else []:
                seen = {n for f, n in inv.get(str(node), []) if f is None or end_at is None or f <= end_at}
                if len(seen) != 1:  # not known, or the node's GPUs changed model: not known
                    names = set()
                    break
                names |= seen
            if names:
                updates.append((" + ".join(sorted(names)), job_id))
        conn.executemany("update verdicts set gpu_model = ? where job_id = ?", updates)
    conn.execute("create index idx_verdicts_template_gpu_model_at on verdicts (template, gpu_model, at)")
    conn.execute("create table baselines_new (template text not null, gpu_model text not null default '', "
                 "metric text not null, median float, mad float, n integer, updated_at float, "
                 "primary key (template, gpu_model, metric))")
    conn.execute("insert into baselines_new (template, gpu_model, metric, median, mad, n, updated_at) "
                 "select template, '', metric, median, mad, n, updated_at from baselines")
    conn.execute("drop table baselines")
    conn.execute("alter table baselines_new rename to baselines")


@MIGRATIONS(name="baseline_model_resets")
def _baseline_model_resets(db: sqlite_utils.Database) -> None:
    """``baseline_resets``: per (template, GPU model) the time its baseline was last
    forgotten on that model alone (``gpuguard baseline reset TEMPLATE --gpu-model NAME``,
    a re-learn with ``[baseline] relearn_forgets = "gpu-model"``). A run counts for its
    model's baseline when judged after both this time and ``templates.reset_at`` (the
    whole template's reset)."""
    db.conn.execute("create table baseline_resets (template text not null, gpu_model text not null, "
                    "reset_at real not null, primary key (template, gpu_model))")
