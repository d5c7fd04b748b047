"""The collector's store tables: GPU samples (the compact ``gpu_*`` tables of
:mod:`gpuguard.samples`, with a ``samples`` view) and ``host_samples`` (the job's cgroup
CPU, memory and I/O per tick). Times are UTC epoch
seconds, column names carry units.

A named migration set (:class:`gpuguard.store.MigrationSet`): append steps, never edit a
released one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuguard.store import MigrationSet, register_set

if TYPE_CHECKING:  # annotations only: the hooks do not import sqlite-utils (gpuguard.store)
    import sqlite_utils

MIGRATIONS = register_set(MigrationSet("collector", legacy={"samples": 1, "samples_by_gpu": 2}))


@MIGRATIONS(name="samples")
def _samples(db: sqlite_utils.Database) -> None:
    db["samples"].create(
        {"job_id": str, "node": str, "at": float, "gpu_index": int, "gpu_uuid": str,
         "gpu_util_pct": float, "mem_util_pct": float, "mem_used_mib": float,
         "power_w": float, "temp_c": float, "sm_clock_mhz": float, "mem_clock_mhz": float,
         "clock_event_mask": int, "ecc_volatile_uncorrected": int,
         "pcie_replay_count": int},
    )
    db["samples"].create_index(["job_id", "at"])
    db["host_samples"].create(
        {"job_id": str, "node": str, "at": float, "cpu_pct": float, "rss_mib": float,
         "io_read_mib": float, "io_write_mib": float},
    )
    db["host_samples"].create_index(["job_id", "at"])


@MIGRATIONS(name="samples_by_gpu")
def _samples_by_gpu(db: sqlite_utils.Database) -> None:
    """The summary reads one GPU's samples of one job on one node in time order."""
    db["samples"].create_index(["job_id", "node", "gpu_index", "at"])


@MIGRATIONS(name="compact_samples")
def _compact_samples(db: sqlite_utils.Database) -> None:
    """GPU samples move to the compact store laid out from the metric table
    (:mod:`gpuguard.samples`: identity once per series, integer-scaled values, primary key
    the only index; 183 B -> ~30 B per GPU-sample); existing rows are moved and
    ``samples`` becomes a read-only view of the old shape."""
    from gpuguard import samples_schema

    samples_schema.migrate(db.conn)


@MIGRATIONS(name="compact_minutes")
def _compact_minutes(db: sqlite_utils.Database) -> None:
    """Narrower per-minute tier (:func:`gpuguard.samples_schema.migrate_minutes`): minutes counted
    from the series' start, min/max as distances from the mean; 64 -> ~50 B per GPU-minute,
    under 1 B per GPU-second. Existing minute rows are converted."""
    from gpuguard import samples_schema

    samples_schema.migrate_minutes(db.conn)



@MIGRATIONS(name="live_minutes")
def _live_minutes(db: sqlite_utils.Database) -> None:
    """The minutes the collector closes while a job runs (:mod:`gpuguard.live_minutes`),
    so the Epilog reads minutes, not samples. Series written before get theirs as their
    next samples arrive."""
    from gpuguard import live_minutes

    live_minutes.migrate(db.conn)

#: Sample columns of the compact layout when it was released (``compact_samples``). Every
#: metric-table row added since gets a step of its own, ``metric_<name>``, that adds the
#: columns the table declares and the store lacks (:func:`gpuguard.samples_schema.add_missing_columns`:
#: idempotent, so a new store whose tables already have them records the step and changes
#: nothing). A metric removed from the table keeps its name here and its step.
RELEASED_SAMPLE_COLUMNS = frozenset({
    "gpu_util_pct", "mem_util_pct", "mem_used_mib", "power_w", "temp_c", "sm_clock_mhz", "clock_event_mask",
    "ecc_volatile_uncorrected", "pcie_replay_count"})


def _add_metric_columns(db: sqlite_utils.Database) -> None:
    """Columns of a metric added to the table after the compact layout (and the
    ``samples``/``minutes_view`` views rebuilt with them)."""
    from gpuguard import samples_schema

    samples_schema.add_missing_columns(db.conn)


def _register_metric_steps() -> None:
    from gpuguard.metrics import GPU_SAMPLED, GPU_SLOW

    for m in (*GPU_SAMPLED, *GPU_SLOW):
        if m.name not in RELEASED_SAMPLE_COLUMNS:
            MIGRATIONS(name=f"metric_{m.name}")(_add_metric_columns)


_register_metric_steps()
