"""The interconnect checks' store tables: the ``net`` migration set
(:class:`gpuguard.store.MigrationSet`; append steps, never edit a released one).

* ``nccl_probes``: one row per probe run. ``state`` is ``ok`` (healthy reading, part of
  the baseline), ``low`` (busbw low, confirmed by a re-measure), ``low_unconfirmed``
  (low once, no time to re-measure: neither counts nor resets), ``errors``
  (``#wrong``/WARN/failure), ``failed`` (tool fault). ``config_key`` identifies the
  command (sizes, GPUs), so a changed probe starts a new baseline.
* ``nccl_busbw``: per probe and message size, busbw/algbw in GB/s (1e9 B/s, nccl-tests).
* ``fabric_counters``: every reading of each InfiniBand/RoCE port of a node
  (``port`` = ``mlx5_0/1``; counters, state and best rate as JSON), appended by each
  health run: the latest is "the last run" for growth, and the Prolog's and Epilog's
  readings bracket a job.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuguard.store import MigrationSet, register_set

if TYPE_CHECKING:  # annotations only: the hooks do not import sqlite-utils (gpuguard.store)
    import sqlite_utils

MIGRATIONS = register_set(MigrationSet("net"))


@MIGRATIONS(name="interconnect")
def _interconnect(db: sqlite_utils.Database) -> None:
    db["nccl_probes"].create(
        {"id": int, "node": str, "at": float, "hook": str, "job_id": str, "gpu_model": str, "gpus": int,
         "config_key": str, "state": str, "duration_s": float, "ratio": float, "detail": str},
        pk="id",
    )
    db["nccl_probes"].create_index(["node", "config_key", "at"])
    db["nccl_probes"].create_index(["gpu_model", "config_key", "at"])
    db["nccl_busbw"].create(
        {"probe_id": int, "node": str, "at": float, "size_b": int, "busbw_gbs": float, "algbw_gbs": float},
        foreign_keys=[("probe_id", "nccl_probes", "id")],
    )
    db["nccl_busbw"].create_index(["probe_id"])
    db["fabric_counters"].create({"node": str, "port": str, "at": float, "counters": str})
    db["fabric_counters"].create_index(["node", "port", "at"])


def ensure(store: object) -> None:
    """Create the ``net`` tables in an open store if the set was registered after it was
    opened (:func:`gpuguard.store.ensure_sets`). Raises StoreError."""
    from gpuguard.store import ensure_sets

    ensure_sets(store, [MIGRATIONS])  # type: ignore[arg-type]
