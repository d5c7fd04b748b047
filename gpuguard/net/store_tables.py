"""Store tables of the interconnect checks (created by store migration 6).

* ``nccl_probes``: one row per probe run. ``state`` is ``ok`` (healthy reading, part of
  the baseline), ``low`` (busbw low, confirmed by a re-measure), ``low_unconfirmed``
  (low once, no time to re-measure: neither counts nor resets), ``errors``
  (``#wrong``/WARN/failure), ``failed`` (tool fault). ``config_key`` identifies the
  command (sizes, GPUs), so a changed probe starts a new baseline.
* ``nccl_busbw``: per probe and message size, busbw/algbw in GB/s (1e9 B/s, nccl-tests).
* ``fabric_counters``: the last reading of each InfiniBand/RoCE port of a node
  (``port`` = ``mlx5_0/1``), counters as JSON, for "rising since the last run".
"""

from __future__ import annotations

from typing import Any


def create_net_tables(db: Any) -> None:
    """Create the tables (sqlite-utils ``Database``); raises ``sqlite3.Error``."""
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
    db["fabric_counters"].create(
        {"node": str, "port": str, "at": float, "counters": str}, pk=("node", "port"),
    )
