"""NvmlSource against the fake pynvml (tests/fake_pynvml.py), which raises the real
nvidia-ml-py error classes. Expected values are written out, not recomputed."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pynvml
import pytest

from gpuguard.gpu.nvml import NvmlSource, NvmlSourceError, error_name
from gpuguard.model import GpuState, NvLinkState

try:
    from tests import fake_pynvml as fp
except ImportError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    import fake_pynvml as fp

TESTS_DIR = Path(__file__).resolve().parent
SHORT = 0.2  # call_timeout_s for hang tests


@pytest.fixture
def h100():
    fake = fp.FakeNvml(fp.h100_node())
    yield fake
    fake.release()


def snap_of(fake, **kw):
    src = NvmlSource(pynvml_module=fake.module, **kw)
    try:
        return src.snapshot()
    finally:
        src.close()


EXPECTED_H100_GPU0 = GpuState(
    index=0,
    uuid="GPU-3a9e1c52-7b4f-d0a8-61e2-0f5c9b8d4e00",
    serial="1654222010000",
    name="NVIDIA H100 80GB HBM3",
    pci_bus_id="0000:18:00.0",
    driver_version="535.129.03",
    cuda_version="12.2",
    vbios_version="96.00.89.00.01",
    inforom_version="G520.0200.00.05",
    temp_c=33.0,
    temp_slowdown_c=90.0,
    temp_shutdown_c=92.0,
    power_w=71.234,
    power_limit_w=700.0,
    sm_clock_mhz=345.0,
    sm_clock_max_mhz=1980.0,
    mem_clock_mhz=2619.0,
    mem_clock_max_mhz=2619.0,
    clock_event_reasons=["gpu_idle"],
    gpu_util_pct=0.0,
    mem_util_pct=0.0,
    mem_used_mib=568.0,
    mem_total_mib=81559.0,
    ecc_enabled=True,
    ecc_volatile_corrected=0,
    ecc_volatile_uncorrected=0,
    ecc_aggregate_corrected=0,
    ecc_aggregate_uncorrected=0,
    retired_pages_sbe=None,
    retired_pages_dbe=None,
    retired_pages_pending=None,
    remapped_rows_correctable=0,
    remapped_rows_uncorrectable=0,
    remapped_rows_pending=False,
    remapped_rows_failure=False,
    pcie_gen_current=5,
    pcie_gen_max=5,
    pcie_width_current=16,
    pcie_width_max=16,
    pcie_replay_count=0,
    nvlinks=[
        NvLinkState(link=i, active=True, replay_errors=0, recovery_errors=0, crc_flit_errors=0, crc_data_errors=0)
        for i in range(18)
    ],
    persistence_mode=True,
    mig_mode=False,
    fabric_state="completed",
    fabric_status="Success",
    fabric_clique_id=32766,
    fabric_cluster_uuid="7bf9f4ab-4a1c-4d52-9c57-0e7d4a3b1f20",
    fabric_health_summary=None,
    fabric_health=[],
    read_errors={},
)


# -- exact values -------------------------------------------------------------


def test_h100_node_every_field_of_gpu0(h100):
    snap = snap_of(h100)
    assert snap.source == "nvml"
    assert snap.error is None
    assert snap.driver_version == "535.129.03"
    assert snap.cuda_version == "12.2"
    assert snap.hostname
    assert [g.index for g in snap.gpus] == list(range(8))
    assert snap.gpus[0] == EXPECTED_H100_GPU0


def test_h100_gpu5_counters_reasons_and_units(h100):
    g = snap_of(h100).gpus[5]
    assert g.uuid == "GPU-3a9e1c52-7b4f-d0a8-61e2-0f5c9b8d4e05"
    assert g.pci_bus_id == "0000:ab:00.0"
    assert g.temp_c == 71.0
    assert g.power_w == 689.512
    assert g.sm_clock_mhz == 1755.0
    assert g.clock_event_reasons == ["sw_power_cap", "sw_thermal_slowdown"]
    assert (g.gpu_util_pct, g.mem_util_pct) == (97.0, 41.0)
    assert g.mem_used_mib == 76800.0
    assert (g.ecc_volatile_corrected, g.ecc_volatile_uncorrected) == (3, 0)
    assert (g.ecc_aggregate_corrected, g.ecc_aggregate_uncorrected) == (17, 1)
    assert (g.remapped_rows_correctable, g.remapped_rows_uncorrectable) == (1, 1)
    assert (g.remapped_rows_pending, g.remapped_rows_failure) == (True, False)
    assert g.pcie_replay_count == 12
    assert g.nvlinks[3] == NvLinkState(3, True, 12, 1, 40, 0)
    assert g.nvlinks[4] == NvLinkState(4, True, 0, 0, 0, 0)
    assert g.read_errors == {}
    assert not g.lost


def test_pci_bus_ids_normalised_for_all_h100_gpus(h100):
    snap = snap_of(h100)
    assert [g.pci_bus_id for g in snap.gpus] == [
        "0000:18:00.0",
        "0000:2a:00.0",
        "0000:3a:00.0",
        "0000:5d:00.0",
        "0000:9a:00.0",
        "0000:ab:00.0",
        "0000:ba:00.0",
        "0000:db:00.0",
    ]
    assert sorted(snap.by_pci()) == [
        "0000:18:00",
        "0000:2a:00",
        "0000:3a:00",
        "0000:5d:00",
        "0000:9a:00",
        "0000:ab:00",
        "0000:ba:00",
        "0000:db:00",
    ]


def test_a100_unsupported_is_none_and_throttle_fallback():
    fake = fp.FakeNvml([fp.a100_gpu()], driver_version="525.147.05", cuda_driver_version=12000)
    snap = snap_of(fake)
    assert (snap.driver_version, snap.cuda_version) == ("525.147.05", "12.0")
    g = snap.gpus[0]
    assert g.name == "NVIDIA A100-PCIE-40GB"
    assert g.pci_bus_id == "0000:3b:00.0"
    assert g.power_w == 250.125
    assert g.power_limit_w == 250.0
    assert (g.mem_used_mib, g.mem_total_mib) == (30720.0, 40960.0)
    # ClocksEventReasons answered FunctionNotFound -> ClocksThrottleReasons was asked
    assert g.clock_event_reasons == ["sw_power_cap"]
    assert fake.calls_for(0).count("nvmlDeviceGetCurrentClocksThrottleReasons") == 1
    assert g.nvlinks is None  # link 0: NotSupported
    assert (g.retired_pages_sbe, g.retired_pages_dbe, g.retired_pages_pending) == (None, None, None)
    assert g.ecc_aggregate_corrected == 2
    assert g.mig_mode is True
    assert g.persistence_mode is False
    assert g.read_errors == {}


def test_v100_retired_pages_nvlink_down_link_and_no_mig():
    fake = fp.FakeNvml([fp.v100_gpu()], driver_version="470.223.02", cuda_driver_version=11040)
    snap = snap_of(fake)
    assert snap.cuda_version == "11.4"
    g = snap.gpus[0]
    assert (g.retired_pages_sbe, g.retired_pages_dbe, g.retired_pages_pending) == (2, 1, True)
    assert (g.remapped_rows_correctable, g.remapped_rows_uncorrectable) == (None, None)
    assert (g.remapped_rows_pending, g.remapped_rows_failure) == (None, None)
    assert g.mig_mode is None
    assert g.pcie_gen_current == 3
    assert len(g.nvlinks) == 6
    assert g.nvlinks[0] == NvLinkState(0, True, 0, 0, 0, 0)
    assert g.nvlinks[5] == NvLinkState(5, False, None, None, None, None)
    assert g.read_errors == {}


@pytest.mark.parametrize("raw,expected", [(12020, "12.2"), (12040, "12.4"), (11080, "11.8"), (13000, "13.0")])
def test_cuda_driver_version_format(raw, expected):
    fake = fp.FakeNvml([fp.a100_gpu()], cuda_driver_version=raw)
    snap = snap_of(fake)
    assert snap.cuda_version == expected
    assert snap.gpus[0].cuda_version == expected


def test_pci_bus_id_given_as_bytes_is_decoded():
    dev = fp.a100_gpu()
    dev["pci_bus_id"] = b"00000000:3B:00.0"
    assert snap_of(fp.FakeNvml([dev])).gpus[0].pci_bus_id == "0000:3b:00.0"


def test_event_reasons_function_missing_from_module_falls_back(h100):
    h100.hide("nvmlDeviceGetCurrentClocksEventReasons")
    g = snap_of(h100).gpus[5]
    assert g.clock_event_reasons == ["sw_power_cap", "sw_thermal_slowdown"]
    assert "nvmlDeviceGetCurrentClocksThrottleReasons" in h100.calls_for(5)


def test_temperature_falls_back_to_temperature_v(h100):
    h100.hide("nvmlDeviceGetTemperature")
    assert snap_of(h100).gpus[1].temp_c == 34.0
    assert "nvmlDeviceGetTemperatureV" in h100.calls_for(1)


def test_no_clock_reason_api_at_all_is_none(h100):
    h100.fail("nvmlDeviceGetCurrentClocksEventReasons", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    h100.hide("nvmlDeviceGetCurrentClocksThrottleReasons")
    g = snap_of(h100).gpus[0]
    assert g.clock_event_reasons is None
    assert g.read_errors == {}


# -- NotSupported and errors ----------------------------------------------------


def test_not_supported_is_none_not_zero_not_error(h100):
    h100.fail("nvmlDeviceGetPowerUsage", pynvml.NVML_ERROR_NOT_SUPPORTED, gpu=2)
    h100.fail("nvmlDeviceGetTotalEccErrors", pynvml.NVML_ERROR_NOT_SUPPORTED, gpu=2)
    g = snap_of(h100).gpus[2]
    assert g.power_w is None
    assert g.ecc_volatile_corrected is None
    assert g.ecc_aggregate_uncorrected is None
    assert g.power_limit_w == 700.0  # the next field is still read
    assert g.read_errors == {}
    assert not g.lost


def test_gpu_is_lost_on_gpu3_stops_that_gpu_only(h100):
    clean = snap_of(fp.FakeNvml(fp.h100_node()))
    h100.fail("*", pynvml.NVML_ERROR_GPU_IS_LOST, gpu=3)
    snap = snap_of(h100)
    g3 = snap.gpus[3]
    assert g3.read_errors == {"uuid": "GpuIsLost"}
    assert g3.lost
    assert g3.uuid is None and g3.temp_c is None and g3.nvlinks is None
    # no call after the one that said GpuIsLost
    assert h100.calls_for(3) == ["nvmlDeviceGetHandleByIndex", "nvmlDeviceGetUUID"]
    for i in (0, 1, 2, 4, 5, 6, 7):
        assert snap.gpus[i] == clean.gpus[i]
        assert snap.gpus[i].read_errors == {}
    assert snap.error is None


def test_gpu_is_lost_mid_read_keeps_earlier_fields(h100):
    h100.fail("nvmlDeviceGetEccMode", pynvml.NVML_ERROR_GPU_IS_LOST, gpu=3)
    g3 = snap_of(h100).gpus[3]
    assert g3.read_errors == {"ecc_enabled": "GpuIsLost"}
    assert g3.mem_total_mib == 81559.0  # read before
    assert g3.ecc_volatile_corrected is None  # not asked after
    assert h100.calls_for(3)[-1] == "nvmlDeviceGetEccMode"


def test_handle_lookup_errors(h100):
    h100.fail("nvmlDeviceGetHandleByIndex", pynvml.NVML_ERROR_GPU_IS_LOST, gpu=3)
    h100.fail("nvmlDeviceGetHandleByIndex", pynvml.NVML_ERROR_NO_PERMISSION, gpu=4)
    snap = snap_of(h100)
    assert snap.gpus[3].read_errors == {"handle": "GpuIsLost"}
    assert snap.gpus[3].lost
    assert snap.gpus[4].read_errors == {"handle": "NoPermission"}
    assert not snap.gpus[4].lost
    assert snap.gpus[4].uuid is None
    assert h100.calls_for(4) == ["nvmlDeviceGetHandleByIndex"]
    assert snap.gpus[5].uuid.endswith("4e05")


def test_unknown_error_recorded_and_reading_goes_on(h100):
    h100.fail("nvmlDeviceGetTemperature", pynvml.NVML_ERROR_UNKNOWN, gpu=1)
    g = snap_of(h100).gpus[1]
    assert g.read_errors == {"temp_c": "Unknown"}
    assert g.temp_c is None
    assert g.temp_slowdown_c == 90.0
    assert g.mig_mode is False
    assert g.lost


def test_nvml_timeout_error_class_on_multi_field_read(h100):
    h100.fail("nvmlDeviceGetRemappedRows", pynvml.NVML_ERROR_TIMEOUT, gpu=6)
    g = snap_of(h100).gpus[6]
    assert g.read_errors == {
        "remapped_rows_correctable": "Timeout",
        "remapped_rows_uncorrectable": "Timeout",
        "remapped_rows_pending": "Timeout",
        "remapped_rows_failure": "Timeout",
    }
    assert g.remapped_rows_correctable is None
    assert g.pcie_gen_current == 5  # NVML's own Timeout returned: reading goes on
    assert g.lost


def test_no_permission_is_an_error_but_not_lost(h100):
    h100.fail("nvmlDeviceGetRetiredPagesPendingStatus", pynvml.NVML_ERROR_NO_PERMISSION, gpu=0)
    g = snap_of(h100).gpus[0]
    assert g.read_errors == {"retired_pages_pending": "NoPermission"}
    assert not g.lost


def test_unexpected_exception_recorded_by_class_name(h100):
    h100.fail("nvmlDeviceGetSerial", ValueError("garbage"), gpu=7)
    h100.fail("nvmlDeviceGetName", pynvml.NVML_ERROR_CORRUPTED_INFOROM, gpu=7)
    g = snap_of(h100).gpus[7]
    assert g.read_errors == {"serial": "ValueError", "name": "CorruptedInforom"}
    assert g.pci_bus_id == "0000:db:00.0"


def test_unconvertible_value_recorded():
    dev = fp.a100_gpu()
    dev["pci_bus_id"] = "not-a-bus"
    g = snap_of(fp.FakeNvml([dev])).gpus[0]
    assert g.read_errors == {"pci_bus_id": "ValueError"}
    assert g.pci_bus_id is None
    assert g.vbios_version == "92.00.25.00.08"


def test_nvlink_counter_error_and_invalid_argument_at_link0(h100):
    h100.fail("nvmlDeviceGetNvLinkErrorCounter", pynvml.NVML_ERROR_UNKNOWN, gpu=2)
    h100.devices[4]["nvlink_state"] = []  # link 0 answers InvalidArgument
    snap = snap_of(h100)
    g2 = snap.gpus[2]
    assert len(g2.nvlinks) == 18
    assert g2.nvlinks[0] == NvLinkState(0, True, None, None, None, None)
    assert g2.read_errors["nvlinks[17].crc_data_errors"] == "Unknown"
    assert len(g2.read_errors) == 18 * 4
    assert snap.gpus[4].nvlinks is None
    assert snap.gpus[4].read_errors == {}


def test_error_name():
    assert error_name(pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)) == "GpuIsLost"
    assert error_name(pynvml.NVMLError_LibRmVersionMismatch()) == "LibRmVersionMismatch"
    assert error_name(pynvml.NVMLError(4242)) == "NVMLError(4242)"
    assert error_name(KeyError("x")) == "KeyError"


# -- init and node-level failures -------------------------------------------------


@pytest.mark.parametrize(
    "code,name",
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "LibraryNotFound"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "DriverNotLoaded"),
    ],
)
def test_init_unavailable_gives_error_snapshot(code, name):
    fake = fp.FakeNvml(fp.h100_node())
    fake.init_error = code
    snap = snap_of(fake)
    assert snap.error.startswith("NVML unavailable: ")
    assert name in snap.error
    assert snap.gpus == []
    assert snap.source == "nvml"
    assert fake.calls == [("nvmlInit", None)]


def test_init_other_error_is_init_failed():
    fake = fp.FakeNvml(fp.h100_node())
    fake.init_error = pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH
    snap = snap_of(fake)
    assert snap.error.startswith("NVML init failed: LibRmVersionMismatch")
    assert snap.gpus == []


def test_init_retried_on_next_snapshot_after_failure():
    fake = fp.FakeNvml([fp.a100_gpu()])
    fake.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    src = NvmlSource(pynvml_module=fake.module)
    assert src.snapshot().error.startswith("NVML unavailable")
    fake.init_error = None
    snap = src.snapshot()
    src.close()
    assert snap.error is None
    assert snap.gpus[0].name == "NVIDIA A100-PCIE-40GB"
    assert (fake.init_count, fake.shutdown_count) == (1, 1)


def test_real_pynvml_without_driver_gives_error_snapshot():
    """This machine has no NVIDIA driver: the real nvidia-ml-py raises LibraryNotFound."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        pass
    else:  # pragma: no cover - a GPU host
        pynvml.nvmlShutdown()
        pytest.skip("NVML is available here")
    snap = snap_of_real()
    assert snap.error.startswith("NVML unavailable: ")
    assert "LibraryNotFound" in snap.error
    assert snap.gpus == []


def snap_of_real():
    src = NvmlSource()
    try:
        return src.snapshot()
    finally:
        src.close()


def test_pynvml_not_importable(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    snap = snap_of_real()
    assert snap.error.startswith("tool error: pynvml not importable")
    assert snap.gpus == []


def test_device_count_failure():
    fake = fp.FakeNvml(fp.h100_node())
    fake.fail("nvmlDeviceGetCount", pynvml.NVML_ERROR_UNKNOWN)
    snap = snap_of(fake)
    assert snap.error == "NVML error: nvmlDeviceGetCount failed: Unknown"
    assert snap.gpus == []
    assert snap.driver_version == "535.129.03"


def test_cuda_version_not_supported_is_none():
    fake = fp.FakeNvml([fp.a100_gpu()], cuda_driver_version=None)
    snap = snap_of(fake)
    assert snap.cuda_version is None
    assert snap.gpus[0].cuda_version is None
    assert snap.gpus[0].read_errors == {}


def test_driver_version_error_copied_to_every_gpu(h100):
    h100.fail("nvmlSystemGetDriverVersion", pynvml.NVML_ERROR_UNKNOWN)
    snap = snap_of(h100)
    assert snap.driver_version is None
    assert snap.error is None
    assert all(g.read_errors == {"driver_version": "Unknown"} for g in snap.gpus)
    assert snap.gpus[7].uuid.endswith("4e07")


# -- hung calls -------------------------------------------------------------------


def test_hung_call_on_one_gpu_times_out_and_others_are_read(h100):
    clean = snap_of(fp.FakeNvml(fp.h100_node()))
    h100.hang("nvmlDeviceGetPowerUsage", gpu=2)
    src = NvmlSource(call_timeout_s=SHORT, pynvml_module=h100.module)
    snap = src.snapshot()
    g2 = snap.gpus[2]
    assert g2.read_errors == {"power_w": "Timeout"}
    assert g2.lost
    assert g2.temp_shutdown_c == 92.0  # read before the hang
    assert g2.power_limit_w is None and g2.mig_mode is None  # never asked
    assert h100.calls_for(2)[-1] == "nvmlDeviceGetPowerUsage"
    for i in (0, 1, 3, 4, 5, 6, 7):
        assert snap.gpus[i] == clean.gpus[i]

    # still hung: the next snapshot does not touch GPU 2 at all
    n_before = len(h100.calls_for(2))
    snap2 = src.snapshot()
    assert snap2.gpus[2].read_errors == {"power_w": "Timeout"}
    assert snap2.gpus[2].uuid is None
    assert len(h100.calls_for(2)) == n_before
    assert snap2.gpus[3] == clean.gpus[3]

    # once the hung call returns, a fresh source reads GPU 2 in full
    h100.release()
    src.close()
    src2 = NvmlSource(call_timeout_s=SHORT, pynvml_module=h100.module)
    snap3 = src2.snapshot()
    src2.close()
    assert snap3.gpus[2] == clean.gpus[2]


def test_gpu_queried_again_once_hung_call_returns(h100):
    h100.hang("nvmlDeviceGetUUID", gpu=0)
    src = NvmlSource(call_timeout_s=SHORT, pynvml_module=h100.module)
    assert src.snapshot().gpus[0].read_errors == {"uuid": "Timeout"}
    h100.release()
    # the abandoned worker finishes its call; from then on the GPU is read again
    for _f, job in list(src._stuck.values()):
        assert job.done.wait(5.0)
    g0 = src.snapshot().gpus[0]
    src.close()
    assert g0 == EXPECTED_H100_GPU0
    assert h100.shutdown_count == 1


def test_close_skips_shutdown_while_call_hung(h100):
    h100.hang("nvmlDeviceGetName", gpu=1)
    src = NvmlSource(call_timeout_s=SHORT, pynvml_module=h100.module)
    assert src.snapshot().gpus[1].read_errors == {"name": "Timeout"}
    src.close()
    assert h100.shutdown_count == 0
    assert ("nvmlShutdown", None) not in h100.calls


def test_hung_node_level_call_gives_error_snapshot(h100):
    h100.hang("nvmlDeviceGetCount")
    src = NvmlSource(call_timeout_s=SHORT, pynvml_module=h100.module)
    snap = src.snapshot()
    assert snap.error.startswith("NVML hung: nvmlDeviceGetCount")
    assert snap.gpus == []
    n = len(h100.calls)
    snap2 = src.snapshot()
    assert snap2.error.startswith("NVML hung: nvmlDeviceGetCount")
    assert len(h100.calls) == n  # nothing new issued while it is stuck
    src.close()


def test_hung_init():
    fake = fp.FakeNvml([fp.a100_gpu()])
    fake.hang("nvmlInit")
    src = NvmlSource(call_timeout_s=SHORT, pynvml_module=fake.module)
    try:
        assert src.snapshot().error.startswith("NVML init failed: Timeout")
        assert src.snapshot().error.startswith("NVML init failed: Timeout")
        assert fake.calls == [("nvmlInit", None)]  # not retried
    finally:
        fake.release()
        src.close()


def test_process_exits_with_a_call_hung_forever():
    """A hung C call must not keep the prolog from exiting (daemon worker threads)."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS_DIR)!r})
        import fake_pynvml as fp
        from gpuguard.gpu.nvml import NvmlSource
        fake = fp.FakeNvml(fp.h100_node())
        fake.hang("nvmlDeviceGetPowerUsage", gpu=0, max_s=3600)
        src = NvmlSource(call_timeout_s=0.2, pynvml_module=fake.module)
        snap = src.snapshot()
        src.close()
        print(snap.gpus[0].read_errors, snap.gpus[1].power_w)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "{'power_w': 'Timeout'} 71.235"


# -- budget -------------------------------------------------------------------------


def test_budget_exceeded_leaves_fields_none_and_notes(h100):
    h100.delay("nvmlDeviceGetUUID", 0.5, gpu=1)
    src = NvmlSource(call_timeout_s=5.0, total_budget_s=0.25, pynvml_module=h100.module)
    snap = src.snapshot()
    src.close()
    assert snap.gpus[0] == EXPECTED_H100_GPU0
    g1 = snap.gpus[1]
    assert g1.uuid == "GPU-3a9e1c52-7b4f-d0a8-61e2-0f5c9b8d4e01"  # started within budget
    assert g1.serial is None and g1.temp_c is None and g1.nvlinks is None
    assert g1.read_errors == {}
    assert not g1.lost
    for g in snap.gpus[2:]:
        assert g == GpuState(index=g.index, driver_version="535.129.03", cuda_version="12.2")
    assert h100.calls_for(2) == []
    assert snap.error is None
    assert len(src.last_notes) == 1
    assert "total_budget_s=0.25 exceeded" in src.last_notes[0]
    assert "GPU(s) 1, 2, 3, 4, 5, 6, 7" in src.last_notes[0]


def test_no_budget_note_when_within_budget(h100):
    src = NvmlSource(total_budget_s=30.0, pynvml_module=h100.module)
    snap = src.snapshot()
    src.close()
    assert snap.gpus[7].mig_mode is False
    assert src.last_notes == []


def test_constructor_validates():
    with pytest.raises(ValueError):
        NvmlSource(call_timeout_s=0)
    with pytest.raises(ValueError):
        NvmlSource(total_budget_s=-1)


# -- XID events ---------------------------------------------------------------------


def test_watch_xid_events(h100):
    src = NvmlSource(pynvml_module=h100.module)
    assert src.watch_xid_events(10) == []
    h100.queue_xid(2, 79)
    h100.queue_xid(5, 48)
    assert src.watch_xid_events(10) == [(2, 79), (5, 48)]
    assert src.watch_xid_events(0) == []
    # the set is created and the GPUs registered once
    assert [c for c in h100.calls if c[0] == "nvmlEventSetCreate"] == [("nvmlEventSetCreate", None)]
    assert len([c for c in h100.calls if c[0] == "nvmlDeviceRegisterEvents"]) == 8
    src.close()
    assert ("nvmlEventSetFree", None) in h100.calls


def test_watch_xid_skips_gpu_that_cannot_register(h100):
    h100.fail("nvmlDeviceRegisterEvents", pynvml.NVML_ERROR_NOT_SUPPORTED, gpu=3)
    src = NvmlSource(pynvml_module=h100.module)
    h100.queue_xid(3, 13)
    h100.queue_xid(4, 31)
    assert src.watch_xid_events(10) == [(4, 31)]
    src.close()


def test_watch_xid_unavailable_raises():
    fake = fp.FakeNvml([fp.a100_gpu()])
    fake.init_error = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    src = NvmlSource(pynvml_module=fake.module)
    with pytest.raises(NvmlSourceError, match="NVML unavailable"):
        src.watch_xid_events(10)


def test_gpu_state_round_trips_through_dict(h100):
    g = snap_of(h100).gpus[5]
    assert GpuState.from_dict(g.to_dict()) == g
    assert dataclasses.asdict(g)["nvlinks"][3]["crc_flit_errors"] == 40


def test_sram_threshold_flag_is_read_through_the_callers_struct(h100):
    """nvmlDeviceGetSramEccErrorStatus fills an nvmlEccSramErrorStatus_v1_t the caller
    passes with its version set; its bThresholdExceeded is the driver's SRAM threshold
    flag. A driver answering NotSupported (the fake's GPUs without the key) leaves None."""
    h100.devices[2]["sram_threshold"] = 1
    h100.devices[3]["sram_threshold"] = 0
    gpus = snap_of(h100).gpus
    assert [g.sram_threshold_exceeded for g in gpus[:4]] == [None, None, True, False]
    assert [g.read_errors for g in gpus[:4]] == [{}, {}, {}, {}]


def test_nvml_repair_status_read_where_the_driver_has_it():
    # R575+ nvmlDeviceGetRepairStatus / nvmlDeviceGetUnrepairableMemoryFlag_v1; older GPUs
    # answer NotSupported: None, no read error
    devs = fp.h100_node()
    devs[2].update(repair=(1, 0), unrepairable=0)
    devs[3].update(repair=(0, 0), unrepairable=1)
    fake = fp.FakeNvml(devs)
    try:
        snap = snap_of(fake)
    finally:
        fake.release()
    assert [(g.channel_repair_pending, g.tpc_repair_pending, g.unrepairable_memory) for g in snap.gpus[:4]] == [
        (None, None, None), (None, None, None), (True, False, False), (False, False, True)]
    assert all(not g.read_errors for g in snap.gpus)


def test_row_remapper_histogram_none_bucket():
    """nvmlDeviceGetRowRemapperHistogram: ``none`` = banks with no spare row left; a GPU
    that answers NotSupported (Volta, no key in the fake) leaves it None, no read error."""
    dev = fp.a100_gpu()
    dev["remap_histogram"] = (637, 1, 0, 0, 2)  # max, high, partial, low, none
    g = snap_of(fp.FakeNvml([dev])).gpus[0]
    assert (g.remap_banks_none, g.read_errors) == (2, {})
    assert snap_of(fp.FakeNvml([fp.v100_gpu()])).gpus[0].remap_banks_none is None
