"""Job summaries from gpuguard's AdminComment: the efficiency report wherever sacct works.

The job judge writes each job's per-node headline figures, per-GPU utilisation included,
into its AdminComment (:mod:`gpuguard.epilog.admincomment`). ``gpuguard report sync``
passes every synced job through :func:`store_admin_summaries`, which turns them into
``job_summaries`` rows (``summary`` JSON with ``gpu_util_mean_pct`` and ``gpus[]``, the
fields the efficiency report reads, plus ``"source": "admin_comment"``). A summary the
store already holds — the Epilog's own, on a single host or the controller — is never
replaced: ``INSERT OR IGNORE`` on the ``(job_id, node)`` key.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

PREFIX = "gpuguard:"


def summaries_of(job_id: str | int, admin_comment: str | None) -> list[tuple[str, str, str]]:
    """``(job_id, node, summary JSON)`` of each node summary one job's AdminComment
    carries (empty when it is not gpuguard's or cannot be decoded). A parallel import
    calls it in its worker processes, so the importing process decodes nothing."""
    if not admin_comment or not admin_comment.startswith(PREFIX):
        return []
    from gpuguard.epilog.admincomment import decode_shared, node_summaries

    doc = decode_shared(admin_comment)
    if doc is None:
        return []
    out = []
    for node, s in node_summaries(doc).items():
        body = {"job_id": str(job_id), "node": node, "source": "admin_comment",
                "gpu_util_mean_pct": s.get("gpu_util_mean_pct"),
                "gpus": [{"gpu_index": g.get("gpu_index"), "gpu_util_mean_pct": g.get("gpu_util_mean_pct")}
                         for g in s.get("gpus") or [] if isinstance(g, dict)]}
        out.append((str(job_id), node, json.dumps(body, separators=(",", ":"))))
    return out


def store_summaries(store: Any, summaries: Iterable[tuple[str, str, str]], synced_at: float) -> int:
    """Insert the ``(job_id, node, summary JSON)`` rows of :func:`summaries_of` that the
    store lacks, created at ``synced_at``, in the caller's transaction. Returns the number
    of rows offered."""
    rows = [(jid, node, synced_at, summary) for jid, node, summary in summaries]
    if rows:
        store.db.conn.executemany(
            "INSERT OR IGNORE INTO job_summaries (job_id, node, created_at, summary_version, summary) "
            "VALUES (?, ?, ?, 0, ?)", rows)
    return len(rows)


def store_admin_summaries(store: Any, jobs: Iterable[tuple[str, str | None]], synced_at: float) -> int:
    """Insert the summaries of ``(job_id, admin_comment)`` pairs that the store lacks, in
    the caller's transaction. Returns the number of rows offered."""
    return store_summaries(store, (t for jid, ac in jobs for t in summaries_of(jid, ac)), synced_at)
