"""nvidia-smi --query-gpu CSV: real outputs to exact GpuState values, and the checks on them."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
from click.testing import CliRunner
from conftest import DATA

from gpuguard.cli import main
from gpuguard.gpu.nvsmi import load_nvidia_smi, parse_nvidia_smi
from gpuguard.gpu.nvsmi_common import NvsmiParseError


def _set(g) -> dict:
    return {k: v for k, v in dataclasses.asdict(g).items() if v is not None and v != {}}


def test_full_query_gpu_csv_with_units_471(monkeypatch, request):
    # every --query-gpu property of a 471.11 driver, values with units ("32.70 W", "38 %")
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    request.addfinalizer(time.tzset)  # after monkeypatch restores TZ
    snap = load_nvidia_smi(DATA / "nvsmi-query-gpu-csv-rtx2080s-471.11-full.csv")
    assert (snap.source, snap.driver_version, snap.taken_at) == ("nvidia-smi-query", "471.11", 1624724387.0)
    [g] = snap.gpus
    assert _set(g) == {
        "index": 0, "uuid": "GPU-0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d", "name": "NVIDIA GeForce RTX 2080 SUPER",
        "pci_bus_id": "0000:0c:00.0", "driver_version": "471.11", "vbios_version": "90.04.7a.40.73",
        "inforom_version": "G001.0000.02.04", "temp_c": 36.0, "power_w": 32.7, "power_limit_w": 250.0,
        "sm_clock_mhz": 111.0, "sm_clock_max_mhz": 2280.0, "mem_clock_mhz": 267.0, "mem_clock_max_mhz": 7751.0,
        "clock_event_reasons": ["gpu_idle"], "gpu_util_pct": 2.0, "mem_util_pct": 10.0, "mem_used_mib": 876.0,
        "mem_total_mib": 8192.0, "pcie_gen_current": 3, "pcie_gen_max": 3, "pcie_width_current": 16,
        "pcie_width_max": 16}


def test_nounits_csv_with_na_fan_p100():
    snap = load_nvidia_smi(DATA / "nvsmi-query-gpu-csv-p100-na.csv")
    [g] = snap.gpus
    assert _set(g) == {"index": 0, "uuid": "GPU-c11cbd4e-8697-40b9-1eef-f35de1532ad0", "name": "Tesla P100-PCIE-16GB",
                       "temp_c": 37.0, "power_w": 28.16, "sm_clock_mhz": 405.0, "mem_clock_mhz": 715.0,
                       "gpu_util_pct": 0.0, "mem_util_pct": 0.0, "mem_used_mib": 0.0}


# Built from the --help-query-gpu property names (NVIDIA nvidia-smi, quoted in netdata/netdata#10362)
_ECC = ("index, pci.bus_id, ecc.errors.uncorrected.volatile.total, retired_pages.pending, "
        "clocks_event_reasons.active, utilization.gpu [%]\n"
        "0, 00000000:07:00.0, 0, No, 0x0000000000000000, 0\n"
        "1, 00000000:0F:00.0, 3, Yes, 0x0000000000000008, 0\n")


def test_ecc_and_hw_slowdown_columns_give_drain_findings(tmp_path):
    p = tmp_path / "q.csv"
    p.write_text(_ECC)
    r = CliRunner().invoke(main, ["--config", "/dev/null", "check", "--json", "--from-nvidia-smi", str(p)])
    doc = json.loads(r.output)
    assert (r.exit_code, doc["outcome"], doc["gpus"]) == (2, "drain", 2)
    assert [(f["code"], f["gpu_index"]) for f in doc["findings"]] == [
        ("ecc.uncorrectable_volatile", 1), ("ecc.retired_pages_pending", 1), ("throttle.hw_slowdown_idle", 1)]


def test_per_reason_columns_and_remapped_rows_query():
    text = ("gpu_bus_id, remapped_rows.correctable, remapped_rows.uncorrectable, remapped_rows.pending, "
            "remapped_rows.failure, clocks_throttle_reasons.hw_slowdown, clocks_throttle_reasons.sw_power_cap\n"
            "00000000:07:00.0, 0, 1, 1, 0, Not Active, Active\n")
    [g] = parse_nvidia_smi(text).gpus
    assert (g.pci_bus_id, g.remapped_rows_correctable, g.remapped_rows_uncorrectable, g.remapped_rows_pending,
            g.remapped_rows_failure, g.clock_event_reasons) == ("0000:07:00.0", 0, 1, True, False, ["sw_power_cap"])


def test_read_error_sentinels_and_lost_gpu_line():
    text = ("index, pci.bus_id, temperature.gpu, ecc.errors.uncorrected.volatile.total\n"
            "0, 00000000:07:00.0, [Unknown Error], [GPU requires reset]\n"
            "Unable to determine the device handle for GPU 00000000:0F:00.0: Unknown Error\n")
    a, b = parse_nvidia_smi(text).gpus
    assert (a.temp_c, a.ecc_volatile_uncorrected, a.read_errors) == (
        None, None, {"temp_c": "Unknown", "ecc_volatile_uncorrected": "ResetRequired"})
    assert (b.index, b.pci_bus_id, b.read_errors) == (1, "0000:0f:00.0", {"device_handle": "Unknown"})


@pytest.mark.parametrize("text, msg", [
    ("index, temperature.gpu\n0, 35, 1\n", "row 1: 3 fields, the header has 2"),
    ("index, clocks_event_reasons.active\n0, busy\n", "row 1: clocks_event_reasons.active 'busy' is not a hex"),
    ("index, gpu_recovery_action\n0, Explode\n", "row 1: unknown GPU recovery action 'Explode'"),
])
def test_bad_rows_are_one_line_errors(text, msg):
    with pytest.raises(NvsmiParseError, match=msg) as e:
        parse_nvidia_smi(text, where="q.csv")
    assert str(e.value).count("row 1") == 1 and "\n" not in str(e.value)


def test_alias_names_print_as_canonical_header_576():
    # `nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw --format=csv` on 576.88, pasted
    # after a blank line (a Korean blog post quoting the console, found by the public-code search)
    text = "\nclocks.current.sm [MHz], clocks.current.memory [MHz], power.draw [W]\n2827 MHz, 14001 MHz, 46.83 W\n"
    [g] = parse_nvidia_smi(text).gpus
    assert (g.index, g.sm_clock_mhz, g.mem_clock_mhz, g.power_w) == (0, 2827.0, 14001.0, 46.83)


def test_query_remapped_rows_after_a_reset():
    # `nvidia-smi --query-remapped-rows=gpu_uuid,...` from a Korean blog post on a GPU reset
    # (UUIDs cut by the author; the author's trailing '# ...' note on one row removed)
    text = ("gpu_uuid, remapped_rows.correctable, remapped_rows.uncorrectable, remapped_rows.pending, "
            "remapped_rows.failure\n"
            "GPU-a895322e-..., 0, 0, No, No\nGPU-455e672a-..., 0, 1, No, No\n"
            "GPU-d66f99e9-..., 0, 0, No, No\nGPU-cd616af2-..., 0, 0, No, No\n")
    gpus = parse_nvidia_smi(text).gpus
    assert [(g.index, g.uuid, g.remapped_rows_uncorrectable, g.remapped_rows_pending, g.remapped_rows_failure)
            for g in gpus] == [(0, "GPU-a895322e-...", 0, False, False), (1, "GPU-455e672a-...", 1, False, False),
                               (2, "GPU-d66f99e9-...", 0, False, False), (3, "GPU-cd616af2-...", 0, False, False)]


@pytest.mark.parametrize("header", ["index, temperature.gpu", "index, gpu_recovery_action"])
def test_a_field_past_the_csv_limit_could_not_check_3(tmp_path, header):
    """A row with a field over the csv module's limit (131,072 characters; never a real
    nvidia-smi value) is one error line and exit 3, never a traceback with exit 1 (which
    reads as "warnings" to a monitoring plugin). Before, both CSV readers (query and
    recovery-action) raised ``_csv.Error``."""
    p = tmp_path / "huge.csv"
    p.write_text(f"{header}\n0, {'9' * 200_000}\n")
    r = CliRunner().invoke(main, ["--config", "/dev/null", "check", "--from-nvidia-smi", str(p)])
    assert r.exit_code == 3
    assert r.output.strip().splitlines()[-1] == (
        f"Error: GPU source: {p}: line 2: a field longer than 131072 characters (not nvidia-smi CSV)")
