"""Which text may stand before a kernel message's ``NVRM:`` / ``nvidia-nvswitchN:``.

Kernel messages can embed user-chosen text (a file name in "process 'x' launched '...'
with NULL argv", an audit ``name="..."``, a ``logger`` line in a syslog file), so an XID
marker anywhere in a line would let any user fake an XID. Two rules, one per kind of
source:

* **structured** sources (``/dev/kmsg`` records, ``journalctl -k -o json`` MESSAGE fields,
  raw ``dmesg -r`` records; :mod:`gpuguard.xid.kernel_log` turns each into the canonical
  line ``[<seconds since boot>] <message>``): the message itself must *start* with
  ``NVRM:`` or ``nvidia-nvswitchN:``, or a dev_printk device prefix then ``NVRM:``
  (``nvidia 0000:3b:00.0: NVRM: Xid ...``). Nothing else may precede it.
* **text** files (``xid scan FILE``, ``[xid] kernel_log = PATH``, pasted logs): the prefix
  must be a sequence of *prefix tokens* (:data:`TOKENS`), each one a piece of a real log
  layout. Tokens may come in any order, which covers every combination the tools below
  print without one fixed regular expression per layout:

  - ``<4>`` syslog priority (``dmesg -r``, RFC 5424 with its version ``<4>1``), kernel
    facility only (``<0>``..``<7>``): ``<13>`` (user.notice, what ``logger`` sends) or
    ``<12>`` (a user write to /dev/kmsg) says the line came from user space;
  - ``4,1234,5678901,-;`` a saved ``/dev/kmsg`` record (kernel facility only, as above);
    its ``SUBSYSTEM=``/``DEVICE=`` property lines are never joined to the message;
  - ``HOST`` may be a name or an IPv4/IPv6 address (``fe80::1 kernel:``);
  - ``kern  :warn  :`` (``dmesg -x``), ``ADDR: kern: LEVEL:`` (Talos ``talosctl dmesg``
    and other immutable/container OS readers), ``kern.warning`` (rsyslog templates);
  - bracketed stamps: ``[ 1234.5678]`` (dmesg), ``[Sun Feb 23 16:24:18 2025]``
    (``dmesg -T``), ``[May19 07:08]`` / ``[  +0.000123]`` (``dmesg -H``), ``[2025-...Z]:``
    (Talos); any bracket holding digits and time punctuation only;
  - ``1715929737.123456`` (``journalctl -o short-unix``), ``1715929737`` (syslog-ng
    ``ts-format(unix)``);
  - ISO 8601 (``dmesg --time-format iso``, ``journalctl -o short-iso[-precise]``,
    RFC 3339 syslog), optionally with a weekday before and then a zone name after
    (``journalctl -o short-full``: ``Fri 2024-05-17 07:08:57 UTC``, ``... +04``); with no
    weekday only ``UTC``/``GMT`` is a zone, so a HOSTNAME in capitals is never one;
  - syslog dates in any locale: ``May 19 07:08:57`` / ``Mai 19 ...`` / ``févr. 19 ...`` /
    ``19 мая ...`` / ``5月 19 ...`` / ``5월 19 ...``, optional microseconds
    (``journalctl -o short-precise``), optional weekday, a year after the day
    (``Dec 01 2026 10:00:00``), before the month (syslog-ng ``ts-format(full)``: ``2026 Dec
    1 10:00:00``) or after the time (unbracketed ctime), ``UTC``/``GMT`` after the time;
  - ``HOST kernel:`` / ``kernel:`` / ``kernel[0]:`` (syslog, ``journalctl`` with and without
    ``--no-hostname``, a line pasted from a node's log with only ``kernel:`` left) and the
    RFC 5424 header ``[-] HOST kernel PROCID MSGID SD`` (the NILVALUE ``-`` for an
    unknown time, PROCID ``-`` or the kernel's ``0``, any MSGID);
  - a dev_printk device prefix (``nvidia 0000:3b:00.0:``, ``pci 0000:3b:00.0:``) at the
    start or after the kernel's tag or stamp, never right after a date (there a user's
    ``logger -t 0000:3b:00.0`` tag would stand);
  - known monitoring-agent wrappers (:data:`WRAPPERS`);
  - for SXid, the ``nvidia-nvswitchN:`` device name.

  Anything else before the marker (``alice:``, ``audit: name="/tmp/``, ``hello``) makes the
  line *rejected*, with the reason naming the first text that is not a prefix token. A
  line with no prefix at all (a bare ``NVRM: Xid ...`` line, as pasted in bug reports) is
  accepted for triage; whether a text source may drain at all is decided by the caller
  (:mod:`gpuguard.health`: a text file that can hold user messages never drains).
"""

from __future__ import annotations

import re

#: Monitoring-agent wrappers seen around a kernel line, each with where it was seen.
WRAPPERS = (
    # Hugging Face m4-logs chronicles (AWS p4de alerting): "Xid errors on instance: HOST, Error: <syslog line>"
    r"Xid errors on (?:instance|node|host): [\w.:-]+, Error:",
)

_W = r"[^\W\d_]{2,12}\.?"  # a month or weekday word in any script ("May", "Mai", "févr.", "мая")
_CJK_MONTH = r"\d{1,2}\s*[月월]"
_TIME = r"\d{1,2}:\d\d:\d\d(?:[.,]\d+)?"
#: the zone journalctl -o short-full prints after the time (``UTC``, ``CET``, ``+04`` where
#: the zone has no abbreviation): only after a weekday, so a HOSTNAME in capitals (``GPUA``)
#: is never read as a zone when no weekday came first
_FULL_ZONE = r"(?:\s+(?:[A-Z]{2,5}|[+-]\d\d(?:\d\d)?)(?=\s))?"
#: a zone after a syslog date (grok's CISCOTIMESTAMP ``%{MONTH} %{MONTHDAY} %{YEAR} %{TIME}
#: %{TZ}``): the two names that are no host name and say the time exactly
_UTC_ZONE = r"(?:\s+(?:UTC|GMT)(?=\s))?"
_YEAR = r"\d{4}"
_ISO = rf"\d{{4}}-\d\d-\d\d[T ]{_TIME}(?:Z|[+-]\d\d:?\d\d)?"
#: a syslog HOSTNAME: a name, or an IPv4/IPv6 address when the relay has no name for the
#: sender (RFC 5424 §6.2.4, RFC 3164 §4.1.2: "the IPv4 address or IPv6 address")
_HOST = r"(?:[0-9a-fA-F]*:[0-9a-fA-F:.]*[0-9a-fA-F.]|[\w.-]+)"
#: dev_printk's device prefix (drivers/base/core.c ``__dev_printk``: ``"%s %s: ",
#: dev_driver_string(dev), dev_name(dev)``) for a PCI device: the driver, or the bus
#: (``pci``) when none is bound, then the device's ``DDDD:BB:DD.F`` name
DEVICE = r"[a-z][\w-]{0,31} [0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]:"

#: (name, pattern) of every prefix token; each is matched at the current position,
#: followed by optional white space.
TOKENS: tuple[tuple[str, str], ...] = (
    ("wrapper", "|".join(WRAPPERS)),
    # the kernel facility only: PRI = facility * 8 + severity (RFC 5424 §6.2.1) and the
    # kernel's facility is 0, so <0>..<7>; <13> is user.notice (`logger`), <12> a user
    # write to /dev/kmsg as `dmesg -r` prints it
    ("priority", r"<[0-7]>(?:1(?=\s))?"),
    # a saved /dev/kmsg record (`cat /dev/kmsg`): PRI,SEQ,USEC,FLAGS[,caller=..];
    # (Documentation/ABI/testing/dev-kmsg); kernel facility only, as above
    ("kmsg_record", r"[0-7],\d+,\d+,[^;\s]*;"),
    ("kern_level", r"(?:(?:\d{1,3}(?:\.\d{1,3}){3}|[0-9a-fA-F:]*:[0-9a-fA-F:]+|[\w.-]+):\s*)?kern\s*:\s*[a-z]+\s*:"),
    # ``HOST kern.warn`` before the tag (BusyBox syslogd, rsyslog templates); the colon form
    # only without a HOST: ``node01 kern.warn:`` is where a syslog line's tag stands, and
    # ``logger -t kern.warn`` writes it
    ("facility", r"(?:[\w.-]+\s+kern\.[a-z]+(?=\s)|kern\.[a-z]+:?(?=\s))"),
    ("bracket", r"\[[\w\s:.,+\-<>/]{0,60}\d[\w\s:.,+\-<>/]{0,60}\]:?"),
    # seconds since the epoch: `journalctl -o short-unix` (with microseconds), syslog-ng
    # ts-format(unix) (whole seconds, frac-digits() optional)
    ("epoch", r"\d{9,11}(?:\.\d{1,9})?(?=\s)"),
    ("iso", rf"(?:{_W},?\s+{_ISO}{_FULL_ZONE}|{_ISO}{_UTC_ZONE}):?"),
    # a date with a month name in any locale and order: [WEEKDAY] [YEAR] (MON DD | DD MON |
    # CJK) [YEAR] TIME [ZONE] [YEAR]. RFC 3164 ``Dec  1 10:00:00``; a year after the day
    # (``Dec 01 2026 10:00:00``, grok's CISCOTIMESTAMP) or first (syslog-ng ts-format(full):
    # ``2026 Dec  1 10:00:00``); ctime, unbracketed (``Tue Dec  1 10:00:00 2026``)
    ("syslog_date", rf"(?:{_W},?\s+)?(?:{_YEAR}\s+)?"
                    rf"(?:{_W}\s+\d{{1,2}}\.?|\d{{1,2}}\.?\s+{_W}|{_CJK_MONTH}\s*\d{{1,2}}\s*[日일]?)"
                    rf"(?:\s+{_YEAR})?\s+{_TIME}{_UTC_ZONE}(?:\s+{_YEAR}(?=\s))?"),
    # the RFC 5424 header after VERSION (§6): TIMESTAMP HOSTNAME APP-NAME PROCID MSGID
    # STRUCTURED-DATA, APP-NAME ``kernel``. TIMESTAMP is read by the ``iso`` token, or is
    # the NILVALUE ``-`` (a relay that did not know the time); HOSTNAME may be ``-``;
    # PROCID ``-`` or the kernel's pid 0 (as ``kernel[0]:``: another pid is
    # ``logger --rfc5424 -t kernel -i``); MSGID ``-`` or 1-32 printable characters;
    # STRUCTURED-DATA ``-`` or one or more SD-ELEMENTs whose quoted values may hold an
    # escaped "]"; then the BOM a UTF-8 MSG starts with (§6.4)
    ("rfc5424_kernel", rf"(?:-\s+)?(?:{_HOST}\s+)?kernel\s+(?:-|0)\s+[!-~]{{1,32}}\s+"
                       r'(?:-|(?:\[(?:[^\]"\\]|\\.|"(?:[^"\\]|\\.)*")*\])+)(?:\s*\ufeff)?'),
    # `kernel[0]:` only: the kernel logs as pid 0; `kernel[4242]:` is `logger -i -t kernel`
    ("host_kernel", rf"{_HOST}\s+kernel(?:\[0?\])?:"),
    ("kernel", r"kernel(?:\[0?\])?:"),
    ("nvswitch", r"nvidia-nvswitch\d+:"),
    # the device a driver printed its message for (dev_printk, dev_err...), before NVRM:
    ("device", DEVICE),
)
_COMPILED = tuple((name, re.compile(pat + r"\s*")) for name, pat in TOKENS)
#: The tokens a ``device`` may follow (or it starts the prefix, as ``dmesg -t`` prints it):
#: the kernel's own tag or stamp. Never right after a date, where a syslog line's HOSTNAME
#: and the writer's tag come: ``node01 0000:3b:00.0:`` is ``logger -t 0000:3b:00.0``.
_DEVICE_AFTER = frozenset({"priority", "kmsg_record", "kern_level", "bracket", "rfc5424_kernel", "host_kernel",
                           "kernel"})
#: More tokens than this is not a log prefix (every real layout above uses at most 7).
MAX_TOKENS = 10

#: The canonical prefix of a structured source's line: ``[<seconds since boot>] ``, after
#: the UTC time when the source knows it (journald's ``__REALTIME_TIMESTAMP``), then the
#: switch's name or the device a dev_printk message names, both the kernel's own text.
_STRUCTURED_RE = re.compile(
    r"(?:\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?[+-]\d\d:\d\d )?\[\s*\d+\.\d+\] "
    rf"(?:nvidia-nvswitch\d+: |{DEVICE} )?"
)


def text_prefix_tokens(prefix: str) -> tuple[list[str], str]:
    """Split a text line's ``prefix`` into token names. Returns ``(names, rest)``;
    ``rest`` is ``""`` when the whole prefix was read, else the text no token matched."""
    pos = len(prefix) - len(prefix.lstrip())
    names: list[str] = []
    while pos < len(prefix) and len(names) < MAX_TOKENS:
        for name, rx in _COMPILED:
            if name == "device" and names and names[-1] not in _DEVICE_AFTER:
                continue
            m = rx.match(prefix, pos)
            if m and m.end() > pos:
                names.append(name)
                pos = m.end()
                break
        else:
            break
    return names, prefix[pos:]


def check_prefix(prefix: str, structured: bool) -> str | None:
    """``None`` when ``prefix`` may stand before the marker, else the one-line reason."""
    if structured:
        if _STRUCTURED_RE.fullmatch(prefix):
            return None
        return "marker not at the start of the kernel message"
    _names, rest = text_prefix_tokens(prefix)
    if not rest:
        return None
    shown = rest.strip()
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return f"not a kernel-log prefix: {shown!r}"
