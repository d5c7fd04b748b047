"""Kernel-log text lines grouped into records, as :func:`gpuguard.xid.parse.parse_lines`
reads them: a container log's envelope taken off (:func:`unwrapped`), a line and the
indented lines that continue it (:func:`records`), the driver's
three-line fallen-off-the-bus record rejoined when a syslog reader split it
(:func:`rejoined`), and which indented marker lines are a later line of another kernel
record (:data:`UNDER_RECORD_REASON`)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator

_HEX = "[0-9a-fA-F]"
XID_TRIGGER = re.compile(r"NVRM:\s*Xid\b")
SXID_TRIGGER = re.compile(r"\bSXid\s*\(")

#: Most continuation lines joined to one record.
MAX_CONTINUATION_LINES = 8

#: words of the non-NVRM client-text heads (:data:`gpuguard.xid.client_text.CLIENT_TEXT_HEADS`)
_USER_TEXT_WORDS_RE = re.compile(r"' launched '|Unknown parameter '|failed to resolve '")
_SGR_RE = re.compile(r"\x1b\[[0-9;]*m")
_STACK_FRAME_RE = re.compile(r"^\s*(?:\?\s+)?(?:[\w.$]+\+0x[0-9a-fA-F]+/0x[0-9a-fA-F]+|</?\w+>)")

#: an indented line whose marker has nothing but white space before it: no log prefix
#: of its own (see :data:`UNDER_RECORD_REASON`)
_BARE_MARKER_RE = re.compile(
    r"[ \t]+(?:NVRM:\s*Xid\b|nvidia-nvswitch\d+:\s*SXid\s*\(|SXid\s*\(|NVRM:.*fallen\s+off\s+the\s+bus)",
    re.IGNORECASE)
#: Why such a line is rejected in a text log: ``dmesg``, ``dmesg -T`` and ``journalctl``
#: print the later lines of a multi-line kernel record indented under its first line, with
#: no stamp or prefix of their own, and a record can hold text a user chose with a newline
#: in it (a file name: :mod:`gpuguard.xid.client_text`); the driver prints every Xid and
#: SXid as a record of its own (one printk per line), which these tools print with its
#: own stamp, so an indented marker line under another record is never the kernel's XID.
UNDER_RECORD_REASON = "an indented line under another kernel record (a later line of it), not a record of its own"

#: the device properties /dev/kmsg prints after a record (`` SUBSYSTEM=pci``,
#: `` DEVICE=+pci:0000:3b:00.0``; Documentation/ABI/testing/dev-kmsg): not message text
_KMSG_PROPERTY_RE = re.compile(r"^[ \t]+(?:SUBSYSTEM|DEVICE)=\S")

#: a container runtime's log line (CRI logging format, kubelet
#: ``pkg/kubelet/kuberuntime/logs``: ``TIMESTAMP STREAM TAG CONTENT``, RFC 3339 nano time,
#: stream ``stdout``/``stderr``, tag ``F`` a full line or ``P`` a partial one that the next
#: line of the same stream continues; containerd and CRI-O write /var/log/pods/... so)
_CRI_RE = re.compile(
    r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{1,9})?(?:Z|[+-]\d\d:\d\d) (?P<stream>stdout|stderr) (?P<tag>[FP])(?: |$)")
#: Most bytes of partial lines joined into one content line (containerd cuts a line at
#: 16 KiB, max_container_log_line_size; a printk record is at most 1,024 bytes).
MAX_PARTIAL_CHARS = 65536


def unwrapped(lines: Iterable[str]) -> Iterator[tuple[int, str]]:
    """(1-based line number, line) with a container log's envelope taken off, so a kernel
    log printed inside a container (``dmesg``, ``journalctl -k`` in a node agent's pod)
    reads as the tool printed it, indentation and repeated prefixes included: a CRI line
    (:data:`_CRI_RE`; ``P`` parts joined to the line that ends them) and a Docker
    ``json-file`` line (``{"log":"...\\n","stream":"stdout","time":"..."}``, the ``log``
    value; one without its closing newline is a partial line, as Docker splits lines of
    16 KiB). The envelope's time is the container's write time, not the kernel's; the
    content's own prefix gives the stamp. Any other line is passed through unchanged."""
    parts: dict[str, tuple[int, str]] = {}
    for n, line in enumerate(lines, 1):
        if n == 1 and line[:1] == "\ufeff":  # a file saved with a UTF-8 byte-order mark
            line = line[1:]
        m = _CRI_RE.match(line)
        if m:
            stream, partial = m["stream"], m["tag"] == "P"
            content = line[m.end():].rstrip("\r\n")
        elif line.startswith('{"log":'):
            try:
                obj = json.loads(line)
            except (ValueError, RecursionError):
                obj = None
            if not isinstance(obj, dict) or not isinstance(obj.get("log"), str):
                yield n, line
                continue
            stream = f"docker-{obj.get('stream')}"
            log = obj["log"]
            partial = not log.endswith("\n")
            content = log.rstrip("\r\n")
        else:
            yield n, line
            continue
        first, before = parts.pop(stream, (n, ""))
        content = (before + content)[:MAX_PARTIAL_CHARS]
        if partial:
            parts[stream] = (first, content)
            continue
        yield first, content
    for first, content in parts.values():  # a partial line the file ends on
        yield first, content


def records(lines: Iterable[str]) -> Iterable[tuple[int, list[str], bool]]:
    """Group input lines into records: (1-based first line number, lines, under), where
    ``under`` says the record's first line is an indented line holding only white space
    before its marker, in a text whose earlier lines are not all indented (a paste
    indented as a whole is not): how ``dmesg`` and ``journalctl`` print the later lines
    of a multi-line kernel record (see :data:`UNDER_RECORD_REASON`)."""
    current: list[str] | None = None
    start = 0
    under = False
    below = False  # a line that is not indented came before
    for n, line in unwrapped(lines):
        line = line.rstrip("\r\n")
        if n == 1 and line[:1] == "\ufeff":  # a file saved with a UTF-8 byte-order mark
            line = line[1:]
        if "\x1b" in line:  # a saved `dmesg --color=always`: colours around stamp and "NVRM: "
            line = _SGR_RE.sub("", line)
        is_continuation = (
            current is not None
            and line[:1] in (" ", "\t")
            and line.strip() != ""
            and len(current) <= MAX_CONTINUATION_LINES
            and ("NVRM" in current[0] or "SXid" in current[0])
            and not _STACK_FRAME_RE.match(line)
            and not _KMSG_PROPERTY_RE.match(line)
            # an indented line holding its own marker is a record of its own
            and not (XID_TRIGGER.search(line) or SXID_TRIGGER.search(line))
        )
        indented = line[:1] in (" ", "\t")
        if is_continuation:
            current.append(line)
            continue
        next_under = indented and below and _BARE_MARKER_RE.match(line) is not None
        if line and not indented:
            below = True
        if current is not None:
            yield start, current, under
        current, start, under = [line], n, next_under
    if current is not None:
        yield start, current, under


_GPU_HEAD_RE = re.compile(rf"NVRM:\s*The NVIDIA GPU {_HEX}{{4,8}}:{_HEX}{{2}}:{_HEX}{{2}}(?:\.[0-7])?\s*$")
_SPLIT_TAIL_RE = re.compile(r"NVRM:\s*(?:\(PCI ID:|fallen\s+off\s+the\s+bus)")


def rejoined(records: Iterable[tuple[int, list[str], bool]],
              every: list[bool]) -> Iterable[tuple[int, list[str], list[str], bool]]:
    """(line number, record, original lines, under); the driver's three-line "The NVIDIA GPU
    <BDF> / (PCI ID: ...) ... / fallen off the bus" record, printed by a syslog reader
    with the kernel's prefix repeated on each line (as the kernel's syslog interface
    does), joined back: only lines with exactly the head line's prefix (same stamp).
    Records that can hold no marker are left out unless ``every[0]`` is true (the caller
    sets it while a client-text window is open: those lines use up its bytes)."""
    head: tuple[int, list[str], list[str], bool, str] | None = None
    for line_no, rec, under in records:
        first = rec[0]
        if ("NVRM" not in first and "SXid" not in first and "detected NVSwitch" not in first
                and ("'" not in first or not _USER_TEXT_WORDS_RE.search(first))):
            # no marker can be in it (a record only continues an NVRM/SXid line) and it
            # opens no client-text window: skipped here, so an ordinary line costs a few
            # substring tests
            if head is not None:
                yield head[:4]
                head = None
            if every[0]:
                yield line_no, rec, rec, under
            continue
        if head is not None:
            tail = _SPLIT_TAIL_RE.search(rec[0])
            if len(rec) == 1 and tail and rec[0][: tail.start()] == head[4] and len(head[1]) < 3:
                head[1].append(" " * tail.start() + rec[0][tail.start():])
                head[2].append(rec[0])
                continue
            yield head[:4]
            head = None
        m = _GPU_HEAD_RE.search(rec[0])
        if len(rec) == 1 and m:
            head = (line_no, list(rec), list(rec), under, rec[0][: m.start()])
            continue
        yield line_no, rec, rec, under
    if head is not None:
        yield head[:4]
