"""The ``sacct_jobs`` cache table of the cluster store (one row per Slurm job).

Created by the store migration that calls :func:`create_sacct_cache`; the key is
``(cluster, job_id_raw)`` (JobIDRaw is unique per cluster, array tasks and het
components included). Times are UTC epoch seconds (REAL), durations seconds.
``usage_end_at`` is ``end_at``, or for a job still running ``start_at + elapsed_s`` as of
its last sync: the end of the usage the reports may charge.
"""

from __future__ import annotations

import sqlite_utils

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
    "CREATE INDEX sacct_jobs_state ON sacct_jobs(state)",
)


def create_sacct_cache(db: sqlite_utils.Database) -> None:
    """Migration body: create ``sacct_jobs`` and its indexes (start, end, state)."""
    db.execute(DDL)
    for sql in INDEXES:
        db.execute(sql)
