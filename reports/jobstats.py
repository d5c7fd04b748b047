"""Princeton jobstats' ``JS1:`` AdminComment: per-job GPU utilisation for clusters
migrating from jobstats.

Format (PrincetonUniversity/jobstats, ``slurm/slurmctldepilog.sh`` and ``jobstats.py``:
``json.loads(gzip.decompress(base64.b64decode(data[4:])))``): ``JS1:`` then base64 of
gzip'd JSON::

    {"gpus": 1, "total_time": 50944,
     "nodes": {"della-l01g13": {"cpus": 12, "total_memory": B, "used_memory": B, "total_time": S,
                                "gpu_total_memory": {"1": B}, "gpu_used_memory": {"1": B},
                                "gpu_utilization": {"1": 98.6}}}}

``gpu_utilization`` is the mean duty cycle (%) of each GPU over the job (jobstats'
``avg_over_time(nvidia_gpu_duty_cycle)``), keyed by the GPU's minor number; a GPU listed
under memory but without a utilisation entry has no reading (jobstats' own
``gpu_util_error_code = 1``), not 0 %. ``JS1:Short`` and ``JS1:None`` mark jobs too short
or without data. Decoding is this module's only job; gpuguard's own AdminComment has its
own decoder (cluster mode), so each format stays one small function.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import io
import json
import zlib
from dataclasses import dataclass

PREFIX = "JS1:"
#: Markers jobstats writes instead of data (jobstats.py: ``"JS1:Short"``, ``"JS1:None"``).
NO_DATA = frozenset({"JS1:Short", "JS1:None"})
#: Largest decompressed document read (jobstats' biggest AdminComments are ~5 kB of base64;
#: our choice: 1 MiB bounds a gzip bomb in a field any admin tool can write).
MAX_JSON_BYTES = 1 << 20


class Js1Error(ValueError):
    """A ``JS1:`` comment that is not base64 of gzip'd JSON of the documented shape; one line."""


@dataclass(frozen=True)
class GpuReading:
    """One GPU of a jobstats summary: ``util_pct`` None when jobstats had no reading;
    memory in bytes (None when absent)."""

    node: str
    gpu: str
    util_pct: float | None
    mem_used_bytes: int | None
    mem_total_bytes: int | None


def is_js1(comment: str | None) -> bool:
    """Whether an AdminComment is jobstats' (``JS1:...``)."""
    return bool(comment) and comment.startswith(PREFIX)


def decode_js1(comment: str) -> dict | None:
    """``JS1:<base64 gzip JSON>`` -> the JSON object; None for ``JS1:Short``/``JS1:None``.
    Raises :class:`Js1Error` for anything else (bad base64, not gzip, not JSON, not an
    object with a ``nodes`` object, larger than :data:`MAX_JSON_BYTES`)."""
    text = comment.strip()
    if text in NO_DATA:
        return None
    if not text.startswith(PREFIX):
        raise Js1Error("not a jobstats comment (no JS1: prefix)")
    try:
        raw = base64.b64decode(text[len(PREFIX):], validate=True)
    except (binascii.Error, ValueError):
        raise Js1Error("JS1: payload is not base64") from None
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(raw)) as fh:
            data = fh.read(MAX_JSON_BYTES + 1)
    except (OSError, EOFError, zlib.error):
        raise Js1Error("JS1: payload is not gzip") from None
    if len(data) > MAX_JSON_BYTES:
        raise Js1Error(f"JS1: document larger than {MAX_JSON_BYTES} bytes")
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise Js1Error("JS1: payload is not JSON") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("nodes"), dict):
        raise Js1Error("JS1: JSON has no \"nodes\" object")
    return doc


def _num(v) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        return None
    return float(v)


def gpu_readings(doc: dict) -> list[GpuReading]:
    """Per-GPU readings of a decoded document, sorted by node and GPU; every GPU named in
    ``gpu_utilization``, ``gpu_used_memory`` or ``gpu_total_memory`` appears once.
    Utilisation outside 0..100 is no reading."""
    out = []
    for node, nd in sorted(doc.get("nodes", {}).items()):
        if not isinstance(nd, dict):
            continue
        parts = {k: (nd.get(k) if isinstance(nd.get(k), dict) else {})
                 for k in ("gpu_utilization", "gpu_used_memory", "gpu_total_memory")}
        gpus = sorted(set().union(*parts.values()), key=lambda g: (len(str(g)), str(g)))
        for g in gpus:
            u = _num(parts["gpu_utilization"].get(g))
            used, total = _num(parts["gpu_used_memory"].get(g)), _num(parts["gpu_total_memory"].get(g))
            out.append(GpuReading(str(node), str(g), u if u is not None and 0 <= u <= 100 else None,
                                  int(used) if used is not None else None, int(total) if total is not None else None))
    return out


def gpu_count(doc: dict) -> int | None:
    """The job's GPU count as jobstats recorded it (``gpus``; jobstats took it from
    AllocTRES), else the number of GPUs its nodes list; None when neither says."""
    n = doc.get("gpus")
    if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
        return n
    listed = gpu_readings(doc)
    return len(listed) or None


def store_readings(store, jobs: list[tuple[int, str]]) -> int:
    """Write the utilisation readings of jobstats comments into ``job_gpu_util`` (the
    table the efficiency report reads; :mod:`gpuguard.reports.util_schema`), one row per
    GPU with a reading, node = jobstats' node name. ``jobs``: ``(job_id_raw,
    admin_comment)``. A job that has a gpuguard summary keeps gpuguard's readings (its own
    measurement, per node); re-importing replaces a job's earlier jobstats rows.
    Unreadable comments are skipped. Returns the number of readings written. Raises
    :class:`gpuguard.store.StoreError`."""
    rows: list[tuple[str, str, int, float]] = []
    ids: list[str] = []
    for jid, comment in jobs:
        try:
            doc = decode_js1(comment)
        except Js1Error:
            continue
        if doc is None:
            continue
        ids.append(str(jid))
        rows += [(str(jid), r.node, int(jid), r.util_pct) for r in gpu_readings(doc) if r.util_pct is not None]
    if not ids:
        return 0
    absent = "NOT EXISTS (SELECT 1 FROM job_summaries s WHERE s.job_id = ?)"

    def go() -> None:
        with store.tx():
            store.db.conn.executemany(f"DELETE FROM job_gpu_util WHERE job_id = ? AND {absent}",
                                      [(j, j) for j in ids])
            store.db.conn.executemany(f"INSERT INTO job_gpu_util (job_id, node, jid, util) SELECT ?, ?, ?, ? "
                                      f"WHERE {absent}", [(*r, r[0]) for r in rows])
    store._guard("jobstats readings", go)
    return len(rows)
