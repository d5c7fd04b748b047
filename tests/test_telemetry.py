"""The collector's per-interval NVML path (gpuguard.gpu.telemetry) through the fake pynvml:
exact values, exact calls per tick, the slow counters, errors and a hung batch."""

import fake_pynvml as fp
import pynvml
import pytest

from gpuguard.gpu.nvml import NvmlSource

FAST_CALLS = ["nvmlDeviceGetUtilizationRates", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetPowerUsage",
              "nvmlDeviceGetTemperature", "nvmlDeviceGetClockInfo", "nvmlDeviceGetCurrentClocksEventReasons"]


@pytest.fixture
def fake():
    devs = fp.h100_node()
    devs[2].update(util_gpu=97, util_mem=41, mem_used_b=40_000 * 2**20, power_mw=650_000, temp=61,
                   clock_sm=1980, clock_event_reasons=0x4 | 0x40, pcie_replay=12)
    devs[2]["ecc"][(pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)] = 3
    return fp.FakeNvml(devs)


def test_reads_only_the_job_gpus_and_only_sample_fields(fake):
    src = NvmlSource(pynvml_module=fake.module)
    snap = src.telemetry([2], [], slow=True)
    assert snap.error is None
    (g,) = snap.gpus
    assert (g.index, g.uuid, g.pci_bus_id) == (2, "GPU-3a9e1c52-7b4f-d0a8-61e2-0f5c9b8d4e02", "0000:3a:00.0")
    assert (g.gpu_util_pct, g.mem_util_pct, g.mem_used_mib, g.power_w, g.temp_c, g.sm_clock_mhz) == (
        97.0, 41.0, 40000.0, 650.0, 61.0, 1980.0)
    assert g.clock_event_reasons == ["sw_power_cap", "hw_thermal_slowdown"]
    assert (g.ecc_volatile_uncorrected, g.pcie_replay_count, g.read_errors) == (3, 12, {})
    assert g.nvlinks is None and g.serial is None  # not a health snapshot
    fake.calls.clear()
    src.telemetry([2], [], slow=False)
    assert fake.calls == [(c, 2) for c in FAST_CALLS]  # 6 calls per GPU per tick, no other GPU touched
    fake.calls.clear()
    src.telemetry([2], [], slow=True)
    assert fake.calls == [(c, 2) for c in FAST_CALLS] + [("nvmlDeviceGetFieldValues", 2)]
    src.close()


def test_by_uuid_and_eight_gpus_cost_eight_times_one(fake):
    src = NvmlSource(pynvml_module=fake.module)
    snap = src.telemetry([], ["gpu-3a9e1c52-7b4f-d0a8-61e2-0f5c9b8d4e05"], slow=False)
    assert [g.index for g in snap.gpus] == [5]
    src8 = NvmlSource(pynvml_module=fake.module)
    src8.telemetry(list(range(8)), [], slow=False)
    fake.calls.clear()
    src8.telemetry(list(range(8)), [], slow=False)
    assert len(fake.calls) == 8 * len(FAST_CALLS)


def test_slow_counters_fall_back_to_single_calls(fake):
    fake.hide("nvmlDeviceGetFieldValues")
    src = NvmlSource(pynvml_module=fake.module)
    (g,) = src.telemetry([2], [], slow=True).gpus
    assert (g.ecc_volatile_uncorrected, g.pcie_replay_count) == (3, 12)
    assert ("nvmlDeviceGetTotalEccErrors", 2) in fake.calls and ("nvmlDeviceGetPcieReplayCounter", 2) in fake.calls


def test_errors_per_field_and_lost_gpu_stops(fake):
    fake.fail("nvmlDeviceGetPowerUsage", pynvml.NVML_ERROR_NOT_SUPPORTED, gpu=0)
    fake.fail("nvmlDeviceGetTemperature", pynvml.NVML_ERROR_UNKNOWN, gpu=0)
    fake.fail("nvmlDeviceGetMemoryInfo", pynvml.NVML_ERROR_GPU_IS_LOST, gpu=1)
    src = NvmlSource(pynvml_module=fake.module)
    g0, g1 = src.telemetry([0, 1], [], slow=False).gpus
    assert (g0.power_w, g0.temp_c, g0.sm_clock_mhz, g0.read_errors) == (None, None, 345.0, {"temp_c": "Unknown"})
    assert (g1.gpu_util_pct, g1.mem_used_mib, g1.power_w, g1.read_errors) == (0.0, None, None,
                                                                           {"mem_used_mib": "GpuIsLost"})
    assert g1.lost


def test_hung_batch_is_one_timeout_and_not_retried(fake):
    src = NvmlSource(call_timeout_s=0.2, pynvml_module=fake.module)
    src.telemetry([0], [], slow=False)
    fake.hang("nvmlDeviceGetClockInfo", gpu=0, max_s=5)
    (g,) = src.telemetry([0], [], slow=False).gpus
    assert (g.index, g.read_errors, g.lost) == (0, {"telemetry": "Timeout"}, True)
    fake.calls.clear()
    (g,) = src.telemetry([0], [], slow=False).gpus  # still hung: no new call into the driver
    assert g.read_errors == {"telemetry": "Timeout"} and fake.calls == []
    fake.release()


def test_compiled_converters_store_what_the_table_says():
    """The reader's compiled converters give round(Nvml.convert(raw) * scale), the value
    metrics.scale_value stores, for every metric of the table with an NVML read."""
    from types import SimpleNamespace

    from gpuguard.gpu.telemetry import converter
    from gpuguard.metrics import GPU_SAMPLED, GPU_SLOW, scale_value

    checked = 0
    for m in (*GPU_SAMPLED, *GPU_SLOW):
        if m.nvml is None:
            continue
        integer = m.scope == "gpu_slow"
        for raw_n in (0, 1, 499, 500, 501, 71_234, 85_520_809_984, 81_234_567_890):
            raw = SimpleNamespace(**{m.nvml.attr: raw_n}) if m.nvml.attr else raw_n
            want = scale_value(m, m.nvml.convert(raw, integer))
            assert converter(m.nvml, integer, m.scale)(raw) == want, (m.name, raw_n)
            checked += 1
    assert checked == 8 * 9  # 6 sampled + 3 slow metrics with an NVML read


def test_reading_values_are_the_stored_integers(fake):
    src = NvmlSource(pynvml_module=fake.module)
    (r,) = src.job_telemetry([2], []).read(slow=True).gpus
    # gpu, mem util %, MiB, power in 0.1 W, degrees C, MHz, clock-event mask
    assert r.values == (97, 41, 40_000, 6500, 61, 1980, 0x4 | 0x40)
    assert r.slow == (3, 12, 81_234_568)  # ECC DBE, PCIe replays, energy J (mJ / 1000, rounded)
    assert r.errors is None
