"""Storing a verdict and reading it back.

:func:`save_verdict` writes the verdict row and its comparison rows
(:func:`gpuguard.epilog.baseline.record_verdict`) and refreshes the template's baseline;
:func:`load_verdict` reads them back for ``gpuguard job show``; :func:`node_context`
reads the node change log the verdict quotes.
"""

from __future__ import annotations

import json
import math
import time
from typing import TYPE_CHECKING, Any

from gpuguard.config import Config
from gpuguard.epilog import baseline as baseline_mod
from gpuguard.epilog.metrics import METRICS

if TYPE_CHECKING:
    from gpuguard.epilog.verdict import Verdict


def node_context(store: Any, nodes: list[str], since: float | None, until: float | None) -> list[dict[str, Any]]:
    """``inventory_changes`` rows on ``nodes`` from ``since`` to a little after ``until``
    (driver, CUDA, VBIOS ... changed), at most 50; empty when the store has none."""
    if not nodes or since is None:
        return []
    q = ",".join("?" * len(nodes))
    try:
        rows = store.query(
            f"select at, node, uuid, gpu_index, field, old, new from inventory_changes where node in ({q}) "
            "and at >= ? and at <= ? order by at", [*nodes, since, (until or time.time()) + 300.0])
    except Exception:  # context only: a store without the table or a read error loses nothing
        return []
    return rows[:50]


def save_verdict(store: Any, v: Verdict, *, cfg: Config | None, exit_code: int | None, critical: bool,
                 now: float) -> None:
    """Store ``v`` and its comparisons, re-learn the template's baseline when its last
    runs call for it (:mod:`gpuguard.epilog.relearn`), then refresh the baseline. The run
    is fit for the baseline (``baseline_ok``) when it completed (``exit_code`` 0 or
    unknown), had no critical finding, was not anomalous and had data. Raises
    :class:`gpuguard.store.StoreError`."""
    ok = (exit_code in (None, 0)) and not critical and not v.anomalous and v.start is not None
    row = {"job_id": v.job_id, "template": v.template, "at": now, "state": v.state, "cause": v.cause,
           "summary": v.summary, "evidence": baseline_mod.dumps(v.evidence), "also": baseline_mod.dumps(v.also),
           "context": baseline_mod.dumps(v.context), "exit_code": exit_code, "critical": int(critical),
           "baseline_ok": int(ok), "nodes": baseline_mod.dumps(v.nodes), "start_at": v.start, "end_at": v.end,
           "gpu_model": v.gpu_model}
    crows = [{"job_id": v.job_id, "template": v.template, "metric": c.metric, "value": c.value,
              "median": c.median, "mad": c.mad, "n": c.n, "z": _finite(c.z), "rel_change": _finite(c.rel_change),
              "flagged": int(c.flagged), "sustained_s": c.sustained_s, "at": now} for c in v.comparisons]
    baseline_mod.record_verdict(store, row, crows, template_source=v.template_source, now=now)
    if v.cause == "job-changed":
        from gpuguard.epilog.relearn import relearn_if_due

        info = relearn_if_due(store, v.template, cfg=cfg, now=now, gpu_model=v.gpu_model)
        if info:
            v.evidence["relearned"] = info
    baseline_mod.update_baseline(store, v.template, cfg=cfg, gpu_model=v.gpu_model, now=now)


def _unit(metric: str) -> str:
    from gpuguard.epilog.compare import unit_of

    try:
        return unit_of(metric)
    except KeyError:  # a metric stored by another gpuguard version
        return ""


def _finite(x: float | None) -> float | None:
    if x is None:
        return None
    return x if math.isfinite(x) else math.copysign(1e308, x)


def load_verdict(store: Any, job_id: str) -> dict[str, Any] | None:
    """A stored verdict with its comparisons, as :meth:`Verdict.to_dict` shapes it
    (for ``gpuguard job show``), or ``None``. Raises :class:`gpuguard.store.StoreError`."""
    rows = store.query("select * from verdicts where job_id = ?", [str(job_id)])
    if not rows:
        return None
    r = rows[0]
    comps = store.query("select metric, value, median, mad, n, z, rel_change, flagged, sustained_s "
                        "from comparisons where job_id = ?", [str(job_id)])
    order = {m: i for i, m in enumerate(METRICS)}
    comps.sort(key=lambda c: order.get(c["metric"], 99))
    for c in comps:
        c["flagged"] = bool(c["flagged"])
        c["unit"] = _unit(c["metric"])
    return {"job_id": r["job_id"], "template": r["template"], "state": r["state"], "cause": r["cause"],
            "summary": r["summary"], "evidence": json.loads(r["evidence"] or "{}"),
            "also": json.loads(r["also"] or "[]"), "context": json.loads(r["context"] or "[]"),
            "exit_code": r["exit_code"], "baseline_ok": bool(r["baseline_ok"]), "judged_at": r["at"],
            "baseline_runs": (json.loads(r["evidence"] or "{}")).get("baseline_runs"),
            "gpu_model": r.get("gpu_model") or "",
            "nodes": json.loads(r["nodes"] or "[]"), "start": r["start_at"], "end": r["end_at"],
            "comparisons": comps}

