"""``gpuguard xid`` commands: a thin layer over :mod:`gpuguard.xid.parse` and
:mod:`gpuguard.xid.catalog` (parse, classify, format)."""

from __future__ import annotations

import re
import sys

import click

from gpuguard.xid.catalog import classify
from gpuguard.output import display_tz, emit, iso_time, output_options, table
from gpuguard.xid.parse import ParseResult, XidEvent, parse_lines

#: CSV columns of ``xid scan --format csv`` (the JSON rows carry every field).
_CSV_HEADERS = ["time_iso", "monotonic_s", "pci_bus_id", "kind", "xid", "name", "pid", "process", "action",
                "severity", "message"]

#: Message column width in the table (characters).
MESSAGE_WIDTH = 60


class FileError(click.ClickException):
    """A one-line error about an input file; exit status 2 like a usage error."""

    exit_code = 2


def _read_lines(path: str) -> tuple[list[str], str | None]:
    """``(lines, problem)`` of ``path`` (``-``: stdin). A gzip file (logrotate's
    ``kern.log.2.gz``) is read decompressed, up to the input cap ("no XID events" on
    compressed bytes would hide a real fault); a gzip stream that ends early (a file cut
    by a full disk or a copy) gives the lines before the cut and the ``problem``."""
    if path == "-":
        return sys.stdin.read().splitlines(), None
    import zlib

    from gpuguard.inputs import MAX_INPUT_BYTES, InputError, read_input

    try:
        data = read_input(path)
    except InputError as exc:
        raise FileError(f"cannot read {exc}") from None
    problem = None
    if data[:2] == b"\x1f\x8b":
        d = zlib.decompressobj(wbits=31)  # gzip header; max_length caps a decompression bomb
        try:
            data = d.decompress(data, MAX_INPUT_BYTES)
        except zlib.error as exc:
            raise FileError(f"cannot read {path}: broken gzip data ({exc})") from None
        if d.unconsumed_tail:
            raise FileError(f"cannot read {path}: more than {MAX_INPUT_BYTES} bytes decompressed")
        if not d.eof:
            problem = f"{path}: gzip data ends early (truncated file); the events before the cut are shown"
    # a syslog file written through a crash holds runs of NUL bytes where unflushed blocks
    # were; they end a line, they do not hide the lines after them
    return re.sub(rb"\x00+", b"\n", data).decode("utf-8", errors="replace").splitlines(), problem


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

    Reads dmesg, dmesg -T, dmesg --time-format iso, journalctl -k and syslog text.
    The table shows time (UTC, or +seconds since boot), PCI id, kind, XID, name, pid,
    process, default action and the message. Every line holding an Xid/SXid marker that
    was not accepted is counted on stderr by reason (a prefix that is not a kernel-log
    prefix, no PCI address, no code), with the first few lines and their numbers.
    Any real log-prefix layout is read (:mod:`gpuguard.xid.prefix`). Exit status 0; 2
    when FILE cannot be read, or is a gzip file that ends early (its events before the
    cut are printed, and the problem on stderr).
    """
    lines, problem = _read_lines(file)
    result = parse_lines(lines)
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
