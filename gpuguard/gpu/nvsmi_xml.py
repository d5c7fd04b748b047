"""Parse ``nvidia-smi -q -x`` XML into a :class:`~gpuguard.model.NodeSnapshot`.

Source: the ``nvidia_smi_log`` document (DTDs ``nvsmi_device_v10`` to ``v12``; the
corpus sample is v11 from driver 510, element names of later drivers from public
575-era dumps). Field mapping, units and the meaning of ``None`` are the same as in
:mod:`gpuguard.gpu.nvsmi_text`; element-name variants handled (old / new):

* ``clocks_throttle_reasons/clocks_throttle_reason_*`` / ``clocks_event_reasons/
  clocks_event_reason_*``;
* ``power_readings`` / ``gpu_power_readings``; ``power_draw`` /
  ``average_power_draw`` (then ``instant_power_draw``); the enforced limit from
  ``current_power_limit``, ``enforced_power_limit`` or ``power_limit``, first found;
* ECC ``volatile``/``aggregate`` as ``sram_*``/``dram_*`` counters (summed, Hopper's
  ``sram_uncorrectable_parity`` + ``_secded`` included) or Volta ``single_bit/total``
  and ``double_bit/total``;
* ``<remapped_rows>N/A</remapped_rows>`` (all remap fields ``None``);
  ``remapped_rows/row_remapper_histogram/row_remapper_histogram_none`` (``0 bank(s)``)
  is ``remap_banks_none``;
* ``mig_mode/current_mig``;
* ``fabric/{state,status,cliqueId,clusterUuid,health/*}`` (R535+; ``N/A`` without a fabric);
* ``temperature/gpu_temp_slow_threshold`` and ``gpu_temp_max_threshold`` are absolute
  thresholds; the ``*_tlimit*`` elements are margins and are not mapped.

Safety: parsed with :mod:`xml.etree.ElementTree` (expat), which never fetches the
``<!DOCTYPE ... SYSTEM "nvsmi_device_v11.dtd">``; a document that declares entities
(``<!ENTITY``, the entity-expansion attack) is refused before parsing.
"""

from __future__ import annotations

import logging
import re
import xml.etree.ElementTree as ET

from gpuguard.gpu.nvsmi_common import (
    NvsmiParseError,
    ValueReader,
    first_available,
    is_xml,
    order_reasons,
    new_snapshot,
    read_fabric,
)
from gpuguard.model import CLOCK_EVENT_REASONS, FABRIC_HEALTH_FLAGS, GpuState, NodeSnapshot, norm_pci

log = logging.getLogger(__name__)

SOURCE = "nvidia-smi-qx"

#: ``clocks_*_reason_<suffix>`` suffixes seen that are not known reasons; ignored.
UNKNOWN_CLOCK_EVENT_ELEMENTS: set[str] = set()

#: element suffix -> reason name (the XML says ``display_clocks_setting``).
_SUFFIX_TO_REASON = {name: name for name in CLOCK_EVENT_REASONS}
_SUFFIX_TO_REASON["display_clocks_setting"] = "display_clock_setting"
_REASON_PREFIX_RE = re.compile(r"^clocks_(?:event|throttle)_reason_")
_ENTITY_RE = re.compile(r"<!ENTITY", re.IGNORECASE)


def _first(el: ET.Element, *paths: str) -> str | None:
    """Text of the first of ``paths`` present under ``el`` and available (not ``N/A``;
    :func:`~gpuguard.gpu.nvsmi_common.first_available`); an element without text is ``""``."""
    found = (el.find(p) for p in paths)
    return first_available(None if f is None else (f.text or "") for f in found)


def _ecc_totals(
    rd: ValueReader, section: ET.Element | None, prefix: str
) -> tuple[int | None, int | None]:
    """(corrected, uncorrected) from ``ecc_errors/volatile`` or ``ecc_errors/aggregate``."""
    if section is None:
        return None, None
    fc, fu = f"ecc_{prefix}_corrected", f"ecc_{prefix}_uncorrected"
    if section.find("single_bit") is not None or section.find("double_bit") is not None:
        return rd.int(fc, section.findtext("single_bit/total")), rd.int(
            fu, section.findtext("double_bit/total")
        )
    corr = [
        c.text for c in section if c.tag in ("sram_correctable", "dram_correctable")
    ]
    unc = [
        c.text
        for c in section
        if c.tag.startswith(("sram_uncorrectable", "dram_uncorrectable"))
    ]
    return rd.counter_sum(fc, corr), rd.counter_sum(fu, unc)


def _clock_event_reasons(rd: ValueReader, gpu_el: ET.Element) -> list[str] | None:
    section = gpu_el.find("clocks_event_reasons")
    if section is None:
        section = gpu_el.find("clocks_throttle_reasons")
    if section is None:
        return None
    active: list[str] = []
    seen_any = False
    for child in section:
        suffix = _REASON_PREFIX_RE.sub("", child.tag)
        name = _SUFFIX_TO_REASON.get(suffix)
        if name is None:
            UNKNOWN_CLOCK_EVENT_ELEMENTS.add(child.tag)
            log.info("unknown clock event reason element <%s> ignored", child.tag)
            continue
        state = rd.bool("clock_event_reasons", child.text)
        if state is not None:
            seen_any = True
            if state:
                active.append(name)
    return order_reasons(active) if seen_any else None


def _read_identity(rd: ValueReader, el: ET.Element, gpu: GpuState) -> None:
    """Product name, serial, UUID, VBIOS/InfoROM versions, persistence and MIG modes."""
    gpu.name = rd.text("name", el.findtext("product_name"))
    gpu.serial = rd.text("serial", el.findtext("serial"))
    gpu.uuid = rd.text("uuid", el.findtext("uuid"))
    gpu.vbios_version = rd.text("vbios_version", el.findtext("vbios_version"))
    gpu.inforom_version = rd.text(
        "inforom_version", el.findtext("inforom_version/img_version")
    )
    gpu.persistence_mode = rd.bool("persistence_mode", el.findtext("persistence_mode"))
    gpu.mig_mode = rd.bool("mig_mode", el.findtext("mig_mode/current_mig"))


def _read_pcie(
    rd: ValueReader, el: ET.Element, gpu: GpuState, where: str, index: int
) -> None:
    """PCI bus id (the ``<gpu id>`` attribute when ``pci_bus_id`` is absent), PCIe link
    generation and width, replay counter."""
    bus = rd.text("pci_bus_id", el.findtext("pci/pci_bus_id")) or el.get("id")
    if bus:
        try:
            gpu.pci_bus_id = norm_pci(bus)
        except ValueError:
            log.warning("%s: GPU %d: bus id %r is not a PCI address", where, index, bus)
    link = "pci/pci_gpu_link_info"
    gpu.pcie_gen_max = rd.int(
        "pcie_gen_max",
        _first(
            el, f"{link}/pcie_gen/max_link_gen", f"{link}/pcie_gen/max_device_link_gen"
        ),
    )
    gpu.pcie_gen_current = rd.int(
        "pcie_gen_current",
        _first(
            el,
            f"{link}/pcie_gen/current_link_gen",
            f"{link}/pcie_gen/device_current_link_gen",
        ),
    )
    gpu.pcie_width_max = rd.int(
        "pcie_width_max", el.findtext(f"{link}/link_widths/max_link_width")
    )
    gpu.pcie_width_current = rd.int(
        "pcie_width_current", el.findtext(f"{link}/link_widths/current_link_width")
    )
    gpu.pcie_replay_count = rd.int(
        "pcie_replay_count", el.findtext("pci/replay_counter")
    )


def _read_util_memory(rd: ValueReader, el: ET.Element, gpu: GpuState) -> None:
    """Clock-event (throttle) reasons, framebuffer memory used/total, GPU and memory utilisation."""
    gpu.clock_event_reasons = _clock_event_reasons(rd, el)
    gpu.mem_total_mib = rd.float("mem_total_mib", el.findtext("fb_memory_usage/total"))
    gpu.mem_used_mib = rd.float("mem_used_mib", el.findtext("fb_memory_usage/used"))
    gpu.gpu_util_pct = rd.float("gpu_util_pct", el.findtext("utilization/gpu_util"))
    gpu.mem_util_pct = rd.float("mem_util_pct", el.findtext("utilization/memory_util"))


def _read_ecc_pages_rows(rd: ValueReader, el: ET.Element, gpu: GpuState) -> None:
    """ECC mode and volatile/aggregate counters, retired pages, GPU recovery action, row remapping."""
    gpu.ecc_enabled = rd.bool("ecc_enabled", el.findtext("ecc_mode/current_ecc"))
    gpu.ecc_volatile_corrected, gpu.ecc_volatile_uncorrected = _ecc_totals(
        rd, el.find("ecc_errors/volatile"), "volatile"
    )
    gpu.ecc_aggregate_corrected, gpu.ecc_aggregate_uncorrected = _ecc_totals(
        rd, el.find("ecc_errors/aggregate"), "aggregate"
    )
    gpu.sram_threshold_exceeded = rd.bool(
        "sram_threshold_exceeded", el.findtext("ecc_errors/aggregate/sram_threshold_exceeded")
    )
    gpu.retired_pages_sbe = rd.int(
        "retired_pages_sbe",
        el.findtext("retired_pages/multiple_single_bit_retirement/retired_count"),
    )
    gpu.retired_pages_dbe = rd.int(
        "retired_pages_dbe",
        el.findtext("retired_pages/double_bit_retirement/retired_count"),
    )
    # both may be present; a Yes in either means pages wait for retirement
    pend = [rd.bool("retired_pages_pending", el.findtext(p))
            for p in ("retired_pages/pending_blacklist", "retired_pages/pending_retirement")]
    gpu.retired_pages_pending = True if True in pend else (False if False in pend else None)
    gpu.recovery_action = rd.recovery_action(el.findtext("gpu_recovery_action"))
    gpu.remapped_rows_correctable = rd.int(
        "remapped_rows_correctable", el.findtext("remapped_rows/remapped_row_corr")
    )
    gpu.remapped_rows_uncorrectable = rd.int(
        "remapped_rows_uncorrectable", el.findtext("remapped_rows/remapped_row_unc")
    )
    gpu.remapped_rows_pending = rd.bool(
        "remapped_rows_pending", el.findtext("remapped_rows/remapped_row_pending")
    )
    gpu.remapped_rows_failure = rd.bool(
        "remapped_rows_failure", el.findtext("remapped_rows/remapped_row_failure")
    )
    gpu.remap_banks_none = rd.int(
        "remap_banks_none", el.findtext("remapped_rows/row_remapper_histogram/row_remapper_histogram_none")
    )
    gpu.channel_repair_pending = rd.bool("channel_repair_pending", el.findtext("ecc_errors/channel_repair_pending"))
    gpu.tpc_repair_pending = rd.bool("tpc_repair_pending", el.findtext("ecc_errors/tpc_repair_pending"))
    gpu.unrepairable_memory = rd.bool("unrepairable_memory", el.findtext("ecc_errors/unrepairable_memory"))


def _read_thermal_power_clocks(rd: ValueReader, el: ET.Element, gpu: GpuState) -> None:
    """Temperature and its slowdown/shutdown thresholds, power draw and limit, current and max clocks."""
    gpu.temp_c = rd.float("temp_c", el.findtext("temperature/gpu_temp"))
    gpu.temp_slowdown_c = rd.float(
        "temp_slowdown_c", el.findtext("temperature/gpu_temp_slow_threshold")
    )
    gpu.temp_shutdown_c = rd.float(
        "temp_shutdown_c", el.findtext("temperature/gpu_temp_max_threshold")
    )

    power = el.find("gpu_power_readings")
    if power is None:
        power = el.find("power_readings")
    if power is not None:
        gpu.power_w = rd.float(
            "power_w",
            _first(power, "power_draw", "average_power_draw", "instant_power_draw"),
        )
        gpu.power_limit_w = rd.float(
            "power_limit_w",
            _first(power, "current_power_limit", "enforced_power_limit", "power_limit"),
        )
    gpu.sm_clock_mhz = rd.float("sm_clock_mhz", el.findtext("clocks/sm_clock"))
    gpu.mem_clock_mhz = rd.float("mem_clock_mhz", el.findtext("clocks/mem_clock"))
    gpu.sm_clock_max_mhz = rd.float(
        "sm_clock_max_mhz", el.findtext("max_clocks/sm_clock")
    )
    gpu.mem_clock_max_mhz = rd.float(
        "mem_clock_max_mhz", el.findtext("max_clocks/mem_clock")
    )


def _read_fabric(rd: ValueReader, el: ET.Element, gpu: GpuState) -> None:
    """``<fabric>``: ``state``, ``status``, ``cliqueId``, ``clusterUuid`` and ``health/*``
    (elements as the R550+ DTD names them; ``health/summary`` and
    ``health/incorrect_configuration`` for the R570+ lines of the same names in ``-q``)."""
    f = el.find("fabric")
    if f is None:
        return
    read_fabric(gpu, rd, f.findtext("state"), f.findtext("status"), f.findtext("cliqueId"),
                f.findtext("clusterUuid"), f.findtext("health/summary"),
                {name: f.findtext(f"health/{tag}") for name, (_s, _l, tag, _b) in FABRIC_HEALTH_FLAGS.items()},
                f.findtext("health/incorrect_configuration"))


def _gpu_state(
    index: int, el: ET.Element, driver: str | None, cuda: str | None, where: str
) -> GpuState:
    """Map one ``<gpu id="...">`` element to a GpuState."""
    gpu = GpuState(index=index, driver_version=driver, cuda_version=cuda)
    rd = ValueReader(gpu.read_errors, where=where)
    _read_identity(rd, el, gpu)
    _read_pcie(rd, el, gpu, where, index)
    _read_util_memory(rd, el, gpu)
    _read_ecc_pages_rows(rd, el, gpu)
    _read_thermal_power_clocks(rd, el, gpu)
    _read_fabric(rd, el, gpu)
    return gpu


def parse_nvsmi_xml(
    text: str, taken_at: float | None = None, where: str = "<text>"
) -> NodeSnapshot:
    """Parse an ``nvidia-smi -q -x`` document.

    ``taken_at`` is used when ``<timestamp>`` is missing or unreadable (default:
    now). Returns a snapshot with source ``"nvidia-smi-qx"``, one GpuState per
    ``<gpu>`` element in document order. Raises :class:`NvsmiParseError` for
    malformed XML, entity declarations, or a root other than ``nvidia_smi_log``.
    """
    if not is_xml(text):
        raise NvsmiParseError(
            f"{where}: not XML; expected the output of nvidia-smi -q -x"
        )
    if _ENTITY_RE.search(text):
        raise NvsmiParseError(
            f"{where}: XML declares entities (<!ENTITY); refused for safety"
        )
    try:
        # the XML declaration must open the document: a paste often starts with blank lines
        root = ET.fromstring(text.lstrip("\ufeff \t\r\n"))
    except ET.ParseError as e:
        raise NvsmiParseError(f"{where}: malformed XML: {e}") from None
    if root.tag != "nvidia_smi_log":
        raise NvsmiParseError(
            f"{where}: root element is <{root.tag}>, expected <nvidia_smi_log>"
        )
    snap = new_snapshot(SOURCE, where, root.findtext("driver_version"), root.findtext("cuda_version"), root.findtext("timestamp"), taken_at)
    driver, cuda = snap.driver_version, snap.cuda_version
    for i, gpu_el in enumerate(root.findall("gpu")):
        snap.gpus.append(_gpu_state(i, gpu_el, driver, cuda, where))
    return snap
