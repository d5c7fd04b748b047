"""A kernel log kept as a text file (``[xid] kernel_log = PATH``), read since a cursor,
across a rotation.

Cursor ``file:<st_dev>:<st_ino>:<byte offset>``. Only complete lines are returned: a line
is delivered once its newline is written. At most ``max_bytes`` of text per call; the
cursor then points just after the last returned line.

Rotation. logrotate (and rsyslog's own rotation) renames the file and the writer opens
a new one, so lines written between our last read and the rename are in the renamed file
(``kern.log.1`` with ``delaycompress``, the Debian default; ``messages-20261201`` with
``dateext``, the RHEL default). A cursor whose inode is no longer the path's is looked
for among the path's siblings whose name is the path's name followed by ``.``, ``-`` or
``_`` (same device and inode: exact, never a guess): its rest is read first, its last
line even without a newline (the writer has moved on), then the new file from byte 0.
Not found (compressed at once, moved to another directory, deleted): the new file from
byte 0, as before. ``copytruncate`` keeps the inode and shortens the file: reading starts
again at byte 0 of the new contents; the lines written between our last read and the copy
are only in the copy, which cannot be matched exactly, so they are not read (a copy
matched by name and size alone could be an older rotation: re-reading it would act again
on XIDs already acted on).
"""

from __future__ import annotations

import os
import re
import stat
import time

from gpuguard.xid.records import log_lines


class LogFileError(OSError):
    """The file could not be read (``str()`` is one line); the caller turns it into its
    own error type."""


def _cursor_parts(cursor: str | None) -> tuple[int, int, int] | None:
    if not cursor or not cursor.startswith("file:"):
        return None
    parts = cursor.split(":")
    if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
        return None
    return int(parts[1]), int(parts[2]), int(parts[3])


def find_rotated(path: str, dev: int, ino: int) -> str | None:
    """The sibling of ``path`` (``path.N``, ``path-DATE``, ``path_...``) that is the file
    with device ``dev`` and inode ``ino``, or None. Symlinks and non-regular files are
    never taken."""
    directory, base = os.path.split(path)
    try:
        entries = os.scandir(directory or ".")
    except OSError:
        return None
    with entries:
        for e in entries:
            if e.name == base or not e.name.startswith(base) or e.name[len(base)] not in ".-_":
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) == (dev, ino):
                return e.path
    return None


def _open_regular(path: str) -> tuple[int, os.stat_result]:
    # O_NONBLOCK: a FIFO or device named by mistake must not hang the prolog
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise LogFileError(f"cannot read {path}: not a regular file")
    return fd, st


def _read_lines(fd: int, offset: int, max_bytes: int, finished: bool) -> tuple[list[str], int]:
    """(complete lines from ``offset``, bytes they take). ``finished``: the file gets no
    more writes, so a last line without a newline counts."""
    os.lseek(fd, offset, os.SEEK_SET)
    data = b""
    while len(data) < max_bytes:
        chunk = os.read(fd, max_bytes - len(data))
        if not chunk:
            break
        data += chunk
    if b"\n" in data:
        if not (finished and len(data) < max_bytes):
            data = data[: data.rindex(b"\n") + 1]
    elif len(data) < max_bytes and not finished:
        data = b""  # an unfinished last line: wait for its newline
    return log_lines(data), len(data)


def _rotated_rest(path: str, dev: int, ino: int, offset: int, max_bytes: int) -> tuple[list[str], int, bool]:
    """(lines of the rotated file after ``offset``, new offset, whether all were read).
    Nothing when the rotated file is not found or is shorter than the offset."""
    old = find_rotated(path, dev, ino)
    if old is None:
        return [], offset, True
    try:
        fd, st = _open_regular(old)
    except OSError:
        return [], offset, True
    try:
        if (st.st_dev, st.st_ino) != (dev, ino) or st.st_size < offset:
            return [], offset, True
        lines, used = _read_lines(fd, offset, max_bytes, finished=True)
    finally:
        os.close(fd)
    return lines, offset + used, offset + used >= st.st_size


def _refuse_wrong_format(fd: int, path: str) -> None:
    """A file that starts as something other than log text (``kern.log.2.gz`` named by
    mistake, a binary) is an error to name, not a log with no XIDs."""
    from gpuguard.xid.filekind import wrong_format

    why = wrong_format(os.pread(fd, 16, 0))
    if why:
        raise LogFileError(f"cannot read {path}: it {why}")


def read_file(cursor: str | None, path: str, *, max_bytes: int, finished: bool = False) -> tuple[list[str], str]:
    """Complete lines of ``path`` after ``cursor`` (``file:<dev>:<ino>:<offset>``) and the
    cursor to store; see the module docstring for rotation. ``finished``: a last line
    without its newline counts (a saved file; a live log's is still being written).
    Raises :class:`LogFileError` (an ``OSError``) when ``path`` cannot be opened or read."""
    try:
        fd, st = _open_regular(path)
    except LogFileError:
        raise
    except OSError as exc:
        raise LogFileError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        lines: list[str] = []
        offset = 0
        parts = _cursor_parts(cursor)
        if parts is not None and (parts[0], parts[1]) != (st.st_dev, st.st_ino):
            lines, old_offset, done = _rotated_rest(path, *parts, max_bytes)
            if not done:
                return lines, f"file:{parts[0]}:{parts[1]}:{old_offset}"
            max_bytes -= old_offset - parts[2]
        elif parts is not None and parts[2] <= st.st_size:
            offset = parts[2]
        if offset == 0:
            _refuse_wrong_format(fd, path)
        new, used = _read_lines(fd, offset, max(max_bytes, 0), finished=finished) if max_bytes > 0 else ([], 0)
    except LogFileError:
        raise
    except OSError as exc:
        raise LogFileError(f"cannot read {path}: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)
    return lines + new, f"file:{st.st_dev}:{st.st_ino}:{offset + used}"


#: The first line a booting kernel prints (``linux_banner``): ``Linux version 6.8.0-49-generic
#: (...)``, as a syslog writer stores it (``... kernel: [    0.000000] Linux version``, the
#: stamp absent with ``printk.time=0``) or in any other layout the kernel-log grammar reads
#: (:func:`is_boot_line`).
BOOT_MARKER = re.compile(rb"Linux version \d")
#: Most bytes of a boot line before its banner that are looked at (a log prefix is short).
_BOOT_PREFIX_BYTES = 4096
#: Most bytes a first scan searches back for the current boot, in whole 1 MiB blocks (our
#: choice: weeks of a busy kern.log; read backwards from the page cache in well under a second).
MAX_BOOT_SCAN_BYTES = 256 << 20
_BLOCK = 1 << 20


def boot_cursor(path: str, *, deadline: float, max_scan_bytes: int = MAX_BOOT_SCAN_BYTES) -> str | None:
    """The cursor (``file:<dev>:<ino>:<offset>``) of the current boot's first kernel line in
    ``path`` (the last :data:`BOOT_MARKER` line, searched back from the end), so a first
    scan does not act on XIDs of earlier boots, which a reboot has dealt with. None when
    no such line is in the last ``max_scan_bytes`` or found before ``deadline``
    (``time.monotonic``), or the file cannot be read: the caller then reads from the
    start. Raises nothing."""
    try:
        fd, st = _open_regular(path)
    except OSError:
        return None
    try:
        pos, size = st.st_size, st.st_size
        while pos > 0 and size - pos < max_scan_bytes and time.monotonic() < deadline:
            lo = max(0, pos - _BLOCK)
            data = os.pread(fd, min(size, pos + 4096) - lo, lo)  # 4 KiB overlap: a marker on the edge
            for hit in reversed([m.start() for m in BOOT_MARKER.finditer(data)]):
                start = _line_start(fd, lo + hit)
                if start is not None and is_boot_line(os.pread(fd, lo + hit - start + 16, start)):
                    return f"file:{st.st_dev}:{st.st_ino}:{start}"
            pos = lo
    except OSError:
        return None
    finally:
        os.close(fd)
    return None


def _line_start(fd: int, at: int) -> int | None:
    """File offset of the start of the line holding offset ``at``; None when it is more
    than :data:`_BOOT_PREFIX_BYTES` before ``at``."""
    back = os.pread(fd, min(at, _BOOT_PREFIX_BYTES), at - min(at, _BOOT_PREFIX_BYTES))
    nl = back.rfind(b"\n")
    if nl >= 0:
        return at - len(back) + nl + 1
    return 0 if at <= _BOOT_PREFIX_BYTES else None


def is_boot_line(head: bytes) -> bool:
    """True when ``head`` (a line's start, through its banner) is the kernel's boot banner:
    ``Linux version N`` at the start of the kernel message, after a prefix the kernel-log
    grammar accepts (:func:`gpuguard.xid.prefix.check_prefix`: ``HOST kernel:``, RFC 5424
    ``HOST kernel - - -``, ``kern  :notice:``, a printk stamp and caller id ``[    0.000000]
    [    T0]``, a container log's envelope...). Before, only ``kernel:`` before the banner
    counted, so a first scan of a kern.log in another layout read every earlier boot and
    acted on XIDs a reboot had dealt with. Text a user chose before the banner (``alice:
    Linux version``) is no boot line, nor is an indented line: ``journalctl`` and ``dmesg``
    print a record's later lines so, under its first line
    (:data:`gpuguard.xid.grouping.UNDER_RECORD_REASON`), and any user's multi-line message
    prints so, while the kernel prints its banner as a record of its own; a file indented
    as a whole then has no boot line and is read from its start (no XID missed)."""
    from gpuguard.xid.grouping import unwrapped
    from gpuguard.xid.prefix import check_prefix

    line = next(iter(unwrapped([head.decode("utf-8", "replace")])))[1]
    if line[:1] in (" ", "\t"):
        return False
    found = _BANNER_TEXT.search(line)
    return found is not None and check_prefix(line[: found.start()], structured=False) is None


_BANNER_TEXT = re.compile(BOOT_MARKER.pattern.decode())
