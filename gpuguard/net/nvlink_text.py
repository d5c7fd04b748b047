"""Saved NVLink outputs -> per-GPU link states and counters (:class:`NvLinkState`), so
the NVLink check judges a paste like a live NVML reading.

* ``nvidia-smi nvlink -s`` (``--status``): ``GPU 0: NAME (UUID: GPU-...)`` then
  ``Link 3: 25 GB/s`` or ``Link 3: <inactive>``. When no link of a GPU is up, the driver
  prints one NVML message instead of the list (``Unable to retrieve NVLink information
  as all links are inActive``): read as *every link inactive*, the count taken from
  other GPUs of the same model in the file (unknown when none lists its links).
  GPUs without NVLink print nothing at all (empty output).
* ``nvidia-smi nvlink -e`` (``--errorcounters``): ``Link 0: Replay Errors: 0``,
  ``Recovery Errors``, ``CRC Errors`` (counted as CRC flit errors, which NVML's
  ``NVML_NVLINK_ERROR_DL_CRC_FLIT`` is), ``CRC Data Errors``; ``N/A`` is unsupported.
* ``dcgmi nvlink --link-status``: ``gpuId N:`` then one letter per link, ``U`` up,
  ``D`` down, ``X`` disabled, ``_`` not supported (DCGM's key).
* ``nvidia-smi topo -m``: the GPU matrix; ``NV#`` is a bonded set of # NVLinks between
  two GPUs. Per GPU, the NVLinks to its peers are summed (:func:`parse_topo`).
"""

from __future__ import annotations

from collections.abc import Callable

import re
from dataclasses import dataclass, field

from gpuguard.model import NvLinkState


@dataclass
class GpuLinks:
    """One GPU as a text output shows it. ``all_inactive``: the NVML message replaced
    the link list; ``links`` is then filled from same-model peers (or left empty)."""

    index: int
    name: str | None = None
    uuid: str | None = None
    links: dict[int, NvLinkState] = field(default_factory=dict)
    all_inactive: bool = False


_GPU = re.compile(r"^GPU\s+(\d+):\s*(.*?)\s*(?:\(UUID:\s*(GPU-[0-9a-fA-F-]+)\))?\s*$")
_LINK_STATUS = re.compile(r"^Link\s+(\d+):\s*(.+?)\s*$")
_LINK_ERR = re.compile(r"^Link\s+(\d+):\s*([A-Za-z ]+?)\s+Errors?:\s*(\S+)\s*$")
_ALL_INACTIVE = re.compile(r"all links are inactive", re.I)
_ERR_FIELDS = {"replay": "replay_errors", "recovery": "recovery_errors", "crc": "crc_flit_errors",
               "crc flit": "crc_flit_errors", "crc data": "crc_data_errors"}


class NvlinkTextError(ValueError):
    """Not the named output (one line)."""


def _link(g: GpuLinks, n: int) -> NvLinkState:
    return g.links.setdefault(n, NvLinkState(n))


def _walk(text: str, what: str, on_line: Callable[[GpuLinks, int, str, list[str]], None],
          ) -> tuple[list[GpuLinks], list[str]]:
    """The ``GPU N: NAME (UUID: ...)`` sections of ``nvidia-smi nvlink -s|-e`` output:
    elided (``[...]``) and blank lines skipped, the all-links-inactive NVML message noted
    on its GPU, every other line handed to ``on_line(gpu, line_no, line, problems)``.
    Raises :class:`NvlinkTextError` when no GPU line is found (``what`` names the command)."""
    gpus: list[GpuLinks] = []
    problems: list[str] = []
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if m := _GPU.match(line):
            gpus.append(GpuLinks(int(m.group(1)), m.group(2) or None, m.group(3)))
        elif not gpus or not line or line in ("...", "[...]"):
            continue
        elif _ALL_INACTIVE.search(line):
            gpus[-1].all_inactive = True
        else:
            on_line(gpus[-1], no, line, problems)
    if not gpus:
        raise NvlinkTextError(f"no 'GPU N: ...' line: not {what} output")
    return gpus, problems


def _status_line(g: GpuLinks, no: int, line: str, problems: list[str]) -> None:
    m = _LINK_STATUS.match(line)
    if m is None:
        problems.append(f"line {no}: not understood: {line[:80]}")
        return
    val = m.group(2)
    speed = re.match(r"^(\d+(?:\.\d+)?)\s*GB/s$", val)
    if val.strip("<>").lower() in ("inactive", "down", "disabled") or (speed and float(speed.group(1)) == 0):
        _link(g, int(m.group(1))).active = False
    elif speed:
        _link(g, int(m.group(1))).active = True
    else:
        problems.append(f"line {no}: link status {val!r} not understood")


def parse_nvlink_status(text: str) -> tuple[list[GpuLinks], list[str]]:
    """``nvidia-smi nvlink -s`` -> ``(gpus, problems)``; raises :class:`NvlinkTextError`
    when no ``GPU N:`` line is found."""
    gpus, problems = _walk(text, "nvidia-smi nvlink -s", _status_line)
    fill_all_inactive(gpus)
    return gpus, problems


def fill_all_inactive(gpus: list[GpuLinks]) -> None:
    """Give every all-inactive GPU as many inactive links as the most any GPU of the same
    model lists (the message does not say how many)."""
    for g in gpus:
        if not g.all_inactive:
            continue
        n = max((len(p.links) for p in gpus if p.name == g.name and not p.all_inactive), default=0)
        g.links = {i: NvLinkState(i, False) for i in range(n)}


def _error_line(g: GpuLinks, no: int, line: str, problems: list[str]) -> None:
    m = _LINK_ERR.match(line)
    attr = _ERR_FIELDS.get(m.group(2).strip().lower()) if m else None
    if m is None or attr is None:
        problems.append(f"line {no}: not understood: {line[:80]}")
        return
    val = m.group(3)
    if val.upper() == "N/A":
        return
    try:
        setattr(_link(g, int(m.group(1))), attr, int(val))
    except ValueError:
        problems.append(f"line {no}: counter {val!r} not a number")


def parse_nvlink_errors(text: str) -> tuple[list[GpuLinks], list[str]]:
    """``nvidia-smi nvlink -e`` -> ``(gpus, problems)``; raises :class:`NvlinkTextError`."""
    return _walk(text, "nvidia-smi nvlink -e", _error_line)


def parse_dcgmi_link_status(text: str) -> tuple[list[GpuLinks], list[str]]:
    """``dcgmi nvlink --link-status`` -> ``(gpus, problems)`` (NvSwitch rows ignored)."""
    gpus: list[GpuLinks] = []
    problems: list[str] = []
    in_gpus = False
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line.startswith("GPUs:"):
            in_gpus = True
        elif line.startswith("NvSwitches:"):
            in_gpus = False
        elif in_gpus and (m := re.match(r"^gpuId\s+(\d+):$", line)):
            gpus.append(GpuLinks(int(m.group(1))))
        elif in_gpus and gpus and line:
            letters = line.split()
            if not all(c in "UDX_" for c in letters):
                problems.append(f"line {no}: link states {line!r} not understood")
                continue
            base = len(gpus[-1].links)
            for i, c in enumerate(letters):
                if c != "_":
                    gpus[-1].links[base + i] = NvLinkState(base + i, c == "U")
    if not gpus:
        raise NvlinkTextError("no 'gpuId N:' rows: not dcgmi nvlink --link-status output")
    return gpus, problems


def parse_topo(text: str) -> tuple[dict[int, dict[int, str]], list[str]]:
    """``nvidia-smi topo -m`` -> ``({gpu: {peer gpu: connection}}, problems)``; raises
    :class:`NvlinkTextError` without a ``GPU0 GPU1 ...`` header."""
    header: list[str] | None = None
    matrix: dict[int, dict[int, str]] = {}
    problems: list[str] = []
    for no, raw in enumerate(text.splitlines(), 1):
        toks = raw.split()
        if not toks:
            continue
        if header is None:
            if toks[0] == "GPU0" and len(toks) > 1 and toks[1] != "X":  # a data row has X (self) next
                header = toks
            continue
        if toks[0] == "Legend:" or toks[0].startswith("NIC"):
            if toks[0] == "Legend:":
                break
            continue
        m = re.fullmatch(r"GPU(\d+)", toks[0])
        if not m:
            continue
        gi = int(m.group(1))
        row: dict[int, str] = {}
        for col, cell in zip(header, toks[1:], strict=False):
            cm = re.fullmatch(r"GPU(\d+)", col)
            if cm and int(cm.group(1)) != gi:
                if not re.fullmatch(r"X|SYS|NODE|PHB|PXB|PIX|NV\d+|SOC|N/A", cell):
                    problems.append(f"line {no}: cell {cell!r} not understood")
                row[int(cm.group(1))] = cell
        matrix[gi] = row
    if header is None:
        raise NvlinkTextError("no 'GPU0 GPU1 ...' header: not nvidia-smi topo -m output")
    return matrix, problems


def topo_nvlink_counts(matrix: dict[int, dict[int, str]]) -> dict[int, int]:
    """NVLinks per GPU summed over its peers (``NV12`` counts 12)."""
    return {g: sum(int(c[2:]) for c in row.values() if c.startswith("NV")) for g, row in matrix.items()}
