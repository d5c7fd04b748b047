"""Structured kernel-log records -> the canonical lines the XID parser reads.

A structured source (``/dev/kmsg``, ``journalctl -k -o json``, ``dmesg -r``) gives each
kernel message exactly as the kernel printed it; :func:`canonical_lines` turns one into
``[<seconds since boot>] <message>`` (with the UTC time in front when the source knows
it), continuation lines of a multi-line record indented. With those lines
:func:`gpuguard.xid.parse.parse_lines` ``(structured=True)`` requires ``NVRM:`` /
``nvidia-nvswitchN:`` to start the message (:mod:`gpuguard.xid.prefix`).
"""

from __future__ import annotations

import re

#: Characters of a line kept; the rest of a longer line is dropped (our choice: no real
#: log line comes near it: printk records are at most 1,024 bytes, ``PRINTKRB_RECORD_MAX``
#: in kernel/printk/internal.h, and rsyslog's ``maxMessageSize`` defaults to 8 KiB; a
#: file that is one 200 MB line took 6.5 min and 489 MB to scan, each chunk re-joined to
#: all the line before it).
MAX_LINE_CHARS = 65536


def log_lines(data: bytes) -> list[str]:
    """Log bytes as lines: split at ``\\n`` only (a trailing ``\\r`` dropped), runs of NUL
    bytes ending a line (blocks a crash left zero-filled must not glue the next kernel
    line to junk), each cut to :data:`MAX_LINE_CHARS`. ``str.splitlines`` would also split
    at U+2028, U+0085, form feed and the ASCII separators, which a user can put inside one
    syslog message (``logger $'hello\\u2028... kernel: NVRM: Xid ...'``) to make its tail
    read as a line of its own."""
    text = re.sub(rb"\x00+", b"\n", data).decode("utf-8", "replace")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [_cut(line[:-1] if line.endswith("\r") else line) for line in lines]


def _cut(line: str) -> str:
    return line if len(line) <= MAX_LINE_CHARS else line[:MAX_LINE_CHARS]


def canonical_lines(message: str, usec: int | None, iso: str | None = None) -> list[str]:
    """One kernel record as the lines :func:`gpuguard.xid.parse.parse_lines` reads with
    ``structured=True``: ``[<seconds since boot>] <message>`` (prefixed by the ISO 8601
    UTC time when the source knows it), continuation lines of a multi-line record
    indented. The message text is kept exactly, so a marker must start it."""
    parts = message.split("\n")
    stamp = f"[{usec // 1_000_000:5d}.{usec % 1_000_000:06d}] " if usec is not None else "[    0.000000] "
    if iso:
        stamp = f"{iso} {stamp}"
    return [stamp + parts[0]] + [" " * len(stamp) + p for p in parts[1:] if p.strip()]


#: ``dmesg -r``: ``<pri>[stamp] `` and, on kernels built with ``CONFIG_PRINTK_CALLER``, the
#: caller id util-linux prints after the stamp (``[ T1234] `` task, ``[ C3] `` CPU); it is
#: dmesg's field, not the kernel's message text
_DMESG_RAW_RE = re.compile(
    r"^<(?P<pri>\d{1,4})>(?:\[\s*(?P<sec>\d+)\.(?P<frac>\d+)\]\s?)?(?:\[\s*[TC]\d+\]\s?)?(?P<msg>.*)$")


def dmesg_canonical(raw_lines: list[str]) -> list[str]:
    """``dmesg -r`` lines (``<pri>[stamp] message``) -> canonical lines of the kernel
    facility only (``pri >> 3 == 0``; a userspace write to /dev/kmsg has facility user)."""
    out: list[str] = []
    keep = False
    for line in raw_lines:
        m = _DMESG_RAW_RE.match(line)
        if not m:
            if keep and line[:1] in (" ", "\t") and out:
                out.append(line)  # continuation of a multi-line kernel record
            continue
        keep = int(m["pri"]) >> 3 == 0
        if not keep:
            continue
        usec = int(m["sec"]) * 1_000_000 + int((m["frac"] + "000000")[:6]) if m["sec"] else None
        out.extend(canonical_lines(m["msg"], usec))
    return out


def not_kernel_entry(entry: dict) -> str | None:
    """Why a journal entry is not a message the kernel itself printed (one phrase), or
    None when it is: ``_TRANSPORT=kernel`` and no ``SYSLOG_FACILITY`` but 0. journald
    reads every /dev/kmsg record as ``_TRANSPORT=kernel``, also the ones a program wrote
    to /dev/kmsg (root, a privileged container, a service logging there), and records
    their facility (journald-kmsg.c dev_kmsg_record: ``SYSLOG_FACILITY=LOG_FAC(pri)``);
    the kernel gives every such write a facility other than kernel (printk.c
    devkmsg_write: "we enforce LOG_USER, to be able to reliably distinguish
    kernel-generated messages from userspace-injected ones"), as the kmsg and dmesg
    readers require (facility 0). Older journald sets SYSLOG_FACILITY only for
    non-kernel records."""
    if entry.get("_TRANSPORT") != "kernel":
        return f"journal entry not from the kernel (_TRANSPORT={entry.get('_TRANSPORT')})"
    facility = entry.get("SYSLOG_FACILITY")
    if facility is not None and facility != "0":
        return f"journal entry written to /dev/kmsg by a program (SYSLOG_FACILITY={facility})"
    return None


def _journal_message(value: object) -> str | None:
    """journald's MESSAGE: a string, or a list of byte values when it is not UTF-8."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(b, int) and 0 <= b < 256 for b in value):
        return bytes(value).decode("utf-8", "replace")
    return None


def journal_lines(entry: dict) -> list[str]:
    """The canonical lines of one kernel journal entry (see :func:`canonical_lines`)."""
    message = _journal_message(entry.get("MESSAGE"))
    if message is None:
        return []
    usec: int | None = None
    for key in ("_SOURCE_MONOTONIC_TIMESTAMP", "__MONOTONIC_TIMESTAMP"):
        v = entry.get(key)
        if isinstance(v, str) and v.isdigit():
            usec = int(v)
            break
    realtime = entry.get("__REALTIME_TIMESTAMP")
    iso = None
    if isinstance(realtime, str) and realtime.isdigit():
        from datetime import UTC, datetime

        try:  # a corrupt entry's time (year 3170843) loses the time, never the message
            iso = datetime.fromtimestamp(int(realtime) / 1e6, tz=UTC).isoformat()
        except (ValueError, OverflowError, OSError):
            iso = None
    return canonical_lines(message, usec, iso)
