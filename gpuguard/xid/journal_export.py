"""A saved journald export read as the structured source it is: ``journalctl -o json`` /
``-o json-seq`` (one JSON entry per line), ``-o json-pretty`` (each entry a ``{`` line,
indented fields, a ``}`` line), ``-o export`` (``KEY=value`` lines, a blank
line between entries) and ``-o verbose`` (a header line per entry, ``    KEY=value``
fields). Only the kernel's own entries count (:func:`gpuguard.xid.records.not_kernel_entry`:
``_TRANSPORT=kernel``, facility kernel): a ``logger -t kernel`` entry in the same export
(``_TRANSPORT=syslog``) or a program's write to /dev/kmsg is told apart exactly as the
live ``journalctl`` source does (:func:`gpuguard.xid.kernel_log.read_journalctl`).

``-o export`` writes a field that is not plain text (binary, or holding a newline) as
``KEY`` then its length in 8 raw bytes: such a field is not read (an NVRM message is
one line of text).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

from gpuguard.inputs import json_loads
from gpuguard.xid.records import _journal_message, journal_lines, not_kernel_entry

_FIELD_RE = re.compile(r"(?P<key>[A-Z0-9_]+)=(?P<value>.*)")
#: ``journalctl -o verbose``'s entry header: the time, then the cursor in brackets
_VERBOSE_HEAD_RE = re.compile(r"\w{3} \d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \S+ \[s=[0-9a-f]+;")

#: (line number, entry or None for a line that is not one, the line's text)
Item = tuple[int, "dict | None", str]


def _json_entry(line: str) -> dict | None:
    """One ``-o json`` (or ``json-seq``: a leading RS byte) line as a dict holding
    ``MESSAGE`` or ``__CURSOR``, else None."""
    text = line.strip().lstrip("\x1e")
    if not text.startswith("{"):
        return None
    try:
        entry = json_loads(text)
    except ValueError:
        return None
    if isinstance(entry, dict) and ("MESSAGE" in entry or "__CURSOR" in entry):
        return entry
    return None


def export_format(first_line: str) -> str | None:
    """``"json"``, ``"json-pretty"``, ``"export"``, ``"verbose"`` or None (not a journal export), from the
    first non-blank line."""
    if _json_entry(first_line) is not None:
        return "json"
    if first_line.rstrip() == "{":
        return "json-pretty"
    if first_line.startswith("__CURSOR="):
        return "export"
    if _VERBOSE_HEAD_RE.match(first_line):
        return "verbose"
    return None


def _json_items(lines: Iterable[tuple[int, str]]) -> Iterator[Item]:
    for n, line in lines:
        if line.strip():
            yield n, _json_entry(line), line


#: Most lines of one ``-o json-pretty`` entry (our choice: an entry has a few dozen fields;
#: a file that never closes its brace is not held in memory whole)
MAX_PRETTY_LINES = 4096


def _pretty_items(lines: Iterable[tuple[int, str]]) -> Iterator[Item]:
    """Entries of ``-o json-pretty``: from a ``{`` line to the next ``}`` line (journalctl
    puts both at the start of a line), each at its first line; a block that is not a
    JSON object with ``MESSAGE``/``__CURSOR`` yields its lines as non-entries."""
    block: list[tuple[int, str]] = []
    for n, line in lines:
        if not block:
            if line.rstrip() == "{":
                block.append((n, line))
            elif line.strip():
                yield n, None, line
            continue
        block.append((n, line))
        if line.rstrip() == "}" or len(block) >= MAX_PRETTY_LINES:
            entry = _json_entry(" ".join(x for _, x in block)) if line.rstrip() == "}" else None
            if entry is not None:
                yield block[0][0], entry, ""
            else:
                yield from ((k, None, x) for k, x in block)
            block = []
    yield from ((k, None, x) for k, x in block)


def _field_items(lines: Iterable[tuple[int, str]], verbose: bool) -> Iterator[Item]:
    """Entries of ``-o export`` / ``-o verbose``, each at its MESSAGE line (else its
    first), and the lines that are not fields."""
    entry: dict[str, str] = {}
    at = 0
    for n, line in lines:
        ends = bool(_VERBOSE_HEAD_RE.match(line)) if verbose else not line.strip()
        if ends:
            if entry:
                yield at, entry, entry.get("MESSAGE", "")
            entry, at = {}, 0
            continue
        m = _FIELD_RE.fullmatch(line[4:] if verbose and line.startswith("    ") else line)
        if m is None:
            if line.strip():
                yield n, None, line
            continue
        entry[m["key"]] = m["value"]
        if m["key"] == "MESSAGE" or not at:
            at = n
    if entry:
        yield at, entry, entry.get("MESSAGE", "")


def kernel_lines(fmt: str, lines: Iterable[tuple[int, str]], others: list[tuple[int, str, str]],
                 keep: Callable[[str], bool]) -> Iterator[tuple[int, str]]:
    """Read ``(line number, line)`` pairs of an export in format ``fmt``
    (:func:`export_format`). Yields ``(line number, canonical line)``
    (:func:`gpuguard.xid.records.canonical_lines`) of the kernel's own entries
    (:func:`~gpuguard.xid.records.not_kernel_entry`); appends ``(line number, reason, text)`` to ``others`` for every
    other entry or line whose text ``keep`` accepts."""
    if fmt == "json":
        items = _json_items(lines)
    elif fmt == "json-pretty":
        items = _pretty_items(lines)
    else:
        items = _field_items(lines, fmt == "verbose")
    for n, entry, text in items:
        if entry is None:
            if keep(text):
                others.append((n, f"not a journal entry in a journalctl -o {fmt} export", text))
            continue
        why = not_kernel_entry(entry)
        if why:
            message = _journal_message(entry.get("MESSAGE")) or ""
            if keep(message):
                others.append((n, why, message))
            continue
        for out in journal_lines(entry):
            yield n, out
