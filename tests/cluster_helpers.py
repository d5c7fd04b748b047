"""Cluster-mode test helpers: scenario rows split into one store per node, each node's
part built by the Epilog's own code, the job judged in a separate cluster store."""

from __future__ import annotations

import logging
import os
from typing import Any

import scenarios as S
from gpuguard.epilog import part as part_mod
from gpuguard.epilog.hook import _encode_part
from gpuguard.epilog.summary import save_summary, summarize_job
from gpuguard.store import open_store

LOG = logging.getLogger("gpuguard.test")


def write_per_node(root: str, rows: S.JobRows, profile: S.Profile, node_map: dict[str, str] | None = None) -> dict:
    """Write ``rows`` into ``{root}/{node}/node.db``, each node's rows only (``node_map``
    renames the profile's nodes). Returns ``node -> open Store``."""
    node_map = node_map or {}
    stores: dict[str, Any] = {}
    for pn in profile.node_names:
        node = node_map.get(pn, pn)
        store = open_store(os.path.join(root, node, "node.db"))
        sub = S.JobRows(rows.job_id, rows.family, rows.start, rows.end)
        for table, rs in rows.tables.items():
            sub.tables[table] = [dict(r, node=node) for r in rs if r.get("node") in (pn, None)]
        S.write(store, sub)
        with store.tx():
            store.db["inventory"].upsert_all([dict(r, node=node) for r in S.inventory_rows(profile, rows.start)
                                              if r["node"] == pn], pk=("node", "uuid"))
        stores[node] = store
    return stores


def parts_of(stores: dict, job_id: str, cfg: Any, job: dict | None = None) -> dict[str, dict]:
    """Each node's part exactly as its Epilog builds it (summary + series, encoded and
    decoded again)."""
    out = {}
    for node, store in stores.items():
        summary = summarize_job(store, job_id, node, exit_status_raw=0, collector_status="ok", ingest=None)
        save_summary(store, summary)
        blob, _ws = _encode_part(store, job_id, cfg, node, dict(job or {}), summary)
        out[node] = part_mod.decode_part(blob)
    return out


def close_all(stores: dict) -> None:
    for s in stores.values():
        s.close()
