"""``gpuguard xid`` commands: a thin layer over :mod:`gpuguard.xid.parse` and
:mod:`gpuguard.xid.catalog` (parse, classify, format)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from itertools import chain

import click

from gpuguard.xid.catalog import classify
from gpuguard.output import display_tz, emit, iso_time, output_options, table
from gpuguard.xid.logtext import parse_log
from gpuguard.xid.parse import ParseResult, XidEvent
from gpuguard.xid.filekind import not_a_log
from gpuguard.xid.stream import HEAD_BYTES, LogStream, StreamError, open_log, split_lines

#: CSV columns of ``xid scan --format csv`` (the JSON rows carry every field).
_CSV_HEADERS = ["time_iso", "monotonic_s", "pci_bus_id", "kind", "xid", "name", "pid", "process", "action",
                "severity", "message"]

#: Message column width in the table (characters).
MESSAGE_WIDTH = 60


class FileError(click.ClickException):
    """A one-line error about an input file; exit status 2 like a usage error."""

    exit_code = 2


def _checked_head(stream: LogStream) -> Iterator[bytes]:
    """``stream``'s (decompressed) chunks, after :func:`not_a_log` has judged the first
    :data:`~gpuguard.xid.stream.HEAD_BYTES` of them. Raises :class:`FileError` for a file
    that is not a kernel log ("no XID events" on a binary file would hide that it is the
    wrong file)."""
    chunks = stream.chunks()
    head: list[bytes] = []
    size = 0
    for chunk in chunks:
        head.append(chunk)
        size += len(chunk)
        if size >= HEAD_BYTES:
            break
    data = b"".join(head)
    if data[:2] in (b"\xff\xfe", b"\xfe\xff"):  # a UTF-16 copy (Windows tools): its NULs are text
        return _utf16_as_utf8(chain(head, chunks))
    nul_only = data and not data.strip(b"\x00")
    while nul_only:  # only NUL bytes so far: the whole file may be (a file zeroed by a crash)
        more = next(chunks, None)
        if more is None:
            break
        head.append(more)
        size += len(more)
        nul_only = not more.strip(b"\x00")
    if nul_only:
        raise FileError(f"{stream.name} holds only NUL bytes ({size} bytes), not a kernel log")
    why = not_a_log(data)
    if why:
        raise FileError(f"{stream.name} {why}")
    return chain(head, chunks)


def _utf16_as_utf8(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """UTF-16 bytes with a byte-order mark, re-encoded as UTF-8 chunk by chunk."""
    import codecs

    dec = codecs.getincrementaldecoder("utf-16")("replace")
    for chunk in chunks:
        yield dec.decode(chunk).encode("utf-8")
    yield dec.decode(b"", final=True).encode("utf-8")


def _scan(path: str) -> tuple[ParseResult, str | None]:
    """Parse ``path`` (``-``: stdin) as a stream, in constant memory whatever its size
    (:mod:`gpuguard.xid.stream`): a gzip file (logrotate's ``kern.log.2.gz``) is read
    decompressed ("no XID events" on compressed bytes would hide a real fault); a gzip
    stream that ends early gives the events before the cut and the problem. Raises
    :class:`FileError` for a file that cannot be read or is not a kernel log."""
    try:
        stream = open_log(path)
        try:
            result = parse_log(split_lines(_checked_head(stream)))
        finally:
            stream.close()
    except StreamError as exc:
        raise FileError(str(exc)) from None
    return result, stream.problem


def _time_text(event: XidEvent) -> str:
    if event.timestamp is not None:
        return iso_time(event.timestamp, display_tz()) or "-"
    if event.monotonic_s is not None:
        return f"+{event.monotonic_s:.6f}s"
    return "-"


def event_rows(result: ParseResult) -> list[dict]:
    """One JSON-ready dict per event: the event's fields, ``time_iso`` (ISO 8601 with
    offset in the display zone, :func:`gpuguard.output.iso_time`, or None)
    and the classification (``action``, ``severity``, ``name``, ``meaning``, ``source``)."""
    rows = []
    tz = display_tz()
    for event in result.events:
        c = classify(event)
        row = event.to_dict()
        row["time_iso"] = iso_time(event.timestamp, tz)
        row.update(action=c.action, severity=c.severity, name=c.name, meaning=c.meaning, source=c.source)
        rows.append(row)
    return rows


def _table(result: ParseResult) -> str:
    header = ("TIME", "PCI", "KIND", "XID", "NAME", "PID", "PROCESS", "ACTION", "MESSAGE")
    body = []
    for event in result.events:
        c = classify(event)
        msg = " ".join(event.message.split())
        if len(msg) > MESSAGE_WIDTH:
            msg = msg[: MESSAGE_WIDTH - 3] + "..."
        pci = event.pci_bus_id + (f" {event.mig_instance}" if event.mig_instance else "")
        body.append((
            _time_text(event), pci, event.kind, str(event.xid), c.name,
            "-" if event.pid is None else str(event.pid), event.process or "-", c.action, msg,
        ))
    return table(body, header, right=[False] * len(header))


@click.group()
def xid() -> None:
    """NVIDIA XID / SXid events in kernel logs."""


@xid.command()
@click.argument("file", default="-", metavar="[FILE|-]")
@output_options()
def scan(file: str, fmt: str) -> None:
    """Parse a kernel log (FILE, or stdin for -) and print its classified XID events.

    Reads dmesg, dmesg -T, dmesg --time-format iso, journalctl -k (text, or a
    saved `-o json` export: only the kernel's own entries count, _TRANSPORT=kernel with
    the kernel facility) and syslog text.
    The table shows time (UTC, or +seconds since boot), PCI id, kind, XID, name, pid,
    process, default action and the message. Every line holding an Xid/SXid marker that
    was not accepted is counted on stderr by reason (a prefix that is not a kernel-log
    prefix, no PCI address, no code), with the first few lines and their numbers.
    Any real log-prefix layout is read (:mod:`gpuguard.xid.prefix`). Exit status 0; 2
    when FILE cannot be read, is not a kernel log (binary data, an executable, an archive,
    xz/zstd/bzip2 data; one line naming the file and what it is), or is a gzip file that ends early (its events before the
    cut are printed, and the problem on stderr).
    """
    result, problem = _scan(file)
    if fmt != "text":
        emit(fmt, event_rows(result), headers=_CSV_HEADERS)
    elif result.events:
        click.echo(_table(result))
    else:
        click.echo("no XID events")
    click.echo(f"unparsed NVRM lines: {result.unparsed}", err=True)
    for why, n in sorted(result.rejected.items(), key=lambda kv: -kv[1]):
        click.echo(f"  {n} x {why}", err=True)
    for line_no, _why, sample in result.rejected_samples:
        click.echo(f"  line {line_no}: {sample}", err=True)
    if problem:
        click.echo(f"Error: {problem}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    xid()
