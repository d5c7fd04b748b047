"""A kernel log given as text (a file, stdin, ``[xid] kernel_log``) -> XID events:
:func:`gpuguard.xid.parse.parse_lines`, except that a saved journald export (``journalctl
-o json`` / ``json-seq`` / ``export`` / ``verbose``) is recognised and read as the
structured source it is (:mod:`gpuguard.xid.journal_export`)."""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from itertools import chain

from gpuguard.xid.parse import ParseResult, has_marker, parse_lines
from gpuguard.xid.journal_export import export_format, kernel_lines


def parse_log(lines: Iterable[str], *, structured: bool = False) -> ParseResult:
    """:func:`parse_lines` for a log given as text (``lines`` may be a stream, read
    once), except that a saved journald export (told by its first non-blank line) is read
    as the structured source it is (:func:`gpuguard.xid.journal_export.kernel_lines`);
    event ``line_no`` is the export's (an entry's MESSAGE line)."""
    it = iter(lines)
    head: list[str] = []
    if not structured:
        for line in it:
            head.append(line)
            if line.strip():
                break
    fmt = None if structured or not head else export_format(head[-1])
    if fmt is None:
        return parse_lines(chain(head, it), structured=structured)
    others: list[tuple[int, str, str]] = []
    origin = array("q")

    def canonical() -> Iterable[str]:
        for n, line in kernel_lines(fmt, enumerate(chain(head, it), 1), others, has_marker):
            origin.append(n)
            yield line

    result = parse_lines(canonical(), structured=True)
    for event in result.events:
        event.line_no = origin[event.line_no - 1]
    for i, (line_no, why, text) in enumerate(result.rejected_samples):
        result.rejected_samples[i] = (origin[line_no - 1], why, text)
    for line_no, why, text in others:
        result.reject(line_no, why, text)
    return result
