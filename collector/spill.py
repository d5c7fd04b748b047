"""Collector rows the store did not take at exit, kept in a file for the Epilog.

When the store is locked (or briefly unwritable) as the Epilog stops the collector, the
rows still in memory would be lost with the process. The collector writes them instead to
``{state_dir}/collector.{job_id}.spill.jsonl`` (one ``{"table": ..., "row": {...}}`` per
line, only the tables it owns: ``samples``, ``host_samples``, ``events``), and the
Epilog loads the file into the store before it summarises the job
(:func:`load_spill`), then removes it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

#: Tables a spill file may fill (the collector's own).
TABLES = ("samples", "host_samples", "events")
#: Largest spill file read back (bytes): the collector's buffer is bounded far below it.
MAX_SPILL_BYTES = 64 * 2**20


def spill_rows(path: str, rows: Mapping[str, Iterable[dict[str, Any]]]) -> int:
    """Append ``rows`` (table -> rows) to ``path``; returns how many were written (0 when
    the file cannot be written)."""
    n = 0
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "a") as fh:
            for table, items in rows.items():
                for row in items:
                    fh.write(json.dumps({"table": table, "row": row}, default=str) + "\n")
                    n += 1
    except OSError:
        return 0
    return n


def load_spill(store: Any, path: str) -> int:
    """Insert a spill file's rows into ``store`` and remove the file; returns the row
    count. Lines that are not ours (unknown table, not JSON) are skipped. Raises
    :class:`gpuguard.store.StoreError` (the file is then kept for the next try)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return 0
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(MAX_SPILL_BYTES)
    by_table: dict[str, list[dict[str, Any]]] = {}
    for line in data.splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and doc.get("table") in TABLES and isinstance(doc.get("row"), dict):
            by_table.setdefault(doc["table"], []).append(doc["row"])
    for table, rows in by_table.items():
        store.insert_many(table, rows)
    os.unlink(path)
    return sum(len(r) for r in by_table.values())
