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


def summary_rows(job_id: str, admin_comment: str | None, synced_at: float) -> list[dict[str, Any]]:
    """``job_summaries`` rows decoded from one job's AdminComment (empty when it is not
    gpuguard's or cannot be decoded)."""
    if not admin_comment or not admin_comment.startswith(PREFIX):
        return []
    from gpuguard.epilog.admincomment import decode, node_summaries

    doc = decode(admin_comment)
    if doc is None:
        return []
    rows = []
    for node, s in node_summaries(doc).items():
        body = {"job_id": str(job_id), "node": node, "source": "admin_comment",
                "gpu_util_mean_pct": s.get("gpu_util_mean_pct"),
                "gpus": [{"gpu_index": g.get("gpu_index"), "gpu_util_mean_pct": g.get("gpu_util_mean_pct")}
                         for g in s.get("gpus") or [] if isinstance(g, dict)]}
        rows.append({"job_id": str(job_id), "node": node, "created_at": synced_at, "summary_version": 0,
                     "summary": json.dumps(body, separators=(",", ":"))})
    return rows


def store_admin_summaries(store: Any, jobs: Iterable[tuple[str, str | None]], synced_at: float) -> int:
    """Insert the summaries of ``(job_id, admin_comment)`` pairs that the store lacks, in
    the caller's transaction. Returns the number of rows offered."""
    rows = [r for jid, ac in jobs for r in summary_rows(jid, ac, synced_at)]
    if rows:
        store.db.conn.executemany(
            "INSERT OR IGNORE INTO job_summaries (job_id, node, created_at, summary_version, summary) "
            "VALUES (:job_id, :node, :created_at, :summary_version, :summary)", rows)
    return len(rows)
