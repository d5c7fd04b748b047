"""Text a user program chose, printed by the NVIDIA driver inside a multi-line NVRM
record: a marker line in it is not the kernel's.

The driver prints some text a user
program chose inside a multi-line NVRM record (:data:`CLIENT_TEXT_HEADS`: the client's
version string in ``NVRM: API mismatch: the client has the version %s, but``, 63
bytes, which any program that opens /dev/nvidiactl sets). A syslog reader
(``/proc/kmsg``: rsyslog's imklog, ``dmesg -S``) repeats the record's prefix on each of
its lines, ``dmesg`` indents them, ``dmesg -t`` prints them bare, so a version string
``1\nNVRM: Xid (PCI:0000:3b:00): 79, ...`` reads as an XID line of its own. A marker
line that belongs to such a record (the head's printk stamp in its prefix, an indented
line, or the head's exact prefix) and starts within the client's bytes not yet used
is rejected ("inside the client-written text of an NVRM message"). A real XID is a
record of its own and comes after the head's fixed tail (three driver lines, over 150
bytes), so it is never inside that window.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: NVRM messages that print text a user program chose, each with the most bytes of it:
#: (head pattern, bytes). Source: NVIDIA open-gpu-kernel-modules, rm_perform_version_check
#: prints the client's ``versionString`` (``NV_RM_API_VERSION_STRING_LENGTH`` 64 bytes,
#: NUL-terminated by the driver: 63 of text) in "NVRM: API mismatch: the client has the
#: version %s, but\nNVRM: this kernel module has the version %s.  Please\n...".
CLIENT_TEXT_HEADS: tuple[tuple[re.Pattern, int], ...] = (
    (re.compile(r"NVRM:\s*API mismatch: the client has the version\b ?"), 63),
)
#: Records after a client-text head that are not its lines before its window is
#: forgotten (other programs' lines interleaved in a syslog file).
MAX_CLIENT_TEXT_OTHERS = 64
CLIENT_TEXT_REASON = "inside the client-written text of an NVRM message (API mismatch version string)"

_STAMP_RE = re.compile(r"\[\s*\d+\.\d+\]")
_ANY_MARKER_RE = re.compile(r"NVRM|SXid")


@dataclass
class ClientText:
    """The open window of a :data:`CLIENT_TEXT_HEADS` record: the head's prefix, its
    printk stamp (or None), the client's bytes not yet seen, records seen since that were
    not its lines."""

    prefix: str
    stamp: str | None
    left: int
    others: int = 0

    @classmethod
    def head(cls, text: str) -> ClientText | None:
        """The window a client-text head in ``text`` (one record) opens, or None."""
        for rx, most in CLIENT_TEXT_HEADS:
            m = rx.search(text)
            if m:
                stamp = _STAMP_RE.search(text[: m.start()])
                return cls(text[: m.start()], stamp.group(0) if stamp else None, most - (len(text) - m.end()))
        return None

    def body(self, line: str) -> str | None:
        """``line`` after the head's prefix when it can be a line of the head's record
        (indented, holding the head's printk stamp, or starting with the head's prefix),
        else None."""
        if line[:1] in (" ", "\t"):
            return line.lstrip()
        if self.stamp is not None:
            i = line.find(self.stamp)
            return line[i + len(self.stamp):].lstrip() if i >= 0 else None
        return line[len(self.prefix):] if line.startswith(self.prefix) else None

    def step(self, line: str) -> tuple[bool, ClientText | None]:
        """Take the next record's first ``line``: (whether a marker in it would start
        inside the client's text, this window or None once it is closed)."""
        body = self.body(line)
        if body is None:
            self.others += 1
            return False, (self if self.others <= MAX_CLIENT_TEXT_OTHERS else None)
        hit = _ANY_MARKER_RE.search(body)
        inside = hit is not None and hit.start() < self.left
        self.left -= len(body) + 1
        return inside, (self if self.left > 0 else None)
