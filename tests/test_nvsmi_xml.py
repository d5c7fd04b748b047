"""nvidia-smi -q -x XML parser, on the real MIG dump of shared/corpus (copied to
tests/data) plus small hand-written variants for element names that dump lacks."""

from __future__ import annotations

import calendar
from pathlib import Path

import pytest

from gpuguard.gpu import nvsmi_xml
from gpuguard.gpu.nvsmi import NvsmiParseError, load_nvidia_smi
from gpuguard.gpu.nvsmi_xml import parse_nvsmi_xml

DATA = Path(__file__).parent / "data"
MIG = DATA / "nvsmi-qx-a100-mig-510.47.03.xml"




def test_a100_mig_xml(utc):
    snap = load_nvidia_smi(MIG)
    assert snap.source == "nvidia-smi-qx"
    assert snap.taken_at == calendar.timegm((2023, 1, 27, 11, 32, 31, 0, 0, 0))
    assert (snap.driver_version, snap.cuda_version) == ("510.47.03", "11.6")
    assert len(snap.gpus) == 1
    g = snap.gpus[0]
    assert g.index == 0
    assert g.pci_bus_id == "0000:00:04.0"
    assert g.name == "NVIDIA A100-SXM4-40GB"
    assert g.uuid == "GPU-c682f17c-8f30-967b-72d4-a5d2c2651e17"
    assert g.serial == "1000000000014"
    assert g.vbios_version == "92.00.45.00.03"
    assert g.inforom_version == "G506.0200.00.04"
    assert g.mig_mode is True
    assert (g.gpu_util_pct, g.mem_util_pct) == (None, None)  # N/A under MIG
    assert (g.ecc_volatile_corrected, g.ecc_volatile_uncorrected) == (None, None)
    assert (g.ecc_aggregate_corrected, g.ecc_aggregate_uncorrected) == (0, 0)
    assert g.ecc_enabled is True
    assert (g.remapped_rows_correctable, g.remapped_rows_pending) == (None, None)
    assert (g.remapped_rows_uncorrectable, g.remapped_rows_failure) == (None, None)
    assert (g.retired_pages_sbe, g.retired_pages_dbe, g.retired_pages_pending) == (
        None,
        None,
        None,
    )
    # the split "Not Active\n            </...applications_clocks_setting>" reads as not active
    assert g.clock_event_reasons == []
    assert g.power_w == 66.92
    assert g.power_limit_w == 400.0  # <enforced_power_limit>
    assert (g.temp_c, g.temp_slowdown_c, g.temp_shutdown_c) == (36.0, 89.0, 92.0)
    assert (g.sm_clock_mhz, g.mem_clock_mhz) == (1410.0, 1215.0)
    assert (g.sm_clock_max_mhz, g.mem_clock_max_mhz) == (1410.0, 1215.0)
    # the GPU's own fb_memory_usage, not a MIG instance's (19968 / 19 MiB)
    assert (g.mem_total_mib, g.mem_used_mib) == (40960.0, 38.0)
    assert (
        g.pcie_gen_max,
        g.pcie_gen_current,
        g.pcie_width_max,
        g.pcie_width_current,
    ) == (4, 4, 16, 16)
    assert g.pcie_replay_count == 0
    assert g.persistence_mode is False
    assert g.read_errors == {}


NEW_LAYOUT = """<?xml version="1.0" ?>
<!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v12.dtd">
<nvidia_smi_log>
  <driver_version>550.54.15</driver_version>
  <gpu id="00000000:18:00.0">
    <clocks_event_reasons>
      <clocks_event_reason_gpu_idle>Not Active</clocks_event_reason_gpu_idle>
      <clocks_event_reason_hw_slowdown>Active</clocks_event_reason_hw_slowdown>
      <clocks_event_reason_hw_power_brake_slowdown>Active</clocks_event_reason_hw_power_brake_slowdown>
      <clocks_event_reason_display_clocks_setting>Active</clocks_event_reason_display_clocks_setting>
      <clocks_event_reason_warp_drive>Active</clocks_event_reason_warp_drive>
    </clocks_event_reasons>
    <ecc_errors>
      <volatile>
        <sram_correctable>2</sram_correctable>
        <sram_uncorrectable_parity>1</sram_uncorrectable_parity>
        <sram_uncorrectable_secded>3</sram_uncorrectable_secded>
        <dram_correctable>10</dram_correctable>
        <dram_uncorrectable>0</dram_uncorrectable>
      </volatile>
      <aggregate>
        <single_bit><total>7</total></single_bit>
        <double_bit><total>[N/A]</total></double_bit>
      </aggregate>
    </ecc_errors>
    <remapped_rows>
      <remapped_row_corr>4</remapped_row_corr>
      <remapped_row_unc>1</remapped_row_unc>
      <remapped_row_pending>Yes</remapped_row_pending>
      <remapped_row_failure>No</remapped_row_failure>
    </remapped_rows>
    <temperature>
      <gpu_temp>41 C</gpu_temp>
      <gpu_temp_tlimit>46 C</gpu_temp_tlimit>
      <gpu_temp_max_tlimit_threshold>-12 C</gpu_temp_max_tlimit_threshold>
    </temperature>
    <gpu_power_readings>
      <average_power_draw>111.15 W</average_power_draw>
      <instant_power_draw>111.26 W</instant_power_draw>
      <current_power_limit>650.00 W</current_power_limit>
    </gpu_power_readings>
    <utilization><gpu_util>Unknown Error</gpu_util></utilization>
  </gpu>
  <gpu id="0000000B:00:00.0"/>
</nvidia_smi_log>
"""


def test_new_element_names_and_sums():
    nvsmi_xml.UNKNOWN_CLOCK_EVENT_ELEMENTS.discard("clocks_event_reason_warp_drive")
    snap = parse_nvsmi_xml(NEW_LAYOUT, taken_at=42.0)
    assert snap.taken_at == 42.0  # no <timestamp>: caller's value
    assert len(snap.gpus) == 2
    g, h = snap.gpus
    assert g.clock_event_reasons == [
        "hw_slowdown",
        "hw_power_brake_slowdown",
        "display_clock_setting",
    ]
    assert "clocks_event_reason_warp_drive" in nvsmi_xml.UNKNOWN_CLOCK_EVENT_ELEMENTS
    assert (g.ecc_volatile_corrected, g.ecc_volatile_uncorrected) == (12, 4)
    assert (g.ecc_aggregate_corrected, g.ecc_aggregate_uncorrected) == (7, None)
    assert (g.remapped_rows_correctable, g.remapped_rows_uncorrectable) == (4, 1)
    assert (g.remapped_rows_pending, g.remapped_rows_failure) == (True, False)
    assert g.temp_c == 41.0 and g.temp_shutdown_c is None  # tlimit margins not mapped
    assert (g.power_w, g.power_limit_w) == (111.15, 650.0)
    assert g.gpu_util_pct is None and g.read_errors == {"gpu_util_pct": "Unknown"}
    assert g.pci_bus_id == "0000:18:00.0"  # from the id attribute
    assert h.index == 1 and h.pci_bus_id == "000b:00:00.0"
    assert h.clock_event_reasons is None and h.power_w is None


def test_entity_declarations_are_refused():
    bomb = (
        '<?xml version="1.0"?>\n<!DOCTYPE nvidia_smi_log [<!ENTITY a "aaaa"><!ENTITY b "&a;&a;">]>\n'
        "<nvidia_smi_log><driver_version>&b;</driver_version></nvidia_smi_log>\n"
    )
    with pytest.raises(NvsmiParseError, match="ENTITY"):
        load_nvidia_smi(bomb)


def test_malformed_and_foreign_xml(tmp_path):
    p = tmp_path / "cut.xml"
    p.write_text(MIG.read_text()[:2000])
    with pytest.raises(NvsmiParseError, match=r"cut\.xml: malformed XML"):
        load_nvidia_smi(p)
    with pytest.raises(NvsmiParseError, match="expected <nvidia_smi_log>"):
        load_nvidia_smi('<?xml version="1.0"?>\n<html/>\n')


def test_bytes_and_text_input_match_the_file():
    from_path = load_nvidia_smi(MIG)
    assert load_nvidia_smi(MIG.read_bytes()).to_dict() == from_path.to_dict()
    assert (
        load_nvidia_smi(MIG.read_text()).gpus[0].to_dict()
        == from_path.gpus[0].to_dict()
    )
