"""Reading an input file named on the command line or in the config, safely.

One way for every file gpuguard is *given* (replay snapshots, nvidia-smi dumps, kernel
logs for ``xid scan``): it must be a regular file (a FIFO, a device such as /dev/zero or a
directory is refused instead of hanging or eating memory), it is opened non-blocking and
it is read up to a size cap. Files gpuguard *writes* where the command line says
(``-o FILE``) go through :func:`write_output`, which will not follow a symlink.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Any

#: Largest input read whole: an 8-GPU ``nvidia-smi -q`` dump is ~100 KiB, a busy kernel
#: log a few MiB.
MAX_INPUT_BYTES = 256 * 1024 * 1024


class InputError(Exception):
    """The input cannot be used; ``str()`` is one line naming the file."""


#: The message of a document nested deeper than Python's parsers recurse.
TOO_DEEP = "arrays/objects nested too deep"


def json_loads(text: str | bytes, **kw: Any) -> Any:
    """:func:`json.loads` of an input gpuguard reads, raising
    :class:`json.JSONDecodeError` (a ``ValueError``) for a document nested deeper than
    the decoder recurses (``[[[[...`` of a few thousand levels: the decoder raises
    ``RecursionError``, which no ``except ValueError`` catches, so a bad file gave a
    traceback, or stopped a reader, instead of its one-line error)."""
    import json

    try:
        return json.loads(text, **kw)
    except RecursionError:
        doc = text if isinstance(text, str) else text.decode("utf-8", "replace")
        raise json.JSONDecodeError(TOO_DEEP, doc, 0) from None


def _open_regular(path: str) -> tuple[Any, os.stat_result]:
    """``(binary file object, stat)`` of regular file ``path``, opened without blocking on
    a FIFO or device. Raises :class:`InputError` when it is missing, unreadable or not a
    regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as e:
        raise InputError(f"{path}: cannot open: {e.strerror or e}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise InputError(f"{path}: not a regular file")
    return os.fdopen(fd, "rb"), st


def read_input(path: str, max_bytes: int = MAX_INPUT_BYTES) -> bytes:
    """The bytes of regular file ``path``. Raises :class:`InputError` when it is missing,
    unreadable, not a regular file, or larger than ``max_bytes``."""
    fh, st = _open_regular(path)
    with fh:
        if st.st_size > max_bytes:
            raise InputError(f"{path}: {st.st_size} bytes, more than the {max_bytes} byte limit")
        try:
            data = fh.read(max_bytes + 1)
        except OSError as e:
            raise InputError(f"{path}: cannot read: {e.strerror or e}") from None
    if len(data) > max_bytes:
        raise InputError(f"{path}: more than the {max_bytes} byte limit")
    return data


def read_head(path: str, max_bytes: int) -> bytes:
    """The first ``max_bytes`` bytes of regular file ``path``, whatever its size (to judge
    what a file is without reading all of it). Raises :class:`InputError` as
    :func:`read_input` does, except for the size."""
    fh, _ = _open_regular(path)
    with fh:
        try:
            return fh.read(max_bytes)
        except OSError as e:
            raise InputError(f"{path}: cannot read: {e.strerror or e}") from None


def write_output(path: str, data: bytes | str) -> None:
    """Write ``data`` (text is UTF-8 encoded) to ``path``, an output file named on the
    command line (``-o FILE``), replacing its contents.

    gpuguard often runs as root, and ``-o`` may name a path in a directory other users
    can write to (``/tmp``): a symlink planted there must not make root overwrite the
    link's target, and a FIFO or device must not hang the command or be written to. So
    the file is opened ``O_NOFOLLOW`` (a symlink as the last component is refused),
    ``O_NONBLOCK`` (a FIFO without a reader fails instead of blocking) and created with
    mode 0644; the open file must be a regular file (``fstat``). Raises
    :class:`InputError`, one line naming the file, when it cannot be written.
    """
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise InputError(f"{path}: cannot write: {e.strerror or e}") from None
    else:
        # Refuse before open(): opening some devices for writing has effects of its own.
        if stat.S_ISLNK(st.st_mode):
            raise InputError(f"{path}: is a symbolic link; refusing to write through it")
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{path}: not a regular file; refusing to write to it")
    flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK
             | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink (planted after the lstat)
            raise InputError(f"{path}: is a symbolic link; refusing to write through it") from None
        if e.errno in (errno.ENXIO, errno.EISDIR):  # a FIFO without a reader, a socket, a directory
            raise InputError(f"{path}: not a regular file; refusing to write to it") from None
        raise InputError(f"{path}: cannot write: {e.strerror or e}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InputError(f"{path}: not a regular file; refusing to write to it")
        view = memoryview(raw)
        while view:
            n = os.write(fd, view)
            view = view[n:]
    except OSError as e:
        raise InputError(f"{path}: cannot write: {e.strerror or e}") from None
    finally:
        os.close(fd)
