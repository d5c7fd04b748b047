"""Charts for the HTML report: matplotlib (Agg, imported on first use) to inline SVG.

Text goes into the SVG as ``<text>`` elements (``svg.fonttype = none``), escaped by
matplotlib's XML writer; mathtext is off (``text.parse_math = False``) so a ``$`` in an
account name is drawn as it is. The SVG carries no date, so the same data gives the same
file. At most :data:`MAX_GROUPS` groups are drawn (the table has them all).
"""

from __future__ import annotations

import io
import re

from gpuguard.reports.queries import FAILURE_STATES, Report

MAX_GROUPS = 15
_COLORS = {
    "COMPLETED": "#4caf50", "FAILED": "#e53935", "CANCELLED": "#9e9e9e", "TIMEOUT": "#fb8c00",
    "NODE_FAIL": "#8e24aa", "OUT_OF_MEMORY": "#d81b60", "PREEMPTED": "#3949ab", "OTHER": "#6d4c41",
}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _svg(fig) -> str:
    plt = _plt()
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    text = buf.getvalue()
    text = re.sub(r"<metadata>.*?</metadata>\s*", "", text, flags=re.S)  # matplotlib's RDF block: not needed
    return text[text.index("<svg"):]


def _rc():
    import matplotlib

    return matplotlib.rc_context({"svg.fonttype": "none", "text.parse_math": False, "svg.hashsalt": "gpuguard",
                                  "font.size": 9})


def _barh(labels, series, title, xlabel, stacked=False):
    plt = _plt()
    n = len(labels)
    fig, ax = plt.subplots(figsize=(7.5, 0.35 * n + 1.2))
    ys = list(range(n))
    left = [0.0] * n
    k = len(series)
    for i, (name, vals, color) in enumerate(series):
        if stacked:
            ax.barh(ys, vals, left=left, label=name, color=color)
            left = [a + b for a, b in zip(left, vals, strict=True)]
        else:
            h = 0.8 / k
            ax.barh([y - 0.4 + h * (i + 0.5) for y in ys], vals, height=h, label=name, color=color)
    ax.set_yticks(ys)
    ax.set_yticklabels(labels)
    ax.invert_yaxis()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    if k > 1:
        ax.legend(loc="lower right", fontsize=7)
    ax.grid(axis="x", alpha=0.3)
    return fig


def chart_svg(report: Report) -> str | None:
    """An SVG document (text starting at ``<svg``) for ``report``'s main table, or None
    when it has no rows."""
    table = report.tables[0]
    rows = table.rows[:MAX_GROUPS]
    if not rows:
        return None
    labels = [str(r["group"]) for r in rows]
    with _rc():
        if report.name == "cost":
            fig = _barh(labels, [("GPU-hours", [r["gpu_hours"] for r in rows], "#1e88e5")],
                        f"GPU-hours per {report.by}", "GPU-hours")
        elif report.name == "wait":
            series = [(f"p{p}", [(r[f"p{p}_s"] or 0) / 3600.0 for r in rows], c)
                      for p, c in ((50, "#90caf9"), (90, "#1e88e5"), (99, "#0d47a1"))]
            fig = _barh(labels, series, f"Queue wait per {report.by}", "hours")
        elif report.name == "failures":
            series = [(s, [r[f"{s}_share"] * 100 for r in rows], _COLORS[s]) for s in (*FAILURE_STATES, "OTHER")]
            fig = _barh(labels, series, f"Job outcomes per {report.by}", "% of jobs", stacked=True)
        elif report.name == "efficiency":
            used = [r["util_weighted_gpu_hours"] for r in rows]
            idle = [r["idle_gpu_hours"] for r in rows]
            unused = [max(0.0, r["measured_gpu_hours"] - u - i) for r, u, i in zip(rows, used, idle, strict=True)]
            nosum = [r["no_summary_gpu_hours"] for r in rows]
            fig = _barh(labels, [("used (util-weighted)", used, "#43a047"), ("idle GPUs", idle, "#e53935"),
                                 ("allocated, unused", unused, "#ffb300"), ("no summary", nosum, "#bdbdbd")],
                        f"GPU-hours per {report.by}", "GPU-hours", stacked=True)
        else:
            return None
        return _svg(fig)
