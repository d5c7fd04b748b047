"""Small state files that survive a read-only or full state directory.

The kernel-log cursor and the pending-drain list are a few hundred bytes that decide
whether a fault is acted on once, never, or again and again. They are kept as JSON
copies in several directories (:func:`state_dirs`: ``[paths] state_dir`` on disk, then
``[paths] run_dir``, a tmpfs such as ``/run/gpuguard`` that stays writable when the disk
is read-only or full). Every write goes to every directory it can (atomically: a
temporary file, ``fsync``, ``rename``); every read takes the copy with the highest
sequence number among the readable ones, so the newest state wins wherever it landed.
A reboot empties ``/run``; the disk copy then carries on. Each copy names its *owner*
(the state directory it belongs to), so several slurmd on one host, or tests sharing
``/run/gpuguard``, never read each other's state.

Files are opened with ``O_NOFOLLOW`` (root writes them; the directories are root's), and
a copy larger than :data:`MAX_BYTES` or not valid JSON is ignored as corrupt.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

#: Largest state file read (bytes): both files are tiny; anything bigger is not ours.
MAX_BYTES = 256 * 1024


def state_dirs(cfg: Any) -> list[str]:
    """The directories copies go to, in preference order (duplicates and empty values
    dropped): ``[paths] state_dir``, ``[paths] run_dir``."""
    out: list[str] = []
    for key in ("state_dir", "run_dir"):
        d = cfg.get("paths", key)
        if d and d not in out:
            out.append(d)
    return out


def read(dirs: list[str], name: str) -> tuple[Any, int]:
    """``(value, seq)`` of the newest readable copy of ``name`` owned by ``dirs[0]``;
    ``(None, 0)`` when there is none. Never raises."""
    best: tuple[Any, int] = (None, 0)
    for d in dirs:
        try:
            fd = os.open(os.path.join(d, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            with os.fdopen(fd, "rb") as fh:
                data = fh.read(MAX_BYTES + 1)
            if len(data) > MAX_BYTES:
                continue
            doc = json.loads(data)
            seq = doc["seq"]
            if doc.get("owner") != dirs[0]:
                continue
            if isinstance(seq, int) and seq > best[1]:
                best = (doc["value"], seq)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return best


def write(dirs: list[str], name: str, value: Any, seq: int | None = None) -> list[str]:
    """Write ``value`` to every directory of ``dirs`` that accepts it, with sequence
    number ``seq`` (default: one above the newest readable copy). Returns the directories
    written; raises ``OSError`` (the last error) when none took it."""
    if seq is None:
        seq = read(dirs, name)[1] + 1
    data = json.dumps({"seq": seq, "owner": dirs[0], "written_at": time.time(), "value": value}).encode()
    written: list[str] = []
    last: OSError | None = None
    for d in dirs:
        try:
            _write_one(d, name, data)
            written.append(d)
        except OSError as e:
            last = e
    if not written:
        raise last or OSError(f"no directory to write {name}")
    return written


def _write_one(d: str, name: str, data: bytes) -> None:
    os.makedirs(d, mode=0o755, exist_ok=True)
    final = os.path.join(d, name)
    tmp = f"{final}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
