"""Render reports as text, CSV, JSON or one self-contained HTML file.

Shapes:

* **json**: ``{"generated_at": ISO, "timezone": NAME, "reports": [REPORT...]}``; a
  REPORT is ``{"report", "title", "since", "until" (ISO 8601 with offset), "since_epoch",
  "until_epoch", "by", "params", "notes", "tables": [{"name", "title", "columns":
  [{"key", "label", "kind"}], "rows": [{key: value}], "total": {key: value} | null}]}``.
  Numbers are raw: hours, seconds, money, shares as fractions 0..1; times (columns of
  kind ``time``) ISO 8601 with offset in the report zone, like every time gpuguard prints.
* **csv**: one header line of column keys, one line per row, then the ``TOTAL`` row.
  When the output holds more than one table (``wait``, ``all``), each table is preceded
  by a line ``# REPORT.TABLE`` and followed by an empty line. A text cell a spreadsheet
  would run as a formula (it starts with ``=``, ``+``, ``-``, ``@``, tab or CR: account
  and user names come from sacct, job comments from users) is written with a ``'``
  before it (OWASP "CSV Injection"); numbers, ``-2.5`` as text included, are not.
* **text**: aligned tables with human units (hours with 2 decimals, durations, %).
* **html**: jinja2 templates ``templates/*.j2`` with autoescaping on, each report's
  chart as inline SVG (:mod:`gpuguard.reports.charts`); no external resources.
"""

from __future__ import annotations

import csv
import io
import json
from datetime import datetime, tzinfo, UTC
from typing import Any

from gpuguard.output import csv_cell, iso_time, table, zone_name
from gpuguard.reports.queries import Column, Report, Table


def iso(ts: float | None, tz: tzinfo) -> str | None:
    """UTC epoch -> ISO 8601 with offset in ``tz`` (:func:`gpuguard.output.iso_time`)."""
    return iso_time(ts, tz)


def tz_name(tz: tzinfo) -> str:
    return zone_name(tz)


def duration(s: float | None) -> str:
    """Seconds -> ``45s``, ``12m30s``, ``3h05m``, ``2d04h``."""
    if s is None:
        return "-"
    s = round(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"


def fmt(v: Any, kind: str, tz: tzinfo) -> str:
    """A value for people (text and HTML tables). A missing GPU-hour or cost figure is
    ``unknown`` (the GPU count was not in the accounting), never a dash or 0."""
    if v is None:
        return "unknown" if kind in ("hours", "money") else "-"
    if kind == "hours":
        return f"{v:,.2f}"
    if kind == "money":
        return f"{v:,.2f}"
    if kind == "share":
        return f"{100 * v:.1f}%"
    if kind == "pct":
        return f"{v:.1f}"
    if kind == "seconds":
        return duration(v)
    if kind == "count":
        return f"{int(v):,}"
    if kind == "time":
        return datetime.fromtimestamp(v, tz).strftime("%Y-%m-%d %H:%M")
    return str(v)


#: Most columns of one HTML table; wider tables are split into parts that each repeat the
#: label columns (our choice: 10 columns of numbers fit an A4 page in portrait at 8 pt).
MAX_HTML_COLUMNS = 10
_LABEL_KEYS = ("period", "group", "group2", "job_id")


def split_columns(columns: list[Column], limit: int = MAX_HTML_COLUMNS) -> list[list[int]]:
    """Column indexes of each part of a table: the leading label columns (period, group
    keys, job id) in every part, the others in runs of ``limit - labels``."""
    labels = [i for i, c in enumerate(columns) if c.key in _LABEL_KEYS]
    rest = [i for i in range(len(columns)) if i not in labels]
    if len(columns) <= limit or not rest:
        return [list(range(len(columns)))]
    n = max(1, limit - len(labels))
    return [labels + rest[k:k + n] for k in range(0, len(rest), n)]


def total_cells(t: Table, tz: tzinfo) -> list[str]:
    """The TOTAL row's cells: ``TOTAL`` in the first column, the other label columns
    (period, second group key) blank."""
    out = []
    for i, c in enumerate(t.columns):
        if c.key in ("period", "group", "group2"):
            out.append("TOTAL" if i == 0 else "")
        else:
            out.append(fmt(t.total.get(c.key), c.kind, tz))
    return out


# --- json -------------------------------------------------------------------------------
def _cells(row: dict[str, Any] | None, cols: list[Column], tz: tzinfo) -> dict[str, Any] | None:
    """A row for JSON/CSV: values exact, ``time`` columns as ISO 8601 with offset."""
    if row is None:
        return None
    return {c.key: (iso(row.get(c.key), tz) if c.kind == "time" else row.get(c.key)) for c in cols}


def _table_doc(t: Table, tz: tzinfo) -> dict[str, Any]:
    return {"name": t.name, "title": t.title,
            "columns": [{"key": c.key, "label": c.label, "kind": c.kind} for c in t.columns],
            "rows": [_cells(r, t.columns, tz) for r in t.rows], "total": _cells(t.total, t.columns, tz)}


def report_doc(r: Report, tz: tzinfo) -> dict[str, Any]:
    return {"report": r.name, "title": r.title, "since": iso(r.since, tz), "until": iso(r.until, tz),
            "since_epoch": r.since, "until_epoch": r.until, "by": r.by, "params": r.params, "notes": r.notes,
            "tables": [_table_doc(t, tz) for t in r.tables]}


def to_json(reports: list[Report], tz: tzinfo, generated_at: float) -> str:
    doc = {"generated_at": iso(generated_at, tz), "timezone": tz_name(tz),
           "reports": [report_doc(r, tz) for r in reports]}
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


# --- csv --------------------------------------------------------------------------------
def to_csv(reports: list[Report], tz: tzinfo) -> str:
    tables = [(r, t) for r in reports for t in r.tables]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    many = len(tables) > 1
    for r, t in tables:
        keys = [c.key for c in t.columns]
        if many:
            buf.write(f"# {r.name}.{t.name}\n")
        w.writerow(keys)
        for row in [*t.rows, *([t.total] if t.total is not None else [])]:
            cells = _cells(row, t.columns, tz)
            w.writerow([csv_cell(cells[k]) for k in keys])
        if many:
            buf.write("\n")
    return buf.getvalue()


# --- text -------------------------------------------------------------------------------
def _text_table(t: Table, tz: tzinfo) -> str:
    cols: list[Column] = t.columns
    if not t.rows:
        return table([], [c.label for c in cols]) + "\n(no jobs)"
    body = [[fmt(r.get(c.key), c.kind, tz) for c in cols] for r in t.rows]
    total = total_cells(t, tz) if t.total is not None else None
    return table(body, [c.label for c in cols], right=[c.kind != "text" for c in cols], total=total)


def to_text(reports: list[Report], tz: tzinfo) -> str:
    parts = []
    for r in reports:
        parts.append(f"== {r.title}: {iso(r.since, tz)} .. {iso(r.until, tz)} ({tz_name(tz)}) ==")
        for t in r.tables:
            parts.append(f"\n{t.title}\n" + _text_table(t, tz))
        if r.notes:
            parts.append("\n" + "\n".join(f"note: {n}" for n in r.notes))
        parts.append("")
    return "\n".join(parts) + "\n"


# --- html -------------------------------------------------------------------------------
def _env():
    import jinja2

    env = jinja2.Environment(loader=jinja2.PackageLoader("gpuguard.reports", "templates"),
                             autoescape=True, undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True)
    return env


def to_html(reports: list[Report], tz: tzinfo, generated_at: float, *, charts: bool = True) -> str:
    """One self-contained HTML page. Every value from the data (account, user, job
    names...) passes through jinja2 autoescaping; only the chart SVG, produced by
    matplotlib with its own XML escaping, is inserted as markup."""
    from markupsafe import Markup

    from gpuguard.reports.charts import charts_svg

    view = []
    for r in reports:
        svgs = charts_svg(r) if charts else []
        tables = []
        for t in r.tables:
            rows = [[fmt(row.get(c.key), c.kind, tz) for c in t.columns] for row in t.rows]
            total = total_cells(t, tz) if t.total is not None and t.rows else None
            tables.append({"title": t.title, "rows": rows,
                           "parts": [{"columns": [t.columns[i] for i in idx],
                                      "rows": [[row[i] for i in idx] for row in rows],
                                      "total": [total[i] for i in idx] if total else None}
                                     for idx in split_columns(t.columns)]})
        view.append({"name": r.name, "title": r.title, "since": iso(r.since, tz), "until": iso(r.until, tz),
                     "by": r.by, "notes": r.notes, "tables": tables,
                     "charts": [Markup(x) for x in svgs]})
    return _env().get_template("report.html.j2").render(
        reports=view, generated_at=iso(generated_at, tz), timezone=tz_name(tz),
        window=(iso(reports[0].since, tz), iso(reports[0].until, tz)) if reports else ("", ""),
    )


def render(reports: list[Report], fmt_name: str, tz: tzinfo, generated_at: float | None = None) -> str:
    """Dispatch on ``fmt_name`` (``text``, ``csv``, ``json``, ``html``)."""
    gen = datetime.now(UTC).timestamp() if generated_at is None else generated_at
    if fmt_name == "json":
        return to_json(reports, tz, gen)
    if fmt_name == "csv":
        return to_csv(reports, tz)
    if fmt_name == "html":
        return to_html(reports, tz, gen)
    return to_text(reports, tz)
