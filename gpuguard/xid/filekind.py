"""What a file given as a kernel log is, when it is not one: a binary, an archive,
compressed or UTF-16 data. ``xid scan`` and ``check --kernel-log`` refuse such a file
with one line naming what it is ("no XID events" on it would hide that it is the wrong
file); the hooks' file source (:mod:`gpuguard.xid.logfile`) turns a file that starts
with such a signature into a tool error."""

from __future__ import annotations

import re

#: Leading bytes of formats that are not a kernel log, as file(1)'s magic database and the
#: formats' specifications give them; named so the error says what the file is.
_MAGIC = ((b"\x7fELF", "an ELF binary"), (b"PK\x03\x04", "a zip archive"),
          (b"\xfd7zXZ\x00", "xz-compressed data (decompress it first: xz -dc FILE | gpuguard xid scan -)"),
          (b"\x28\xb5\x2f\xfd", "zstd-compressed data (decompress it first: zstd -dc FILE | gpuguard xid scan -)"),
          (b"BZh", "bzip2-compressed data (decompress it first: bzcat FILE | gpuguard xid scan -)"),
          (b"SQLite format 3\x00", "an SQLite database"), (b"%PDF-", "a PDF document"),
          (b"\x89PNG", "a PNG image"))
#: Largest share of a file's non-NUL characters that may be undecodable UTF-8 or control
#: characters other than tab, newline, CR, form feed and ESC (dmesg --color) while it is
#: still read as a kernel log. Our choice: a real log with a few corrupt bytes stays far
#: below it; a binary file is far above (about 70 % for random bytes, more for executables).
MAX_BINARY_SHARE = 0.10
_CONTROL = re.compile("[\x01-\x08\x0b\x0e-\x1a\x1c-\x1f\x7f\ufffd]")
#: What the hooks' file source refuses at a file's start: every signature above, gzip and
#: UTF-16 (a byte-order mark), which ``xid scan`` reads but a hook's incremental read cannot.
_HOOK_MAGIC = ((b"\x1f\x8b", "gzip-compressed data"), (b"\xff\xfe", "UTF-16 text"), (b"\xfe\xff", "UTF-16 text"))


def not_a_log(data: bytes) -> str | None:
    """Why ``data`` (a file's bytes, decompressed) is not a kernel log, one phrase, or
    None when it reads as text. NUL bytes are left out (a log written through a crash
    holds runs of them); an empty file is an empty log."""
    for magic, what in _MAGIC:
        if data.startswith(magic):
            return f"is {what}, not a kernel log"
    text = data.replace(b"\x00", b"")
    if data and not text:
        return f"holds only NUL bytes ({len(data)} bytes), not a kernel log"
    chars = text.decode("utf-8", errors="replace")
    bad = len(_CONTROL.findall(chars))
    if chars and bad > MAX_BINARY_SHARE * len(chars):
        return (f"is binary data, not a kernel log ({bad} of {len(chars)} characters are not text: "
                "undecodable UTF-8 or control characters)")
    return None


def wrong_format(head: bytes) -> str | None:
    """What a kernel-log file starting with ``head`` is when its first bytes say it is not
    log text the hooks can read step by step (one phrase), else None."""
    for magic, what in (*_MAGIC, *_HOOK_MAGIC):
        if head.startswith(magic):
            return f"is {what.split(' (')[0]}, not kernel-log text"
    return None
