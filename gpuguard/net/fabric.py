"""Glue between the fabric readers, the store and a health run: read the ports, load
the previous run's reading (the latest ``fabric_counters`` row per port), and the rows
that store this run's."""

from __future__ import annotations

import json
from typing import Any

from gpuguard.net.ib_judge import port_memory
from gpuguard.net.ib_model import IbPort
from gpuguard.net.ib_sysfs import read_ports


def read_fabric(cfg: Any) -> list[IbPort]:
    """Ports under ``[fabric] sysfs_root`` (those in ``ports`` if set), without the link
    layers in ``ignore_link_layers``."""
    return select_ports(read_ports(cfg.get("fabric", "sysfs_root"), list(cfg.get("fabric", "ports")) or None), cfg)


def select_ports(ports: list[IbPort], cfg: Any) -> list[IbPort]:
    """The ports the node is judged on: named in ``[fabric] ports`` (when set) and not of
    a link layer in ``ignore_link_layers``. A counters-only port (a pasted ``perfquery``
    names it by LID, not by device) is kept: its name cannot be matched."""
    only = set(cfg.get("fabric", "ports"))
    skip = {s.lower() for s in cfg.get("fabric", "ignore_link_layers")}
    return [p for p in ports if (p.link_layer or "").lower() not in skip
            and (not only or not p.has_state or p.name in only)]


def load_previous(store: Any, node: str) -> dict[str, dict[str, Any]]:
    """``port name -> stored memory`` of the node's latest reading of each port. Raises
    StoreError."""
    rows = store.query(
        "select f.port, f.counters from fabric_counters f join "
        "(select port, max(at) as at from fabric_counters where node = ? group by port) l "
        "on f.port = l.port and f.at = l.at where f.node = ?", [node, node])
    return {r["port"]: json.loads(r["counters"]) for r in rows}


def fabric_rows(node: str, ports: list[IbPort], previous: dict[str, dict[str, Any]], now: float) -> list[dict[str, Any]]:
    """``fabric_counters`` rows for this run's reading of every port."""
    return [{"node": node, "port": p.name, "at": now,
             "counters": json.dumps(port_memory(p, previous.get(p.name), now))} for p in ports]
