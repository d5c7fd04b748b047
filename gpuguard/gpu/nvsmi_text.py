"""Parse ``nvidia-smi -q`` text into a :class:`~gpuguard.model.NodeSnapshot`.

Source: the text layout nvidia-smi prints for ``-q`` (drivers 460 to 560 in
``shared/corpus``, section 2 of its INDEX.md). The document is an indentation-nested
``Key : Value`` tree; :func:`build_tree` turns it into :class:`Entry` nodes without
knowing any key, and :func:`parse_nvsmi_text` maps the known keys onto
:class:`~gpuguard.model.GpuState` (units: W, MHz, MiB, degrees C, percent).

Layout variants handled (old name / new name):

* ``Clocks Throttle Reasons`` (< 530) / ``Clocks Event Reasons``; sub-reasons nested
  under ``HW Slowdown`` are read like top-level ones.
* ``Ecc Mode`` / ``ECC Mode`` (keys match case-insensitively everywhere).
* ECC counters: Ampere/Hopper ``SRAM|DRAM Correctable`` and ``SRAM|DRAM Uncorrectable``
  (Hopper splits SRAM uncorrectable into ``Parity`` and ``SEC-DED``) are *summed*
  into the corrected / uncorrected totals; Volta/Pascal ``Single Bit > Total`` and
  ``Double Bit > Total`` are taken as they are.
* ``Power Readings`` (``Enforced Power Limit``) / ``GPU Power Readings``
  (``Current Power Limit``); ``Power Draw`` or, from R545, ``Average Power Draw``.
* ``Remapped Rows`` as a block or as a single ``N/A`` line (then all ``None``); its
  ``Bank Remap Availability Histogram > None`` (``0 bank(s)``) is ``remap_banks_none``.
* ``Replays Since Reset`` / ``Replay Number``.
* R575+ (Blackwell) ``ECC Errors > Channel Repair Pending`` / ``TPC Repair Pending`` /
  ``Unrepairable Memory`` (580 dump in tests/data); absent on older drivers (``None``).
* ``Fabric`` (R535+: ``State``, ``Status``; R550+: ``CliqueId``, ``ClusterUUID``, a
  ``Health`` block; R570+: ``Health > Summary`` / ``Incorrect Configuration``), read by
  :func:`~gpuguard.gpu.nvsmi_common.read_fabric`; ``N/A`` on GPUs without NVLink fabric.

Temperatures: ``GPU Current Temp`` -> ``temp_c``, ``GPU Slowdown Temp`` ->
``temp_slowdown_c``, ``GPU Shutdown Temp`` -> ``temp_shutdown_c``. The 535+ Hopper
lines ``GPU T.Limit Temp``, ``GPU Slowdown T.Limit Temp`` and ``GPU Shutdown T.Limit
Temp`` are *margins* relative to the T.Limit (``-8 C`` = 8 degrees past it), not
absolute thresholds; they are deliberately not mapped, so on such GPUs the two
threshold fields stay ``None`` (the model has no margin field).

PCI bus ids are stored normalised by :func:`gpuguard.model.norm_pci`
(``00000001:00:00.0`` -> ``0001:00:00.0``). GPU index = order in the document.
NVLink counters are not part of ``-q``: ``nvlinks`` stays ``None``.

Tolerated: ``[...]`` / ``...`` elision lines, the ``==NVSMI LOG==`` banner, fragments
that start mid-tree (no ``GPU xxxx:xx:xx.x`` header: one GPU with index 0 is built
from whatever fields are there). A file that is not ``-q`` text at all raises
:class:`~gpuguard.gpu.nvsmi_common.NvsmiParseError`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from gpuguard.gpu.nvsmi_common import (
    NvsmiParseError,
    ValueReader,
    first_available,
    order_reasons,
    new_snapshot,
    read_fabric,
    reject_other_formats,
)
from gpuguard.model import CLOCK_EVENT_REASONS, FABRIC_HEALTH_FLAGS, GpuState, NodeSnapshot, norm_pci

log = logging.getLogger(__name__)

SOURCE = "nvidia-smi-q"

#: Clock-event labels seen in parsed dumps that are not in ``CLOCK_EVENT_REASONS``
#: (a newer driver's reason). They are ignored, never fatal; kept here for triage.
UNKNOWN_CLOCK_EVENT_LABELS: set[str] = set()

_LABEL_TO_REASON = {
    label.casefold(): name for name, (_bit, label) in CLOCK_EVENT_REASONS.items()
}

_GPU_HEADER_RE = re.compile(
    r"^GPU\s+([0-9A-Fa-f]{1,8}:[0-9A-Fa-f]{1,2}:[0-9A-Fa-f]{1,2}\.[0-7])$"
)
_KEY_VALUE_RE = re.compile(r"^(.*?\S)\s+:(?:\s+(.*))?$")
_ELISION_RE = re.compile(r"^(?:\[\s*(?:\.{3}|…)\s*\]|\.{3,}|…)$")
_BANNER_RE = re.compile(r"^=+\s*NVSMI LOG\s*=+$")
_DOCUMENT_KEYS = {"timestamp", "driver version", "cuda version", "attached gpus"}


@dataclass
class Entry:
    """One line of the tree: ``key`` and ``value`` (``None`` for a section header
    such as ``MIG Mode``), the lines indented under it, and its 1-based line number.
    A key may repeat under one parent (``Processes``); lookups return the first."""

    key: str
    value: str | None = None
    children: list[Entry] = field(default_factory=list)
    line: int = 0

    def find(self, *path: str) -> Entry | None:
        """The entry at ``path`` (keys compared case-insensitively), or ``None``."""
        node: Entry | None = self
        for key in path:
            k = key.casefold()
            node = next((c for c in node.children if c.key.casefold() == k), None)
            if node is None:
                return None
        return node

    def get(self, *path: str) -> str | None:
        """The raw value at ``path``; ``None`` if the key is absent or a header."""
        e = self.find(*path)
        return e.value if e is not None else None

    def first(self, *paths: tuple[str, ...]) -> str | None:
        """The value of the first of ``paths`` that is present and available (not
        ``N/A``), see :func:`~gpuguard.gpu.nvsmi_common.first_available`."""
        return first_available(self.get(*p) for p in paths)


def build_tree(text: str) -> Entry:
    """Nest ``Key : Value`` lines by indentation under a root :class:`Entry`.

    Tabs count as 4 columns. Blank lines and the banner are skipped. A line less
    indented than the one before closes the sections it was in. An elision line
    (``[...]``, ``...``) closes the sections at its depth; lines indented deeper
    after it are attached to the section that is still open above it.
    """
    root = Entry(key="", line=0)
    stack: list[tuple[int, Entry]] = [(-1, root)]
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.expandtabs(4).rstrip()
        body = line.lstrip()
        if not body or _BANNER_RE.match(body):
            continue
        indent = len(line) - len(body)
        if _ELISION_RE.match(body):
            # Lines cut out here belonged to unknown sections: close the sections at
            # this depth and let deeper lines that follow fall to the open parent.
            while stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, stack[-1][1]))
            continue
        m = _KEY_VALUE_RE.match(body)
        entry = (
            Entry(key=m.group(1), value=m.group(2) or "", line=n)
            if m
            else Entry(key=body, line=n)
        )
        while stack[-1][0] >= indent:
            stack.pop()
        stack[-1][1].children.append(entry)
        stack.append((indent, entry))
    return root


def _ecc_totals(
    rd: ValueReader, section: Entry | None, prefix: str
) -> tuple[int | None, int | None]:
    """(corrected, uncorrected) from a ``Volatile`` or ``Aggregate`` section."""
    if section is None:
        return None, None
    fc, fu = f"ecc_{prefix}_corrected", f"ecc_{prefix}_uncorrected"
    if section.find("Single Bit") is not None or section.find("Double Bit") is not None:
        return rd.int(fc, section.get("Single Bit", "Total")), rd.int(
            fu, section.get("Double Bit", "Total")
        )
    corr = [
        c.value
        for c in section.children
        if c.key.casefold() in ("sram correctable", "dram correctable")
    ]
    unc = [
        c.value
        for c in section.children
        if c.key.casefold().startswith(("sram uncorrectable", "dram uncorrectable"))
    ]
    return rd.counter_sum(fc, corr), rd.counter_sum(fu, unc)


def _clock_event_reasons(rd: ValueReader, g: Entry) -> list[str] | None:
    section = g.find("Clocks Event Reasons") or g.find("Clocks Throttle Reasons")
    if section is None:
        return None
    active: list[str] = []
    seen_any = False

    def walk(entries: list[Entry]) -> None:
        nonlocal seen_any
        for e in entries:
            walk(e.children)
            if e.value is None:
                continue
            name = _LABEL_TO_REASON.get(e.key.casefold())
            if name is None:
                UNKNOWN_CLOCK_EVENT_LABELS.add(e.key)
                log.info(
                    "unknown clock event reason label %r (line %d) ignored",
                    e.key,
                    e.line,
                )
                continue
            state = rd.bool("clock_event_reasons", e.value)
            if state is not None:
                seen_any = True
                if state:
                    active.append(name)

    walk(section.children)
    return order_reasons(active) if seen_any else None


def _read_identity(rd: ValueReader, g: Entry, gpu: GpuState) -> None:
    """Product name, serial, UUID, VBIOS/InfoROM versions, persistence and MIG modes."""
    gpu.name = rd.text("name", g.get("Product Name"))
    gpu.serial = rd.text("serial", g.get("Serial Number"))
    gpu.uuid = rd.text("uuid", g.get("GPU UUID"))
    gpu.vbios_version = rd.text("vbios_version", g.get("VBIOS Version"))
    gpu.inforom_version = rd.text(
        "inforom_version", g.get("Inforom Version", "Image Version")
    )
    gpu.persistence_mode = rd.bool("persistence_mode", g.get("Persistence Mode"))
    gpu.mig_mode = rd.bool("mig_mode", g.get("MIG Mode", "Current"))


def _read_pcie(
    rd: ValueReader, g: Entry, gpu: GpuState, bus_header: str | None, where: str, index: int
) -> None:
    """PCI bus id (the section header's when the body has none), PCIe link generation and
    width, replay counter."""
    bus = rd.text("pci_bus_id", g.get("PCI", "Bus Id")) or bus_header
    if bus:
        try:
            gpu.pci_bus_id = norm_pci(bus)
        except ValueError:
            log.warning("%s: GPU %d: bus id %r is not a PCI address", where, index, bus)
    link = ("PCI", "GPU Link Info")
    gpu.pcie_gen_max = rd.int(
        "pcie_gen_max",
        g.first(
            (*link, "PCIe Generation", "Max"), (*link, "PCIe Generation", "Device Max")
        ),
    )
    gpu.pcie_gen_current = rd.int(
        "pcie_gen_current",
        g.first(
            (*link, "PCIe Generation", "Current"),
            (*link, "PCIe Generation", "Device Current"),
        ),
    )
    gpu.pcie_width_max = rd.int("pcie_width_max", g.get(*link, "Link Width", "Max"))
    gpu.pcie_width_current = rd.int(
        "pcie_width_current", g.get(*link, "Link Width", "Current")
    )
    gpu.pcie_replay_count = rd.int(
        "pcie_replay_count",
        g.first(("PCI", "Replays Since Reset"), ("PCI", "Replay Number")),
    )


def _read_util_memory(rd: ValueReader, g: Entry, gpu: GpuState) -> None:
    """Clock-event (throttle) reasons, framebuffer memory used/total, GPU and memory utilisation."""
    gpu.clock_event_reasons = _clock_event_reasons(rd, g)
    gpu.mem_total_mib = rd.float("mem_total_mib", g.get("FB Memory Usage", "Total"))
    gpu.mem_used_mib = rd.float("mem_used_mib", g.get("FB Memory Usage", "Used"))
    gpu.gpu_util_pct = rd.float("gpu_util_pct", g.get("Utilization", "Gpu"))
    gpu.mem_util_pct = rd.float("mem_util_pct", g.get("Utilization", "Memory"))


def _read_ecc_pages_rows(rd: ValueReader, g: Entry, gpu: GpuState) -> None:
    """ECC mode and volatile/aggregate counters, retired pages, GPU recovery action, row remapping."""
    gpu.ecc_enabled = rd.bool("ecc_enabled", g.get("ECC Mode", "Current"))
    ecc = g.find("ECC Errors")
    gpu.ecc_volatile_corrected, gpu.ecc_volatile_uncorrected = _ecc_totals(
        rd, ecc.find("Volatile") if ecc else None, "volatile"
    )
    gpu.ecc_aggregate_corrected, gpu.ecc_aggregate_uncorrected = _ecc_totals(
        rd, ecc.find("Aggregate") if ecc else None, "aggregate"
    )
    gpu.sram_threshold_exceeded = rd.bool(
        "sram_threshold_exceeded", g.get("ECC Errors", "Aggregate", "SRAM Threshold Exceeded")
    )
    gpu.retired_pages_sbe = rd.int(
        "retired_pages_sbe", g.get("Retired Pages", "Single Bit ECC")
    )
    gpu.retired_pages_dbe = rd.int(
        "retired_pages_dbe", g.get("Retired Pages", "Double Bit ECC")
    )
    # Drivers print "Pending Page Blacklist" and/or "Pending Page Retirement" (or a bare
    # "Pending"): a Yes in any of them means pages wait for retirement.
    pend = [rd.bool("retired_pages_pending", g.get("Retired Pages", k))
            for k in ("Pending Page Blacklist", "Pending Page Retirement", "Pending")]
    gpu.retired_pages_pending = True if True in pend else (False if False in pend else None)
    gpu.recovery_action = rd.recovery_action(g.get("GPU Recovery Action"))
    gpu.remapped_rows_correctable = rd.int(
        "remapped_rows_correctable", g.get("Remapped Rows", "Correctable Error")
    )
    gpu.remapped_rows_uncorrectable = rd.int(
        "remapped_rows_uncorrectable", g.get("Remapped Rows", "Uncorrectable Error")
    )
    gpu.remapped_rows_pending = rd.bool(
        "remapped_rows_pending", g.get("Remapped Rows", "Pending")
    )
    gpu.remapped_rows_failure = rd.bool(
        "remapped_rows_failure", g.get("Remapped Rows", "Remapping Failure Occurred")
    )
    gpu.remap_banks_none = rd.int(
        "remap_banks_none", g.get("Remapped Rows", "Bank Remap Availability Histogram", "None")
    )
    # R575+ (Blackwell): under ECC Errors, next to Volatile / Aggregate
    gpu.channel_repair_pending = rd.bool("channel_repair_pending", g.get("ECC Errors", "Channel Repair Pending"))
    gpu.tpc_repair_pending = rd.bool("tpc_repair_pending", g.get("ECC Errors", "TPC Repair Pending"))
    gpu.unrepairable_memory = rd.bool("unrepairable_memory", g.get("ECC Errors", "Unrepairable Memory"))


def _read_thermal_power_clocks(rd: ValueReader, g: Entry, gpu: GpuState) -> None:
    """Temperature and its slowdown/shutdown thresholds, power draw and limit, current and max clocks."""
    gpu.temp_c = rd.float("temp_c", g.get("Temperature", "GPU Current Temp"))
    gpu.temp_slowdown_c = rd.float(
        "temp_slowdown_c", g.get("Temperature", "GPU Slowdown Temp")
    )
    gpu.temp_shutdown_c = rd.float(
        "temp_shutdown_c", g.get("Temperature", "GPU Shutdown Temp")
    )

    power = g.find("GPU Power Readings") or g.find("Power Readings") or Entry(key="")
    gpu.power_w = rd.float(
        "power_w",
        power.first(
            ("Power Draw",), ("Average Power Draw",), ("Instantaneous Power Draw",)
        ),
    )
    gpu.power_limit_w = rd.float(
        "power_limit_w",
        power.first(
            ("Current Power Limit",), ("Enforced Power Limit",), ("Power Limit",)
        ),
    )
    gpu.sm_clock_mhz = rd.float("sm_clock_mhz", g.get("Clocks", "SM"))
    gpu.mem_clock_mhz = rd.float("mem_clock_mhz", g.get("Clocks", "Memory"))
    gpu.sm_clock_max_mhz = rd.float("sm_clock_max_mhz", g.get("Max Clocks", "SM"))
    gpu.mem_clock_max_mhz = rd.float("mem_clock_max_mhz", g.get("Max Clocks", "Memory"))


def _read_fabric(rd: ValueReader, g: Entry, gpu: GpuState) -> None:
    """The ``Fabric`` block (R535+; ``Health`` from R550, its ``Summary`` and ``Incorrect
    Configuration`` lines from R570): state, status, clique id, cluster UUID, health."""
    f = g.find("Fabric")
    if f is None:
        return
    h = f.find("Health") or Entry(key="")
    read_fabric(gpu, rd, f.get("State"), f.get("Status"), f.get("CliqueId"), f.get("ClusterUUID"),
                h.get("Summary"), {name: h.get(label) for name, (_s, label, _x, _b) in FABRIC_HEALTH_FLAGS.items()},
                h.get("Incorrect Configuration"))


def _gpu_state(
    index: int,
    g: Entry,
    bus_header: str | None,
    driver: str | None,
    cuda: str | None,
    where: str,
) -> GpuState:
    """Map one ``GPU xxxx:xx:xx.x`` section (or a headerless fragment) to a GpuState."""
    gpu = GpuState(index=index, driver_version=driver, cuda_version=cuda)
    rd = ValueReader(gpu.read_errors, where=where)
    _read_identity(rd, g, gpu)
    _read_pcie(rd, g, gpu, bus_header, where, index)
    _read_util_memory(rd, g, gpu)
    _read_ecc_pages_rows(rd, g, gpu)
    _read_thermal_power_clocks(rd, g, gpu)
    _read_fabric(rd, g, gpu)
    return gpu


#: Keys nvidia-smi -q prints inside a GPU section (casefolded), for recognising fragments.
_GPU_SECTION_KEYS = frozenset(k.casefold() for k in (
    "Product Name", "GPU UUID", "Serial Number", "VBIOS Version", "Persistence Mode", "PCI",
    "FB Memory Usage", "Utilization", "Ecc Mode", "ECC Mode", "ECC Errors", "Retired Pages",
    "Remapped Rows", "Temperature", "Power Readings", "GPU Power Readings", "Clocks", "Max Clocks",
    "Clocks Event Reasons", "Clocks Throttle Reasons", "Performance State", "MIG Mode", "Fabric",
))


def parse_nvsmi_text(
    text: str, taken_at: float | None = None, where: str = "<text>"
) -> NodeSnapshot:
    """Parse a whole or partial ``nvidia-smi -q`` document.

    ``taken_at`` is used when the dump has no ``Timestamp`` line (default: now);
    ``where`` names the file in log lines and errors. Returns a snapshot with source
    ``"nvidia-smi-q"``, one GpuState per ``GPU`` section in document order.
    Raises :class:`NvsmiParseError` for another nvidia-smi format (table, CSV) or
    when no ``Key : Value`` line is found. NUL bytes (a file written through a crash
    or a full disk; nvidia-smi prints none) are read through, so a NUL at a line's
    start does not move the line out of its section, and mark the dump incomplete:
    the bytes they replaced may have held a fault.
    """
    damaged = f"{where}: holds NUL bytes (the dump is damaged)" if "\0" in text else None
    text = text.replace("\0", "")
    reject_other_formats(text, where)
    root = build_tree(text)
    if not any(e.value is not None for e in _walk(root)):
        raise NvsmiParseError(
            f"{where}: no 'Key : Value' lines; not nvidia-smi -q output"
        )
    snap = new_snapshot(SOURCE, where, root.get("Driver Version"), root.get("CUDA Version"), root.get("Timestamp"), taken_at)
    driver, cuda = snap.driver_version, snap.cuda_version
    sections = [(c, _GPU_HEADER_RE.match(c.key)) for c in root.children]
    gpu_sections = [(c, m.group(1)) for c, m in sections if m]
    if not gpu_sections and any(
        c.key.casefold() not in _DOCUMENT_KEYS for c in root.children
    ):
        # A fragment cut out of one GPU's section -- but only if it holds, at its top, a
        # key that nvidia-smi -q really prints there; any other "Key : Value" text (a
        # README, a kernel log) would otherwise become one GPU and fail the GPU-count
        # check, and a GPU section under a header line not read (a damaged byte, a new
        # layout) would become one GPU with nothing read, which passes.
        if not any(e.key.casefold() in _GPU_SECTION_KEYS for e in root.children):
            raise NvsmiParseError(
                f"{where}: no GPU section and no nvidia-smi -q GPU field; not nvidia-smi -q output"
            )
        gpu_sections = [(root, None)]
    for i, (g, bus) in enumerate(gpu_sections):
        snap.gpus.append(_gpu_state(i, g, bus, driver, cuda, where))
    snap.incomplete = damaged or _cut_short(text, [g for g, _ in gpu_sections], where)
    return snap


def _cut_short(text: str, sections: list[Entry], where: str) -> str | None:
    """Why the dump looks cut short, or None: its last line has no newline (``head -c``,
    a full disk), or its last GPU section lacks keys the first one has, ``Processes`` (the
    last key nvidia-smi prints in a section) among them (a multi-GPU dump cut between
    lines). A ``-q -d ECC`` subset is whole (every section has the same keys), and so is a
    node of two GPU models (each section ends with its ``Processes``)."""
    if text and not text.endswith("\n"):
        return f"{where}: the last line has no newline (the dump is cut short)"
    if len(sections) > 1:
        first = {c.key.casefold() for c in sections[0].children}
        last = {c.key.casefold() for c in sections[-1].children}
        missing = [c.key for c in sections[0].children if c.key.casefold() in first - last]
        if missing and "processes" in first - last:
            return (f"{where}: the last GPU section lacks {', '.join(missing[:3])}"
                    f"{' ...' if len(missing) > 3 else ''} (the dump is cut short)")
    return None


def _walk(e: Entry) -> Iterator[Entry]:
    """Every entry under ``e``, depth first."""
    for c in e.children:
        yield c
        yield from _walk(c)
