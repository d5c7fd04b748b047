"""Read the kernel log since a cursor, from /dev/kmsg, journalctl, dmesg or a file.

API: :func:`read_since` ``(source, cursor, timeout_s) -> (lines, new_cursor)``. The
caller stores ``new_cursor`` (an opaque string) and passes it back next time; ``None``
means "from the start of what the source holds". Lines have no trailing newline and
are in the shapes :mod:`gpuguard.xid.parse` reads.

Sources (``source`` argument):

* ``"kmsg"`` -- ``/dev/kmsg``, opened non-blocking. Each record is
  ``pri,seq,usec,flags;message``; only kernel-facility records (``pri >> 3 == 0``) are
  kept, so a userspace write to /dev/kmsg cannot fake an XID. Records come out as
  ``[<seconds since boot>] message``; embedded newlines (escaped ``\\x0a``) become
  indented continuation lines, as dmesg prints them. Cursor ``kmsg:<boot_id>:<seq>``
  with the boot id from ``/proc/sys/kernel/random/boot_id``; a different boot id means
  a reboot and reading starts from the first record again. Records the ring buffer
  overwrote before we read them are lost (``EPIPE`` is skipped).
* ``"journalctl"`` -- ``journalctl -k -o json --no-pager [--after-cursor=C]`` (an
  argument list; the binary found with ``shutil.which`` on ``PATH``, then on
  ``/usr/bin:/bin``). ``-k`` implies the current boot. Only entries with
  ``_TRANSPORT=kernel`` are kept, their ``MESSAGE`` taken exactly. Cursor
  ``journal:<__CURSOR of the last entry>``. If journalctl rejects a stored cursor it is
  run once more from the time the cursor names (its ``t=`` field), entries up to that
  time skipped, or without it when the cursor names no time.
* ``"dmesg"`` -- the whole ring buffer raw (``dmesg -r``: ``<pri>[stamp] message``) every
  time; records whose facility is not kernel are dropped. Cursor
  ``dmesg:<lines seen>:<sha256 of the last line seen, 16 hex>``. The last seen line is
  looked for (at its old index first, then from the end backwards); lines after it are
  new. Not found (reboot, buffer cleared or rotated past it) -> all lines are new.
  Because dmesg lines carry a microsecond monotonic stamp the last line is practically
  unique; on hosts with ``printk.time=0`` identical lines can hide new ones.

The three are *structured* sources (:func:`is_structured`): they return canonical lines
``[<seconds since boot>] <message>`` (:func:`canonical_lines`), and the parser then
requires ``NVRM:`` / ``nvidia-nvswitchN:`` to start the message
(:mod:`gpuguard.xid.prefix`).
* any other string -- a plain file path. Cursor ``file:<st_dev>:<st_ino>:<byte offset>``;
  a changed inode or device (rotated) reads the rest of the renamed file first when it is
  found beside the path (:mod:`gpuguard.xid.logfile`), then the new file from byte 0; a
  file shorter than the offset (truncated) starts again at byte 0. Only complete lines
  are returned: a line is delivered once its newline is written.
* ``"auto"`` -- the source the cursor names if that source is still usable, else kmsg
  if it can be opened, else journalctl if installed, else dmesg; when journalctl is
  picked but fails (no journal files, bad exit) dmesg is tried once. A cursor from another
  source than the one used is ignored (reads start from the beginning).

At most :data:`MAX_READ_BYTES` (16 MiB) of new log text is returned per call; the
cursor then points just after the last returned line so the next call continues. Every
subprocess and the kmsg read loop stop after ``timeout_s`` seconds.

Errors (source missing or unreadable, command failed or timed out, bad source name)
raise :class:`KernelLogError` with a one-line message; the caller records it as a tool
error and never drains on it.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time

from gpuguard.inputs import json_loads
from gpuguard.xid.records import canonical_lines, dmesg_canonical, journal_lines, log_lines, not_kernel_entry

log = logging.getLogger(__name__)

#: Most bytes of new log text returned by one call (16 MiB).
MAX_READ_BYTES = 16 * 2**20
#: Search path used when a tool is not on ``PATH`` (prolog environments are bare).
FALLBACK_PATH = "/usr/bin:/bin"
KMSG_PATH = "/dev/kmsg"
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
SOURCES = ("auto", "kmsg", "journalctl", "dmesg")

_KMSG_READ_BYTES = 65536  # one read() returns one record; records are < 8 KiB


class KernelLogError(Exception):
    """The kernel log could not be read. ``str()`` is one line."""


def find_tool(name: str) -> str:
    """Absolute path of ``name`` on ``PATH``, else on :data:`FALLBACK_PATH`.

    Raises :class:`KernelLogError` when neither has it."""
    path = shutil.which(name) or shutil.which(name, path=FALLBACK_PATH)
    if not path:
        raise KernelLogError(f"{name} not found on PATH or {FALLBACK_PATH}")
    return os.path.abspath(path)


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text[:300]


def _run_capped(argv: list[str], timeout_s: float, max_bytes: int) -> tuple[bytes, bool, int]:
    """Run ``argv``; return (stdout up to ``max_bytes``, overflowed, return code).

    The process is killed when ``timeout_s`` passes or when the output overflows.
    Raises :class:`KernelLogError` on a timeout or when it cannot start."""
    name = os.path.basename(argv[0])
    with tempfile.TemporaryFile() as err:
        try:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                env={**os.environ, "LC_ALL": "C", "SYSTEMD_PAGER": "", "PAGER": "cat"},
                start_new_session=True,  # so a kill reaches children holding the pipe
            )
        except OSError as exc:
            raise KernelLogError(f"cannot run {name}: {exc.strerror or exc}") from exc
        timed_out = threading.Event()

        def _kill_group() -> None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass

        def _kill() -> None:
            timed_out.set()
            _kill_group()

        timer = threading.Timer(timeout_s, _kill)
        timer.start()
        try:
            assert proc.stdout is not None
            data = proc.stdout.read(max_bytes + 1)
            overflow = len(data) > max_bytes
            if overflow:
                _kill_group()
                data = data[:max_bytes]
            proc.stdout.close()
            rc = proc.wait()
        finally:
            timer.cancel()
        if timed_out.is_set():
            raise KernelLogError(f"{name} timed out after {timeout_s:g} s")
        if rc != 0 and not overflow:
            err.seek(0)
            msg = _one_line(err.read(4096).decode("utf-8", "replace")) or "no error output"
            raise KernelLogError(f"{name} exited with status {rc}: {msg}")
        return data, overflow, rc


def _complete_lines(data: bytes, overflow: bool) -> list[str]:
    """Decode and split; when the output was cut, drop the partial last line."""
    if overflow and b"\n" in data:
        data = data[: data.rindex(b"\n") + 1]
    return log_lines(data)


# --------------------------------------------------------------------- kmsg

_KMSG_ESCAPE_RE = re.compile(rb"\\x([0-9a-fA-F]{2})")


def read_boot_id(boot_id_path: str = BOOT_ID_PATH) -> str:
    """The current boot id (a UUID string). Raises :class:`KernelLogError`."""
    try:
        with open(boot_id_path, encoding="ascii") as f:
            return f.read().strip()
    except OSError as exc:
        raise KernelLogError(f"cannot read boot id {boot_id_path}: {exc.strerror or exc}") from exc


def _kmsg_record_lines(record: bytes) -> tuple[int, list[str]] | None:
    """(seq, lines) of one kernel-facility record; None for other facilities or junk."""
    header, sep, body = record.partition(b";")
    if not sep:
        return None
    fields = header.split(b",")
    try:
        pri, seq, usec = int(fields[0]), int(fields[1]), int(fields[2])
    except (IndexError, ValueError):
        return None
    if pri >> 3 != 0:
        return None
    text = _KMSG_ESCAPE_RE.sub(lambda m: bytes([int(m.group(1), 16)]), body)
    return seq, canonical_lines(text.decode("utf-8", "replace"), usec)


def read_kmsg(
    cursor: str | None,
    timeout_s: float,
    *,
    kmsg_path: str = KMSG_PATH,
    boot_id_path: str = BOOT_ID_PATH,
    max_bytes: int = MAX_READ_BYTES,
) -> tuple[list[str], str]:
    """Kernel records after ``cursor`` (``kmsg:<boot_id>:<seq>``). See module docstring.

    Works on the real character device (one record per read) and on a regular file
    holding records one per line (tests). Raises :class:`KernelLogError`."""
    boot_id = read_boot_id(boot_id_path)
    last_seq = -1
    if cursor and cursor.startswith("kmsg:"):
        _, cur_boot, cur_seq = [*cursor.split(":", 2), "", ""][:3]
        if cur_boot == boot_id and cur_seq.lstrip("-").isdigit():
            last_seq = int(cur_seq)
    try:
        fd = os.open(kmsg_path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise KernelLogError(f"cannot open {kmsg_path}: {exc.strerror or exc}") from exc
    deadline = time.monotonic() + timeout_s
    lines: list[str] = []
    taken_bytes = 0
    pending = b""
    try:
        while True:
            if time.monotonic() > deadline:
                raise KernelLogError(f"reading {kmsg_path} timed out after {timeout_s:g} s")
            try:
                chunk = os.read(fd, _KMSG_READ_BYTES)
            except BlockingIOError:
                break  # EAGAIN: no more records
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    continue  # records overwritten under us; the next read resyncs
                raise KernelLogError(f"cannot read {kmsg_path}: {exc.strerror or exc}") from exc
            if not chunk:
                break  # regular file: EOF
            pending += chunk
            full = False
            while b"\n" in pending:
                record, pending = pending.split(b"\n", 1)
                if record.startswith((b" ", b"\t")):
                    continue  # " KEY=value" device properties after a record
                parsed = _kmsg_record_lines(record)
                if parsed is None or parsed[0] <= last_seq:
                    continue
                size = sum(len(x) + 1 for x in parsed[1])
                if taken_bytes + size > max_bytes and lines:
                    full = True
                    break
                lines.extend(parsed[1])
                taken_bytes += size
                last_seq = parsed[0]
            if full:
                break
    finally:
        os.close(fd)
    return lines, f"kmsg:{boot_id}:{last_seq}"


# --------------------------------------------------------------- journalctl


def read_journalctl(
    cursor: str | None, timeout_s: float, *, max_bytes: int = MAX_READ_BYTES
) -> tuple[list[str], str | None]:
    """Kernel messages of the current boot after ``cursor`` (``journal:<cursor>``), read
    as ``journalctl -k -o json``: one JSON object per entry, ``MESSAGE`` is the kernel's
    text exactly, and only the kernel's own entries are kept (``logger -t kernel`` and
    other userspace writes have ``_TRANSPORT=syslog``/``journal``/``stdout``; a write to
    /dev/kmsg has a facility other than kernel: :func:`gpuguard.xid.records.not_kernel_entry`).

    Returns canonical lines and the new cursor (the last entry's ``__CURSOR``), or the
    old one when nothing new was printed (``None`` when there was none). Raises
    :class:`KernelLogError`."""

    exe = find_tool("journalctl")
    journal_cursor = cursor[len("journal:"):] if cursor and cursor.startswith("journal:") else None
    base = [exe, "-k", "-o", "json", "--no-pager"]
    argv = base + ([f"--after-cursor={journal_cursor}"] if journal_cursor else [])
    seen_until_us = None  # entries at or before this realtime were read under the old cursor
    try:
        data, overflow, _ = _run_capped(argv, timeout_s, max_bytes)
    except KernelLogError:
        if not journal_cursor:
            raise
        data, overflow, seen_until_us = _read_past_rejected(base, journal_cursor, timeout_s, max_bytes)
        journal_cursor = None
    lines: list[str] = []
    new_cursor = journal_cursor
    for raw in _complete_lines(data, overflow):
        try:
            entry = json_loads(raw)
        except ValueError:
            continue  # "-- No entries --" in older versions, a cut line
        if not isinstance(entry, dict):
            continue
        if isinstance(entry.get("__CURSOR"), str):
            new_cursor = entry["__CURSOR"]
        if not_kernel_entry(entry) or _seen(entry, seen_until_us):
            continue
        lines.extend(journal_lines(entry))
    if overflow:
        log.warning("journalctl output over %d bytes; continuing from the last entry read", max_bytes)
    return lines, (f"journal:{new_cursor}" if new_cursor else None)


def _read_past_rejected(base: list[str], journal_cursor: str, timeout_s: float,
                        max_bytes: int) -> tuple[bytes, bool, int | None]:
    """journalctl's output when it rejected ``journal_cursor`` (vacuumed, rotated, corrupt):
    from the time the cursor names, whose entries up to it the caller skips (the third
    value), else the whole boot (None). Re-reading the whole boot would act again on XIDs
    already acted on: a node an admin resumed would be drained again."""
    seen_until_us = cursor_time_us(journal_cursor)
    if seen_until_us is not None:
        log.warning("journalctl rejected the stored cursor; reading from its time on")
        try:
            data, overflow, _ = _run_capped([*base, f"--since=@{seen_until_us // 1_000_000}"], timeout_s, max_bytes)
            return data, overflow, seen_until_us
        except KernelLogError:
            pass
    log.warning("journalctl rejected the stored cursor; reading the whole boot")
    data, overflow, _ = _run_capped(base, timeout_s, max_bytes)
    return data, overflow, None


def cursor_time_us(journal_cursor: str) -> int | None:
    """The realtime a journal cursor names, µs since the epoch: its ``t=`` field, in hex
    (``s=<seqnum id>;i=<seqnum>;b=<boot id>;m=<monotonic>;t=<realtime>;x=<xor hash>``,
    sd_journal_get_cursor(3)); None when it has none."""
    for part in journal_cursor.split(";"):
        if part.startswith("t="):
            try:
                return int(part[2:], 16)
            except ValueError:
                return None
    return None


def _seen(entry: dict, seen_until_us: int | None) -> bool:
    """Whether a journal entry is at or before ``seen_until_us`` (its
    ``__REALTIME_TIMESTAMP``), so it was read before."""
    if seen_until_us is None:
        return False
    try:
        return int(entry.get("__REALTIME_TIMESTAMP")) <= seen_until_us
    except (TypeError, ValueError):
        return False


# -------------------------------------------------------------------- dmesg


def _line_hash(line: str) -> str:
    return hashlib.sha256(line.encode("utf-8", "replace")).hexdigest()[:16]


def read_dmesg(
    cursor: str | None, timeout_s: float, *, max_bytes: int = MAX_READ_BYTES
) -> tuple[list[str], str]:
    """Ring-buffer records after ``cursor`` (``dmesg:<count>:<hash>``), read raw
    (``dmesg -r``: the priority tells kernel records from userspace ones) and returned as
    canonical lines. See the module docstring for the matching rule. Raises
    :class:`KernelLogError`."""
    exe = find_tool("dmesg")
    # The ring buffer is bounded by the kernel; read it with headroom, keep new lines only.
    data, overflow, _ = _run_capped([exe, "-r"], timeout_s, 4 * max_bytes)
    all_lines = _complete_lines(data, overflow)
    start = 0
    if cursor and cursor.startswith("dmesg:"):
        parts = cursor.split(":")
        if len(parts) == 3 and parts[1].isdigit():
            seen, want = int(parts[1]), parts[2]
            if 0 < seen <= len(all_lines) and _line_hash(all_lines[seen - 1]) == want:
                start = seen
            else:
                for i in range(len(all_lines) - 1, -1, -1):
                    if _line_hash(all_lines[i]) == want:
                        start = i + 1
                        break
    new = all_lines[start:]
    out: list[str] = []
    size = 0
    for line in new:
        size += len(line.encode("utf-8", "replace")) + 1
        if size > max_bytes and out:
            break
        out.append(line)
    end = start + len(out)
    if end == 0:
        return [], "dmesg:0:"
    return dmesg_canonical(out), f"dmesg:{end}:{_line_hash(all_lines[end - 1])}"


# --------------------------------------------------------------------- file


def read_file(cursor: str | None, path: str, *, max_bytes: int = MAX_READ_BYTES,
              finished: bool = False) -> tuple[list[str], str]:
    """Complete lines of ``path`` after ``cursor`` (``file:<dev>:<ino>:<offset>``), the
    rest of a rotated file first (:mod:`gpuguard.xid.logfile`); ``finished``: a last line
    without its newline counts too.

    Raises :class:`KernelLogError` when the file cannot be opened or read."""
    from gpuguard.xid.logfile import read_file as read_log_file

    try:
        return read_log_file(cursor, path, max_bytes=max_bytes, finished=finished)
    except OSError as exc:
        raise KernelLogError(str(exc) if exc.strerror is None else f"cannot read {path}: {exc.strerror}") from exc


# --------------------------------------------------------------------- entry


def _kmsg_usable(kmsg_path: str) -> bool:
    try:
        fd = os.open(kmsg_path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    os.close(fd)
    return True


def _tool_usable(name: str) -> bool:
    try:
        find_tool(name)
    except KernelLogError:
        return False
    return True


def pick_source(cursor: str | None = None, *, kmsg_path: str = KMSG_PATH) -> str:
    """The source ``"auto"`` resolves to (see module docstring)."""
    kind = (cursor or "").split(":", 1)[0]
    if kind == "kmsg" and _kmsg_usable(kmsg_path):
        return "kmsg"
    if kind == "journal" and _tool_usable("journalctl"):
        return "journalctl"
    if kind == "dmesg" and _tool_usable("dmesg"):
        return "dmesg"
    if _kmsg_usable(kmsg_path):
        return "kmsg"
    if _tool_usable("journalctl"):
        return "journalctl"
    return "dmesg"


def is_structured(source: str) -> bool:
    """True for the sources that deliver the kernel's message text exactly (kmsg,
    journalctl's JSON, raw dmesg, and ``auto``, which picks one of them); False for a
    text file, whose lines may hold anything its writer put there."""
    return source in SOURCES


def read_since(
    source: str,
    cursor: str | None,
    timeout_s: float,
    *,
    kmsg_path: str = KMSG_PATH,
    boot_id_path: str = BOOT_ID_PATH,
    max_bytes: int = MAX_READ_BYTES,
) -> tuple[list[str], str]:
    """Kernel-log lines written after ``cursor`` and the cursor to store for next time.

    ``source``: ``"auto"``, ``"kmsg"``, ``"journalctl"``, ``"dmesg"`` or a file path.
    ``timeout_s``: wall-clock limit in seconds for any subprocess / the kmsg loop.
    ``max_bytes``: cap on new text per call (default 16 MiB). The returned cursor is
    never ``None`` except for journalctl with an empty journal, where ``""`` is
    returned (read from the start next time). Raises :class:`KernelLogError`.
    """
    if timeout_s <= 0:
        raise KernelLogError(f"timeout_s must be positive, got {timeout_s!r}")
    if source == "auto":
        source = pick_source(cursor, kmsg_path=kmsg_path)
        if source == "journalctl":
            try:
                return read_since("journalctl", cursor, timeout_s, max_bytes=max_bytes)
            except KernelLogError as exc:
                # e.g. "No journal files were found" on hosts without journald storage
                log.warning("journalctl unusable (%s); falling back to dmesg", exc)
                try:
                    return read_dmesg(cursor, timeout_s, max_bytes=max_bytes)
                except KernelLogError as exc2:
                    raise KernelLogError(f"{exc}; then {exc2}") from exc2
    if source == "kmsg":
        return read_kmsg(cursor, timeout_s, kmsg_path=kmsg_path, boot_id_path=boot_id_path, max_bytes=max_bytes)
    if source == "journalctl":
        lines, new_cursor = read_journalctl(cursor, timeout_s, max_bytes=max_bytes)
        return lines, new_cursor or ""
    if source == "dmesg":
        return read_dmesg(cursor, timeout_s, max_bytes=max_bytes)
    if not source or source in SOURCES:
        raise KernelLogError(f"unknown kernel-log source {source!r}")
    return read_file(cursor, source, max_bytes=max_bytes)
