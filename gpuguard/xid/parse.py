"""Parse NVIDIA XID / SXid / "fallen off the bus" messages out of kernel-log text.

There is no library for this format; it is matched with ``re`` on the shapes seen in
``shared/corpus/xid-*.txt`` (real host output, issue pastes, driver-source examples):

* ``NVRM: Xid (PCI:0000:9b:00): 119, pid=2024380, name=nvidia-smi, Timeout ...``
* ``nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20034, Fatal, Link 48 LTSSM Fault Up``
* ``NVRM: GPU 0000:91:00.0: GPU has fallen off the bus.`` and the three-line
  ``NVRM: The NVIDIA GPU 0000:b3:00.0 / (PCI ID: ...) installed ... / fallen off the bus``

The Xid/SXid marker is searched in the line; the text before it must be a kernel-log
prefix (:mod:`gpuguard.xid.prefix`: structured sources need the message to start with
the marker, text files accept a grammar of real prefix tokens), else the line is
*rejected* and counted with its reason. The prefix is then read for a time stamp:

* none -> ``timestamp = monotonic_s = None``;
* ``[  123.456789]`` (dmesg, kmsg) -> ``monotonic_s`` (seconds since boot);
* ``1715929737.123456`` (``journalctl -o short-unix``; syslog-ng ``ts-format(unix)``
  without the fraction) -> ``timestamp`` (UTC epoch);
* ``[Sun Feb 23 16:24:18 2025]`` (``dmesg -T``/``--ctime``; also unbracketed, as syslog
  daemons print a ctime date; any English month-name date with its year: ``Dec 01 2026
  10:00:00``, syslog-ng ``2026 Dec  1 10:00:00``) -> ``timestamp``, read as
  the *local* time of the process parsing it (dmesg printed the host's local time;
  the prolog parses on that same host) unless ``UTC``/``GMT`` follows the time;
* ISO 8601 (``dmesg --time-format iso`` with its ``,usec`` separator, ``journalctl -o
  short-iso``/``short-iso-precise``, RFC 3339 syslog) -> ``timestamp``; a naive one is
  local time unless a zone follows it (``journalctl -o short-full``: ``UTC``, ``+04``);
* RFC 5424 with the NILVALUE ``-`` for its time -> ``timestamp = None`` (a printk stamp in
  the message still gives ``monotonic_s``);
* syslog ``Mon DD HH:MM:SS host kernel:`` has no year -> ``timestamp`` stays ``None``
  (guessing the year is wrong around New Year); a monotonic stamp after it is still read;
* third-party wrappers (``Xid errors on instance: ..., Error: <syslog line>``) are
  prefix tokens (:data:`gpuguard.xid.prefix.WRAPPERS`).

Odd cases, and what is done with them:

* ``pid='<unknown>'``, ``pid=<unknown>``, ``pid=<varies>`` (user edit) -> ``pid=None``;
  ``name=<unknown>`` -> ``process=None``. Process names may contain ``::`` or spaces
  (up to the next comma).
* No ``pid=`` at all (legacy 418 ``31, Ch 0000003a, intr ...``; XID 62 bare hex words;
  NVLink5 ``149, NETIR ...``; ``79, GPU has fallen off the bus.``) -> pid/process
  ``None``, the whole text after the code is the message. ``pid=`` without ``name=``
  (450-era) keeps the pid.
* The code is always the number right after ``): ``; ``caused by previous Xid N`` /
  ``critical error 79`` inside a message are never taken as a code.
* ``64, ...`` (user-truncated) -> an event for XID 64 whose message is ``...``: the
  code is what matters for the action.
* A lone ``...`` line (user elision) is an ordinary line and ignored.
* Multi-line records: a line that starts with white space and follows a line holding
  ``NVRM`` or ``SXid`` continues it (dmesg/journald print a multi-line kernel record
  that way; users re-wrap long lines that way). At most 8 continuation lines are
  joined; kernel stack-frame lines (``  func+0x1/0x2``, ``<TASK>``) never are. The
  message is the joined text (a leading ``NVRM:`` of each continuation dropped, single
  spaces); ``raw`` keeps the original lines joined by ``\\n``.
* MIG: ``(PCI:0000:01:00 GPU-I:05)`` -> ``mig_instance="GPU-I:05"`` (everything after
  the address inside the parentheses).
* Non-zero PCI domains (``0008:``, ``00000001:``) are normalised by
  :func:`gpuguard.model.pci_key` / :func:`~gpuguard.model.norm_pci`.
* A fallen-off-bus record whose previous *event* is an XID 79 (or another
  fallen-off-bus event) for the same GPU, within 10 s when both carry times, is the
  same incident: it is appended to that event's ``raw`` and creates no event.
* The three-line fallen-off-the-bus record split by a syslog reader into three lines
  with the same prefix is joined back (:func:`gpuguard.xid.grouping.rejoined`).
* SXid detail lines (message starting ``Severity `` or ``Data {``) belong to the
  report whose header line (``Fatal, Link ...``) the switch printed just before: they
  are appended to the ``raw`` of the most recent SXid event with the same switch and
  code (within 10 s when both carry times). With no such event (the header was cut
  off) the detail line is an event of its own.
* nvidia-fabricmanager's own log line for an NVSwitch error (``detected NVSwitch fatal
  error 20034 on fid 0 on NVSwitch pci bus id ...``) is an SXid event
  (:mod:`gpuguard.xid.fabricmanager`).
* User-written text inside a kernel record (the version string of ``NVRM: API
  mismatch``, which any program sets; an exec's file name, a mount option's name): a
  marker line inside it is rejected (:mod:`gpuguard.xid.client_text`); in a text log, so
  is an indented marker line with no prefix of its own, a later line of another record
  (:data:`gpuguard.xid.grouping.UNDER_RECORD_REASON`).
* A line that holds the Xid/SXid marker or "NVRM: ... fallen off the bus" but is not
  accepted (no PCI address, no numeric code, a prefix that is not a log prefix) counts
  in ``unparsed`` and in ``rejected`` by reason (first 5 kept in ``unparsed_samples`` /
  ``rejected_samples``): nothing with a marker is dropped silently. Every other line is
  ignored.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from gpuguard.model import norm_pci, pci_key
from gpuguard.xid.client_text import CLIENT_TEXT_REASON, ClientText  # noqa: F401 (CLIENT_TEXT_REASON: re-exported)
from gpuguard.xid.fabricmanager import fabric_manager_sxid
from gpuguard.xid.grouping import (  # noqa: F401 (UNDER_RECORD_REASON, MAX_CONTINUATION_LINES: re-exported)
    MAX_CONTINUATION_LINES,
    SXID_TRIGGER,
    UNDER_RECORD_REASON,
    XID_TRIGGER,
    records,
    rejoined,
)
from gpuguard.xid.prefix import check_prefix
from gpuguard.xid.stamps import prefix_times

#: Kinds of event.
KINDS = ("xid", "sxid", "fallen_off_bus")

#: Two records further apart than this (seconds, either clock) are never merged.
MERGE_WINDOW_S = 10.0
#: How many unparsable lines are kept as samples.
MAX_UNPARSED_SAMPLES = 5


@dataclass
class XidEvent:
    """One XID / SXid / fallen-off-bus event.

    ``pci_bus_id``: GPU as :func:`~gpuguard.model.pci_key` (``"0000:91:00"``); for an
    SXid the NVSwitch BDF with function, as :func:`~gpuguard.model.norm_pci`
    (``"0000:06:00.0"``). ``xid``: the XID code, the SXid code, or 79 for
    ``fallen_off_bus``. ``timestamp``: UTC epoch seconds or ``None``; ``monotonic_s``:
    seconds since boot or ``None``. ``line_no``: 1-based number of the first input line.
    """

    kind: str
    pci_bus_id: str
    xid: int
    pid: int | None
    process: str | None
    message: str
    timestamp: float | None
    monotonic_s: float | None
    mig_instance: str | None
    raw: str
    line_no: int
    #: the text file the event was read from when that file may hold user messages (a
    #: syslog file of all facilities): such events never drain (:mod:`gpuguard.health`)
    untrusted_source: str | None = None

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "pci_bus_id": self.pci_bus_id,
            "xid": self.xid,
            "pid": self.pid,
            "process": self.process,
            "message": self.message,
            "timestamp": self.timestamp,
            "monotonic_s": self.monotonic_s,
            "mig_instance": self.mig_instance,
            "raw": self.raw,
            "line_no": self.line_no,
            "untrusted_source": self.untrusted_source,
        }


@dataclass
class ParseResult:
    """``events`` in input order; ``unparsed``: number of NVRM Xid/SXid/fallen-off-bus
    records that could not be read; ``gpu_uuids``: ``pci_key -> "GPU-<uuid>"`` from
    ``NVRM: GPU at PCI:...: GPU-...`` lines (helps map events to GPUs)."""

    events: list[XidEvent] = field(default_factory=list)
    unparsed: int = 0
    unparsed_samples: list[str] = field(default_factory=list)
    gpu_uuids: dict[str, str] = field(default_factory=dict)
    #: reason -> number of marker lines rejected for it (sums to ``unparsed``)
    rejected: dict[str, int] = field(default_factory=dict)
    #: (line number, reason, text) of the first :data:`MAX_UNPARSED_SAMPLES` rejected lines
    rejected_samples: list[tuple[int, str, str]] = field(default_factory=list)

    def reject(self, line_no: int, why: str, text: str) -> None:
        """Count one marker line that is not accepted, with its reason."""
        self.unparsed += 1
        self.rejected[why] = self.rejected.get(why, 0) + 1
        if len(self.unparsed_samples) < MAX_UNPARSED_SAMPLES:
            self.unparsed_samples.append(text[:300])
            self.rejected_samples.append((line_no, why, text[:300]))

    def merge(self, other: ParseResult) -> None:
        """Add the result of the text that follows this one's (events in order, rejected
        counts and samples, GPU UUIDs)."""
        self.events += other.events
        self.unparsed += other.unparsed
        for why, n in other.rejected.items():
            self.rejected[why] = self.rejected.get(why, 0) + n
        room = MAX_UNPARSED_SAMPLES - len(self.unparsed_samples)
        self.unparsed_samples += other.unparsed_samples[:max(0, room)]
        self.rejected_samples += other.rejected_samples[:max(0, room)]
        self.gpu_uuids.update(other.gpu_uuids)

    def rejected_summary(self) -> str:
        """``"3 (not a kernel-log prefix: 'alice:' x2; no PCI address x1)"`` or ``"0"``."""
        if not self.unparsed:
            return "0"
        parts = [f"{why} x{n}" for why, n in sorted(self.rejected.items(), key=lambda kv: -kv[1])]
        return f"{self.unparsed} ({'; '.join(parts)})"


_HEX = "[0-9a-fA-F]"
_XID_RE = re.compile(r"NVRM:\s*Xid\s*\((?P<loc>[^)]*)\):\s*(?P<code>\d+)\b,?\s*(?P<rest>.*)$")
_SXID_RE = re.compile(r"\bSXid\s*\((?P<loc>[^)]*)\):\s*(?P<code>\d+)\b,?\s*(?P<rest>.*)$")
_FALLEN_RE = re.compile(r"fallen\s+off\s+the\s+bus", re.IGNORECASE)
_NVRM_RE = re.compile(r"NVRM:\s*")
_LOC_RE = re.compile(
    rf"^\s*(?:PCI:)?(?P<pci>{_HEX}{{1,8}}:{_HEX}{{1,2}}:{_HEX}{{1,2}}(?:\.[0-7])?)\s*(?P<extra>.*?)\s*$"
)
_BDF_IN_TEXT_RE = re.compile(
    rf"(?<![0-9a-fA-F:])(?:PCI:)?({_HEX}{{4,8}}:{_HEX}{{2}}:{_HEX}{{2}}(?:\.[0-7])?)(?![0-9a-fA-F])"
)
_PID_RE = re.compile(r"^pid=(?P<pid>'[^']*'|<[^>]*>|[^,\s]*)\s*(?:,\s*|$)")
_NAME_RE = re.compile(r"^name=(?P<name>'[^']*'|<[^>]*>|[^,]*?)\s*(?:,\s*|$)")
_GPU_UUID_RE = re.compile(
    rf"NVRM:\s*GPU at (?:PCI:)?(?P<pci>[0-9a-fA-F:.]+):\s*(?P<uuid>GPU-{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}})"
)


def _strip_placeholder(value: str) -> str | None:
    """``'<unknown>'`` / ``<unknown>`` / empty -> None; quotes removed otherwise."""
    v = value.strip()
    if len(v) >= 2 and v[0] == v[-1] == "'":
        v = v[1:-1].strip()
    if not v or (v.startswith("<") and v.endswith(">")):
        return None
    return v


def _split_pid_name(rest: str) -> tuple[int | None, str | None, str]:
    """Split ``pid=..., name=..., message`` into (pid, process, message)."""
    pid: int | None = None
    process: str | None = None
    m = _PID_RE.match(rest)
    if m:
        value = _strip_placeholder(m["pid"])
        pid = int(value) if value is not None and value.isdigit() else None
        rest = rest[m.end():]
        n = _NAME_RE.match(rest)
        if n:
            process = _strip_placeholder(n["name"])
            rest = rest[n.end():]
    return pid, process, rest.strip()


def _joined(lines: list[str]) -> str:
    parts = [lines[0].rstrip()]
    for cont in lines[1:]:
        text = cont.strip()
        if text.startswith("NVRM:"):
            text = text[5:].strip()
        parts.append(text)
    return " ".join(p for p in parts if p)


def _close_in_time(a: XidEvent, b: XidEvent) -> bool:
    if a.monotonic_s is not None and b.monotonic_s is not None:
        return abs(a.monotonic_s - b.monotonic_s) <= MERGE_WINDOW_S
    if a.timestamp is not None and b.timestamp is not None:
        return abs(a.timestamp - b.timestamp) <= MERGE_WINDOW_S
    return True


def _fm_record(text: str, raw: str, line_no: int, structured: bool) -> XidEvent | str | None:
    """The SXid event of a Fabric Manager error line, the reason it is not accepted, or
    None (:mod:`gpuguard.xid.fabricmanager`)."""
    fm = fabric_manager_sxid(text, structured)
    if not isinstance(fm, tuple):
        return fm
    pci, code, message, timestamp = fm
    return XidEvent(kind="sxid", pci_bus_id=norm_pci(pci), xid=code, pid=None, process=None, message=message,
                    timestamp=timestamp, monotonic_s=None, mig_instance=None, raw=raw, line_no=line_no)


def _parse_record(text: str, raw: str, line_no: int, structured: bool) -> XidEvent | str | None:
    """An event, ``None`` for an ordinary line, or the reason (one line) why a line
    holding an XID/SXid/fallen-off-the-bus marker is not accepted."""
    m = _XID_RE.search(text)
    if m or XID_TRIGGER.search(text):
        if not m:
            return "no '(PCI:...): <code>' after the Xid marker"
        why = check_prefix(text[: m.start()], structured)
        if why:
            return why  # the marker is inside someone's text, not the kernel's
        loc = _LOC_RE.match(m["loc"])
        if not loc:
            return f"not a PCI address: {m['loc'][:40]!r}"
        timestamp, mono = prefix_times(text[: m.start()])
        pid, process, message = _split_pid_name(m["rest"])
        return XidEvent(
            kind="xid",
            pci_bus_id=pci_key(loc["pci"]),
            xid=int(m["code"]),
            pid=pid,
            process=process,
            message=message,
            timestamp=timestamp,
            monotonic_s=mono,
            mig_instance=loc["extra"] or None,
            raw=raw,
            line_no=line_no,
        )
    m = _SXID_RE.search(text)
    if m or SXID_TRIGGER.search(text):
        if not m:
            return "no '(PCI:...): <code>' after the SXid marker"
        why = check_prefix(text[: m.start()], structured)
        if why:
            return why
        loc = _LOC_RE.match(m["loc"])
        if not loc:
            return f"not a PCI address: {m['loc'][:40]!r}"
        timestamp, mono = prefix_times(text[: m.start()])
        return XidEvent(
            kind="sxid",
            pci_bus_id=norm_pci(loc["pci"]),
            xid=int(m["code"]),
            pid=None,
            process=None,
            message=m["rest"].strip(),
            timestamp=timestamp,
            monotonic_s=mono,
            mig_instance=None,
            raw=raw,
            line_no=line_no,
        )
    if (fm := _fm_record(text, raw, line_no, structured)) is not None:
        return fm
    if _FALLEN_RE.search(text) and "NVRM" in text:
        nvrm = _NVRM_RE.search(text)
        if nvrm is None:
            return None  # "NVRM" without the kernel's "NVRM:": not a driver message
        why = check_prefix(text[: nvrm.start()], structured)
        if why:
            return why
        body = text[nvrm.end():]
        bdf = _BDF_IN_TEXT_RE.search(body)
        if not bdf:
            return "fallen off the bus without a PCI address"
        timestamp, mono = prefix_times(text[: nvrm.start()])
        return XidEvent(
            kind="fallen_off_bus",
            pci_bus_id=pci_key(bdf.group(1)),
            xid=79,
            pid=None,
            process=None,
            message=body.strip(),
            timestamp=timestamp,
            monotonic_s=mono,
            mig_instance=None,
            raw=raw,
            line_no=line_no,
        )
    return None


def _merge_target(event: XidEvent, events: list[XidEvent]) -> XidEvent | None:
    """The earlier event a duplicate/detail record belongs to (see module docstring)."""
    if not events:
        return None
    if event.kind == "fallen_off_bus":
        prev = events[-1]
        if prev.xid == 79 and prev.kind in ("xid", "fallen_off_bus") and prev.pci_bus_id == event.pci_bus_id:
            return prev if _close_in_time(prev, event) else None
        return None
    if event.kind == "sxid" and event.message.startswith(("Severity ", "Data {")):
        for prev in reversed(events):
            if prev.kind == "sxid" and prev.pci_bus_id == event.pci_bus_id and prev.xid == event.xid:
                return prev if _close_in_time(prev, event) else None
    return None


def parse_lines(lines: Iterable[str], *, structured: bool = False) -> ParseResult:
    """Parse kernel-log lines (with or without trailing newlines) into a
    :class:`ParseResult`. Never raises on odd input; see the module docstring for how
    each odd case is handled.

    ``structured``: the lines come from a structured source in the canonical
    ``[<seconds>] <message>`` form (:mod:`gpuguard.xid.kernel_log`), so the message must
    start with ``NVRM:`` / ``nvidia-nvswitchN:``; otherwise the text-prefix grammar of
    :mod:`gpuguard.xid.prefix` applies."""
    result = ParseResult()
    client: ClientText | None = None  # an open client-text window (gpuguard.xid.client_text)
    every = [False]  # set while a client-text window is open: every line is read
    for line_no, record, original, under in rejoined(records(lines), every):
        raw = "\n".join(original)
        text = _joined(record)
        uuid = _GPU_UUID_RE.search(text)
        if uuid:
            try:
                result.gpu_uuids[pci_key(uuid["pci"])] = uuid["uuid"]
            except ValueError:
                pass
        try:
            parsed = _parse_record(text, raw, line_no, structured)
        except Exception as e:  # one odd record must never stop the scan
            parsed = f"parser error: {type(e).__name__}"
        if under and not structured and parsed is not None:
            parsed = UNDER_RECORD_REASON
        if client is not None:
            reason = client.reason
            inside, client = client.step(record[0])
            if inside and parsed is not None:
                parsed = reason
        client = ClientText.head(text, structured) or client
        every[0] = client is not None
        if parsed is None:
            continue
        if isinstance(parsed, str):
            result.reject(line_no, parsed, text)
            continue
        target = _merge_target(parsed, result.events)
        if target is not None:
            target.raw += "\n" + parsed.raw
            continue
        result.events.append(parsed)
    return result


def has_marker(text: str) -> bool:
    """True when ``text`` holds an Xid/SXid marker or an NVRM fallen-off-the-bus message."""
    return bool(XID_TRIGGER.search(text) or SXID_TRIGGER.search(text)
                or (_FALLEN_RE.search(text) and "NVRM" in text))


def parse_text(text: str) -> ParseResult:
    """:func:`parse_lines` on a whole text (split on newlines)."""
    return parse_lines(text.split("\n"))
