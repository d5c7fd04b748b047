"""The collector on a MIG node samples no GPU the job does not own: Slurm's GPU index counts
MIG devices (not NVML's physical GPUs), MIG ids map to their parent GPU through NVML, and a
GPU in MIG mode is not sampled at all (its device-level readings are every tenant's). Each
case: exact rows, exact warnings, exact NVML GPUs touched."""

from __future__ import annotations

import json
import logging

import fake_pynvml as fp
import pytest
from conftest import node_snapshot

from gpuguard.collector.host import HostSampler
from gpuguard.collector.mig import MigLayout, mig_parent_uuid, parse_mig_entries, restrict
from gpuguard.collector.rows import row_dict
from gpuguard.collector.run import Collector
from gpuguard.gpu.nvml import NvmlSource
from gpuguard.gpu.replay import ReplaySource

MIG_A = "MIG-5c89852c-d268-c3f3-1b07-005d5ae1dc3f"
MIG_B = "MIG-7e1a33b0-91c2-5b4e-a0d7-3c6f0e9b2a14"


def mig_node():
    """GPU 0 in MIG mode with two instances (slots 0 and 2; slot 1 empty), GPU 1 a plain GPU
    that is busy: the GPU a job on MIG gres index 1 was wrongly sampled as."""
    devs = [fp.h100_gpu(0), fp.h100_gpu(1)]
    devs[0].update(mig=[1, 1], mig_devices=[MIG_A, None, MIG_B])
    devs[1].update(util_gpu=93, power_mw=640_000)
    return fp.FakeNvml(devs)


def collector(source, gpus, log="t.mig"):
    return Collector(job_id="1", node="n1", source=source, gpus=gpus, host=HostSampler("1", "n1"),
                     liveness=None, open_store=lambda: None, interval_s=1, flush_s=1, log=logging.getLogger(log))


def sample(fake, gpus, caplog):
    src = NvmlSource(call_timeout_s=5.0, pynvml_module=fake.module)
    try:
        c = collector(src, gpus)
        with caplog.at_level(logging.WARNING, logger="t.mig"):
            rows = [c.gpu_rows() for _ in range(2)]
    finally:
        src.close()
    return rows, [r.getMessage() for r in caplog.records if r.name == "t.mig"]


def sampled_gpus(fake):
    """The physical GPUs the per-tick reads touched (not the start-up MIG layout read)."""
    return {g for f, g in fake.calls if g is not None and f in ("nvmlDeviceGetPowerUsage", "nvmlDeviceGetUtilizationRates")}


def test_a_slurm_gpu_index_on_a_mig_node_is_not_sampled_as_the_physical_gpu(caplog):
    fake = mig_node()
    rows, warnings = sample(fake, "1", caplog)
    assert rows == [None, None]
    assert sampled_gpus(fake) == set()  # GPU 1 (another tenant's) never read
    assert warnings == ["job GPU index(es) 1: GPU(s) 0 of this node are in MIG mode (or their MIG mode is "
                        "unreadable), where Slurm's GPU index counts MIG devices, not NVML's GPUs: not sampled"]


@pytest.mark.parametrize("spec", [MIG_B, MIG_B.lower(), f"MIG-{fp.h100_gpu(0)['uuid']}/2/0"])
def test_a_mig_device_maps_to_its_parent_gpu_whose_shared_readings_are_not_sampled(spec, caplog):
    fake = mig_node()
    rows, warnings = sample(fake, spec, caplog)
    assert rows == [None, None] and sampled_gpus(fake) == set()
    assert warnings == [f"MIG device {spec} is on GPU 0 ({fp.h100_gpu(0)['uuid']}): the GPU's device-level "
                        "readings are shared with its other MIG instances: not sampled"]


def test_an_unknown_mig_device_is_one_warning_and_nothing_sampled(caplog):
    fake = mig_node()
    rows, warnings = sample(fake, "MIG-00000000-0000-0000-0000-000000000000", caplog)
    assert rows == [None, None] and sampled_gpus(fake) == set()
    assert warnings == ["MIG device MIG-00000000-0000-0000-0000-000000000000: not found on any GPU of this node: "
                        "not sampled"]


def test_a_plain_gpu_named_by_uuid_on_a_mixed_node_is_sampled_and_a_mig_gpu_is_not(caplog):
    fake = mig_node()
    u0, u1 = fp.h100_gpu(0)["uuid"], fp.h100_gpu(1)["uuid"]
    rows, warnings = sample(fake, f"{u0},{u1}", caplog)
    got = [(d["gpu_index"], d["gpu_uuid"], d["gpu_util_pct"], d["power_w"]) for d in map(row_dict, rows[0])]
    assert got == [(1, u1, 93.0, 640.0)]
    assert sampled_gpus(fake) == {1}
    assert warnings == [f"job GPU {u0} (GPU 0) is in MIG mode: its device-level readings are shared with its "
                        "MIG tenants: not sampled"]


def test_a_node_without_mig_samples_indices_as_before(caplog):
    fake = fp.FakeNvml(fp.h100_node())
    rows, warnings = sample(fake, "1,3", caplog)
    assert [d["gpu_index"] for d in map(row_dict, rows[1])] == [1, 3]
    assert sampled_gpus(fake) == {1, 3} and warnings == []


def test_an_unreadable_mig_mode_counts_as_mig_and_a_missing_mig_api_as_not(caplog):
    fake = fp.FakeNvml(fp.h100_node()[:2])
    fake.fail("nvmlDeviceGetMigMode", fp.NVMLError(fp._real.NVML_ERROR_UNKNOWN), gpu=1)
    rows, warnings = sample(fake, "0", caplog)
    assert rows == [None, None] and len(warnings) == 1 and "GPU(s) 1 of this node" in warnings[0]
    caplog.clear()
    fake = fp.FakeNvml(fp.h100_node()[:2])
    fake.hide("nvmlDeviceGetMigMode")
    rows, warnings = sample(fake, "0", caplog)
    assert [d["gpu_index"] for d in map(row_dict, rows[0])] == [0] and warnings == []


def test_replay_source_knows_mig_mode_and_mig_devices(tmp_path, caplog):
    snap = node_snapshot(2, gpu0={"mig_mode": True})
    from gpuguard.gpu.replay import dump_snapshot

    doc = json.loads(dump_snapshot(snap))
    doc["mig_devices"] = {MIG_A: 0}
    p = tmp_path / "r.json"
    p.write_text(json.dumps(doc))
    c = collector(ReplaySource(str(p)), f"0,{MIG_A}")
    with caplog.at_level(logging.WARNING, logger="t.mig"):
        assert c.gpu_rows() is None
    assert [r.getMessage() for r in caplog.records] == [
        "job GPU index(es) 0: GPU(s) 0 of this node are in MIG mode (or their MIG mode is unreadable), where "
        "Slurm's GPU index counts MIG devices, not NVML's GPUs: not sampled",
        f"MIG device {MIG_A} is on GPU 0 ({snap.gpus[0].uuid}): the GPU's device-level readings are shared with "
        "its other MIG instances: not sampled"]


def test_a_source_with_only_snapshots_gives_mig_modes_but_maps_no_mig_device(caplog):
    class Plain:
        def __init__(self, snap):
            self.snap = snap

        def snapshot(self):
            return self.snap

    c = collector(Plain(node_snapshot(2)), f"1,{MIG_A}")
    with caplog.at_level(logging.WARNING, logger="t.mig"):
        rows = c.gpu_rows()
    assert [d["gpu_index"] for d in map(row_dict, rows)] == [1]
    assert [r.getMessage() for r in caplog.records] == [
        f"MIG device {MIG_A}: this GPU source cannot map MIG devices to their GPU: not sampled"]
    caplog.clear()
    c = collector(Plain(node_snapshot(2, gpu0={"mig_mode": True})), "1")
    with caplog.at_level(logging.WARNING, logger="t.mig"):
        assert c.gpu_rows() is None
    assert [r.getMessage() for r in caplog.records] == [
        "job GPU index(es) 1: GPU(s) 0 of this node are in MIG mode (or their MIG mode is unreadable), where "
        "Slurm's GPU index counts MIG devices, not NVML's GPUs: not sampled"]


def test_while_the_mig_layout_is_unknown_nothing_is_sampled_then_it_is(caplog):
    fake = fp.FakeNvml(fp.h100_node()[:2])
    fake.init_error = fp._real.NVML_ERROR_UNKNOWN
    src = NvmlSource(call_timeout_s=5.0, pynvml_module=fake.module)
    try:
        c = collector(src, "1")
        with caplog.at_level(logging.WARNING, logger="t.mig"):
            assert [c.gpu_rows(), c.gpu_rows()] == [None, None]
            assert sampled_gpus(fake) == set()
            fake.init_error = None
            rows = c.gpu_rows()
    finally:
        src.close()
    assert [d["gpu_index"] for d in map(row_dict, rows)] == [1]
    assert [r.getMessage() for r in caplog.records] == [
        "GPU source cannot tell whether GPUs are in MIG mode yet: no GPU sampled until it can (a GPU index may "
        "name a MIG device)"]


def test_parsing_mig_ids():
    assert parse_mig_entries(f" 0,{MIG_A} ,GPU-ab,mig-GPU-cd/1/0,NoDevFiles") == [MIG_A, "mig-GPU-cd/1/0"]
    assert parse_mig_entries(None) == []
    assert mig_parent_uuid("MIG-GPU-cd/1/0") == "GPU-cd"
    assert mig_parent_uuid(MIG_A) is None
    layout = MigLayout({0: "GPU-a", 1: "GPU-b"}, frozenset(), {})
    assert restrict(layout, [0, 1], ["GPU-b"], []) == ([0, 1], ["GPU-b"], [])


def test_a_hung_mig_mode_read_is_an_unknown_layout_not_a_guess():
    fake = fp.FakeNvml(fp.h100_node()[:2])
    fake.hang("nvmlDeviceGetMigMode", gpu=1, max_s=5.0)
    src = NvmlSource(call_timeout_s=0.2, pynvml_module=fake.module)
    try:
        assert src.mig_layout() is None
        assert [f for f, _g in fake.calls].count("nvmlDeviceGetMigMode") == 2  # stopped at the hung call
    finally:
        fake.release()
        src.close()
    fake = mig_node()
    src = NvmlSource(call_timeout_s=5.0, pynvml_module=fake.module)
    try:
        layout = src.mig_layout()
    finally:
        src.close()
    assert layout == MigLayout({0: fp.h100_gpu(0)["uuid"], 1: fp.h100_gpu(1)["uuid"]}, frozenset({0}),
                               {MIG_A.lower(): 0, MIG_B.lower(): 0})


def test_a_snapshot_with_an_unreadable_mig_mode_samples_no_index(caplog):
    """A source with snapshots only: a GPU whose MIG mode read failed counts as MIG (its
    node's Slurm indices may count MIG devices), as MigLayout says, so index 1 is not
    sampled as NVML GPU 1."""
    class Plain:
        def snapshot(self):
            return node_snapshot(2, gpu0={"mig_mode": None, "read_errors": {"mig_mode": "Unknown"}})

    c = collector(Plain(), "1")
    with caplog.at_level(logging.WARNING, logger="t.mig"):
        assert c.gpu_rows() is None
    assert [r.getMessage() for r in caplog.records] == [
        "job GPU index(es) 1: GPU(s) 0 of this node are in MIG mode (or their MIG mode is unreadable), where "
        "Slurm's GPU index counts MIG devices, not NVML's GPUs: not sampled"]
