"""The reports' store tables, as the named migration set ``reports``
(:class:`gpuguard.store.MigrationSet`; it requires the ``epilog`` set, whose
``job_summaries`` its triggers watch): ``sacct_jobs`` (step ``sacct_jobs``) and
``job_gpu_util`` (step ``job_gpu_util``, :mod:`gpuguard.reports.util_schema`).

The ``sacct_jobs`` cache of the cluster store has one row per Slurm job. Created by
:func:`create_sacct_cache`; the key is
``(cluster, job_id_raw, attempt_at)`` since step ``sacct_attempts`` (JobIDRaw is unique per cluster, array tasks and het
components included; ``attempt_at`` the submit time of one attempt of a requeued job). Times are UTC epoch seconds (REAL), durations seconds.
``usage_end_at`` is ``end_at``, or for a job still running ``start_at + elapsed_s`` as of
its last sync: the end of the usage the reports may charge. ``charge_s``, ``wait_s`` and
``submit_wait_s`` are derived once at sync (:func:`gpuguard.reports.sacct._finish`) so the
reports do not recompute them per row.

This is a store migration: once released it is never edited; a change is a new step.
"""

from __future__ import annotations

import sqlite_utils

import gpuguard.epilog.schema  # noqa: F401  (registers the "epilog" set this one requires)
from gpuguard.store import MigrationSet, register_set

TABLE = "sacct_jobs"

DDL = """
CREATE TABLE sacct_jobs (
    cluster TEXT NOT NULL DEFAULT '',
    job_id_raw INTEGER NOT NULL,
    job_id TEXT NOT NULL,
    array_job_id INTEGER,
    array_task_id INTEGER,
    het_job_id INTEGER,
    het_job_offset INTEGER,
    job_name TEXT,
    user TEXT,
    account TEXT,
    partition TEXT,
    qos TEXT,
    submit_at REAL,
    eligible_at REAL,
    start_at REAL,
    end_at REAL,
    elapsed_s INTEGER,
    usage_end_at REAL,
    charge_s REAL,
    wait_s REAL,
    submit_wait_s REAL,
    state TEXT NOT NULL,
    state_raw TEXT,
    exit_code INTEGER,
    exit_signal INTEGER,
    gpus INTEGER NOT NULL DEFAULT 0,
    gpu_type TEXT,
    cpus INTEGER,
    alloc_tres TEXT,
    nnodes INTEGER,
    node_list TEXT,
    comment TEXT,
    admin_comment TEXT,
    template TEXT,
    synced_at REAL,
    source TEXT,
    PRIMARY KEY (cluster, job_id_raw)
)
"""

INDEXES = (
    "CREATE INDEX sacct_jobs_start ON sacct_jobs(start_at)",
    "CREATE INDEX sacct_jobs_end ON sacct_jobs(end_at)",
    "CREATE INDEX sacct_jobs_usage_end ON sacct_jobs(usage_end_at)",
    "CREATE INDEX sacct_jobs_state ON sacct_jobs(state)",
    # Covering index for the default grouping (--by account): every report's GROUP BY
    # account walks it in order, without a sort and without reading the wide table rows;
    # wait_s second gives the queue-wait report its per-account order for percentiles.
    "CREATE INDEX sacct_jobs_by_account ON sacct_jobs(account, wait_s, start_at, usage_end_at, end_at, charge_s, "
    "gpus, cpus, state, gpu_type, partition, submit_wait_s, job_id_raw)",
)


def create_sacct_cache(db: sqlite_utils.Database) -> None:
    """Migration body: create ``sacct_jobs`` and its indexes (start, end, usage end, state)."""
    db.execute(DDL)
    for sql in INDEXES:
        db.execute(sql)


MIGRATIONS = register_set(MigrationSet("reports", requires=("epilog",),
                                       legacy={"sacct_jobs": 4, "job_gpu_util": 5}))


@MIGRATIONS(name="sacct_jobs")
def _sacct_jobs(db: sqlite_utils.Database) -> None:
    create_sacct_cache(db)


@MIGRATIONS(name="job_gpu_util")
def _job_gpu_util(db: sqlite_utils.Database) -> None:
    from gpuguard.reports.util_schema import create_job_gpu_util

    create_job_gpu_util(db)


#: Step ``sacct_attempts``: one row per *attempt* (a requeued job's attempts kept apart, as slurmdbd
#: keys its job table on (id_job, time_submit)); ``gpus`` NULL = GPU usage unknown, with
#: ``gpu_source`` naming the field the count came from; ``time_limit_s``.
DDL_V6 = (DDL.replace("gpus INTEGER NOT NULL DEFAULT 0", "gpus INTEGER")
          .replace("    PRIMARY KEY (cluster, job_id_raw)",
                   "    attempt_at REAL NOT NULL DEFAULT 0,\n    gpu_source TEXT,\n    time_limit_s INTEGER,\n"
                   "    PRIMARY KEY (cluster, job_id_raw, attempt_at)")
          .replace("CREATE TABLE sacct_jobs", "CREATE TABLE sacct_jobs_v6"))
INDEXES_V6 = (*INDEXES, "CREATE INDEX sacct_jobs_raw ON sacct_jobs(job_id_raw)")


def migrate_sacct_attempts(db: sqlite_utils.Database) -> None:
    """Migration body: rebuild ``sacct_jobs`` with ``attempt_at`` (the attempt's submit
    time, 0 when unknown) in the key, nullable ``gpus``, ``gpu_source``, ``time_limit_s``.
    Stored rows keep their values: ``attempt_at`` = their submit time, ``gpu_source``
    ``AllocTRES`` where their AllocTRES holds ``gres/gpu``, else unknown when no AllocTRES
    was imported (their 0 was never a fact), else ``none: AllocTRES``."""
    db.execute(DDL_V6)
    old = [r[1] for r in db.execute("PRAGMA table_info(sacct_jobs)").fetchall()]
    cols = ", ".join(old)
    db.execute(f"""INSERT INTO sacct_jobs_v6 ({cols}, attempt_at, gpu_source)
        SELECT {cols.replace("gpus", "CASE WHEN alloc_tres IS NULL AND gpus = 0 THEN NULL ELSE gpus END", 1)},
               COALESCE(submit_at, 0),
               CASE WHEN alloc_tres LIKE '%gres/gpu%' THEN 'AllocTRES'
                    WHEN alloc_tres IS NULL AND gpus = 0 THEN 'unknown: no AllocTRES/ReqTRES/GRES field'
                    WHEN alloc_tres IS NULL THEN 'AllocTRES' ELSE 'none: AllocTRES' END
        FROM sacct_jobs""")
    db.execute("DROP TABLE sacct_jobs")
    db.execute("ALTER TABLE sacct_jobs_v6 RENAME TO sacct_jobs")
    for sql in INDEXES_V6:
        db.execute(sql)


@MIGRATIONS(name="sacct_attempts")
def _sacct_attempts(db: sqlite_utils.Database) -> None:
    migrate_sacct_attempts(db)


#: Step ``sacct_pending_index``: the full ``state`` index becomes a partial index of the PENDING
#: jobs. Only the wait report's pending tables look jobs up by state (``state = 'PENDING'``,
#: the partial index's own term, so SQLite uses it); a filter on a final state is bounded by
#: the time indexes instead. A full index of a column with a dozen values cost a bulk load of
#: 1 M jobs 0.78 s to rebuild; the partial one, about 1 % of the jobs, 0.17 s, and the pending
#: queries take the same 20-30 ms on it (measured on ``bench/reports_1m.py``'s trace).
PENDING_INDEX = "CREATE INDEX sacct_jobs_pending ON sacct_jobs(account) WHERE state = 'PENDING'"


@MIGRATIONS(name="sacct_pending_index")
def _sacct_pending_index(db: sqlite_utils.Database) -> None:
    db.execute("DROP INDEX IF EXISTS sacct_jobs_state")
    db.execute(PENDING_INDEX)
