"""The collector's sampler thread (gpuguard.collector.sampler) through the fake pynvml: the
job's GPUs sampled with exact values off the main thread, and a hung NVML read declared
hung by the main thread, Timeout rows meanwhile, sampling back once the call returns."""

import logging
import threading
import time

import fake_pynvml as fp
import pytest

from gpuguard.collector.host import HostSampler
from gpuguard.collector.run import Collector
from gpuguard.gpu.nvml import NvmlSource
from gpuguard.store import open_store


class Alive:
    def check(self):
        return True, "test"


def make(tmp_path, fake, timeout_s=5.0):
    src = NvmlSource(call_timeout_s=timeout_s, pynvml_module=fake.module)
    c = Collector(job_id="7", node="n1", source=src, gpus="1,3", host=HostSampler("7", "n1", dirs=[str(tmp_path)]),
                  liveness=Alive(), open_store=lambda: open_store(str(tmp_path / "node.db")), interval_s=0.05,
                  flush_s=0.2, liveness_s=5.0, log=logging.getLogger("t"))
    return c, src


def rows(tmp_path):
    return open_store(str(tmp_path / "node.db")).query(
        "select gpu_index, gpu_util_pct, power_w, temp_c, clock_event_mask, ecc_volatile_uncorrected, "
        "pcie_replay_count from samples where job_id = '7' order by at, gpu_index")


def run_in_thread(c):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("rc", c.run()), daemon=True)
    t.start()
    return t, out


def wait_for(pred, limit_s=10.0):
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return False


def test_sampler_thread_reads_only_job_gpus_with_exact_values(tmp_path):
    devs = fp.h100_node()
    devs[3].update(util_gpu=97, power_mw=650_000, temp=61, clock_event_reasons=0x4 | 0x40, pcie_replay=12)
    fake = fp.FakeNvml(devs)
    c, src = make(tmp_path, fake)
    t, out = run_in_thread(c)
    assert wait_for(lambda: any(th.name == "gpuguard-sampler" for th in threading.enumerate()))
    assert wait_for(lambda: c.buffer.written["samples"] >= 8)
    c.stop_event.set()
    t.join(10)
    src.close()
    assert out == {"rc": 0}
    got = rows(tmp_path)
    assert {r["gpu_index"] for r in got} == {1, 3}
    first3 = next(r for r in got if r["gpu_index"] == 3)
    assert first3 == {"gpu_index": 3, "gpu_util_pct": 97.0, "power_w": 650.0, "temp_c": 61.0,
                      "clock_event_mask": 0x4 | 0x40, "ecc_volatile_uncorrected": 0, "pcie_replay_count": 12}
    later = [r for r in got if r["gpu_index"] == 1][1:]
    assert later and all(r["pcie_replay_count"] is None for r in later)  # slow counters: first tick only
    # no other GPU's metrics read: other GPUs see only the one start-up MIG layout read
    layout = ("nvmlDeviceGetHandleByIndex", "nvmlDeviceGetUUID", "nvmlDeviceGetMigMode")
    assert {g for f, g in fake.calls if g is not None and f not in layout} == {1, 3}
    assert [g for f, g in fake.calls if f == "nvmlDeviceGetMigMode"] == list(range(8))


@pytest.mark.timeout(60)
def test_hung_read_gives_timeout_rows_and_sampling_resumes_when_it_returns(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    fake = fp.FakeNvml(fp.h100_node())
    c, src = make(tmp_path, fake, timeout_s=0.3)
    t, out = run_in_thread(c)
    assert wait_for(lambda: c.buffer.written["samples"] >= 4)
    fake.hang("nvmlDeviceGetPowerUsage", gpu=3, max_s=30)
    hung_at = time.monotonic()
    # declared hung within 2 x call_timeout_s (plus load); Timeout rows written meanwhile
    assert wait_for(lambda: any(r["power_w"] is None and r["temp_c"] is None for r in rows(tmp_path)))
    assert time.monotonic() - hung_at < 10
    calls_while_hung = len(fake.calls)
    time.sleep(0.5)
    assert len(fake.calls) == calls_while_hung  # nothing else entered the driver meanwhile
    fake.release()
    assert wait_for(lambda: "returned; sampling on its own thread again" in caplog.text)
    assert wait_for(lambda: any(th.name == "gpuguard-sampler" for th in threading.enumerate()))
    assert wait_for(lambda: rows(tmp_path)[-1]["power_w"] == 71.2)  # sampled again (GPU 3: 71234 mW)
    stop_at = time.monotonic()
    c.stop_event.set()
    t.join(10)
    assert out == {"rc": 0} and time.monotonic() - stop_at < 5
    src.close()
    assert "NVML telemetry read hung for more than 0.3 s" in caplog.text


def test_stop_while_hung_exits_promptly_and_keeps_rows(tmp_path):
    fake = fp.FakeNvml(fp.h100_node())
    c, src = make(tmp_path, fake, timeout_s=0.3)
    t, out = run_in_thread(c)
    assert wait_for(lambda: c.buffer.written["samples"] >= 2)
    fake.hang("nvmlDeviceGetClockInfo", gpu=1, max_s=30)
    time.sleep(1.0)
    stop_at = time.monotonic()
    c.stop_event.set()
    t.join(10)
    assert out == {"rc": 0} and time.monotonic() - stop_at < 5
    src.close()  # skips nvmlShutdown while the call is outstanding
    assert fake.shutdown_count == 0
    fake.release()
    assert len(c.buffer) == 0 and rows(tmp_path)


def test_sampler_thread_failure_hands_the_ticks_to_the_main_thread(tmp_path, caplog):
    fake = fp.FakeNvml(fp.h100_node())
    c, src = make(tmp_path, fake)
    real = c.sample_host
    calls = {"n": 0}

    def host_once_then_bug():
        calls["n"] += 1
        if calls["n"] == 2 and threading.current_thread().name == "gpuguard-sampler":
            raise RuntimeError("bug")
        real()

    c.sample_host = host_once_then_bug
    t, out = run_in_thread(c)
    assert wait_for(lambda: "sampler thread failed: RuntimeError: bug" in caplog.text, 20)
    n = c.buffer.written["samples"] + len(c.buffer.rows["samples"])
    assert wait_for(lambda: c.buffer.written["samples"] >= n + 6, 20)  # the main thread samples on
    c.stop_event.set()
    t.join(10)
    src.close()
    assert out == {"rc": 0}
