"""Which text may stand before a kernel message's ``NVRM:`` / ``nvidia-nvswitchN:``.

Kernel messages can embed user-chosen text (a file name in "process 'x' launched '...'
with NULL argv", an audit ``name="..."``, a ``logger`` line in a syslog file), so an XID
marker anywhere in a line would let any user fake an XID. Two rules, one per kind of
source:

* **structured** sources (``/dev/kmsg`` records, ``journalctl -k -o json`` MESSAGE fields,
  raw ``dmesg -r`` records; :mod:`gpuguard.xid.kernel_log` turns each into the canonical
  line ``[<seconds since boot>] <message>``): the message itself must *start* with
  ``NVRM:`` or ``nvidia-nvswitchN:``. Nothing else may precede it.
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
  - ``1715929737.123456`` (``journalctl -o short-unix``);
  - ISO 8601 (``dmesg --time-format iso``, ``journalctl -o short-iso[-precise]``,
    RFC 3339 syslog), optionally with a weekday before and a zone name after
    (``journalctl -o short-full``: ``Fri 2024-05-17 07:08:57 UTC``);
  - syslog dates in any locale: ``May 19 07:08:57`` / ``Mai 19 ...`` / ``févr. 19 ...`` /
    ``19 мая ...`` / ``5月 19 ...`` / ``5월 19 ...``, optional microseconds
    (``journalctl -o short-precise``), optional weekday and year (unbracketed ctime);
  - ``HOST kernel:`` / ``kernel:`` / ``kernel[0]:`` (syslog, ``journalctl`` with and without
    ``--no-hostname``, a line pasted from a node's log with only ``kernel:`` left) and the
    RFC 5424 ``HOST kernel - - -`` header;
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
#: a syslog HOSTNAME: a name, or an IPv4/IPv6 address when the relay has no name for the
#: sender (RFC 5424 §6.2.4, RFC 3164 §4.1.2: "the IPv4 address or IPv6 address")
_HOST = r"(?:[0-9a-fA-F]*:[0-9a-fA-F:.]*[0-9a-fA-F.]|[\w.-]+)"

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
    ("facility", r"(?:[\w.-]+\s+)?kern\.[a-z]+:?(?=\s)"),
    ("bracket", r"\[[\w\s:.,+\-<>/]{0,60}\d[\w\s:.,+\-<>/]{0,60}\]:?"),
    # `journalctl -o short-unix`: seconds since the epoch with microseconds
    ("epoch", r"\d{9,11}\.\d{1,9}(?=\s)"),
    ("iso", rf"(?:{_W},?\s+)?\d{{4}}-\d\d-\d\d[T ]{_TIME}(?:Z|[+-]\d\d:?\d\d)?(?:\s+[A-Z]{{2,5}}(?=\s))?:?"),
    ("syslog_date", rf"(?:{_W},?\s+)?(?:{_W}\s+\d{{1,2}}\.?|\d{{1,2}}\.?\s+{_W}|{_CJK_MONTH}\s*\d{{1,2}}\s*[日일]?)"
                    rf"\s+{_TIME}(?:\s+\d{{4}}(?=\s))?"),
    # HOST APP-NAME PROCID MSGID STRUCTURED-DATA (RFC 5424 §6): "-" or one or more
    # SD-ELEMENTs whose quoted values may hold an escaped "]"; then the BOM a UTF-8 MSG
    # starts with (§6.4)
    ("rfc5424_kernel", rf'(?:{_HOST}\s+)?kernel\s+-\s+-\s+(?:-|(?:\[(?:[^\]"\\]|\\.|"(?:[^"\\]|\\.)*")*\])+)(?:\s*\ufeff)?'),
    # `kernel[0]:` only: the kernel logs as pid 0; `kernel[4242]:` is `logger -i -t kernel`
    ("host_kernel", rf"{_HOST}\s+kernel(?:\[0?\])?:"),
    ("kernel", r"kernel(?:\[0?\])?:"),
    ("nvswitch", r"nvidia-nvswitch\d+:"),
)
_COMPILED = tuple((name, re.compile(pat + r"\s*")) for name, pat in TOKENS)
#: More tokens than this is not a log prefix (every real layout above uses at most 7).
MAX_TOKENS = 10

#: The canonical prefix of a structured source's line: ``[<seconds since boot>] ``, after
#: the UTC time when the source knows it (journald's ``__REALTIME_TIMESTAMP``).
_STRUCTURED_RE = re.compile(
    r"(?:\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?[+-]\d\d:\d\d )?\[\s*\d+\.\d+\] (?:nvidia-nvswitch\d+: )?"
)


def text_prefix_tokens(prefix: str) -> tuple[list[str], str]:
    """Split a text line's ``prefix`` into token names. Returns ``(names, rest)``;
    ``rest`` is ``""`` when the whole prefix was read, else the text no token matched."""
    pos = len(prefix) - len(prefix.lstrip())
    names: list[str] = []
    while pos < len(prefix) and len(names) < MAX_TOKENS:
        for name, rx in _COMPILED:
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
