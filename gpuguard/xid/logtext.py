"""A kernel log given as text (a file, stdin, ``[xid] kernel_log``) -> XID events:
:func:`gpuguard.xid.parse.parse_lines`, except that a saved ``journalctl -o json`` export
is recognised and read as the structured source it is."""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from itertools import chain

from gpuguard.xid.parse import ParseResult, has_marker, parse_lines
from gpuguard.xid.records import is_journal_entry, journal_export


def parse_log(lines: Iterable[str], *, structured: bool = False) -> ParseResult:
    """:func:`parse_lines` for a log given as text (``lines`` may be a stream, read
    once), except that a saved ``journalctl -o json`` export (first non-blank line a
    journal entry) is read as the structured source it is
    (:func:`gpuguard.xid.records.journal_export`); event ``line_no`` is the export's."""
    it = iter(lines)
    head: list[str] = []
    if not structured:
        for line in it:
            head.append(line)
            if line.strip():
                break
    if structured or not head or not is_journal_entry(head[-1]):
        return parse_lines(chain(head, it), structured=structured)
    others: list[tuple[int, str, str]] = []
    origin = array("q")

    def canonical() -> Iterable[str]:
        for n, line in journal_export(enumerate(chain(head, it), 1), others, has_marker):
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
