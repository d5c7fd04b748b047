"""What nvidia-smi prints for GPUs it cannot reach, and the GPU recovery action.

* **Dead GPUs.** When NVML cannot get a handle for a GPU, nvidia-smi prints, in place of
  that GPU's section (``-q``, ``-a``, ``-q -x``) or as its whole output (``-i N``), one line
  of its own: ``Unable to determine the device handle for GPU 0000:09:00.0: Unknown
  Error`` (NVIDIA/nvidia-docker#1553; lyulyul/shine-cluster#171). :func:`split_lost_lines`
  takes those lines out of the dump and returns a :class:`~gpuguard.model.GpuState` per
  line, with the bus id and ``read_errors["device_handle"]`` set to the NVML error name,
  so the ``gpu_lost`` check raises ``gpu.lost`` (critical) on that bus id.
  :func:`place_lost_gpus` merges them with the parsed GPUs in document order (the GPU
  index is the position in the dump, as for the sections).
* **Fewer sections than ``Attached GPUs``** is *not* a fault by itself: ``nvidia-smi -q
  -i N`` prints one section under ``Attached GPUs : 8``. Only the configured
  ``[node] gpu_count`` or the job's gres judge the count.
* **GPU recovery action** (R550+ drivers; NVML ``nvmlDeviceGpuRecoveryAction_t``:
  0 None, 1 GPU Reset, 2 Node Reboot, 3 Drain P2P, 4 Drain and Reset). nvidia-smi prints
  it as ``GPU Recovery Action : <name>`` (``-q``), ``<gpu_recovery_action>`` (``-q -x``)
  and in ``--query-gpu=index,gpu_recovery_action --format=csv[,noheader]``
  (:func:`parse_recovery_csv`). Names differ between drivers and tools (``Reset``,
  ``GPU Reset Required``, ``Reboot``, ``OS Reboot``, ``Node Reboot Required``...);
  :func:`gpuguard.xid.catalog.recovery_action_code` maps all of them, or a printed
  number, to the enum value.
"""

from __future__ import annotations

import re

from gpuguard.gpu.nvsmi_common import csv_rows, READ_ERROR_NAMES, NvsmiParseError, ValueReader
from gpuguard.model import GpuState, NodeSnapshot, norm_pci
from gpuguard.xid.catalog import recovery_action_code

_LOST_RE = re.compile(
    r"^\s*Unable to determine the device handle for (?:GPU\s*)?"
    r"(?P<bus>[0-9A-Fa-f]{1,8}:[0-9A-Fa-f]{1,2}:[0-9A-Fa-f]{1,2}(?:\.[0-7])?)\s*:\s*(?P<err>.*?)\s*$",
    re.MULTILINE,
)
_HEADER_RE = re.compile(
    r"^\s*(?:GPU\s+|<gpu id=\")(?P<bus>[0-9A-Fa-f]{1,8}:[0-9A-Fa-f]{1,2}:[0-9A-Fa-f]{1,2}\.[0-7])\"?>?\s*$",
    re.MULTILINE,
)

#: What nvidia-smi prints *instead of* any dump when the driver or every GPU is gone
#: (nvidia-smi's own messages: no GPU enumerated; the kernel module not loaded; NVML not
#: initialised, e.g. "Driver/library version mismatch" after an upgrade without reboot).
_NODE_FAILURE_RE = re.compile(
    r"^(?:No devices were found"
    r"|NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver\b.*"
    r"|Failed to initialize NVML: .+)$"
)


def node_failure(text: str) -> str | None:
    """nvidia-smi's whole-node failure message when that is what the dump holds (its first
    non-empty line; a following ``NVML library version: ...`` line is allowed), else
    ``None``. The caller records it as the snapshot's ``error``: the driver check then
    judges it like NVML failing on the node."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines or not _NODE_FAILURE_RE.match(lines[0]):
        return None
    if any(not ln.startswith("NVML library version") for ln in lines[1:]):
        return None
    return lines[0]


def split_lost_lines(text: str) -> tuple[str, list[tuple[int, GpuState]]]:
    """Remove nvidia-smi's per-GPU "Unable to determine the device handle" lines.

    Returns ``(remaining text, [(offset in the dump, lost GpuState), ...])``. The error
    text after the bus id becomes the NVML error name (``Unknown Error`` -> ``Unknown``,
    ``GPU is lost`` -> ``GpuIsLost``, read from the first sentence; anything else ->
    ``Unknown``)."""
    lost: list[tuple[int, GpuState]] = []
    for m in _LOST_RE.finditer(text):
        # the name is the first sentence: "GPU is lost.  Reboot the system to recover this GPU"
        err = READ_ERROR_NAMES.get(m["err"].split(".", 1)[0].strip().lower(), "Unknown")
        try:
            bus = norm_pci(m["bus"])
        except ValueError:
            continue
        lost.append((m.start(), GpuState(index=-1, pci_bus_id=bus, read_errors={"device_handle": err})))
    if not lost:
        return text, []
    return _LOST_RE.sub("", text), lost


def place_lost_gpus(snap: NodeSnapshot, original: str, lost: list[tuple[int, GpuState]]) -> None:
    """Insert ``lost`` GPUs into ``snap.gpus`` in document order and renumber indices
    (index = position in the dump, as nvidia-smi numbers GPUs by PCI order)."""
    order: list[tuple[int, GpuState]] = []
    headers = [(m.start(), norm_pci(m["bus"])) for m in _HEADER_RE.finditer(original)]
    for i, g in enumerate(snap.gpus):
        pos = next((p for p, bus in headers if bus == g.pci_bus_id), None)
        order.append((pos if pos is not None else -1 + i * 1e-6, g))
    for pos, g in lost:
        g.driver_version, g.cuda_version = snap.driver_version, snap.cuda_version
        order.append((pos, g))
    order.sort(key=lambda pg: pg[0])
    snap.gpus = [g for _, g in order]
    for i, g in enumerate(snap.gpus):
        g.index = i


def lost_only_snapshot(lost: list[tuple[int, GpuState]], source: str, taken_at: float) -> NodeSnapshot:
    """A snapshot of a dump that holds nothing but device-handle error lines."""
    snap = NodeSnapshot(taken_at=taken_at, source=source)
    snap.gpus = [g for _, g in lost]
    for i, g in enumerate(snap.gpus):
        g.index = i
    return snap


def parse_recovery_csv(text: str, where: str, taken_at: float) -> NodeSnapshot:
    """``nvidia-smi --query-gpu=index[,pci.bus_id],gpu_recovery_action --format=csv``
    (with or without the header line) -> one GpuState per row with ``recovery_action``
    set. Without a header the columns must be ``index, gpu_recovery_action``. Raises
    :class:`NvsmiParseError` for any other CSV."""
    rows = csv_rows(text, where)
    if not rows:
        raise NvsmiParseError(f"{where}: empty CSV")
    header = [c.strip().lower() for c in rows[0]]
    if "gpu_recovery_action" in header:
        cols = {name: header.index(name) for name in header}
        body = rows[1:]
    else:
        cols = {"index": 0, "gpu_recovery_action": 1}
        body = rows
    snap = NodeSnapshot(taken_at=taken_at, source="nvidia-smi-query")
    for n, row in enumerate(body, 1):
        try:
            index = int(row[cols["index"]]) if "index" in cols else n - 1
            raw = row[cols["gpu_recovery_action"]]
        except (IndexError, ValueError):
            raise NvsmiParseError(f"{where}: row {n}: expected index, gpu_recovery_action") from None
        g = GpuState(index=index)
        try:  # [Not Supported] -> None; [GPU requires reset] -> a read error of that GPU
            g.recovery_action = ValueReader(g.read_errors, where=where).recovery_action(raw, strict=True)
        except ValueError as e:
            raise NvsmiParseError(f"{where}: row {n}: {e}") from None
        if "pci.bus_id" in cols:
            try:
                g.pci_bus_id = norm_pci(row[cols["pci.bus_id"]])
            except (IndexError, ValueError):
                pass
        snap.gpus.append(g)
    return snap


#: A bracketed nvidia-smi sentinel cell (``[N/A]``, ``[Not Supported]``, ``[GPU requires reset]``).
_SENTINEL_CELL_RE = re.compile(r"^\[[A-Za-z/][A-Za-z/ ]*\]$")


def looks_like_recovery_csv(text: str) -> bool:
    """True for ``--query-gpu`` CSV whose columns are what :func:`parse_recovery_csv` reads:
    a header naming ``gpu_recovery_action``, or header-less ``index, action`` rows, every
    one a known action or a bracketed sentinel (the GPU that needs a reset may be the
    first row) and at least one a known action."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if lines and "gpu_recovery_action" in lines[0].lower():
        return True
    named = False
    for ln in lines:
        cells = [c.strip() for c in ln.split(",")]
        if len(cells) != 2 or not cells[0].isdigit():
            return False
        if recovery_action_code(cells[1]) is not None:
            named = True
        elif not _SENTINEL_CELL_RE.match(cells[1]):
            return False
    return named
