"""NVLink fabric registration: the ``Fabric`` block of nvidia-smi -q / -q -x / --query-gpu,
NVML's nvmlDeviceGetGpuFabricInfoV, and the gpu_fabric check's findings and drains.

Real blocks in tests/data (tests/data/README.md): an In Progress GPU (gpu-operator #2511,
580.159.04), a Completed / Insufficient Resources one (azhpc-images #506), a Completed /
Success / Summary Unhealthy one (dra-driver-nvidia-gpu #626), the 535 HGX H100 dump
(Completed / Success), and the N/A blocks of GPUs without a fabric (Titan V 560, RTX 5080
580)."""

from __future__ import annotations

import pathlib
import time

import fake_pynvml as fp
import pytest
from conftest import healthy_gpu, node_snapshot

from gpuguard.checks import CheckContext
from gpuguard.checks import gpu_fabric as fab
from gpuguard.gpu.nvml import NvmlSource
from gpuguard.gpu.nvsmi import load_nvidia_smi, parse_nvidia_smi
from gpuguard.gpu.nvsmi_csv import parse_query_csv
from gpuguard.model import GpuState, NodeSnapshot, decode_fabric_health
from gpuguard.prolog import hook
from gpuguard.store import open_store

DATA = pathlib.Path(__file__).parent / "data"
FIELDS = ("fabric_state", "fabric_status", "fabric_clique_id", "fabric_cluster_uuid", "fabric_health_summary",
          "fabric_health")


def fabric(g: GpuState) -> tuple:
    return tuple(getattr(g, f) for f in FIELDS)


# --- nvidia-smi -q text -------------------------------------------------------------------

@pytest.mark.parametrize(("name", "want"), [
    ("nvsmi-q-fabric-580.159.04-in-progress-fragment.txt", ("in_progress", None, None, None, None, None)),
    ("nvsmi-q-fabric-completed-insufficient-resources-fragment.txt",
     ("completed", "Insufficient Resources", 0, "00000000-0000-0000-0000-000000000000", None, None)),
    ("nvsmi-q-fabric-completed-summary-unhealthy-fragment.txt",
     ("completed", "Success", 2, "dc6e40c4-d722-4357-9ba6-5291dd461278", "unhealthy", [])),
    ("nvsmi-q-titanv-560.35.03-volta-ecc.txt", (None,) * 6),
    ("nvsmi-q-rtx5080-580.173.02-blackwell-repair-fields.txt", (None,) * 6),
    ("nvsmi-q-a100-525.60.13-single-gpu-with-process.txt", (None,) * 6),
])
def test_text_fabric_block_exact_fields(name, want):
    snap = load_nvidia_smi(DATA / name)
    [g] = snap.gpus
    assert fabric(g) == want
    assert g.read_errors == {}


def test_text_h100_dump_every_gpu_completed_success():
    snap = load_nvidia_smi(DATA / "nvsmi-q-h100x8-535.183.01-full.txt")
    assert [fabric(g) for g in snap.gpus] == [("completed", "Success", None, None, None, None)] * 8


def test_text_health_block_flags_and_incorrect_configuration():
    # the layout of the 580 fragment, with values a fault would print
    text = (DATA / "nvsmi-q-fabric-580.159.04-in-progress-fragment.txt").read_text()
    text = (text.replace("In Progress", "Completed").replace("Status                                         : N/A",
                                                             "Status                                         : Success")
            .replace("Summary                                    : N/A", "Summary                                    : Limited Capacity")
            .replace("Bandwidth                                  : N/A", "Bandwidth                                  : Degraded")
            .replace("Route Unhealthy                            : N/A", "Route Unhealthy                            : False")
            .replace("Access Timeout Recovery                    : N/A", "Access Timeout Recovery                    : True")
            .replace("Incorrect Configuration                    : N/A", "Incorrect Configuration                    : Insufficient NVLinks"))
    [g] = parse_nvidia_smi(text).gpus
    assert fabric(g) == ("completed", "Success", None, None, "limited_capacity",
                         ["bandwidth_degraded", "access_timeout_recovery", "incorrect_configuration.insufficient_nvlinks"])


def test_status_unknown_error_is_the_registration_error_not_a_read_error():
    # GPUd #1140: single-GPU H200 boxes report Not Supported with status "Unknown Error"
    text = "    Fabric\n        State : Not Supported\n        Status : Unknown Error\n"
    [g] = parse_nvidia_smi(text).gpus
    assert (g.fabric_state, g.fabric_status, g.read_errors) == ("not_supported", "Unknown Error", {})


# --- nvidia-smi -q -x and --query-gpu ------------------------------------------------------

XML = ('<?xml version="1.0" ?>\n<nvidia_smi_log><driver_version>580.159.04</driver_version>'
       '<gpu id="00000008:01:00.0"><fabric><state>Completed</state><status>Success</status>'
       '<cliqueId>2</cliqueId><clusterUuid>dc6e40c4-d722-4357-9ba6-5291dd461278</clusterUuid><health>'
       '<summary>Unhealthy</summary><bandwidth>Full</bandwidth><route_recovery_in_progress>False'
       '</route_recovery_in_progress><route_unhealthy>True</route_unhealthy><access_timeout_recovery>False'
       '</access_timeout_recovery><incorrect_configuration>None</incorrect_configuration></health></fabric></gpu>'
       '<gpu id="00000009:01:00.0"><fabric><state>In Progress</state><status>N/A</status><cliqueId>N/A</cliqueId>'
       '<clusterUuid>N/A</clusterUuid><health><bandwidth>N/A</bandwidth><route_recovery_in_progress>N/A'
       '</route_recovery_in_progress><route_unhealthy>N/A</route_unhealthy><access_timeout_recovery>N/A'
       '</access_timeout_recovery></health></fabric></gpu>'
       '<gpu id="0000000A:01:00.0"><fabric><state>N/A</state><status>N/A</status><cliqueId>N/A</cliqueId>'
       '<clusterUuid>N/A</clusterUuid></fabric></gpu></nvidia_smi_log>\n')


def test_xml_fabric_elements_exact_fields():
    # element names as the R550+ DTD and public -q -x dumps print them (<fabric><state>..
    # <health><route_unhealthy>); values of the dra-driver #626 block with the hidden line shown
    snap = parse_nvidia_smi(XML)
    assert [fabric(g) for g in snap.gpus] == [
        ("completed", "Success", 2, "dc6e40c4-d722-4357-9ba6-5291dd461278", "unhealthy", ["route_unhealthy"]),
        ("in_progress", None, None, None, None, None),
        (None,) * 6,
    ]
    assert [g.read_errors for g in snap.gpus] == [{}, {}, {}]


def test_query_csv_fabric_columns():
    # the query NVSentinel's fabric check runs (ADR-050): index,fabric.state,fabric.status
    csv = ("index, fabric.state, fabric.status\n0, Completed, Success\n1, In Progress, [N/A]\n"
           "2, Completed, Insufficient Resources\n3, [N/A], [N/A]\n")
    snap = parse_query_csv(csv, "q.csv", 0.0)
    assert [(g.index, g.fabric_state, g.fabric_status) for g in snap.gpus] == [
        (0, "completed", "Success"), (1, "in_progress", None), (2, "completed", "Insufficient Resources"),
        (3, None, None)]


# --- NVML ----------------------------------------------------------------------------------

def _nvml(devs, **kw):
    fake = fp.FakeNvml(devs, **kw)
    with NvmlSource(pynvml_module=fake.module) as src:
        return src.snapshot(), fake


def test_nvml_fabric_v3_v2_legacy_and_not_supported():
    devs = [fp.h100_gpu(i) for i in range(6)]
    # GB200 as GPUd #1106 printed it: Completed/Success, clique 4026, no health telemetry
    devs[0]["fabric"] = fp.fabric_info(clique_id=4026, cluster_uuid="9c6f5af3-53bf-49b5-a436-b66766c413c3",
                                       health_mask=0, health_summary=0)
    # azhpc-images #506: Completed / Insufficient Resources (NVML_ERROR_INSUFFICIENT_RESOURCES 23)
    devs[1]["fabric"] = fp.fabric_info(status=23, clique_id=0, cluster_uuid="0" * 32)
    # an R550 driver (v2 only): In Progress
    devs[2]["fabric"] = fp.fabric_info(state=2, versions=(2,), health_mask=0)
    # a pre-R550 driver: the legacy call, no health
    devs[3]["fabric"] = fp.fabric_info(versions=())
    # v3 health: route unhealthy + Incorrect Configuration 5 (insufficient NVLinks), summary 2 (unhealthy)
    devs[4]["fabric"] = fp.fabric_info(health_mask=2 | 2 << 2 | 1 << 4 | 2 << 6 | 5 << 8, health_summary=2)
    del devs[5]["fabric"]  # a PCIe GPU: NotSupported
    snap, fake = _nvml(devs)
    assert [fabric(g) for g in snap.gpus] == [
        ("completed", "Success", 4026, "9c6f5af3-53bf-49b5-a436-b66766c413c3", None, None),
        ("completed", "Insufficient Resources", 0, "00000000-0000-0000-0000-000000000000", None, []),
        ("in_progress", "Success", 32766, "7bf9f4ab-4a1c-4d52-9c57-0e7d4a3b1f20", None, None),
        ("completed", "Success", 32766, "7bf9f4ab-4a1c-4d52-9c57-0e7d4a3b1f20", None, None),
        ("completed", "Success", 32766, "7bf9f4ab-4a1c-4d52-9c57-0e7d4a3b1f20", "unhealthy",
         ["route_unhealthy", "incorrect_configuration.insufficient_nvlinks"]),
        (None,) * 6,
    ]
    assert [g.read_errors for g in snap.gpus] == [{}] * 6
    fabric_calls = [(f, g) for f, g in fake.calls if "Fabric" in f]
    # one call per GPU on a current driver; the fall-backs only where the driver refuses
    assert fabric_calls == [("nvmlDeviceGetGpuFabricInfoV", 0), ("nvmlDeviceGetGpuFabricInfoV", 1),
                            ("nvmlDeviceGetGpuFabricInfoV", 2), ("nvmlDeviceGetGpuFabricInfoV", 2),
                            ("nvmlDeviceGetGpuFabricInfoV", 3), ("nvmlDeviceGetGpuFabricInfoV", 3),
                            ("nvmlDeviceGetGpuFabricInfo", 3), ("nvmlDeviceGetGpuFabricInfoV", 4),
                            ("nvmlDeviceGetGpuFabricInfoV", 5)]


def test_nvml_fabric_read_error_and_old_binding():
    devs = [fp.h100_gpu(0), fp.h100_gpu(1)]
    fake = fp.FakeNvml(devs)
    fake.fail("nvmlDeviceGetGpuFabricInfoV", fp._real.NVML_ERROR_UNKNOWN, gpu=1)
    fake.hide("nvmlDeviceGetGpuFabricInfoV")  # an nvidia-ml-py without the V call: the legacy one
    with NvmlSource(pynvml_module=fake.module) as src:
        snap = src.snapshot()
    assert [fabric(g) for g in snap.gpus] == [
        ("completed", "Success", 32766, "7bf9f4ab-4a1c-4d52-9c57-0e7d4a3b1f20", None, None)] * 2
    fake = fp.FakeNvml(devs)
    fake.fail("nvmlDeviceGetGpuFabricInfoV", fp._real.NVML_ERROR_UNKNOWN, gpu=1)
    with NvmlSource(pynvml_module=fake.module) as src:
        snap = src.snapshot()
    assert (snap.gpus[1].fabric_state, snap.gpus[1].read_errors) == (None, {"fabric_state": "Unknown"})


def test_collector_telemetry_never_reads_the_fabric():
    fake = fp.FakeNvml([fp.h100_gpu(0), fp.h100_gpu(1)])
    with NvmlSource(pynvml_module=fake.module) as src:
        tele = src.job_telemetry([0, 1], [])
        for slow in (False, True, False):
            tele.read(slow)
    assert [f for f, _g in fake.calls if "Fabric" in f] == []


def test_decode_health_mask_bit_layout():
    # nvml.h: 2-bit fields at shifts 0/2/4/6 (1 = true), Incorrect Configuration 4 bits at 8
    assert decode_fabric_health(0) is None
    assert decode_fabric_health(0x1AA | 0x100) == []  # all false, configuration "none" (1)
    assert decode_fabric_health(1 | 1 << 2 | 2 << 4 | 2 << 6 | 4 << 8) == [
        "bandwidth_degraded", "route_recovery_in_progress", "incorrect_configuration.no_partition"]


# --- the check -----------------------------------------------------------------------------

T = 1764460800.0


def _run(gpus, boot=T - 86400.0, monkeypatch=None, settings=None):
    monkeypatch.setattr(fab, "boot_time", lambda: boot)
    ctx = CheckContext(NodeSnapshot(taken_at=T, source="replay", gpus=gpus), settings=settings or {})
    return [(f.code, f.severity, f.gpu_index, f.message) for f in fab.gpu_fabric(ctx)]


def _gpu(i, **kw):
    return healthy_gpu(i, **kw)


def test_check_decisions_per_state(monkeypatch):
    gpus = [
        _gpu(0, fabric_state="completed", fabric_status="Success", fabric_health=[]),
        _gpu(1, fabric_state="in_progress"),
        _gpu(2, fabric_state="completed", fabric_status="Insufficient Resources", fabric_clique_id=0),
        _gpu(3, fabric_state="completed", fabric_status="Success", fabric_health_summary="unhealthy", fabric_health=[]),
        _gpu(4, fabric_state="completed", fabric_status="Success", fabric_health=["bandwidth_degraded"],
             fabric_health_summary="limited_capacity"),
        _gpu(5, fabric_state="not_supported", fabric_status="Unknown Error"),
        _gpu(6),
        _gpu(7, fabric_state="not_started"),
    ]
    assert _run(gpus, monkeypatch=monkeypatch) == [
        ("fabric.not_registered", "critical", 1, "gpu1 (0000:29:00.0) NVLink fabric registration in progress, "
         "past the 900 s grace after boot (Fabric Manager down or stuck?)"),
        ("fabric.registration_failed", "critical", 2,
         "gpu2 (0000:3a:00.0) NVLink fabric registration failed: Insufficient Resources"),
        ("fabric.unhealthy", "critical", 3, "gpu3 (0000:4b:00.0) NVLink fabric unhealthy: summary Unhealthy"),
        ("fabric.degraded", "warning", 4, "gpu4 (0000:5c:00.0) NVLink fabric degraded: bandwidth degraded"),
        ("fabric.not_registered", "critical", 7, "gpu7 (0000:8f:00.0) NVLink fabric registration not started, "
         "past the 900 s grace after boot (Fabric Manager down or stuck?)"),
    ]


def test_in_progress_within_the_grace_after_boot_is_a_warning(monkeypatch):
    gpus = [_gpu(0, fabric_state="in_progress"), _gpu(1, fabric_state="not_started")]
    assert _run(gpus, boot=T - 120.0, monkeypatch=monkeypatch) == [
        ("fabric.registration_pending", "warning", 0,
         "gpu0 (0000:18:00.0) NVLink fabric registration in progress 120 s after boot (within the 900 s grace)"),
        ("fabric.registration_pending", "warning", 1,
         "gpu1 (0000:29:00.0) NVLink fabric registration not started 120 s after boot (within the 900 s grace)"),
    ]
    # the grace is config; an unreadable boot time (or a dump older than this boot) is past it
    assert [c for c, *_ in _run(gpus[:1], boot=T - 120.0, monkeypatch=monkeypatch,
                                settings={"fabric_registration_grace_s": 60.0})] == ["fabric.not_registered"]
    assert _run(gpus[:1], boot=None, monkeypatch=monkeypatch)[0][3].endswith(
        "registration in progress, boot time unknown (Fabric Manager down or stuck?)")
    assert [c for c, *_ in _run(gpus[:1], boot=T + 5.0, monkeypatch=monkeypatch)] == ["fabric.not_registered"]


def test_not_started_can_be_left_alone_by_config(monkeypatch):
    gpus = [_gpu(0, fabric_state="not_started"), _gpu(1, fabric_state="in_progress")]
    assert [(c, i) for c, _s, i, _m in _run(gpus, monkeypatch=monkeypatch,
                                           settings={"fabric_not_started_is_fault": False})] == [
        ("fabric.not_registered", 1)]


def test_healthy_and_fabricless_gpus_never_read_the_boot_time(monkeypatch):
    def boom():
        raise AssertionError("boot time read on the healthy path")

    monkeypatch.setattr(fab, "boot_time", boom)
    gpus = [_gpu(0, fabric_state="completed", fabric_status="Success", fabric_health=[]), _gpu(1),
            _gpu(2, fabric_state="not_supported")]
    assert fab.gpu_fabric(CheckContext(NodeSnapshot(taken_at=T, source="replay", gpus=gpus))) == []


@pytest.mark.parametrize(("name", "want"), [
    ("nvsmi-q-fabric-580.159.04-in-progress-fragment.txt", ["fabric.not_registered"]),
    ("nvsmi-q-fabric-completed-insufficient-resources-fragment.txt", ["fabric.registration_failed"]),
    ("nvsmi-q-fabric-completed-summary-unhealthy-fragment.txt", ["fabric.unhealthy"]),
    ("nvsmi-q-h100x8-535.183.01-full.txt", []),
    ("nvsmi-q-titanv-560.35.03-volta-ecc.txt", []),
    ("nvsmi-q-rtx5080-580.173.02-blackwell-repair-fields.txt", []),
])
def test_real_blocks_decide(name, want, monkeypatch):
    snap = load_nvidia_smi(DATA / name)
    assert [c for c, *_ in _run(snap.gpus, boot=snap.taken_at - 86400.0, monkeypatch=monkeypatch)] == want


# --- through the prolog: the drain reason --------------------------------------------------

ENV = {"SLURM_JOB_ID": "42", "SLURM_JOB_GPUS": "0,1", "SLURMD_NODENAME": "n1"}


def _prolog(tmp_path, make_config, write_replay, snap):
    kl = tmp_path / "kern.log"
    kl.write_text("")
    make_config('[prolog]\nstart_collector = false\n', replay=write_replay(snap), kernel_log=str(kl))
    return str(tmp_path / "node.db")


def test_prolog_drains_a_gpu_whose_registration_is_stuck(tmp_path, make_config, write_replay, fake_slurm_bin,
                                                         monkeypatch):
    monkeypatch.setattr(fab, "boot_time", lambda: time.time() - 7200.0)
    snap = node_snapshot(4, gpu2={"fabric_state": "in_progress"},
                         **{f"gpu{i}": {"fabric_state": "completed", "fabric_status": "Success"} for i in (0, 1, 3)})
    db = _prolog(tmp_path, make_config, write_replay, snap)
    assert hook.run(ENV) == 1
    assert fake_slurm_bin() == [["scontrol", "update", "nodename=n1", "state=drain",
                                 "reason=gpuguard: fabric.not_registered gpu2 (0000:3a:00.0) NVLink fabric "
                                 "registration in progress, past the 900 s grace after boot (Fabric Manager down "
                                 "or stuck?)"]]
    rows = open_store(db).query("select code, action, gpu_index from findings")
    assert rows == [{"code": "fabric.not_registered", "action": "drain", "gpu_index": 2}]


def test_prolog_alerts_only_during_the_boot_grace(tmp_path, make_config, write_replay, fake_slurm_bin, monkeypatch):
    # the replay source stamps its snapshot with the wall clock
    monkeypatch.setattr(fab, "boot_time", lambda: time.time() - 300.0)
    db = _prolog(tmp_path, make_config, write_replay, node_snapshot(4, gpu2={"fabric_state": "in_progress"}))
    assert hook.run(ENV) == 0
    assert fake_slurm_bin() == []
    rows = open_store(db).query("select code, action, gpu_index from findings")
    assert rows == [{"code": "fabric.registration_pending", "action": "alert", "gpu_index": 2}]


def test_replay_file_keeps_and_checks_fabric_fields():
    g = _gpu(0, fabric_state="completed", fabric_status="Success", fabric_clique_id=2,
             fabric_cluster_uuid="dc6e40c4-d722-4357-9ba6-5291dd461278", fabric_health_summary="unhealthy",
             fabric_health=["route_unhealthy"])
    assert GpuState.from_dict(g.to_dict()) == g
    with pytest.raises(ValueError, match="fabric_state must be one of"):
        GpuState.from_dict(dict(g.to_dict(), fabric_state="Completed"))
    with pytest.raises(ValueError, match=r"fabric_health: unknown problem\(s\) \['route_flapping'\]"):
        GpuState.from_dict(dict(g.to_dict(), fabric_health=["route_flapping"]))
