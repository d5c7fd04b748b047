"""Helpers shared by tests/test_reports_*.py (imported explicitly; conftest.py is shared)."""

from __future__ import annotations

import json
import pathlib
from datetime import datetime, UTC

from gpuguard import store as store_mod

DATA = pathlib.Path(__file__).parent / "data"
HANDMADE = DATA / "reports-handmade-p.txt"


def utc(text: str) -> float:
    """``2025-03-01T00:00:00`` (UTC) -> epoch seconds."""
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def open_cache_store(path) -> store_mod.Store:
    return store_mod.open_store(str(path))


def cache_store(tmp_path):
    """Body of each test module's ``cstore`` fixture: a fresh cluster store with every
    migration applied (the sacct cache included), closed afterwards."""
    s = open_cache_store(tmp_path / "cluster.db")
    yield s
    s.close()


def add_summary(store: store_mod.Store, job_id: str, node: str, gpu_utils: list[float | None]) -> None:
    """Store one gpuguard job summary the way the epilog does: a ``job_summaries`` row per
    (job, node) with the JobSummary JSON in ``summary`` (per-GPU ``gpu_util_mean_pct``)."""
    utils = [u for u in gpu_utils if u is not None]
    doc = {"job_id": job_id, "node": node, "gpu_util_mean_pct": (sum(utils) / len(utils)) if utils else None,
           "gpus": [{"gpu_index": i, "gpu_uuid": None, "sample_count": 1 if u is not None else 0,
                     "gpu_util_mean_pct": u} for i, u in enumerate(gpu_utils)]}
    conn = store.db.conn
    if not conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'job_summaries'").fetchall():
        conn.execute("CREATE TABLE job_summaries (job_id TEXT, node TEXT, summary TEXT, PRIMARY KEY (job_id, node))")
    conn.execute("INSERT INTO job_summaries (job_id, node, summary) VALUES (?, ?, ?)", [job_id, node, json.dumps(doc)])
