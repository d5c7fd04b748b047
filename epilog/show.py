"""Text of a verdict for ``gpuguard job show``: the cause and its evidence first, then
one row per compared metric, then the node change-log context."""

from __future__ import annotations

import math
from typing import Any

from gpuguard.output import cell, table


def _num(v: Any) -> str:
    """A value for people (:func:`gpuguard.output.cell`: no exponent notation); the
    verdict stores an infinite z as a huge float, shown as ``inf``."""
    if isinstance(v, float) and (not math.isfinite(v) or abs(v) >= 1e300):
        return "inf" if v > 0 else "-inf"
    return cell(v)


def template_line(d: dict[str, Any]) -> str:
    """``template NAME (STATE, N baseline runs on GPU MODEL)`` of a verdict dict: the GPU
    model the baseline's runs ran on (the run's own) when it is known."""
    runs = d.get("baseline_runs")
    model = d.get("gpu_model") or ""
    inner = str(d.get("state"))
    if runs is not None:
        inner += f", {runs} baseline runs" + (f" on {model}" if model else "")
    elif model:
        inner += f", on {model}"
    return f"template {d.get('template')} ({inner})"


def format_verdict(d: dict[str, Any]) -> str:
    """Text for ``gpuguard job show``: the verdict and its evidence first, then one row
    per metric (this run, baseline median, deviation as relative change and z, flag),
    then the node change-log context. ``d`` is :func:`load_verdict`'s dict (or
    :meth:`Verdict.to_dict`)."""
    head = f"verdict: {d['cause']} — {d['summary']}"
    out = [head, "  " + template_line(d)]
    if d.get("also"):
        out.append("  also: " + ", ".join(d["also"]))
    ev = d.get("evidence") or {}
    for key in ("gpus", "leaks"):
        for h in ev.get(key, [])[:8]:
            out.append("  evidence: " + ", ".join(f"{k}={_num(v)}" for k, v in h.items()
                                                  if k not in ("gpu_uuid",) and not isinstance(v, dict)))
    if ev.get("reasons"):
        out.append("  active reasons: " + ", ".join(f"{r} {v:.0%}" for r, v in ev["reasons"].items()))
    for e in (ev.get("events") or [])[:5]:
        out.append(f"  event: {e['node']} gpu{e['gpu_index']} {e['kind']} {e['code']} ({e.get('action')}) "
                   f"{e.get('message', '')}")
    for f in (ev.get("findings") or [])[:5]:
        out.append(f"  finding: {f['node']} gpu{f['gpu_index']} {f['code']} {f['severity']}: {f.get('message', '')}")
    if ev.get("other_gpu_models"):
        out.append("  runs on other GPU models (not compared with): "
                   + ", ".join(f"{m or 'unknown'} {n}" for m, n in sorted(ev["other_gpu_models"].items())))
    if ev.get("unexplained"):
        out.append("  moved without a cause: " + ", ".join(ev["unexplained"]))
    rows = []
    for c in d.get("comparisons", []):
        dev = "-"
        if c.get("rel_change") is not None and c.get("median") is not None:
            rel = c["rel_change"]
            dev = (f"{rel:+.1%}" if isinstance(rel, float) and math.isfinite(rel) and abs(rel) < 1e300 else "new")
            if c.get("z") is not None:
                dev += f" (z {_num(c['z'])})"
        rows.append([c["metric"], c.get("unit", ""), _num(c.get("value")), _num(c.get("median")), dev,
                     "FLAG" if c.get("flagged") else ""])
    if rows:
        # compared values cover the job after its warm-up, not the whole job as the summary does
        headers = ["METRIC (after warm-up)", "UNIT", "THIS RUN", "BASELINE MEDIAN", "DEVIATION", ""]
        out += ["", table(rows, headers, right=[False, False, True, True, False, False])]
    if d.get("context"):
        out += ["", "node changes since the baseline's runs:"]
        for c in d["context"][:10]:
            out.append(f"  {c['node']} gpu{c['gpu_index']} {c['field']}: {c['old']} -> {c['new']}")
    return "\n".join(out)
