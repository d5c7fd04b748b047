"""Interconnect evidence for a job's verdict: each node's NCCL baseline and the fabric
findings of the job's nodes while it ran.

The verdict (``gpuguard.epilog``) calls :func:`communication_evidence` when it names
communication as the cause. Fabric faults found during the job (an IB port that went
down or trained at a lower rate, errors rising between the Prolog's and the Epilog's
reading, NVLink errors, a low NCCL probe) are ordinary findings in the store; the
verdict's hardware detector already counts the draining ones, and
:data:`FABRIC_CODES` lists every code that says "the machine's fabric", so a job slowed
by a degraded link is blamed on the machine.
"""

from __future__ import annotations

import statistics
from typing import Any

#: Findings that mean the fabric of a node degraded (IB/RoCE, NVLink, NCCL probe).
FABRIC_CODES = ("ib.port_down", "ib.rate_degraded", "ib.errors_rising", "ib.link_flapping",
                "nvlink.link_down", "nvlink.errors_rising", "nccl.busbw_low", "nccl.errors")
#: Findings recorded up to this long after the job's last sample belong to it (the
#: Epilog's health run comes a little after; same margin as the verdict's hardware window).
AFTER_S = 300.0


def node_nccl_baseline(store: Any, node: str) -> dict[str, Any] | None:
    """The node's NCCL baseline as the probe keeps it: for the largest message size of
    its healthy probes, median/MAD busbw (GB/s) and the probe count, plus the last probe's
    state and ratio to the baseline. None when the node was never probed."""
    last = store.query("select at, state, ratio, config_key from nccl_probes where node = ? order by at desc, id desc "
                       "limit 1", [node])
    if not last:
        return None
    key = last[0]["config_key"]
    rows = store.query(
        "select b.size_b, b.busbw_gbs from nccl_busbw b join nccl_probes p on p.id = b.probe_id "
        "where p.node = ? and p.config_key = ? and p.state = 'ok' order by p.at desc limit 200", [node, key])
    out: dict[str, Any] = {"last_probe_at": last[0]["at"], "last_state": last[0]["state"],
                           "last_ratio": last[0]["ratio"]}
    if rows:
        size = max(r["size_b"] for r in rows)
        vals = [r["busbw_gbs"] for r in rows if r["size_b"] == size]
        med = statistics.median(vals)
        out.update({"size_b": size, "busbw_median_gbs": round(med, 3),
                    "busbw_mad_gbs": round(statistics.median(abs(v - med) for v in vals), 3), "probes": len(vals)})
    return out


def fabric_findings(store: Any, nodes: list[str], start: float, end: float) -> list[dict[str, Any]]:
    """Fabric findings (:data:`FABRIC_CODES`) on ``nodes`` from ``start`` to ``end`` +
    :data:`AFTER_S`, oldest first, at most 50."""
    if not nodes:
        return []
    marks = ",".join("?" * len(nodes))
    codes = ",".join("?" * len(FABRIC_CODES))
    return store.query(
        f"select at, node, code, severity, action, message from findings where node in ({marks}) "
        f"and code in ({codes}) and at >= ? and at <= ? order by at limit 50",
        [*nodes, *FABRIC_CODES, start, end + AFTER_S])


def communication_evidence(store: Any, nodes: list[str], start: float | None, end: float | None) -> dict[str, Any]:
    """``{"node_nccl_baseline": {node: ... or None}, "fabric_findings": [...],
    "fabric_degraded": bool}`` for the verdict. Never raises: a store without the
    tables (an older node) gives empty evidence with ``"error"``."""
    try:
        base = {n: node_nccl_baseline(store, n) for n in nodes}
        found = fabric_findings(store, nodes, start, end) if start is not None and end is not None else []
    except Exception as e:  # evidence only: the verdict stands without it
        return {"node_nccl_baseline": None, "fabric_findings": [], "fabric_degraded": False,
                "error": f"{type(e).__name__}: {e}"}
    return {"node_nccl_baseline": base, "fabric_findings": found,
            "fabric_degraded": any(f["action"] != "record" for f in found)}
