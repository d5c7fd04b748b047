"""Glue between the fabric readers, the store and a health run: read the ports, load
the previous run's counters, store this run's (``fabric_counters``)."""

from __future__ import annotations

import json
import time
from typing import Any

from gpuguard.net.ib_judge import port_memory
from gpuguard.net.ib_model import IbPort
from gpuguard.net.ib_sysfs import read_ports


def read_fabric(cfg: Any) -> list[IbPort]:
    """Ports under ``[fabric] sysfs_root`` (those in ``ports`` if set), without the link
    layers in ``ignore_link_layers``."""
    ports = read_ports(cfg.get("fabric", "sysfs_root"), list(cfg.get("fabric", "ports")) or None)
    skip = {s.lower() for s in cfg.get("fabric", "ignore_link_layers")}
    return [p for p in ports if (p.link_layer or "").lower() not in skip]


def load_previous(store: Any, node: str) -> dict[str, dict[str, Any]]:
    """``port name -> stored memory`` of the node's last run. Raises StoreError."""
    rows = store.query("select port, counters from fabric_counters where node = ?", [node])
    return {r["port"]: json.loads(r["counters"]) for r in rows}


def record_fabric(store: Any, node: str, ports: list[IbPort], previous: dict[str, dict[str, Any]],
                  now: float | None = None) -> None:
    """Upsert this run's reading of every port. Raises StoreError."""
    now = time.time() if now is None else now
    rows = [{"node": node, "port": p.name, "at": now,
             "counters": json.dumps(port_memory(p, previous.get(p.name), now))} for p in ports]
    if not rows:
        return

    def go() -> None:
        with store.tx():
            store.db["fabric_counters"].upsert_all(rows, pk=("node", "port"))
    store._guard("fabric counter update", go)
