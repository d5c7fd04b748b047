"""Text a user program chose, printed by the kernel or the NVIDIA driver inside a
multi-line record: a marker line in it is not the kernel's.

Some kernel messages print text an unprivileged program chose (:data:`CLIENT_TEXT_HEADS`):
the client's version string in the NVIDIA driver's ``NVRM: API mismatch: the client has
the version %s, but`` (63 bytes, which any program that opens /dev/nvidiactl sets), the
file name given to ``execve`` with an empty argv (``process 'x' launched '%s' with NULL
argv``, any user, once a boot), a mount option's name in ``tmpfs: Unknown parameter '%s'``
(any user in a user namespace). Such text may hold a newline. A syslog reader
(``/proc/kmsg``: rsyslog's imklog, ``dmesg -S``) repeats the record's prefix on each of
its lines, ``dmesg`` and ``journalctl`` indent them, ``dmesg -t`` prints them bare, so a
string ``1\nNVRM: Xid (PCI:0000:3b:00): 79, ...`` reads as an XID line of its own. A
marker line that belongs to such a record (the head's printk stamp in its prefix, an
indented line, or the head's exact prefix) and starts within the user's bytes not yet
used is rejected ("inside the user-written text of ..."). A real XID is a record of its
own; after an API mismatch it comes after the head's fixed tail (three driver lines,
over 150 bytes), so it is never inside that window.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

@dataclass(frozen=True)
class Head:
    """One kernel message that prints user-chosen text: ``pattern`` matched at the start
    of the message (after the log prefix) and ending where that text starts; ``most``:
    the most bytes of it; ``what``: what the text is, for the rejection reason."""

    pattern: re.Pattern
    most: int
    what: str
    #: opens a window in text logs only: a structured source gives the record's lines
    #: apart already (indented, rejected by :func:`gpuguard.xid.prefix.check_prefix`)
    text_only: bool = True

    @property
    def reason(self) -> str:
        """The one-line reason a marker line inside this head's text is rejected with."""
        if self.what.startswith("API mismatch"):  # the reason's wording since it was first logged
            return f"inside the client-written text of an NVRM message ({self.what})"
        return f"inside the user-written text of a kernel message ({self.what})"


#: Kernel messages that print text an unprivileged program chose, each with the most
#: bytes of it. Sources:
#: NVIDIA open-gpu-kernel-modules rm_perform_version_check prints the client's
#: ``versionString`` (``NV_RM_API_VERSION_STRING_LENGTH`` 64 bytes, NUL-terminated by the
#: driver: 63 of text) in "NVRM: API mismatch: the client has the version %s, but\nNVRM:
#: this kernel module has the version %s.  Please\n...";
#: Linux fs/exec.c do_execveat_common (5.18+, commit dcd46d897adb) ``pr_warn_once("process
#: '%s' launched '%s' with NULL argv: empty string added\n", current->comm,
#: bprm->filename)``: the comm (15 bytes, itself may hold a newline, so the text before
#: ``' launched '`` is at most 15 bytes of it) and the path given to execve (PATH_MAX 4096);
#: Linux fs/fs_parser.c ``invalf(fc, "%s: Unknown parameter '%s'", ...)``, printed by
#: fs/fs_context.c logfc when no fsopen log is attached (mount(2)): the option's name, out
#: of one page of options (copy_mount_options: PAGE_SIZE 4096); overlayfs (fs/overlayfs)
#: "overlayfs: failed to resolve '%s': %i" with a lowerdir/upperdir path (PATH_MAX).
CLIENT_TEXT_HEADS: tuple[Head, ...] = (
    Head(re.compile(r"NVRM:\s*API mismatch: the client has the version\b ?"), 63, "API mismatch version string",
         text_only=False),
    Head(re.compile(r"(?:process '[^\n]{0,15}|[^\n]{0,15})' launched '"), 4096, "file name of an exec with NULL argv"),
    Head(re.compile(r"[\w.-]{1,40}: Unknown parameter '"), 4096, "mount option name"),
    Head(re.compile(r"overlayfs: failed to resolve '"), 4096, "overlayfs mount path"),
)
#: Records after a client-text head that are not its lines before its window is
#: forgotten (other programs' lines interleaved in a syslog file).
MAX_CLIENT_TEXT_OTHERS = 64
#: the reason of the NVRM API mismatch head (kept as a name: tests and callers use it)
CLIENT_TEXT_REASON = CLIENT_TEXT_HEADS[0].reason

#: Prefix tokens (:data:`gpuguard.xid.prefix.TOKENS`) only a kernel line's prefix holds; a
#: head's line must have one, or no prefix at all (``dmesg -t``), so that a program's
#: syslog line quoting a head (``host alice: x' launched '``) opens no window.
KERNEL_TOKENS = frozenset({"priority", "kmsg_record", "kern_level", "facility", "bracket", "rfc5424_kernel",
                           "host_kernel", "kernel", "nvswitch"})
#: a word every head holds (a cheap test before the prefix is read)
_HEAD_WORDS_RE = re.compile(r"API mismatch|' launched '|Unknown parameter '|failed to resolve '")
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
    reason: str = CLIENT_TEXT_REASON

    @classmethod
    def head(cls, text: str, structured: bool = False) -> ClientText | None:
        """The window a client-text head in ``text`` (one record) opens, or None (for a
        ``structured`` source's line, only the heads that are not ``text_only``). The
        head must start the message: right after the line's kernel-log prefix
        (:func:`gpuguard.xid.prefix.text_prefix_tokens`), so a program's own line that
        quotes a head opens no window."""
        from gpuguard.xid.prefix import text_prefix_tokens

        if not _HEAD_WORDS_RE.search(text):  # most records: no head, no tokenising
            return None
        names, rest = text_prefix_tokens(text)
        if names and not KERNEL_TOKENS.intersection(names):
            return None  # a program's line ("host alice: ..."), or a date alone: not the kernel's
        start = len(text) - len(rest)
        for h in CLIENT_TEXT_HEADS:
            if structured and h.text_only:
                continue
            m = h.pattern.match(text, start)
            if m:
                stamp = _STAMP_RE.search(text[:start])
                return cls(text[:start], stamp.group(0) if stamp else None, h.most - (len(text) - m.end()),
                           reason=h.reason)
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
