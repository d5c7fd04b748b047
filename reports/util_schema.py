"""``job_gpu_util``: the per-GPU utilisation readings of gpuguard's job summaries, one row
per reading, kept in step with ``job_summaries`` by triggers (step ``job_gpu_util`` of
the ``reports`` migration set, :mod:`gpuguard.reports.schema`).

The efficiency report needs, per job, the mean utilisation over its GPUs and the share of
them under a threshold chosen at report time. Parsing every summary's JSON on each run
(1 M jobs: ~1 s of ``json_each``) is done once instead, when the summary is written: every
writer of ``job_summaries`` (the epilog's upsert, an ingest, a plain INSERT) goes through
the triggers, and the migration fills the table from the summaries already stored.

Readings of one ``(job_id, node)`` summary, through the summary's published shape
(:mod:`gpuguard.epilog.summary_shape`, never the epilog's own field list): each per-GPU
``GPU_UTIL_MEAN``; a summary without per-GPU entries counts as one reading of its
``NODE_GPU_UTIL_MEAN``; null readings and unparsable JSON give no row. ``jid`` is the job id
as an integer (the join key with ``sacct_jobs.job_id_raw``); the covering index
``(jid, util)`` lets the report aggregate per job without reading the table.

This is a store migration step: once released it is never edited; a change is a new step.
"""

from __future__ import annotations

import sqlite_utils

from gpuguard.epilog.summary_shape import GPU_UTIL_MEAN, GPUS, NODE_GPU_UTIL_MEAN

TABLE = "job_gpu_util"


def readings_sql(summary: str) -> str:
    """SELECT of the non-null readings ``u`` of one summary document (SQL expression
    ``summary``, e.g. ``NEW.summary``)."""
    doc = f"(CASE WHEN json_valid({summary}) THEN {summary} ELSE '{{}}' END)"
    return (f"SELECT u FROM ("
            f"SELECT CAST(json_extract(g.value, '{GPU_UTIL_MEAN.path}') AS REAL) AS u "
            f"FROM json_each({doc}, '{GPUS}') AS g "
            f"UNION ALL "
            f"SELECT CAST(json_extract({doc}, '{NODE_GPU_UTIL_MEAN.path}') AS REAL) "
            f"WHERE COALESCE(json_array_length({doc}, '{GPUS}'), 0) = 0"
            f") WHERE u IS NOT NULL")


def _fill(row: str) -> str:
    return (f"INSERT INTO job_gpu_util (job_id, node, jid, util) "
            f"SELECT {row}.job_id, {row}.node, CAST({row}.job_id AS INTEGER), u FROM ({readings_sql(f'{row}.summary')})")


DDL = (
    """CREATE TABLE job_gpu_util (
        job_id TEXT NOT NULL,
        node TEXT NOT NULL,
        jid INTEGER,
        util REAL NOT NULL
    )""",
    "CREATE INDEX job_gpu_util_key ON job_gpu_util(job_id, node)",
    "CREATE INDEX job_gpu_util_jid ON job_gpu_util(jid, util)",
    # INSERT OR REPLACE deletes the old row without firing DELETE triggers (recursive
    # triggers are off), so the insert trigger clears the (job, node) first.
    f"""CREATE TRIGGER job_summaries_util_insert AFTER INSERT ON job_summaries BEGIN
        DELETE FROM job_gpu_util WHERE job_id = NEW.job_id AND node = NEW.node;
        {_fill('NEW')};
    END""",
    f"""CREATE TRIGGER job_summaries_util_update AFTER UPDATE OF job_id, node, summary ON job_summaries BEGIN
        DELETE FROM job_gpu_util WHERE job_id = OLD.job_id AND node = OLD.node;
        DELETE FROM job_gpu_util WHERE job_id = NEW.job_id AND node = NEW.node;
        {_fill('NEW')};
    END""",
    """CREATE TRIGGER job_summaries_util_delete AFTER DELETE ON job_summaries BEGIN
        DELETE FROM job_gpu_util WHERE job_id = OLD.job_id AND node = OLD.node;
    END""",
)


def all_readings_sql() -> str:
    """SELECT ``(job_id, node, u)`` of every non-null reading of every stored summary (the
    same rule as :func:`readings_sql`, over the whole table)."""
    doc = "(CASE WHEN json_valid(summary) THEN summary ELSE '{}' END)"
    return f"""
        SELECT job_id, node, u FROM (
            SELECT js.job_id, js.node, CAST(json_extract(g.value, '{GPU_UTIL_MEAN.path}') AS REAL) AS u
            FROM job_summaries AS js, json_each({doc}, '{GPUS}') AS g
            UNION ALL
            SELECT job_id, node, CAST(json_extract({doc}, '{NODE_GPU_UTIL_MEAN.path}') AS REAL)
            FROM job_summaries WHERE COALESCE(json_array_length({doc}, '{GPUS}'), 0) = 0
        ) WHERE u IS NOT NULL"""


def create_job_gpu_util(db: sqlite_utils.Database) -> None:
    """Migration body: the table, its indexes and triggers, filled from the stored summaries
    (``job_summaries`` comes from the ``epilog`` set, which the ``reports`` set requires)."""
    for sql in DDL:
        db.execute(sql)
    db.execute("INSERT INTO job_gpu_util (job_id, node, jid, util) "
               f"SELECT job_id, node, CAST(job_id AS INTEGER), u FROM ({all_readings_sql()})")
