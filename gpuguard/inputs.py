"""Reading an input file named on the command line or in the config, safely.

One way for every file gpuguard is *given* (replay snapshots, nvidia-smi dumps, kernel
logs for ``xid scan``): it must be a regular file (a FIFO, a device such as /dev/zero or a
directory is refused instead of hanging or eating memory), it is opened non-blocking and
it is read up to a size cap.
"""

from __future__ import annotations

import os
import stat

#: Largest input read whole: an 8-GPU ``nvidia-smi -q`` dump is ~100 KiB, a busy kernel
#: log a few MiB.
MAX_INPUT_BYTES = 256 * 1024 * 1024


class InputError(Exception):
    """The input cannot be used; ``str()`` is one line naming the file."""


def read_input(path: str, max_bytes: int = MAX_INPUT_BYTES) -> bytes:
    """The bytes of regular file ``path``. Raises :class:`InputError` when it is missing,
    unreadable, not a regular file, or larger than ``max_bytes``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as e:
        raise InputError(f"{path}: cannot open: {e.strerror or e}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise InputError(f"{path}: not a regular file")
    with os.fdopen(fd, "rb") as fh:
        if st.st_size > max_bytes:
            raise InputError(f"{path}: {st.st_size} bytes, more than the {max_bytes} byte limit")
        try:
            data = fh.read(max_bytes + 1)
        except OSError as e:
            raise InputError(f"{path}: cannot read: {e.strerror or e}") from None
    if len(data) > max_bytes:
        raise InputError(f"{path}: more than the {max_bytes} byte limit")
    return data
