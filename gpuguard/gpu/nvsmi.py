"""Load an ``nvidia-smi -q`` or ``nvidia-smi -q -x`` dump, whichever it is.

This is the entry point for the replay GPU source and for triage of dumps that
operators attach to tickets: :func:`load_nvidia_smi` sniffs the format and hands the
text to :mod:`gpuguard.gpu.nvsmi_text` or :mod:`gpuguard.gpu.nvsmi_xml`, and
``--query-gpu`` CSV with its header to :mod:`gpuguard.gpu.nvsmi_csv`. Other nvidia-smi
outputs (the default table, header-less CSV, ``nvlink --status``) raise :class:`NvsmiParseError` with a one-line message naming the file and the
command to run instead.
"""

from __future__ import annotations

import os
from pathlib import Path

from gpuguard.gpu.nvsmi_common import NvsmiParseError, is_xml, reject_other_formats
from gpuguard.gpu.nvsmi_text import parse_nvsmi_text
from gpuguard.gpu.nvsmi_xml import parse_nvsmi_xml
from gpuguard.model import NodeSnapshot

__all__ = ["NvsmiParseError", "load_nvidia_smi", "parse_nvidia_smi"]


def parse_nvidia_smi(
    text: str, taken_at: float | None = None, where: str = "<text>"
) -> NodeSnapshot:
    """Parse dump text: XML when it starts with ``<?xml`` / ``<nvidia_smi_log``,
    else ``-q`` text. ``taken_at`` is used only when the dump has no timestamp
    (default: now). Raises :class:`NvsmiParseError`."""
    import time

    from gpuguard.gpu import nvsmi_lost

    from gpuguard.gpu import nvsmi_csv

    if nvsmi_csv.looks_like_query_csv(text):
        rest, lost = nvsmi_lost.split_lost_lines(text)
        snap = nvsmi_csv.parse_query_csv(rest, where, taken_at if taken_at is not None else time.time())
        for _pos, g in lost:  # a GPU nvidia-smi could not reach prints its error line instead of its row
            g.index = len(snap.gpus)
            snap.gpus.append(g)
        return snap
    if nvsmi_lost.looks_like_recovery_csv(text):
        return nvsmi_lost.parse_recovery_csv(text, where, taken_at if taken_at is not None else time.time())
    failure = nvsmi_lost.node_failure(text)
    if failure:
        return NodeSnapshot(taken_at=taken_at if taken_at is not None else time.time(),
                            source="nvidia-smi-q", error=f"nvidia-smi: {failure}")
    # nvidia-smi's own per-GPU error line stands in for a dead GPU's section, or is the
    # whole output of `nvidia-smi -q -i N`: a lost GPU, not bad input
    rest, lost = nvsmi_lost.split_lost_lines(text)
    if lost and not rest.strip(" \t\r\n=NVSMILOG"):
        return nvsmi_lost.lost_only_snapshot(lost, "nvidia-smi-q", taken_at if taken_at is not None else time.time())
    if is_xml(rest):
        snap = parse_nvsmi_xml(rest, taken_at=taken_at, where=where)
    else:
        reject_other_formats(rest, where)
        snap = parse_nvsmi_text(rest, taken_at=taken_at, where=where)
    if lost:
        nvsmi_lost.place_lost_gpus(snap, text, lost)
    return snap


def load_nvidia_smi(
    path_or_text: str | os.PathLike[str] | bytes, taken_at: float | None = None
) -> NodeSnapshot:
    """Read a dump from a file or from text and return its :class:`NodeSnapshot`.

    ``path_or_text``: a ``Path``/``PathLike`` is always a file; ``bytes`` are UTF-8
    text; a ``str`` is text when it contains a newline or starts with ``<``, and a
    file path otherwise. The snapshot's ``taken_at`` is the dump's own timestamp
    (node local time -> epoch); without one, ``taken_at`` if given, else the file's
    modification time, else now.

    Raises :class:`NvsmiParseError` (message ``<file>: <what is wrong>``) for a file
    that cannot be read or is not ``-q``/``-q -x`` output.
    """
    if isinstance(path_or_text, bytes):
        return parse_nvidia_smi(
            path_or_text.decode("utf-8", errors="replace"), taken_at
        )
    if isinstance(path_or_text, str) and (
        "\n" in path_or_text or path_or_text.lstrip().startswith("<")
    ):
        return parse_nvidia_smi(path_or_text, taken_at)
    path = Path(path_or_text)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
        mtime = path.stat().st_mtime
    except OSError as e:
        raise NvsmiParseError(f"{path}: cannot read: {e.strerror or e}") from None
    return parse_nvidia_smi(
        text, taken_at if taken_at is not None else mtime, where=str(path)
    )
