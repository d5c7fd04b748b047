"""Small file helpers for files other programs read while we write them
(node_exporter's textfile collector, dcgm-exporter's job map, the maintenance cache)."""

from __future__ import annotations

import os


def atomic_write(path: str, text: str, mode: int = 0o644, *, fsync: bool = False) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory and
    ``os.replace``: a reader sees the old or the new file, never half of one. The
    temporary file is opened with ``O_NOFOLLOW | O_EXCL`` (no symlink planted in a shared
    directory redirects a root write). ``fsync``: the data reaches the disk before the
    rename (for files another host picks up from a shared directory). Creates the
    directory (0755). Raises ``OSError``."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, mode=0o755, exist_ok=True)
    tmp = os.path.join(d, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass  # already gone
        raise
