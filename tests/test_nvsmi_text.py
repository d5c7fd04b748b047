"""nvidia-smi -q text parser, on the real dumps of shared/corpus (copied to tests/data).

Every expected value below was read from the dump file itself (line numbers given
where a file holds several GPUs).
"""

from __future__ import annotations

import calendar
import json
import os
from pathlib import Path

import pytest

from gpuguard.gpu import nvsmi_text
from gpuguard.gpu.nvsmi import NvsmiParseError, load_nvidia_smi, parse_nvidia_smi
from gpuguard.gpu.nvsmi_text import build_tree, parse_nvsmi_text

DATA = Path(__file__).parent / "data"




def load(name: str):
    return load_nvidia_smi(DATA / name)


# --- H100 535.161.08, header + first GPU -------------------------------------------


def test_h100_powerbrake_single_gpu(utc):
    snap = load("nvsmi-q-h100-535.161.08-powerbrake.txt")
    assert snap.source == "nvidia-smi-q"
    assert snap.taken_at == calendar.timegm((2024, 7, 31, 11, 22, 39, 0, 0, 0))
    assert (snap.driver_version, snap.cuda_version) == ("535.161.08", "12.2")
    assert len(snap.gpus) == 1  # header says 8 attached; the dump holds the first only
    g = snap.gpus[0]
    assert g.index == 0
    assert g.pci_bus_id == "0000:19:00.0"
    assert g.name == "NVIDIA H100 80GB HBM3"
    assert g.serial == "1000000000046"
    assert g.uuid == "GPU-6b44c336-a4a7-3210-ce3b-5cce07096584"
    assert g.vbios_version == "96.00.74.00.0D"
    assert g.inforom_version == "G520.0200.00.05"
    assert (g.driver_version, g.cuda_version) == ("535.161.08", "12.2")
    assert g.clock_event_reasons == ["hw_slowdown", "hw_power_brake_slowdown"]
    assert g.power_w == 67.74
    assert g.power_limit_w == 700.0  # "Current Power Limit" under "GPU Power Readings"
    assert g.pcie_replay_count == 67
    assert (
        g.pcie_gen_current,
        g.pcie_gen_max,
        g.pcie_width_current,
        g.pcie_width_max,
    ) == (5, 5, 16, 16)
    assert g.temp_c == 29.0
    # Only T.Limit margins (56 C, -8 C, -2 C) are printed: not absolute thresholds.
    assert g.temp_slowdown_c is None and g.temp_shutdown_c is None
    assert (g.sm_clock_mhz, g.mem_clock_mhz) == (86.0, 2619.0)
    assert (g.sm_clock_max_mhz, g.mem_clock_max_mhz) == (1980.0, 2619.0)
    assert (g.mem_total_mib, g.mem_used_mib) == (81559.0, 0.0)
    assert (g.gpu_util_pct, g.mem_util_pct) == (0.0, 0.0)
    assert g.ecc_enabled is True
    assert (g.ecc_volatile_corrected, g.ecc_volatile_uncorrected) == (0, 0)
    assert (g.ecc_aggregate_corrected, g.ecc_aggregate_uncorrected) == (0, 0)
    assert (g.retired_pages_sbe, g.retired_pages_dbe, g.retired_pages_pending) == (
        None,
        None,
        None,
    )
    assert (g.remapped_rows_correctable, g.remapped_rows_uncorrectable) == (0, 0)
    assert (g.remapped_rows_pending, g.remapped_rows_failure) == (False, False)
    assert g.persistence_mode is True
    assert g.mig_mode is False
    assert g.nvlinks is None
    assert g.read_errors == {}


# --- H100 x8 535.183.01, whole document ---------------------------------------------

X8_BUS = ["53", "64", "75", "86", "97", "a8", "b9", "ca"]
X8_REPLAYS = [120, 111, 58, 60, 63, 93, 69, 78]  # lines 74, 279, 484, ... 1515
X8_POWER = [71.97, 68.88, 118.01, 72.91, 71.68, 71.69, 69.44, 74.76]
X8_TEMP = [36.0, 37.0, 39.0, 39.0, 38.0, 36.0, 37.0, 35.0]


def test_h100x8_splits_into_eight_gpus_in_document_order(utc):
    snap = load("nvsmi-q-h100x8-535.183.01-full.txt")
    assert snap.taken_at == calendar.timegm((2024, 6, 21, 2, 3, 8, 0, 0, 0))
    assert [g.index for g in snap.gpus] == list(range(8))
    assert [g.pci_bus_id for g in snap.gpus] == [f"0000:{b}:00.0" for b in X8_BUS]
    assert [g.pcie_replay_count for g in snap.gpus] == X8_REPLAYS
    assert [g.power_w for g in snap.gpus] == X8_POWER
    assert [g.temp_c for g in snap.gpus] == X8_TEMP
    assert snap.gpus[0].uuid == "GPU-e57793a7-5f25-37b3-e854-1de587258cc8"
    assert snap.gpus[7].serial == "1000000000018"
    assert set(snap.by_pci()) == {f"0000:{b}:00" for b in X8_BUS}


def test_h100x8_only_75_has_power_brake():
    snap = load("nvsmi-q-h100x8-535.183.01-full.txt")
    brake = [
        g.pci_bus_id
        for g in snap.gpus
        if "hw_power_brake_slowdown" in g.clock_event_reasons
    ]
    assert brake == ["0000:75:00.0"]
    # lines 492-501: SW Power Cap, nested HW Power Brake and SW Thermal active; HW Slowdown not.
    assert snap.gpus[2].clock_event_reasons == [
        "sw_power_cap",
        "sw_thermal_slowdown",
        "hw_power_brake_slowdown",
    ]
    assert snap.gpus[0].clock_event_reasons == ["gpu_idle"]


def test_h100x8_host_max_na_does_not_hide_pcie_gen():
    g = load("nvsmi-q-h100x8-535.183.01-full.txt").gpus[0]
    assert (g.pcie_gen_max, g.pcie_gen_current) == (
        5,
        5,
    )  # "Host Max : N/A" beside them


# --- A100 460.32.03: old names, non-zero PCI domain -----------------------------------


def test_a100_460_old_throttle_naming_and_domain(utc):
    snap = load("nvsmi-q-a100-460.32.03-throttle-reasons.txt")
    assert snap.taken_at == calendar.timegm((2021, 10, 25, 22, 6, 14, 0, 0, 0))
    assert len(snap.gpus) == 1
    g = snap.gpus[0]
    assert g.pci_bus_id == "0001:00:00.0"  # "GPU 00000001:00:00.0" (Hyper-V domain)
    assert g.name == "A100-SXM4-40GB"
    assert g.clock_event_reasons == ["gpu_idle"]  # from "Clocks Throttle Reasons"
    assert g.ecc_enabled is True  # from "Ecc Mode"
    assert g.power_w == 55.63
    assert g.power_limit_w == 400.0  # "Enforced Power Limit"
    assert (g.temp_c, g.temp_slowdown_c, g.temp_shutdown_c) == (41.0, 89.0, 92.0)
    assert (g.sm_clock_mhz, g.sm_clock_max_mhz, g.mem_clock_mhz) == (
        210.0,
        1410.0,
        1215.0,
    )
    assert g.persistence_mode is False
    assert g.pcie_replay_count == 0
    assert (g.pcie_gen_max, g.pcie_width_max) == (4, 16)
    assert g.mem_total_mib == 40536.0


# --- A100 510.73.08 partial with [...] elision ----------------------------------------


def test_a100_510_row_remap_pending_partial():
    snap = load("nvsmi-q-a100-510.73.08-row-remap-pending-partial.txt")
    assert len(snap.gpus) == 1
    g = snap.gpus[0]
    assert g.pci_bus_id == "0000:10:1c.0"
    assert g.name == "NVIDIA A100-SXM4-80GB"
    assert g.remapped_rows_pending is True
    assert g.remapped_rows_correctable == 1
    assert g.remapped_rows_uncorrectable == 0
    assert g.remapped_rows_failure is False
    assert g.ecc_volatile_corrected == 177  # DRAM 177 + SRAM 0
    assert g.ecc_aggregate_corrected == 177
    assert (g.ecc_volatile_uncorrected, g.ecc_aggregate_uncorrected) == (0, 0)
    assert g.temp_c is None and g.power_w is None  # elided, not zero


# --- TITAN V 560.35.03: Volta ECC layout, single-line Remapped Rows --------------------


def test_titanv_volta_ecc_all_na_and_remapped_rows_na():
    g = load("nvsmi-q-titanv-560.35.03-volta-ecc.txt").gpus[0]
    assert g.name == "NVIDIA TITAN V"
    assert g.ecc_enabled is None
    assert (g.ecc_volatile_corrected, g.ecc_volatile_uncorrected) == (None, None)
    assert (g.ecc_aggregate_corrected, g.ecc_aggregate_uncorrected) == (None, None)
    assert (g.retired_pages_sbe, g.retired_pages_dbe, g.retired_pages_pending) == (
        None,
        None,
        None,
    )
    assert g.remapped_rows_correctable is None
    assert g.remapped_rows_uncorrectable is None
    assert g.remapped_rows_pending is None
    assert g.remapped_rows_failure is None
    assert g.mig_mode is None  # "Current : N/A"
    assert (g.temp_c, g.temp_slowdown_c, g.temp_shutdown_c) == (44.0, 97.0, 100.0)
    assert (g.pcie_gen_current, g.pcie_gen_max) == (1, 3)
    assert g.power_w == 29.02 and g.power_limit_w == 250.0
    assert g.mem_used_mib == 290.0
    assert g.read_errors == {}


def test_volta_totals_are_read_when_present():
    text = """\
GPU 00000000:3B:00.0
    ECC Errors
        Volatile
            Single Bit
                Device Memory             : 4
                Total                     : 6
            Double Bit
                Device Memory             : 1
                Total                     : 1
        Aggregate
            Single Bit
                Total                     : 30
            Double Bit
                Total                     : 2
"""
    g = parse_nvsmi_text(text).gpus[0]
    assert (g.ecc_volatile_corrected, g.ecc_volatile_uncorrected) == (6, 1)
    assert (g.ecc_aggregate_corrected, g.ecc_aggregate_uncorrected) == (30, 2)


# --- A100 525.60.13 single GPU ---------------------------------------------------------


def test_a100_525_single_gpu(utc):
    snap = load("nvsmi-q-a100-525.60.13-single-gpu-with-process.txt")
    assert snap.taken_at == calendar.timegm((2023, 3, 4, 4, 56, 17, 0, 0, 0))
    assert (snap.driver_version, snap.cuda_version) == ("525.60.13", "12.0")
    assert len(snap.gpus) == 1
    g = snap.gpus[0]
    assert g.pci_bus_id == "0000:07:00.0"
    assert g.clock_event_reasons == []  # section present, every reason "Not Active"
    assert (g.mem_used_mib, g.mem_total_mib) == (22377.0, 81920.0)
    assert g.power_w == 67.97 and g.power_limit_w == 400.0
    assert (g.sm_clock_mhz, g.mem_clock_mhz) == (1155.0, 1593.0)
    assert (g.temp_c, g.temp_slowdown_c, g.temp_shutdown_c) == (28.0, 89.0, 92.0)
    assert g.inforom_version == "G506.0210.00.03"
    assert g.persistence_mode is True and g.mig_mode is False


# --- ECC SRAM fragment (no GPU header) -------------------------------------------------


def test_ecc_sram_fragment_gives_one_gpu_with_only_ecc():
    snap = load_nvidia_smi(
        DATA / "nvsmi-q-a100-ecc-sram-uncorrectable-partial.txt", taken_at=1000.0
    )
    assert snap.taken_at == 1000.0  # no Timestamp line: caller's value
    assert snap.driver_version is None
    assert len(snap.gpus) == 1
    g = snap.gpus[0]
    assert g.index == 0
    assert g.ecc_volatile_uncorrected == 1
    assert g.ecc_aggregate_uncorrected == 5
    assert (g.ecc_volatile_corrected, g.ecc_aggregate_corrected) == (0, 0)
    filled = {
        k
        for k, v in g.to_dict().items()
        if v is not None and k not in ("index", "read_errors")
    }
    assert filled == {
        "ecc_volatile_corrected",
        "ecc_volatile_uncorrected",
        "ecc_aggregate_corrected",
        "ecc_aggregate_uncorrected",
    }


def test_timestamp_falls_back_to_file_mtime(tmp_path):
    p = tmp_path / "frag.txt"
    p.write_text((DATA / "nvsmi-q-a100-ecc-sram-uncorrectable-partial.txt").read_text())
    os.utime(p, (1_700_000_000, 1_700_000_000))
    assert load_nvidia_smi(p).taken_at == 1_700_000_000


# --- not -q text ------------------------------------------------------------------------


def test_default_table_is_refused_with_advice():
    path = DATA / "nvsmi-default-v100-inforom-corrupt.txt"
    with pytest.raises(NvsmiParseError) as e:
        load_nvidia_smi(path)
    msg = str(e.value)
    assert str(path) in msg
    assert "default nvidia-smi table" in msg and "nvidia-smi -q" in msg
    assert "\n" not in msg


def test_csv_without_header_is_refused_with_advice(tmp_path):
    # --query-gpu CSV with its header is read (tests/test_nvsmi_csv.py); without it the
    # columns have no names
    rows = (DATA / "nvsmi-query-gpu-csv-p100-na.csv").read_text().splitlines()[1:]
    p = tmp_path / "noheader.csv"
    p.write_text("\n".join(rows) + "\n")
    with pytest.raises(NvsmiParseError, match=r"comma-separated.*noheader.*use nvidia-smi -q") as e:
        load_nvidia_smi(p)
    assert "noheader.csv" in str(e.value)


def test_nvlink_status_and_empty_and_missing_are_refused(tmp_path):
    with pytest.raises(NvsmiParseError, match="nvlink --status"):
        load_nvidia_smi(DATA / "nvsmi-nvlink-s-a100-sxm4-80gb-12links.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(NvsmiParseError, match="empty input"):
        load_nvidia_smi(empty)
    with pytest.raises(NvsmiParseError, match="cannot read"):
        load_nvidia_smi(tmp_path / "nope.txt")
    with pytest.raises(NvsmiParseError, match="no 'Key : Value' lines"):
        parse_nvidia_smi("just some words\nand more words\n")


# --- tree builder and value handling ------------------------------------------------------


def test_build_tree_nests_by_indent_and_keeps_repeated_keys():
    text = (DATA / "nvsmi-q-titanv-560.35.03-volta-ecc.txt").read_text()
    root = build_tree(text)
    gpu = root.find("GPU 00000000:01:00.0")
    assert gpu is not None and gpu.value is None
    assert root.get("Attached GPUs") == "1"
    pids = [c.value for c in gpu.find("Processes").children if c.key == "Process ID"]
    assert pids == ["100607", "100838", "101815"]
    assert (
        gpu.get("Processes", "Process ID", "Name") == "/usr/lib/xorg/Xorg"
    )  # first match
    assert gpu.get("ECC Errors", "Aggregate", "Double Bit", "Total") == "N/A"
    assert (
        gpu.get("Remapped Rows") == "N/A" and gpu.find("Remapped Rows").children == []
    )
    assert gpu.get("ecc mode", "current") == "N/A"  # case-insensitive keys


def test_sentinels_read_errors_and_unknown_labels():
    nvsmi_text.UNKNOWN_CLOCK_EVENT_LABELS.discard("Quantum Slowdown")
    text = """\
GPU 00000000:AB:00.0
    Product Name                          : [N/A]
    Persistence Mode                      : Requested functionality has been deprecated
    Clocks Event Reasons
        Idle                              : Not Active
        Quantum Slowdown                  : Active
        SW Power Cap                      : Active
    Temperature
        GPU Current Temp                  : Unknown Error
    GPU Power Readings
        Power Draw                        : GPU is lost
    Utilization
        Gpu                               : Not Supported
...
"""
    g = parse_nvsmi_text(text, taken_at=5.0).gpus[0]
    assert g.name is None and g.persistence_mode is None and g.gpu_util_pct is None
    assert g.temp_c is None and g.power_w is None
    assert g.read_errors == {"temp_c": "Unknown", "power_w": "GpuIsLost"}
    assert g.lost is True
    assert g.clock_event_reasons == ["sw_power_cap"]
    assert "Quantum Slowdown" in nvsmi_text.UNKNOWN_CLOCK_EVENT_LABELS


def test_hopper_sram_parity_and_secded_are_summed():
    text = (DATA / "nvsmi-q-h100-535.161.08-powerbrake.txt").read_text()
    text = text.replace(
        "SRAM Uncorrectable Parity     : 0", "SRAM Uncorrectable Parity     : 2", 1
    )
    text = text.replace(
        "SRAM Uncorrectable SEC-DED    : 0", "SRAM Uncorrectable SEC-DED    : 3", 1
    )
    text = text.replace(
        "DRAM Uncorrectable            : 0", "DRAM Uncorrectable            : 4", 1
    )
    text = text.replace(
        "SRAM Correctable              : 0", "SRAM Correctable              : 5", 1
    )
    g = parse_nvsmi_text(text).gpus[0]
    assert (g.ecc_volatile_corrected, g.ecc_volatile_uncorrected) == (5, 9)
    assert (g.ecc_aggregate_corrected, g.ecc_aggregate_uncorrected) == (
        0,
        0,
    )  # only Volatile edited


def test_elision_line_does_not_capture_the_lines_after_it():
    text = """\
GPU 00000000:10:1C.0
    Product Name                          : NVIDIA A100-SXM4-80GB
    [...]
        Correctable Error                 : 1
    Remapped Rows
        Pending                           : Yes
...
"""
    root = build_tree(text)
    gpu = root.find("GPU 00000000:10:1C.0")
    assert [c.key for c in gpu.children] == [
        "Product Name",
        "Correctable Error",
        "Remapped Rows",
    ]
    assert [c.key for c in root.children] == ["GPU 00000000:10:1C.0"]
    assert parse_nvsmi_text(text).gpus[0].remapped_rows_pending is True


def test_a_dump_cut_short_is_marked_incomplete_and_check_cannot_pass_it(tmp_path):
    """`head -c` (no final newline) or a multi-GPU dump cut between lines (its last
    section lacks keys the first has) reads what is there and says it is incomplete;
    `gpuguard check` then exits 3, not 0 "no findings". Whole dumps are not marked."""
    from click.testing import CliRunner

    from gpuguard.cli import main

    full = (DATA / "nvsmi-q-h100x8-535.183.01-full.txt").read_text()
    assert parse_nvsmi_text(full, where="full").incomplete is None
    single = (DATA / "nvsmi-q-a100-525.60.13-single-gpu-with-process.txt").read_text()
    assert parse_nvsmi_text(single, where="one").incomplete is None
    cut = parse_nvsmi_text(full[:5000], where="cut")
    assert (len(cut.gpus), cut.incomplete) == (1, "cut: the last line has no newline (the dump is cut short)")
    lines = full.splitlines(keepends=True)
    two = parse_nvsmi_text("".join(lines[:400]), where="two")
    assert (len(two.gpus), two.incomplete) == (
        2, "two: the last GPU section lacks Max Clocks, Max Customer Boost Clocks, Clock Policy ... "
           "(the dump is cut short)")
    # a node of two models: the last section lacks a key the first has but ends whole
    i = full.rindex("    Fabric\n")
    j = full.index("    Processes", i)
    mixed = parse_nvsmi_text(full[:i] + full[j:], where="mixed")
    assert (len(mixed.gpus), mixed.incomplete) == (8, None)
    single_lines = single.splitlines(keepends=True)
    path = tmp_path / "cut-dump.txt"
    path.write_text("".join(single_lines[: len(single_lines) // 2]).rstrip("\n"))
    r = CliRunner().invoke(main, ["--config", "/dev/null", "check", "--from-nvidia-smi", str(path)])
    assert r.exit_code == 3
    assert r.output.splitlines()[-1] == f"incomplete: {path}: the last line has no newline (the dump is cut short)"


def test_v100_570_average_power_na_falls_back_to_instantaneous():
    # R545+ on a GPU without averaged power (Volta): "Average Power Draw : N/A" first, the
    # reading is "Instantaneous Power Draw"; 570 also adds GPU Reset Status "deprecated" lines
    snap = load_nvidia_smi(DATA / "nvsmi-q-v100-570.124.06-avg-power-na.txt")
    [g] = snap.gpus
    assert (g.power_w, g.power_limit_w) == (24.07, 250.0)
    assert (g.pci_bus_id, g.name, g.driver_version, g.recovery_action) == (
        "0001:00:00.0", "Tesla V100-PCIE-16GB", "570.124.06", 0)
    assert (g.ecc_volatile_uncorrected, g.retired_pages_dbe, g.retired_pages_pending, g.remapped_rows_pending) == (
        0, 0, False, None)
    assert (g.temp_c, g.temp_slowdown_c, g.temp_shutdown_c, g.clock_event_reasons) == (29.0, 87.0, 90.0, ["gpu_idle"])
    assert (g.pcie_gen_current, g.pcie_gen_max, g.pcie_width_current, g.pcie_replay_count) == (3, 3, 16, 0)
    assert g.read_errors == {}


def test_xml_average_power_na_falls_back_to_instantaneous():
    xml = ('<?xml version="1.0" ?>\n<nvidia_smi_log><gpu id="00000001:00:00.0"><gpu_power_readings>'
           '<average_power_draw>N/A</average_power_draw><instant_power_draw>24.07 W</instant_power_draw>'
           '<current_power_limit>250.00 W</current_power_limit></gpu_power_readings></gpu></nvidia_smi_log>\n')
    g = parse_nvidia_smi(xml).gpus[0]
    assert (g.power_w, g.power_limit_w) == (24.07, 250.0)


def test_xml_after_blank_lines_is_read():
    # the head of Checkmk's nvidia_smi agent test (tests/unit-shell/agents/plugins/test_nvidia_smi.sh,
    # 535.54.03, DTD v12), which echoes the dump after a newline as a pasted dump often starts
    xml = ('\n\n<?xml version="1.0" encoding="UTF-8"?>\n<!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v12.dtd">\n'
           '<nvidia_smi_log>\n    <timestamp>Fri Aug  4 11:44:30 2023</timestamp>\n'
           '    <driver_version>535.54.03</driver_version>\n    <cuda_version>12.2</cuda_version>\n'
           '    <gpu id="00000000:01:00.0">\n        <product_name>NVIDIA A100-SXM4-80GB</product_name>\n'
           '        <gpu_power_readings>\n            <power_state>P0</power_state>\n'
           '            <power_draw>67.03 W</power_draw>\n            <current_power_limit>500.00 W</current_power_limit>\n'
           '        </gpu_power_readings>\n    </gpu>\n</nvidia_smi_log>\n')
    snap = parse_nvidia_smi(xml)
    [g] = snap.gpus
    assert (snap.driver_version, g.name, g.pci_bus_id, g.power_w, g.power_limit_w) == (
        "535.54.03", "NVIDIA A100-SXM4-80GB", "0000:01:00.0", 67.03, 500.0)


def test_hopper_sram_threshold_flag_is_read():
    """'SRAM Threshold Exceeded' (ECC Errors / Aggregate, 535+): No in the real dump; a
    dump reading Yes (a GPU past the driver's SRAM error threshold) gives True."""
    text = (DATA / "nvsmi-q-h100-535.161.08-powerbrake.txt").read_text()
    assert parse_nvsmi_text(text).gpus[0].sram_threshold_exceeded is False
    text = text.replace("SRAM Threshold Exceeded       : No", "SRAM Threshold Exceeded       : Yes", 1)
    assert parse_nvsmi_text(text).gpus[0].sram_threshold_exceeded is True


def test_rtx5080_580_layout_reads_every_used_field():
    # driver 580: wider key column, `Utilization > GPU`, `Clocks Event Reasons Counters`
    # (same labels as the reasons, in us: never read as reasons), Blackwell repair fields
    snap = load("nvsmi-q-rtx5080-580.173.02-blackwell-repair-fields.txt")
    assert (snap.driver_version, snap.cuda_version, snap.incomplete, len(snap.gpus)) == ("580.173.02", "13.0", None, 1)
    g = snap.gpus[0]
    assert (g.name, g.pci_bus_id, g.serial, g.vbios_version, g.inforom_version) == (
        "NVIDIA GeForce RTX 5080 Laptop GPU", "0000:01:00.0", "0", "98.03.5C.00.73", "G005.0000.98.01")
    assert (g.temp_c, g.temp_slowdown_c, g.temp_shutdown_c, g.power_w, g.power_limit_w) == (49.0, None, None, 12.72, 80.0)
    assert (g.sm_clock_mhz, g.mem_clock_mhz, g.sm_clock_max_mhz, g.mem_clock_max_mhz) == (427.0, 405.0, 3090.0, 14001.0)
    assert (g.gpu_util_pct, g.mem_util_pct, g.mem_used_mib, g.mem_total_mib) == (0.0, 0.0, 570.0, 16303.0)
    assert g.clock_event_reasons == []
    assert (g.pcie_gen_current, g.pcie_gen_max, g.pcie_width_current, g.pcie_width_max, g.pcie_replay_count) == (1, 5, 8, 16, 0)
    assert (g.ecc_enabled, g.ecc_volatile_uncorrected, g.ecc_aggregate_uncorrected, g.retired_pages_pending) == (None,) * 4
    assert (g.remapped_rows_pending, g.remapped_rows_failure, g.recovery_action) == (None, None, 0)
    assert (g.persistence_mode, g.mig_mode, g.read_errors) == (False, None, {})


def test_gh200_c2c_x1_link_and_a_remapped_uncorrectable_row_proceed_with_a_warning():
    # GH200 (NVLink-C2C): the PCIe link is x1 at its maximum, not a degraded x16; one
    # uncorrectable row remapped (aggregate 1, nothing pending) is no fault today, but a
    # saved dump has no history to say how old it is: reported once, as warnings
    snap = load("nvsmi-q-gh200-550.127.05-c2c-x1-remapped-unc.txt")
    (g,) = snap.gpus
    assert (g.name, g.pci_bus_id, g.pcie_width_current, g.pcie_width_max, g.pcie_gen_current, g.pcie_gen_max) == (
        "NVIDIA GH200 480GB", "0000:dd:00.0", 1, 1, 4, 4)
    assert (g.ecc_volatile_uncorrected, g.ecc_aggregate_uncorrected, g.remapped_rows_uncorrectable,
            g.remapped_rows_pending, g.remapped_rows_failure, g.remap_banks_none) == (0, 1, 1, False, False, 0)
    assert (g.power_w, g.power_limit_w, g.temp_c, g.clock_event_reasons, g.recovery_action) == (
        87.88, 700.0, 31.0, ["gpu_idle"], None)
    from click.testing import CliRunner

    from gpuguard.cli import main
    r = CliRunner().invoke(main, ["--config", "/dev/null", "check", "--json", "--from-nvidia-smi",
                                  str(DATA / "nvsmi-q-gh200-550.127.05-c2c-x1-remapped-unc.txt")])
    doc = json.loads(r.output)
    assert (r.exit_code, doc["outcome"]) == (1, "proceed")
    assert [(f["code"], f["severity"], f["action"], f["message"]) for f in doc["findings"]] == [
        ("ecc.uncorrectable_aggregate_present", "warning", "alert",
         "gpu0 (0000:dd:00.0) lifetime uncorrectable ECC count 1 (first reading, no earlier value)"),
        ("ecc.row_remap_uncorrectable_present", "warning", "alert",
         "gpu0 (0000:dd:00.0) 1 row(s) remapped for uncorrectable ECC errors (first reading, no earlier value)")]


def test_nul_bytes_are_read_through_and_mark_the_dump_damaged(tmp_path):
    """NUL bytes (a dump written through a crash or a full disk, a preallocated file)
    are no nvidia-smi text. Before, a NUL at a line's start counted as its first column:
    the line fell out of its section, the SRAM uncorrectable count was lost and `check`
    passed a faulty GPU (exit 0). Now they are read through (the fault is found) and
    the dump is marked incomplete, so with nothing worse found the check cannot pass."""
    from click.testing import CliRunner

    from gpuguard.cli import main

    frag = (DATA / "nvsmi-q-a100-ecc-sram-uncorrectable-partial.txt").read_text()
    snap = parse_nvsmi_text(frag.replace("\n", "\n\0"), where="nul")
    [g] = snap.gpus
    assert (g.ecc_volatile_uncorrected, g.ecc_aggregate_uncorrected) == (1, 5)
    assert snap.incomplete == "nul: holds NUL bytes (the dump is damaged)"
    whole = (DATA / "nvsmi-q-a100-525.60.13-single-gpu-with-process.txt").read_text()
    path = tmp_path / "nul-dump.txt"
    path.write_text(whole + "\0" * 4096)
    r = CliRunner().invoke(main, ["--config", "/dev/null", "check", "--from-nvidia-smi", str(path)])
    assert r.exit_code == 3
    assert r.output.splitlines()[-1] == f"incomplete: {path}: holds NUL bytes (the dump is damaged)"


@pytest.mark.parametrize("header", ["GP\ufffdU 00000000:19:00.0", "GPU 00000000:19:00", "Device 0000:19:00.0"])
def test_a_gpu_section_under_a_header_not_read_is_refused_not_an_empty_gpu(header):
    """A GPU section whose header line is not ``GPU <bus id>`` (a damaged byte, a layout a
    later driver might print) holds every field one level down. Before, the document was
    taken for a fragment of one GPU because a GPU field was found *somewhere* in it: one
    GPU with nothing read, no findings, and `check` passed a GPU whose dump says
    ``HW Power Brake Slowdown: Active`` (exit 0). A fragment's GPU fields stand at its top."""
    text = (DATA / "nvsmi-q-h100-535.161.08-powerbrake.txt").read_text()
    with pytest.raises(NvsmiParseError) as e:
        parse_nvsmi_text(text.replace("GPU 00000000:19:00.0", header), where="dump")
    assert str(e.value) == "dump: no GPU section and no nvidia-smi -q GPU field; not nvidia-smi -q output"
