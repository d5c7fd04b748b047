"""A kernel log given to ``gpuguard xid scan`` read as a stream of lines, in constant
memory whatever its size (a year of ``/var/log/kern.log``, a rotated ``.gz``).

:func:`log_stream` opens the file (or stdin), looks at its first
:data:`HEAD_BYTES` (decompressed) to refuse what is not a log
(:func:`gpuguard.xid.cli.not_a_log`), and returns the lines as an iterator, split at
``\\n`` only with runs of NUL bytes ending a line (the rules of
:func:`gpuguard.xid.records.log_lines`, applied chunk by chunk with the same result). A
gzip file is decompressed as it is read (every member of a multi-member file); a gzip
stream that ends early gives the lines before the cut and sets :attr:`LogStream.problem`.
"""

from __future__ import annotations

import os
import re
import stat
import sys
import zlib
from collections.abc import Iterator
from typing import BinaryIO
from gpuguard.xid.records import MAX_LINE_CHARS

#: Bytes read per call (our choice: large enough that the per-chunk work is negligible).
CHUNK_BYTES = 1 << 20
#: Bytes (decompressed) judged by ``not_a_log`` before any line is parsed.
HEAD_BYTES = 1 << 20

_NUL_RUN = re.compile(rb"\x00+")


class StreamError(Exception):
    """The input cannot be read; ``str()`` is one line naming it."""


class LogStream:
    """One input read in chunks (:meth:`chunks`); ``problem`` is set (one line) once the
    chunks are consumed when a gzip stream ended early."""

    def __init__(self, fh: BinaryIO, name: str, closes: bool) -> None:
        self.name = name
        self.problem: str | None = None
        self._fh = fh
        self._closes = closes

    def _raw(self) -> Iterator[bytes]:
        while True:
            try:
                chunk = self._fh.read(CHUNK_BYTES)
            except OSError as exc:
                raise StreamError(f"cannot read {self.name}: {exc.strerror or exc}") from None
            if not chunk:
                return
            yield chunk

    def chunks(self) -> Iterator[bytes]:
        """The (decompressed) bytes in chunks, the head first."""
        raw = self._raw()
        first = next(raw, b"")

        def all_raw() -> Iterator[bytes]:
            if first:
                yield first
            yield from raw

        return self._inflated_members(all_raw()) if first[:2] == b"\x1f\x8b" else all_raw()

    def _inflated_members(self, raw: Iterator[bytes]) -> Iterator[bytes]:
        d = zlib.decompressobj(wbits=31)
        fresh = True
        for chunk in raw:
            while chunk:
                if fresh and not chunk.strip(b"\x00"):
                    break  # zero padding after the last member (as gzip(1) allows)
                try:
                    out = d.decompress(chunk)
                except zlib.error as exc:
                    raise StreamError(f"cannot read {self.name}: broken gzip data ({exc})") from None
                fresh = False
                if out:
                    yield out
                if not d.eof:
                    break
                chunk = d.unused_data  # the next member of a multi-member file
                d, fresh = zlib.decompressobj(wbits=31), True
        if not d.eof and not fresh:
            self.problem = f"{self.name}: gzip data ends early (truncated file); the events before the cut are shown"

    def close(self) -> None:
        if self._closes:
            self._fh.close()


def open_log(path: str) -> LogStream:
    """Open ``path`` (``-``: stdin) for :meth:`LogStream.chunks`. Raises :class:`StreamError`
    for a file that cannot be opened or is not a regular file (a FIFO or a device would
    hang or never end)."""
    if path == "-":
        stream = getattr(sys.stdin, "buffer", None)
        if stream is None:  # a text-only stdin (tests): its text as bytes
            import io

            stream = io.BytesIO(sys.stdin.read().encode())
        return LogStream(stream, "stdin", closes=False)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as exc:
        raise StreamError(f"cannot read {path}: cannot open: {exc.strerror or exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise StreamError(f"cannot read {path}: not a regular file")
    return LogStream(os.fdopen(fd, "rb"), path, closes=True)


#: Bytes of a line :func:`split_lines` holds: enough for :data:`~gpuguard.xid.records.MAX_LINE_CHARS`
#: characters whatever they are (UTF-8 and each ``replace`` character take at most 4 bytes),
#: and the cut's last, maybe incomplete, character beyond them.
MAX_LINE_BYTES = 4 * MAX_LINE_CHARS + 8


def split_lines(chunks: Iterator[bytes]) -> Iterator[str]:
    """Lines of a byte stream, exactly as :func:`gpuguard.xid.records.log_lines` splits
    the whole text: at ``\\n`` only, a trailing ``\\r`` dropped, a run of NUL bytes
    ending a line (one run, also across chunks), a last line without a newline kept, each
    cut to :data:`~gpuguard.xid.records.MAX_LINE_CHARS`. Memory and time per chunk are
    bounded: of a longer line only its first :data:`MAX_LINE_BYTES` are held, and the rest
    is skipped up to its end."""
    carry = b""
    in_nul_run = False
    skipping = False  # carry holds the head of an over-long line; the rest is dropped
    for chunk in chunks:
        if in_nul_run:
            chunk = chunk.lstrip(b"\x00")
            if not chunk:
                continue
        in_nul_run = chunk.endswith(b"\x00")
        chunk = _NUL_RUN.sub(b"\n", chunk)  # carry holds no NUL: the same as on carry + chunk
        if skipping:
            end = chunk.find(b"\n")
            if end < 0:
                continue
            yield _decode(carry)
            carry, skipping, chunk = b"", False, chunk[end + 1:]
        parts = (carry + chunk).split(b"\n")
        carry = parts.pop()
        for p in parts:
            yield _decode(p)
        if len(carry) > MAX_LINE_BYTES:
            carry, skipping = carry[:MAX_LINE_BYTES], True
    if carry:
        yield _decode(carry)


def _decode(line: bytes) -> str:
    text = line.decode("utf-8", "replace")
    text = text[:-1] if text.endswith("\r") else text
    return text if len(text) <= MAX_LINE_CHARS else text[:MAX_LINE_CHARS]
