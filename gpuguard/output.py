"""The one CLI output layer: formats, times, numbers and tables for every command.

* **Output files.** :func:`output_file_options` gives a command ``-o/--output FILE`` and
  ``--force``; :func:`write_output_file` writes it (a new file unless ``--force``).
* **Formats.** :func:`output_options` gives a command ``--format text|json|csv`` (plus
  whatever extra formats it renders itself, e.g. ``html``) and ``--json`` as an alias of
  ``--format json`` (modelled on sqlite-utils' ``output_options``); :func:`emit` writes
  one result in the chosen format.
* **Times.** The store keeps UTC epoch seconds; every printed time, JSON included, is ISO
  8601 with its UTC offset, seconds precision, in the display zone
  (:func:`iso_time`, :func:`display_tz`): ``[display] timezone``, else ``[reports]
  timezone``, else ``$TZ``, else the system zone (``/etc/localtime``), else UTC.
* **Numbers.** Exact in JSON and CSV; rounded for people in text (:func:`human_number`:
  ``27070.4`` -> ``27070``, ``4.6031`` -> ``4.603``, never ``2.707e+04``).
* **Tables.** :func:`table` uses ``tabulate``; it wraps the widest text columns, then
  splits a still too wide table into parts that repeat its label columns, so the table
  fits the terminal (``$COLUMNS``, else the terminal's width when stdout is one;
  piped output is not wrapped, so ``grep``/``awk`` see whole rows).
* **Text** shows terminal control characters (ESC, C1, bidi overrides) in user-written
  values as escapes (:func:`printable`): a job name never drives the admin's terminal.
* **CSV cells** a spreadsheet would run as formulas are prefixed with ``'`` (OWASP "CSV
  Injection"): account, user and job names come from users.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import io
import json
import math
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime, tzinfo
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import click
import tabulate as tabulate_mod
from tabulate import tabulate

# tabulate pads every header by two spaces beyond its column's widest cell; with our
# two-space column gap that only widens tables past the terminal.
tabulate_mod.MIN_PADDING = 0

FORMATS = ("text", "json", "csv")


# -- formats -------------------------------------------------------------------------------
def output_options(formats: Sequence[str] = FORMATS, default: str = "text") -> Callable:
    """Click decorator: ``--format`` (``formats``, default ``default``) and ``--json`` (an
    alias of ``--format json``). The command receives one keyword, ``fmt``. ``--json``
    together with another ``--format`` is a usage error (exit 2)."""

    def deco(f: Callable) -> Callable:
        @functools.wraps(f)
        def wrapper(*args: Any, fmt: str, as_json: bool, **kwargs: Any) -> Any:
            if as_json:
                if fmt not in (default, "json"):
                    raise click.UsageError(f"--json and --format {fmt} contradict each other")
                fmt = "json"
            return f(*args, fmt=fmt, **kwargs)

        wrapper = click.option("--json", "as_json", is_flag=True, help="same as --format json")(wrapper)
        return click.option("--format", "fmt", type=click.Choice(list(formats)), default=default,
                            show_default=True, help="output format")(wrapper)

    return deco


def output_file_options(help_text: str = "write to FILE instead of stdout", *, required: bool = False) -> Callable:
    """Click decorator for every command that writes a file the command line names:
    ``-o/--output FILE`` (the command receives ``output``, ``None`` when not given) and
    ``--force`` (``force``: replace an existing file). Write it with
    :func:`write_output_file`, whose policy is :func:`gpuguard.inputs.write_output`'s."""

    def deco(f: Callable) -> Callable:
        f = click.option("--force", is_flag=True,
                         help="with -o: replace FILE if it exists (only a regular file you own; "
                              "never a symlink, FIFO, device or directory)")(f)
        return click.option("-o", "--output", metavar="FILE", required=required, help=help_text)(f)

    return deco


class OutputFileError(click.ClickException):
    """An ``-o FILE`` that was not written: ``Error: <one line naming the file>``, exit 2."""

    exit_code = 2


def write_output_file(path: str, data: str | bytes, *, force: bool) -> None:
    """Write ``data`` to the ``-o`` file ``path`` (:func:`gpuguard.inputs.write_output`:
    a new file unless ``force``, all or nothing, never through a symlink, never another
    user's file). Raises :class:`OutputFileError` (exit 2) when nothing was written."""
    from gpuguard.inputs import InputError, write_output

    try:
        write_output(path, data, force=force)
    except InputError as e:
        raise OutputFileError(str(e)) from None


def emit(fmt: str, data: Any, *, rows: list[dict[str, Any]] | None = None, headers: Sequence[str] | None = None,
         text: Callable[[], str] | None = None) -> None:
    """Print one result: ``json`` -> ``data`` as JSON; ``csv`` -> ``rows`` under ``headers``
    (default: ``data`` when it is a list of dicts, keys of its first row); ``text`` ->
    ``text()`` when given, else :func:`table` of ``rows``."""
    if fmt == "json":
        click.echo(to_json(data), nl=False)
        return
    if rows is None and isinstance(data, list):
        rows = data
    rows = rows or []
    headers = list(headers or (rows[0].keys() if rows else []))
    if fmt == "csv":
        click.echo(to_csv(rows, headers), nl=False)
    elif text is not None:
        click.echo(printable(text()))
    else:
        click.echo(table([[r.get(h) for h in headers] for r in rows], [h.upper() for h in headers]))


def _json_default(o: Any) -> Any:
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return dataclasses.asdict(o)
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    return str(o)


def to_json(data: Any) -> str:
    """``data`` as indented JSON (UTF-8 text, not ``\\u`` escapes) ending in a newline.
    Numbers are written exactly; NaN/inf become ``null`` (JSON has neither)."""
    return json.dumps(_finite(data), indent=2, ensure_ascii=False, default=_json_default) + "\n"


def _finite(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
_NUMBER_RE = re.compile(r"^[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?$", re.ASCII)


def csv_cell(v: Any) -> Any:
    """A value as a CSV cell: ``None`` empty; a string a spreadsheet would run as a formula
    prefixed with ``'``; numbers, and strings that are plain decimal numbers, as they are;
    lists and dicts as compact JSON."""
    if v is None:
        return ""
    if isinstance(v, (list, dict)):
        v = json.dumps(v, ensure_ascii=False, separators=(",", ":"), default=_json_default)
    if isinstance(v, str) and v.startswith(_FORMULA_START) and not _NUMBER_RE.match(v):
        return "'" + v
    return v


def to_csv(rows: Iterable[dict[str, Any]], headers: Sequence[str]) -> str:
    """One header line of ``headers``, one line per row (values exact, see :func:`csv_cell`)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(headers)
    for r in rows:
        w.writerow([csv_cell(r.get(h)) for h in headers])
    return buf.getvalue()


# -- times ---------------------------------------------------------------------------------
class ZoneError(ValueError):
    """An unknown time-zone name; ``str()`` names it."""


def resolve_zone(name: str | None = None) -> tzinfo:
    """``name`` (an IANA name such as ``Europe/Berlin`` or ``UTC``), else ``$TZ``, else
    ``/etc/localtime``, else UTC. Raises :class:`ZoneError` for an unknown ``name``."""
    if name:
        try:
            return ZoneInfo(name)
        except (ZoneInfoNotFoundError, ValueError):
            raise ZoneError(f"unknown timezone {name!r} (expected an IANA name such as Europe/Berlin)") from None
    env = os.environ.get("TZ", "").lstrip(":")
    if env:
        try:
            return ZoneInfo(env)
        except (ZoneInfoNotFoundError, ValueError):
            pass  # a POSIX TZ string like "CET-1CEST": fall through to the system zone
    try:
        target = os.path.realpath("/etc/localtime")
        if "/zoneinfo/" in target:
            return ZoneInfo(target.split("/zoneinfo/", 1)[1])
    except (ZoneInfoNotFoundError, ValueError, OSError):
        pass  # not a link into the zone database: read the file itself
    try:
        with open("/etc/localtime", "rb") as fh:
            return ZoneInfo.from_file(fh, key="localtime")
    except (OSError, ValueError):
        return ZoneInfo("UTC")


def zone_name(tz: tzinfo) -> str:
    """The IANA key of ``tz`` (``Europe/Berlin``), else its ``str()``."""
    return getattr(tz, "key", None) or str(tz)


def display_tz(cfg: Any = None) -> tzinfo:
    """The zone times are printed in: ``[display] timezone``, else ``[reports] timezone``
    of ``cfg`` (default: the running click command's config when it loads), else
    :func:`resolve_zone`'s fallbacks. An unknown configured name raises :class:`ZoneError`."""
    if cfg is None:
        ctx = click.get_current_context(silent=True)
        obj = getattr(ctx, "obj", None) if ctx else None
        try:
            cfg = obj.cfg if obj is not None and hasattr(obj, "cfg") else None
        except click.ClickException:
            cfg = None  # a broken config is reported by the commands that need it
    name = None
    if cfg is not None:
        name = _cfg_get(cfg, "display", "timezone") or _cfg_get(cfg, "reports", "timezone")
    return resolve_zone(name or None)


def _cfg_get(cfg: Any, section: str, key: str) -> Any:
    try:
        return cfg.get(section, key)
    except KeyError:
        return None


def iso_time(ts: float | None, tz: tzinfo | None = None) -> str | None:
    """UTC epoch seconds -> ISO 8601 with offset in ``tz`` (default UTC), seconds
    precision: ``2026-03-01T14:05:09+01:00``. None stays None."""
    if ts is None or isinstance(ts, bool):
        return None
    return datetime.fromtimestamp(ts, tz or UTC).isoformat(timespec="seconds")


def isoify(obj: Any, tz: tzinfo | None = None) -> Any:
    """Copy of ``obj`` (dicts/lists) with every number under a key ``at``, ``*_at`` or
    ``since`` made :func:`iso_time` in ``tz``: the store's epoch-second naming rule."""
    if isinstance(obj, dict):
        return {k: (iso_time(v, tz) if _is_time_key(k) and isinstance(v, (int, float)) else isoify(v, tz))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [isoify(v, tz) for v in obj]
    return obj


def _is_time_key(k: Any) -> bool:
    return isinstance(k, str) and (k in ("at", "since", "last_seen") or k.endswith("_at"))


# -- numbers and cells ---------------------------------------------------------------------
def human_number(v: float | int) -> str:
    """A number for people: integers as they are (no separators: pids, uids and job ids
    are integers too); floats by size — from 1000 up no decimals, from 100 one, from 1 up
    to three (trailing zeros dropped), below 1 three significant digits (``0.00123``).
    Never exponent notation (our choice: four significant digits is more than any GPU
    counter or step time is repeatable to). Reports format their own kinds (hours, money)
    with separators."""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    if not math.isfinite(v):
        return str(v)
    a = abs(v)
    if a >= 1000:
        return f"{v:.0f}"
    if a >= 100:
        s = f"{v:.1f}"
    elif a >= 1 or a == 0:
        s = f"{v:.3f}"
    else:
        digits = 2 - math.floor(math.log10(a))
        s = f"{v:.{min(digits, 12)}f}"
    return s.rstrip("0").rstrip(".") if "." in s else s


def cell(v: Any, tz: tzinfo | None = None) -> str:
    """A value as a text-table cell: None ``-``, bools ``yes``/``no``, numbers
    :func:`human_number`, lists comma-joined, everything else ``str()`` (control
    characters are escaped by :func:`table`, :func:`printable`)."""
    if v is None:
        return "-"
    if isinstance(v, (bool, int, float)):
        return human_number(v)
    if isinstance(v, (list, tuple)):
        return ", ".join(cell(x, tz) for x in v) or "-"
    return str(v)


#: Characters a terminal acts on rather than shows: C0 controls, DEL, C1 controls (ECMA-48:
#: ESC/CSI/OSC sequences set colours and titles, move the cursor, write the clipboard) and
#: the bidirectional overrides and isolates (Unicode TR #9; "Trojan Source", CVE-2021-42574)
#: that reorder what an admin reads.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str, keep: str = "\n\t") -> str:
    """``text`` with every terminal control character (:data:`_UNPRINTABLE`) but those in
    ``keep`` shown as a Python escape (``\\x1b``, ``\\u202e``), so a job name, comment or
    file name a user chose prints as what it is and never drives the admin's terminal."""
    def esc(m: re.Match[str]) -> str:
        c = m.group(0)
        return c if c in keep else (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")
    return _UNPRINTABLE.sub(esc, text)


def terminal_width() -> int | None:
    """Columns to fit text tables into: ``$COLUMNS``, else the terminal's width when
    stdout is a terminal, else None (piped output is not wrapped)."""
    env = os.environ.get("COLUMNS", "")
    if env.isascii() and env.isdigit() and int(env) > 20:
        return int(env)
    try:
        if sys.stdout.isatty():
            return shutil.get_terminal_size().columns
    except (AttributeError, ValueError, OSError):
        pass
    return None


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str], *, right: Sequence[bool] | None = None,
          width: int | None = -1, tz: tzinfo | None = None, total: Sequence[Any] | None = None) -> str:
    """An aligned text table (tabulate's ``simple`` style: header, dashes, rows). Cells go
    through :func:`cell` (strings given are kept). ``right``: per column, right-align
    (default: numeric columns right, text left). ``width``: columns to fit (default
    :func:`terminal_width`; None: no limit): the widest non-numeric columns are wrapped
    down to 12 characters, and a table still too wide is split into parts, one under the
    other, each repeating the leading label (non-numeric) columns. ``total``: a last row
    set off by a dashed line."""
    body = [[printable(c if isinstance(c, str) else cell(c, tz), keep="") for c in r] for r in rows]
    if total is not None:
        body.append([printable(c if isinstance(c, str) else cell(c, tz), keep="") for c in total])
    headers = [printable(h, keep="") for h in headers]
    ncol = len(headers)
    if right is None:
        right = [all(_numeric(r[i]) for r in rows if r[i] is not None) and any(r[i] is not None for r in rows)
                 for i in range(ncol)]
    if width == -1:
        width = terminal_width()
    maxw = _fit(body, list(headers), right, width) if width else None
    parts = _parts(body, list(headers), right, maxw, width) if width else [list(range(ncol))]
    out = []
    for cols in parts:
        part = [[r[i] for i in cols] for r in body]
        if total is not None:
            part.insert(len(part) - 1, tabulate_mod.SEPARATING_LINE)
        out.append(tabulate(part, headers=[headers[i] for i in cols], tablefmt="simple", disable_numparse=True,
                            colalign=["right" if right[i] else "left" for i in cols],
                            maxcolwidths=[maxw[i] for i in cols] if maxw else None))
    return "\n\n".join(out)


def _widths(body: list[list[str]], headers: list[str]) -> list[int]:
    return [max([len(headers[i])] + [max((len(x) for x in r[i].split("\n")), default=0) for r in body])
            for i in range(len(headers))]


def _parts(body: list[list[str]], headers: list[str], right: Sequence[bool], maxw: list[int | None] | None,
           width: int) -> list[list[int]]:
    """Column index groups that each fit ``width``, each starting with the label columns."""
    widths = [w if not maxw or maxw[i] is None else min(w, maxw[i]) for i, w in enumerate(_widths(body, headers))]
    if sum(widths) + 2 * (len(widths) - 1) <= width:
        return [list(range(len(headers)))]
    keep = 0
    while keep < len(headers) - 1 and not right[keep]:
        keep += 1
    keep = max(keep, 1)
    base = sum(widths[:keep]) + 2 * (keep - 1)
    if base >= width:
        keep, base = 1, widths[0]
    parts: list[list[int]] = []
    cur: list[int] = []
    used = base
    for i in range(keep, len(headers)):
        if cur and used + 2 + widths[i] > width:
            parts.append(list(range(keep)) + cur)
            cur, used = [], base
        cur.append(i)
        used += 2 + widths[i]
    parts.append(list(range(keep)) + cur)
    return parts


def _numeric(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fit(body: list[list[str]], headers: list[str], right: Sequence[bool], width: int) -> list[int | None] | None:
    widths = _widths(body, headers)
    total = sum(widths) + 2 * (len(widths) - 1)
    if total <= width:
        return None
    maxw: list[int | None] = [None] * len(widths)
    over = total - width
    wrappable = sorted((i for i in range(len(widths)) if not right[i] and widths[i] > 12), key=lambda i: -widths[i])
    for i in wrappable:
        cut = min(over, widths[i] - 12)
        maxw[i] = widths[i] - cut
        over -= cut
        if over <= 0:
            break
    return maxw
