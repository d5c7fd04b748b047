"""Reading an input file named on the command line or in the config, safely.

One way for every file gpuguard is *given* (replay snapshots, nvidia-smi dumps, kernel
logs for ``xid scan``): it must be a regular file (a FIFO, a device such as /dev/zero or a
directory is refused instead of hanging or eating memory), it is opened non-blocking and
it is read up to a size cap. Files gpuguard *writes* where the command line says
(``-o FILE``, ``--force``) go through :func:`write_output`: a new file unless forced,
written whole through a temporary file, never through a symlink or to a FIFO/device,
never replacing another user's file.
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


#: ``errno`` of ``link(2)`` on a filesystem without hard links (vfat, some FUSE and network
#: mounts): the new file is then renamed into place after a second look that the name is
#: still free.
_NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS}


def write_output(path: str, data: bytes | str, *, force: bool = False) -> None:
    """Write ``data`` (text is UTF-8 encoded) to ``path``, an output file named on the
    command line (``-o FILE`` of ``report *``, ``job show``, ``gpu snapshot``): the one
    writer of every such option.

    gpuguard often runs as root, ``-o`` may name a path in a directory other users can
    write to (``/tmp``), and a typo must not cost a file. The policy:

    * **New file by default.** An existing file is replaced only with ``force=True``
      (``--force``); without it: ``PATH: already exists; not replaced (--force replaces
      it)``. The name is claimed with ``link(2)``, which fails when anything appeared
      there meanwhile, so no file created between the check and the write is replaced
      either (on a filesystem without hard links: ``rename(2)`` after a second look).
    * **Only a regular file the running user owns is replaced** (``force=True``): as
      root, a file not owned by root (``/home/alice/x``, a file alice left in ``/tmp``)
      is never replaced (``PATH: owned by uid N, not by uid 0 running this; not
      replaced``): root does not destroy another user's data, and a file another user
      made is not evidence that root meant to overwrite it. Remove it first, or write
      elsewhere.
    * **Never a symlink, FIFO, device, socket or directory**, with or without
      ``force``: a symlink as the last component is refused, never followed (its target
      untouched; a dangling one creates nothing), and the other kinds are refused
      before anything is opened (opening a device or FIFO for writing can block or have
      effects of its own). Directories above the last component are followed (that is
      the path the operator typed), except, as root, a symlink another user owns
      (``/home/alice/reports -> /etc`` would let alice choose where root writes): ``PATH:
      DIR is a symbolic link owned by uid N; ...``.
    * **All or nothing.** ``data`` goes to a temporary file ``.NAME.XXXXXXXX.tmp`` in
      the target's directory (``O_CREAT|O_EXCL|O_NOFOLLOW``, mode 0600 while written),
      is flushed to disk (``fsync``), and is then linked or renamed into place, so a
      reader, or a crash, sees the old file or the whole new one, never half a report;
      on any error the temporary file is removed and the target is as it was.
    * **Mode.** A new file gets 0644 less the umask; a replaced file's permission bits
      (0777 part) and group are kept, so a report shared 0640 with a group stays so.

    Every step works relative to the directory opened once (``dir_fd``), so the
    directory cannot be swapped between the checks and the rename. Residual race: in a
    directory another user may write without the sticky bit (not ``/tmp``), that user
    can change entries at any time; the file checked is compared (device, inode) with
    the one replaced right before the rename. Raises :class:`InputError`, one line naming
    ``path``, when nothing was written.
    """
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    d, name = os.path.split(path)
    if name in ("", ".", ".."):
        raise InputError(f"{path}: not a regular file; refusing to write to it")
    if os.geteuid() == 0:
        _no_foreign_symlink(path, d or ".")
    try:
        dfd = os.open(d or ".", os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise InputError(f"{path}: cannot write: {e.strerror or e}") from None
    try:
        if os.geteuid() == 0:  # the directory opened is the one checked (not swapped meanwhile)
            _no_foreign_symlink(path, d or ".")
            try:
                same = os.path.samestat(os.stat(d or "."), os.fstat(dfd))
            except OSError:
                same = False
            if not same:
                raise InputError(f"{path}: its directory changed while it was opened; not written")
        old = _replaceable(path, name, dfd, force)
        tmp = _write_temporary(path, name, dfd, raw, old)
        try:
            _put_in_place(path, name, dfd, tmp, old)
        finally:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except FileNotFoundError:
                pass  # renamed into place
            except OSError:
                pass  # a stray temporary file; the output itself is settled
    finally:
        os.close(dfd)


def _no_foreign_symlink(path: str, d: str) -> None:
    """As root: refuse when a directory on the way to ``path`` is reached through a
    symlink another user owns (``/home/alice/reports -> /etc``: alice would choose where
    root writes), as Linux's ``fs.protected_symlinks`` does for sticky directories."""
    here = os.sep
    for part in os.path.abspath(d).split(os.sep):
        if not part:
            continue
        here = os.path.join(here, part)
        try:
            st = os.lstat(here)
        except OSError:
            return  # opening the directory reports it
        if stat.S_ISLNK(st.st_mode) and st.st_uid != 0:
            raise InputError(f"{path}: {here} is a symbolic link owned by uid {st.st_uid}; root does not write "
                             "through another user's link")


def _replaceable(path: str, name: str, dfd: int, force: bool) -> os.stat_result | None:
    """The stat of the file ``write_output`` may replace, or None when the name is free.
    Raises :class:`InputError` per its policy."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise InputError(f"{path}: cannot write: {e.strerror or e}") from None
    if stat.S_ISLNK(st.st_mode):
        raise InputError(f"{path}: is a symbolic link; refusing to write through it")
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"{path}: not a regular file; refusing to write to it")
    if not force:
        raise InputError(f"{path}: already exists; not replaced (--force replaces it)")
    if st.st_uid != os.geteuid():
        raise InputError(f"{path}: owned by uid {st.st_uid}, not by uid {os.geteuid()} running this; not replaced")
    return st


def _write_temporary(path: str, name: str, dfd: int, raw: bytes, old: os.stat_result | None) -> str:
    """Write ``raw`` to a new temporary file beside ``name``; returns its name."""
    import secrets

    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = f".{name[:200]}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(tmp, flags, 0o600, dir_fd=dfd)
            break
        except FileExistsError:
            continue
        except OSError as e:
            raise InputError(f"{path}: cannot write: {e.strerror or e}") from None
    else:
        raise InputError(f"{path}: cannot write: no free temporary name in its directory")
    try:
        try:
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view):]
            if old is None:
                umask = os.umask(0o022)
                os.umask(umask)
                os.fchmod(fd, 0o644 & ~umask)
            else:
                try:
                    os.fchown(fd, -1, old.st_gid)
                except OSError:
                    pass  # not a member of the old file's group: the new file keeps ours
                os.fchmod(fd, stat.S_IMODE(old.st_mode) & 0o777)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        try:
            os.unlink(tmp, dir_fd=dfd)
        except OSError:
            pass
        raise InputError(f"{path}: cannot write: {e.strerror or e}") from None
    return tmp


def _put_in_place(path: str, name: str, dfd: int, tmp: str, old: os.stat_result | None) -> None:
    """Link (new file) or rename (replacing ``old``) ``tmp`` to ``name``."""
    if old is None:
        try:
            os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
            return
        except FileExistsError:
            raise InputError(f"{path}: appeared while it was written; not replaced") from None
        except OSError as e:
            if e.errno not in _NO_HARD_LINKS:
                raise InputError(f"{path}: cannot write: {e.strerror or e}") from None
        if _stat_or_none(name, dfd) is not None:  # no hard links here: look again, then rename
            raise InputError(f"{path}: appeared while it was written; not replaced")
    else:
        now = _stat_or_none(name, dfd)
        if now is None or (now.st_dev, now.st_ino) != (old.st_dev, old.st_ino):
            raise InputError(f"{path}: changed while it was written; not replaced")
    try:
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except OSError as e:
        raise InputError(f"{path}: cannot write: {e.strerror or e}") from None


def _stat_or_none(name: str, dfd: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None
