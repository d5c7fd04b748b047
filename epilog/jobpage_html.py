"""``gpuguard job show --format html``: the job page as one self-contained HTML file.

The same content as the text page (:func:`gpuguard.epilog.jobpage.view`) plus time-series
plots drawn by matplotlib as inline SVG (no script, no external resource): per GPU
utilisation, memory used and SM clock; per rank step time. Every value from the job
(names, accounts, messages) passes through jinja2 autoescaping; only the SVG, written by
matplotlib's XML writer with mathtext off, is inserted as markup.

Series are averaged into at most :data:`MAX_POINTS` time buckets per GPU or rank by
SQLite, so a week-long job at 1 s sampling still renders in a second.
"""

from __future__ import annotations

import re
from datetime import tzinfo
from typing import Any

#: Points per line at most (our choice: more than a 1000-pixel-wide plot can show).
MAX_POINTS = 600
#: Lines per plot at most; more GPUs or ranks are drawn as their mean (our choice: a
#: legend of 16 entries still reads; 2 nodes x 8 GPUs fit).
MAX_LINES = 16


def load_series(store: Any, job_id: str) -> dict[str, Any]:
    """``{"t0": epoch, "gpus": {"node gpuN": {"t_min": [...], "util_pct": [...],
    "mem_used_gib": [...], "sm_clock_mhz": [...], "power_w": [...]}}, "ranks": {"rank R":
    {"t_min": [...], "step_time_s": [...]}}}`` with times in minutes since the job's
    first sample or step. Raises :class:`gpuguard.store.StoreError`."""
    jid = str(job_id)
    span = store.query("SELECT MIN(at) AS a, MAX(at) AS b FROM samples WHERE job_id = ?", [jid])[0]
    sspan = store.query("SELECT MIN(t) AS a, MAX(t) AS b FROM steps WHERE job_id = ?", [jid])[0]
    starts = [x for x in (span["a"], sspan["a"]) if x is not None]
    ends = [x for x in (span["b"], sspan["b"]) if x is not None]
    if not starts:
        return {"t0": None, "gpus": {}, "ranks": {}}
    t0, t1 = min(starts), max(ends)
    w = max(1.0, (t1 - t0) / MAX_POINTS)
    gpus: dict[str, dict[str, list]] = {}
    for r in store.query(
            "SELECT node, gpu_index, AVG(at) AS at, AVG(gpu_util_pct) AS u, AVG(mem_used_mib) AS m, "
            "AVG(sm_clock_mhz) AS c, AVG(power_w) AS p FROM samples WHERE job_id = ? "
            "GROUP BY node, gpu_index, CAST((at - ?) / ? AS INTEGER) ORDER BY node, gpu_index, 3", [jid, t0, w]):
        s = gpus.setdefault(f"{r['node']} gpu{r['gpu_index']}",
                            {"t_min": [], "util_pct": [], "mem_used_gib": [], "sm_clock_mhz": [], "power_w": []})
        s["t_min"].append((r["at"] - t0) / 60.0)
        s["util_pct"].append(r["u"])
        s["mem_used_gib"].append(r["m"] / 1024.0 if r["m"] is not None else None)
        s["sm_clock_mhz"].append(r["c"])
        s["power_w"].append(r["p"])
    ranks: dict[str, dict[str, list]] = {}
    for r in store.query(
            "SELECT rank, AVG(t) AS t, AVG(step_time_s) AS st FROM steps WHERE job_id = ? AND step_time_s IS NOT NULL "
            "GROUP BY rank, CAST((t - ?) / ? AS INTEGER) ORDER BY rank, 2", [jid, t0, w]):
        s = ranks.setdefault(f"rank {r['rank']}", {"t_min": [], "step_time_s": []})
        s["t_min"].append((r["t"] - t0) / 60.0)
        s["step_time_s"].append(r["st"])
    return {"t0": t0, "gpus": gpus, "ranks": ranks}


def _natural(name: str) -> list:
    """Sort key putting ``rank 2`` before ``rank 10``."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _lines(series: dict[str, dict[str, list]], key: str) -> list[tuple[str, list, list]]:
    """``(label, x, y)`` per series; beyond :data:`MAX_LINES` the rest is one mean line."""
    items = sorted(series.items(), key=lambda kv: _natural(kv[0]))
    out = [(name, s["t_min"], s[key]) for name, s in items[:MAX_LINES]]
    rest = items[MAX_LINES:]
    if rest:
        pts: dict[int, list[float]] = {}
        for _, s in rest:
            for x, y in zip(s["t_min"], s[key], strict=True):
                if y is not None:
                    pts.setdefault(round(x), []).append(y)
        xs = sorted(pts)
        out.append((f"mean of {len(rest)} more", xs, [sum(pts[x]) / len(pts[x]) for x in xs]))
    return out


def plot_svg(panels: list[tuple[str, str, list[tuple[str, list, list]]]], title: str) -> str | None:
    """Stacked panels ``(ylabel, unit, lines)`` sharing the time axis, legend outside on
    the right, as an SVG document; None when there is nothing to draw."""
    panels = [p for p in panels if p[2]]
    if not panels:
        return None
    from gpuguard.svgplot import pyplot, render_svg, style

    plt = pyplot()
    with style():
        fig, axes = plt.subplots(len(panels), 1, figsize=(9.5, 2.1 * len(panels) + 0.6), sharex=True, squeeze=False)
        for ax, (ylabel, unit, lines) in zip(axes[:, 0], panels, strict=True):
            for name, xs, ys in lines:
                ax.plot(xs, [float("nan") if y is None else y for y in ys], label=name, linewidth=1.0)
            ax.set_ylabel(f"{ylabel} ({unit})")
            ax.grid(alpha=0.3)
        axes[-1, 0].set_xlabel("minutes since the first sample")
        axes[0, 0].set_title(title)
        handles, labels = axes[0, 0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.0, 0.95), fontsize=7, frameon=False)
        fig.tight_layout()
        return render_svg(fig)


def render_html(rep: dict[str, Any], series: dict[str, Any] | None, *, tz: tzinfo,
                advice: dict[str, dict[str, Any]], idle_gpu_pct: float = 5.0) -> str:
    """The page (module docstring). ``series``: :func:`load_series`'s dict or None."""
    import jinja2
    from markupsafe import Markup

    from gpuguard.epilog.jobpage import _header_lines, _verdict_lines, view, when

    v = view(rep, advice=advice, idle_gpu_pct=idle_gpu_pct)
    series = series or {"t0": None, "gpus": {}, "ranks": {}}
    gpu_svg = plot_svg([("utilisation", "%", _lines(series["gpus"], "util_pct")),
                        ("memory used", "GiB", _lines(series["gpus"], "mem_used_gib")),
                        ("SM clock", "MHz", _lines(series["gpus"], "sm_clock_mhz"))], "Per GPU")
    rank_svg = plot_svg([("step time", "s", _lines(series["ranks"], "step_time_s"))], "Per rank")
    env = jinja2.Environment(loader=jinja2.PackageLoader("gpuguard.epilog", "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    return env.get_template("job.html.j2").render(
        job=v["header"], header=_header_lines(v["header"], tz), verdict=_verdict_lines(v["verdict"]),
        gpus=v["gpus"], advice=v["advice"], idle_pct=idle_gpu_pct, findings=v["findings"], events=v["events"],
        gpu_svg=Markup(gpu_svg) if gpu_svg else None, rank_svg=Markup(rank_svg) if rank_svg else None,
        t0=when(series.get("t0"), tz))
