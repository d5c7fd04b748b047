"""Charts for the HTML report: matplotlib (Agg, imported on first use) to inline SVG.

Text goes into the SVG as ``<text>`` elements (``svg.fonttype = none``), escaped by
matplotlib's XML writer; mathtext is off (``text.parse_math = False``) so a ``$`` in an
account name is drawn as it is. The SVG carries no date, so the same data gives the same
file. At most :data:`MAX_GROUPS` bars are drawn: the largest groups and one "other (K
groups)" bar holding the rest, so every job is in the chart; legends sit outside the plot
area, right of it, so they never cover a bar.
"""

from __future__ import annotations

from gpuguard.reports.queries import FAILURE_STATES, Report
from gpuguard.svgplot import pyplot as _plt
from gpuguard.svgplot import render_svg as _svg
from gpuguard.svgplot import style as _rc

MAX_GROUPS = 15
_COLORS = {
    "COMPLETED": "#4caf50", "FAILED": "#e53935", "CANCELLED": "#9e9e9e", "TIMEOUT": "#fb8c00",
    "NODE_FAIL": "#8e24aa", "OUT_OF_MEMORY": "#d81b60", "PREEMPTED": "#3949ab", "OTHER": "#6d4c41",
}


def _legend_outside(ax, n_series: int) -> None:
    """Legend to the right of the plot area, never over the bars."""
    if n_series > 1:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)


def _barh(labels, series, title, xlabel, stacked=False):
    plt = _plt()
    n = len(labels)
    fig, ax = plt.subplots(figsize=(7.5, 0.35 * n + 1.2))
    ys = list(range(n))
    left = [0.0] * n
    k = len(series)
    for i, (name, vals, color) in enumerate(series):
        if k == 1:  # one series: the "other (K groups)" bar in grey, apart from the named groups
            color = [("#9e9e9e" if str(lab).startswith("other (") else color) for lab in labels]
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
    _legend_outside(ax, k)
    ax.grid(axis="x", alpha=0.3)
    return fig


def _label(r: dict) -> str:
    return f"{r['group']} / {r['group2']}" if "group2" in r else str(r["group"])


_ADDITIVE = ("gpu_hours", "util_weighted_gpu_hours", "idle_gpu_hours", "measured_gpu_hours",
             "no_summary_gpu_hours", "jobs")


def _merge(rows: list[dict], keys: tuple[str, ...], shares: tuple[str, ...] = ()) -> dict:
    """One row standing for ``rows``: additive ``keys`` summed (None as 0), ``shares``
    (fractions of jobs) weighted by jobs."""
    out: dict = {k: sum(r.get(k) or 0 for r in rows) for k in keys}
    jobs = sum(r.get("jobs") or 0 for r in rows)
    for k in shares:
        out[k] = sum((r.get(k) or 0) * (r.get("jobs") or 0) for r in rows) / jobs if jobs else 0.0
    return out


def top_n(rows: list[dict], key: str, keys: tuple[str, ...], shares: tuple[str, ...] = (),
          n: int = MAX_GROUPS) -> list[tuple[str, dict]]:
    """``(label, row)`` of the ``n`` largest groups by ``key`` and, when there are more,
    one ``other (K groups)`` row merging the rest, so a chart shows every job. Rows of a
    bucketed table (``period``) are first merged per group."""
    merged: dict[str, list[dict]] = {}
    for r in rows:
        merged.setdefault(_label(r), []).append(r)
    items = [(lab, rs[0] if len(rs) == 1 and "period" not in rs[0] else _merge(rs, keys, shares))
             for lab, rs in merged.items()]
    items.sort(key=lambda it: -(it[1].get(key) or 0))
    if len(items) <= n:
        return items
    head, rest = items[:n - 1], items[n - 1:]
    return [*head, (f"other ({len(rest)} groups)", _merge([r for _, r in rest], keys, shares))]


def _over_time(series: dict, title: str):
    """Stacked bars of GPU-hours per period, top groups plus other, legend outside."""
    plt = _plt()
    periods = series["periods"]
    totals = sorted(series["groups"].items(), key=lambda kv: -sum(kv[1]))
    shown = totals[:MAX_GROUPS - 1] if len(totals) > MAX_GROUPS else totals
    rest = totals[len(shown):]
    lines = list(shown)
    if rest:
        lines.append((f"other ({len(rest)} groups)", [sum(v[i] for _, v in rest) for i in range(len(periods))]))
    fig, ax = plt.subplots(figsize=(9.0, 3.6))
    bottom = [0.0] * len(periods)
    cmap = plt.get_cmap("tab20")
    for i, (name, vals) in enumerate(lines):
        color = "#9e9e9e" if name.startswith("other (") else cmap(i % 20)
        ax.bar(range(len(periods)), vals, bottom=bottom, label=name, color=color)
        bottom = [a + b for a, b in zip(bottom, vals, strict=True)]
    step = max(1, len(periods) // 16)
    ax.set_xticks(range(0, len(periods), step))
    ax.set_xticklabels(periods[::step], rotation=45, ha="right")
    ax.set_ylabel("GPU-hours")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    return fig


def charts_svg(report: Report) -> list[str]:
    """Every chart of ``report`` as SVG documents: the per-group chart of its main table
    (top :data:`MAX_GROUPS` minus one plus "other") and, for the cost report with a
    usage series, GPU-hours over time."""
    out = []
    one = chart_svg(report)
    if one:
        out.append(one)
    if report.name == "cost" and report.series and report.series.get("groups"):
        first = report.by.split(",")[0]
        with _rc():
            out.append(_svg(_over_time(report.series, f"GPU-hours per {report.series['bucket']} and {first}")))
    return out


def chart_svg(report: Report) -> str | None:
    """An SVG document (text starting at ``<svg``) for ``report``'s main table, or None
    when it has no rows."""
    table = report.tables[0]
    if not table.rows:
        return None
    by = report.by.replace(",", " / ")
    bucketed = bool(table.rows) and "period" in table.rows[0]
    with _rc():
        if report.name == "cost":
            items = top_n(table.rows, "gpu_hours", ("gpu_hours", "jobs"))
            fig = _barh([i[0] for i in items], [("GPU-hours", [i[1]["gpu_hours"] or 0 for i in items], "#1e88e5")],
                        f"GPU-hours per {by}", "GPU-hours")
        elif report.name == "wait":
            if bucketed:
                return None  # percentiles of several buckets cannot be merged; the table has them
            rows = sorted(table.rows, key=lambda r: -(r.get("jobs") or 0))[:MAX_GROUPS]
            series = [(f"p{p}", [(r[f"p{p}_s"] or 0) / 3600.0 for r in rows], c)
                      for p, c in ((50, "#90caf9"), (90, "#1e88e5"), (99, "#0d47a1"))]
            more = len(table.rows) - len(rows)
            fig = _barh([_label(r) for r in rows], series,
                        f"Queue wait per {by}" + (f" (the {len(rows)} busiest; {more} more in the table)"
                                                  if more else ""), "hours")
        elif report.name == "failures":
            states = (*FAILURE_STATES, "OTHER")
            items = top_n(table.rows, "jobs", ("jobs",), tuple(f"{s}_share" for s in states))
            series = [(s, [i[1][f"{s}_share"] * 100 for i in items], _COLORS[s]) for s in states]
            fig = _barh([i[0] for i in items], series, f"Job outcomes per {by}", "% of jobs", stacked=True)
        elif report.name == "efficiency":
            items = top_n(table.rows, "gpu_hours", _ADDITIVE)
            rows = [i[1] for i in items]
            used = [r.get("util_weighted_gpu_hours") or 0 for r in rows]
            idle = [r.get("idle_gpu_hours") or 0 for r in rows]
            unused = [max(0.0, (r.get("measured_gpu_hours") or 0) - u - i) for r, u, i in zip(rows, used, idle, strict=True)]
            nosum = [r.get("no_summary_gpu_hours") or 0 for r in rows]
            fig = _barh([i[0] for i in items], [("used (util-weighted)", used, "#43a047"), ("idle GPUs", idle, "#e53935"),
                                                ("allocated, unused", unused, "#ffb300"),
                                                ("no summary", nosum, "#bdbdbd")],
                        f"GPU-hours per {by}", "GPU-hours", stacked=True)
        else:
            return None
        return _svg(fig)
