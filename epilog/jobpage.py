"""The job page of ``gpuguard job show``: one screen a job's owner reads first.

Layout (text, default; ``--full`` appends every table of :func:`gpuguard.epilog.cli.format_text`):

1. header: job, name, user, account, partition; state, exit, elapsed against the time
   limit, start/end in the viewer's zone; nodes, GPUs, template;
2. the verdict with up to :data:`EVIDENCE_LINES` lines of its evidence;
3. one line per GPU: utilisation (0..100 %), memory peak and mean power as bars; memory
   and power bars are scaled to the largest value among the job's GPUs (the GPU's total
   memory and power limit are not in the summary), so a GPU that lags its peers shows;
4. advice for the cause (and for idle GPUs): what to check and a docs link, from
   :mod:`gpuguard.epilog.advice`;
5. one line counting findings and events, pointing at ``--full``.

It fits 40 lines for a 2-node, 16-GPU job (tests pin it). The renderer reads a plain
dict (:func:`gpuguard.epilog.cli.job_report`'s, plus ``job``: the header record of
:func:`job_header` or of whichever source fills it), so it works for any data source.
"""

from __future__ import annotations

from datetime import datetime, tzinfo
from typing import Any

#: Evidence lines shown under the verdict on the default page.
EVIDENCE_LINES = 3
#: Width of a bar in characters.
BAR_W = 16
#: Most GPU lines on the default page (2 nodes x 8 GPUs); a larger job gets one line per
#: node (means over its GPUs) plus a line for each idle GPU (``--full`` lists every GPU).
MAX_GPU_LINES = 16
#: Lines of the default page (our choice: one 40-line terminal screen; jobstats' page is
#: about as long). Advice is cut to fit, never the header, verdict or GPUs.
PAGE_LINES = 40


def bar(frac: float | None, width: int = BAR_W) -> str:
    """``[#####.....]``-style bar of ``frac`` (0..1, clamped) in Unicode blocks; blanks
    for None."""
    if frac is None:
        return "[" + " " * width + "]"
    f = min(1.0, max(0.0, frac))
    full = round(f * width)
    return "[" + "█" * full + "·" * (width - full) + "]"


def duration(s: float | None) -> str:
    """Seconds -> ``2h03m``, ``45m10s``, ``3d04h``; ``-`` for None."""
    from gpuguard.reports.render import duration as d

    return d(s)


def when(ts: float | str | None, tz: tzinfo) -> str:
    """UTC epoch (or ISO 8601 text) -> ``2026-11-30 10:04 CET`` in the viewer's zone."""
    ts = _epoch(ts)
    if ts is None:
        return "-"
    dt = datetime.fromtimestamp(ts, tz)
    return dt.strftime("%Y-%m-%d %H:%M ") + (dt.tzname() or "")


def _epoch(v: Any) -> float | None:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if isinstance(v, str) and v:
        try:
            return datetime.fromisoformat(v.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return None


def job_header(store: Any, rep: dict[str, Any]) -> dict[str, Any]:
    """The header record of a job: ``{job_id, name, user, account, partition, state,
    exit, elapsed_s, time_limit_s, start_at, end_at, nodes: [str], gpus: int | None,
    source}``. From the store's sacct cache (``sacct_jobs``: its latest attempt) when the
    job is there, else from the nodes' summaries (exit text, first start, last end)."""
    jid = str(rep["job_id"])
    h: dict[str, Any] = {"job_id": jid, "name": None, "user": None, "account": None, "partition": None,
                         "state": None, "exit": None, "elapsed_s": None, "time_limit_s": None,
                         "start_at": None, "end_at": None, "nodes": list(rep.get("nodes") or []),
                         "gpus": len(rep.get("gpus") or []) or None, "source": "gpuguard summaries"}
    row = None
    try:
        rows = store.query("SELECT * FROM sacct_jobs WHERE job_id = ? OR job_id_raw = ? "
                           "ORDER BY attempt_at DESC LIMIT 1", [jid, int(jid) if jid.isdigit() else -1])
        row = rows[0] if rows else None
    except Exception:  # no sacct cache in this store (node store, never synced): summaries only
        row = None
    sums = rep.get("summaries") or []
    if row is not None:
        h.update(name=row.get("job_name"), user=row.get("user"), account=row.get("account"),
                 partition=row.get("partition"), state=row.get("state"), elapsed_s=row.get("elapsed_s"),
                 time_limit_s=row.get("time_limit_s"), start_at=row.get("start_at"), end_at=row.get("end_at"),
                 source="sacct cache")
        if row.get("exit_code") is not None:
            h["exit"] = f"{row['exit_code']}:{row.get('exit_signal') or 0}"
        if row.get("gpus") is not None:
            h["gpus"] = row["gpus"]
    starts = [t for t in (_epoch(s.get("started_at")) for s in sums) if t is not None]
    ends = [t for t in (_epoch(s.get("ended_at")) for s in sums) if t is not None]
    if h["start_at"] is None and starts:
        h["start_at"] = min(starts)
    if h["end_at"] is None and ends:
        h["end_at"] = max(ends)
    if h["elapsed_s"] is None and h["start_at"] is not None and h["end_at"] is not None:
        h["elapsed_s"] = max(0.0, h["end_at"] - h["start_at"])
    if h["exit"] is None and sums:
        h["exit"] = sums[0].get("exit_text")
    return h


def _gpu_rows(rep: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for s in rep.get("summaries") or []:
        for g in s.get("gpus") or []:
            out.append({"node": s["node"], "gpu": g.get("gpu_index"), "util": g.get("gpu_util_mean_pct"),
                        "mem": g.get("mem_used_peak_mib"), "power": g.get("power_mean_w"),
                        "clock": g.get("sm_clock_mean_mhz"), "temp": g.get("temp_max_c")})
    return out


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def view(rep: dict[str, Any], *, advice: dict[str, dict[str, Any]], idle_gpu_pct: float = 5.0) -> dict[str, Any]:
    """The page's content, shared by the text and HTML renderers: ``header`` (the job
    record), ``verdict`` (or None), ``gpus`` (per-GPU dicts with ``util``, ``mem``,
    ``power`` and 0..1 fractions ``util_f``, ``mem_f``, ``power_f``), ``idle`` (GPUs under
    ``idle_gpu_pct``), ``advice`` (``[{cause, who, check, docs}]``), ``findings``,
    ``events`` counts."""
    gpus = _gpu_rows(rep)
    mem_max = max((g["mem"] for g in gpus if g["mem"]), default=None)
    pw_max = max((g["power"] for g in gpus if g["power"]), default=None)
    for g in gpus:
        g["util_f"] = g["util"] / 100.0 if g["util"] is not None else None
        g["mem_f"] = g["mem"] / mem_max if g["mem"] is not None and mem_max else None
        g["power_f"] = g["power"] / pw_max if g["power"] is not None and pw_max else None
    idle = [g for g in gpus if g["util"] is not None and g["util"] < idle_gpu_pct]
    v = rep.get("verdict")
    causes = []
    if v and v.get("cause") in advice:
        causes.append(v["cause"])
    for c in (v or {}).get("also") or []:
        if c in advice and c not in causes:
            causes.append(c)
    if idle and "idle-gpus" in advice:
        causes.append("idle-gpus")
    return {"header": rep.get("job") or {}, "verdict": v, "gpus": gpus, "idle": idle,
            "advice": [{"cause": c, **advice[c]} for c in causes],
            "findings": rep.get("findings") or [], "events": rep.get("events") or []}


def _header_lines(h: dict[str, Any], tz: tzinfo) -> list[str]:
    name = f' "{h["name"]}"' if h.get("name") else ""
    who = "  ".join(f"{k} {h[k]}" for k in ("user", "account", "partition") if h.get(k))
    lim = h.get("time_limit_s")
    el = h.get("elapsed_s")
    elapsed = duration(el)
    if lim:
        elapsed += f" of {duration(lim)} limit ({100.0 * (el or 0) / lim:.0f} %)"
    nodes = h.get("nodes") or []
    shown = ", ".join(nodes[:4]) + (f", +{len(nodes) - 4}" if len(nodes) > 4 else "")
    gpus = h.get("gpus")
    return [f"Job {h.get('job_id')}{name}" + (f"   {who}" if who else ""),
            f"State {h.get('state') or '-'}   exit {h.get('exit') or '-'}   elapsed {elapsed}",
            f"Start {when(h.get('start_at'), tz)}   end {when(h.get('end_at'), tz)}",
            f"Nodes {len(nodes)} ({shown})   GPUs {gpus if gpus is not None else 'unknown'}"]


def _verdict_lines(v: dict[str, Any] | None) -> list[str]:
    if not v:
        return ["Verdict: none recorded (no baseline comparison for this job)"]
    from gpuguard.epilog.show import template_line

    out = [f"Verdict: {v['cause']} — {v.get('summary', '')}", "  " + template_line(v)]
    ev = v.get("evidence") or {}
    lines = []
    flagged = [c for c in v.get("comparisons") or [] if c.get("flagged")]
    for c in flagged:
        rel = c.get("rel_change")
        dev = f"{rel:+.0%}" if isinstance(rel, float) and abs(rel) < 1e6 else "new"
        val = " ".join(x for x in (_num(c.get("value"), ".4g"), c.get("unit") or "") if x)
        lines.append(f"  {c['metric']}: {val} vs baseline {_num(c.get('median'), '.4g')} ({dev})")
    for key in ("gpus", "leaks"):
        for hit in ev.get(key, []):
            lines.append("  " + ", ".join(f"{k}={_num(x, '.4g') if isinstance(x, float) else x}"
                                          for k, x in hit.items() if k != "gpu_uuid" and not isinstance(x, dict)))
    if ev.get("reasons"):
        lines.append("  clock-event reasons: " + ", ".join(f"{r} {x:.0%}" for r, x in ev["reasons"].items()))
    out += lines[:EVIDENCE_LINES]
    if len(lines) > EVIDENCE_LINES:
        out.append(f"  ... {len(lines) - EVIDENCE_LINES} more (--full)")
    return out


def _node_rows(gpus: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-node means of the GPU rows (bars scaled as the GPU rows are)."""
    out = []
    for node in sorted({g["node"] for g in gpus}):
        gs = [g for g in gpus if g["node"] == node]

        def mean(k: str, gs: list[dict[str, Any]] = gs) -> float | None:
            xs = [g[k] for g in gs if g[k] is not None]
            return sum(xs) / len(xs) if xs else None

        out.append({"label": f"{node} ({len(gs)} GPUs)", "util": mean("util"), "util_f": mean("util_f"),
                    "mem": mean("mem"), "mem_f": mean("mem_f"), "power": mean("power"), "power_f": mean("power_f")})
    return out


def _gpu_line(label: str, g: dict[str, Any], idle_pct: float) -> str:
    util = f"{bar(g['util_f'])} {_num(g['util'], '3.0f')}%"
    mem = f"{bar(g['mem_f'])} {_num(g['mem'] / 1024 if g['mem'] is not None else None, '5.1f')} GiB"
    pw = f"{bar(g['power_f'])} {_num(g['power'], '4.0f')} W"
    idle = "  idle" if g["util"] is not None and g["util"] < idle_pct else ""
    return f"{label}  {util}  {mem}  {pw}{idle}"


def _gpu_lines(gpus: list[dict[str, Any]], idle_pct: float) -> list[str]:
    if not gpus:
        return ["GPUs: no samples recorded"]
    if len(gpus) <= MAX_GPU_LINES:
        rows = [(f"{g['node']} gpu{g['gpu']}", g) for g in gpus]
        head = "GPU"
    else:
        rows = [(n["label"], n) for n in _node_rows(gpus)]
        rows += [(f"{g['node']} gpu{g['gpu']}", g) for g in gpus if g["util"] is not None and g["util"] < idle_pct]
        head = "node (mean of its GPUs)"
    w = max(len(lab) for lab, _ in [*rows, (head, None)])
    out = [f"{head.ljust(w)}  {'utilisation'.ljust(BAR_W + 7)}  {'memory peak'.ljust(BAR_W + 11)}  power mean"]
    out += [_gpu_line(lab.ljust(w), g, idle_pct) for lab, g in rows]
    return out


def _advice_block(a: dict[str, Any], checks: int) -> list[str]:
    who = "you can fix this" if a.get("who") == "you" else "the machine's fault, reported to the admins"
    out = [f"What to check ({a['cause']}: {who}):"]
    out += [f"  - {c}" for c in (a.get("check") or [])[:checks]]
    if a.get("docs"):
        out.append(f"  more: {a['docs']}")
    return out


def _advice_lines(advice: list[dict[str, Any]], budget: int | None = None) -> list[str]:
    """The advice blocks, cut to ``budget`` lines: a block that does not fit whole keeps
    its title, first check and link; blocks that do not fit at all are named."""
    out: list[str] = []
    for i, a in enumerate(advice):
        block = _advice_block(a, len(a.get("check") or []))
        if budget is not None and len(out) + len(block) > budget:
            block = _advice_block(a, 1)
            if len(out) + len(block) + (1 if i + 1 < len(advice) else 0) > budget:
                rest = [x["cause"] for x in advice[i:]]
                if len(out) < budget:
                    out.append(f"More advice ({', '.join(rest)}): --format html")
                break
        out += block
    return out


def format_page(rep: dict[str, Any], *, tz: tzinfo, advice: dict[str, dict[str, Any]],
                idle_gpu_pct: float = 5.0) -> str:
    """The default, one-screen text page (module docstring): at most :data:`PAGE_LINES`
    lines for up to :data:`MAX_GPU_LINES` GPUs."""
    v = view(rep, advice=advice, idle_gpu_pct=idle_gpu_pct)
    out = [*_header_lines(v["header"], tz), "", *_verdict_lines(v["verdict"]), ""]
    out += _gpu_lines(v["gpus"], idle_gpu_pct)
    ev = v["events"]
    xids = [e for e in ev if str(e.get("kind", "")).lower() in ("xid", "sxid")]
    tail = ["", f"{len(v['findings'])} finding(s), {len(ev)} event(s)"
            + (f" ({len(xids)} XID/SXid)" if xids else "") + "; every metric, finding and event: --full"]
    if v["advice"]:
        budget = PAGE_LINES - len(out) - len(tail) - 1
        lines = _advice_lines(v["advice"], budget)
        if lines:
            out += ["", *lines]
    return "\n".join(out + tail)
