"""Helpers shared by tests/test_reports_*.py (imported explicitly; conftest.py is shared)."""

from __future__ import annotations

import pathlib
from datetime import datetime, UTC

import pytest

from gpuguard import store as store_mod

DATA = pathlib.Path(__file__).parent / "data"
HANDMADE = DATA / "reports-handmade-p.txt"


def utc(text: str) -> float:
    """``2025-03-01T00:00:00`` (UTC) -> epoch seconds."""
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def open_cache_store(path) -> store_mod.Store:
    return store_mod.open_store(str(path))


@pytest.fixture
def cstore(tmp_path):
    """A fresh cluster store with every migration applied (the sacct cache included)."""
    s = open_cache_store(tmp_path / "cluster.db")
    yield s
    s.close()


def add_summary(store: store_mod.Store, job_id: str, node: str, util: float) -> None:
    """Insert one gpuguard job summary row. Creates a minimal ``job_summaries`` table when
    the store has none; otherwise fills NOT NULL columns without defaults with neutral
    values so the test does not depend on the epilog's full column list."""
    conn = store.db.conn
    cols = conn.execute("SELECT name, type, \"notnull\", dflt_value, pk FROM pragma_table_info('job_summaries')").fetchall()
    if not cols:
        conn.execute("CREATE TABLE job_summaries (job_id TEXT, node TEXT, gpu_util_mean_pct REAL)")
        cols = conn.execute("SELECT name, type, \"notnull\", dflt_value, pk FROM pragma_table_info('job_summaries')").fetchall()
    row = {"job_id": job_id, "node": node, "gpu_util_mean_pct": util}
    for name, typ, notnull, dflt, pk in cols:
        if name in row or not (notnull or pk) or dflt is not None:
            continue
        if pk and "INT" in (typ or "").upper():
            continue  # rowid alias: SQLite assigns it
        row[name] = 0 if any(t in (typ or "").upper() for t in ("INT", "REAL", "FLOA", "NUM")) else ""
    names = ", ".join(f'"{k}"' for k in row)
    conn.execute(f"INSERT INTO job_summaries ({names}) VALUES ({', '.join('?' for _ in row)})", list(row.values()))
