"""Each check on hand-built GPU states: exact codes, severities, GPUs and messages."""

from conftest import healthy_gpu, node_snapshot

from gpuguard.checks import CheckContext, counters_of, load_all, run_checks
from gpuguard.model import NodeSnapshot, NvLinkState


def codes(findings):
    return sorted((f.code, f.severity, f.gpu_index) for f in findings)


def run(snap, **kw):
    findings, errors = run_checks(CheckContext(snapshot=snap, **kw))
    assert errors == []
    return findings


def test_healthy_node_has_no_findings():
    assert run(node_snapshot(8), expected_gpu_count=8, job_gpu_indices=[0, 1]) == []


def test_registry_has_every_family():
    assert set(load_all()) == {"driver", "gpu_count", "gpu_lost", "gpu_recovery_action", "ecc", "retired_pages", "row_remap",
                               "memory_repair", "pcie_link", "pcie_replay", "nvlink", "temperature", "idle_throttle",
                               "persistence", "inventory", "xid", "idle_baseline", "ib",
                               "gpu_fabric"}


def test_driver_unusable_only_where_gpus_expected():
    snap = NodeSnapshot(taken_at=0, source="nvml", error="NVML unavailable: NVML Shared Library Not Found")
    f = run(snap, gpu_nodes_expected=True)
    assert codes(f) == [("gpu.driver_unusable", "critical", None)]
    assert f[0].message == "GPU driver/NVML unusable: NVML unavailable: NVML Shared Library Not Found"
    assert codes(run(snap, gpu_nodes_expected=False)) == [("gpu.none", "info", None)]


def test_gpu_count():
    snap = node_snapshot(7)
    f = run(snap, expected_gpu_count=8)
    assert codes(f) == [("gpu.count_mismatch", "critical", None)]
    assert f[0].message == "7 GPUs visible, node configured for 8"
    f = run(node_snapshot(2), job_gpu_indices=[1, 3])
    assert f[0].message == "job's GPU(s) 3 not visible (2 GPUs visible)"
    assert codes(run(node_snapshot(9), expected_gpu_count=8)) == [("gpu.count_unexpected", "warning", None)]


def test_lost_and_read_errors():
    snap = node_snapshot(4, gpu1={"read_errors": {"temp_c": "GpuIsLost"}},
                         gpu2={"read_errors": {"power_w": "Timeout"}},
                         gpu3={"read_errors": {"vbios_version": "NoPermission"}})
    f = run(snap)
    assert codes(f) == [("gpu.lost", "critical", 1), ("gpu.lost", "critical", 2), ("gpu.read_error", "warning", 3)]
    assert f[0].message == "gpu1 (0000:29:00.0) lost or hung: temp_c=GpuIsLost"


def test_an_internal_driver_error_on_an_auxiliary_read_is_a_warning_not_a_lost_gpu():
    """nvidia-smi prints 'Unknown Error' for some fields of GPUs that work (a fan, a power
    limit); the node's driver-version read is copied to every GPU: one such error must not
    drain a node. On a read every working GPU answers, or with ResetRequired, it is lost."""
    snap = node_snapshot(6, gpu0={"read_errors": {"power_limit_w": "Unknown"}},
                         gpu1={"read_errors": {"driver_version": "Unknown"}},
                         gpu2={"read_errors": {"temp_c": "Unknown"}},
                         gpu3={"read_errors": {"device_handle": "Unknown"}},
                         gpu4={"read_errors": {"ecc_enabled": "ResetRequired"}},
                         gpu5={"read_errors": {"remapped_rows_pending": "Unknown", "remapped_rows_failure": "Unknown"}})
    f = run(snap)
    assert codes(f) == [("gpu.lost", "critical", 2), ("gpu.lost", "critical", 3), ("gpu.lost", "critical", 4),
                        ("gpu.read_error", "warning", 0), ("gpu.read_error", "warning", 1),
                        ("gpu.read_error", "warning", 5)]
    assert [x.message for x in f if x.gpu_index == 0] == ["gpu0 (0000:18:00.0) read errors: power_limit_w=Unknown"]


def test_ecc_volatile_new_and_aggregate_growth():
    snap = node_snapshot(2, gpu1={"ecc_volatile_uncorrected": 3, "ecc_aggregate_uncorrected": 5})
    prev = {snap.gpus[1].uuid: {"ecc_volatile_uncorrected": 1, "ecc_aggregate_uncorrected": 3}}
    f = run(snap, previous=prev)
    assert codes(f) == [("ecc.uncorrectable_aggregate", "warning", 1), ("ecc.uncorrectable_volatile", "critical", 1)]
    vol = next(x for x in f if x.code == "ecc.uncorrectable_volatile")
    assert vol.message == "gpu1 (0000:29:00.0) 3 uncorrectable ECC error(s) since driver load (2 new)"
    assert vol.evidence == {"volatile_uncorrected": 3, "new": 2, "previous": 1}


def test_unsupported_is_not_zero_and_not_a_finding():
    # TITAN V-like: every ECC/remap field N/A -> None -> nothing to judge
    g = healthy_gpu(0, ecc_volatile_uncorrected=None, ecc_aggregate_uncorrected=None, ecc_enabled=None,
                    remapped_rows_pending=None, remapped_rows_failure=None, pcie_replay_count=None,
                    nvlinks=None, temp_slowdown_c=None, clock_event_reasons=None, persistence_mode=None)
    assert run(NodeSnapshot(0, "replay", [g])) == []


def test_retired_pages_and_row_remap():
    snap = node_snapshot(3, gpu0={"retired_pages_pending": True, "retired_pages_dbe": 2},
                         gpu1={"remapped_rows_pending": True, "remapped_rows_correctable": 1},
                         gpu2={"remapped_rows_failure": True})
    assert codes(run(snap)) == [("ecc.retired_pages_pending", "critical", 0),
                                ("ecc.row_remap_failure", "critical", 2),
                                ("ecc.row_remap_pending", "critical", 1)]


def test_pcie_width_always_gen_opt_in_and_replay_growth():
    snap = node_snapshot(2, gpu0={"pcie_width_current": 8, "pcie_gen_current": 1},
                         gpu1={"pcie_gen_current": 1, "pcie_replay_count": 250})
    prev = {snap.gpus[1].uuid: {"pcie_replay_count": 150}}
    assert codes(run(snap, previous=prev)) == [("pcie.replay_growth", "warning", 1), ("pcie.width_degraded", "warning", 0)]
    f = run(snap, previous=prev, settings={"pcie_require_max_link": True})
    assert codes(f) == [("pcie.gen_degraded", "warning", 0), ("pcie.gen_degraded", "warning", 1),
                        ("pcie.replay_growth", "warning", 1), ("pcie.width_degraded", "warning", 0)]
    prev_small = {snap.gpus[1].uuid: {"pcie_replay_count": 200}}
    assert codes(run(snap, previous=prev_small)) == [("pcie.width_degraded", "warning", 0)]


def test_nvlink_down_and_rising():
    links = [NvLinkState(0, True, 0, 0, 0, 0), NvLinkState(1, False, 0, 0, 0, 0),
             NvLinkState(2, True, 10, 0, 4, 0), NvLinkState(3, True, 0, 0, 0, 0)]
    snap = node_snapshot(1, gpu0={"nvlinks": links})
    prev = counters_of(node_snapshot(1))
    f = run(snap, previous=prev)
    assert codes(f) == [("nvlink.errors_rising", "warning", 0), ("nvlink.link_down", "critical", 0)]
    rising = next(x for x in f if x.code == "nvlink.errors_rising")
    # same timestamp as the previous reading: no rate, any growth counts
    assert rising.evidence == {"increase": {"link2.crc_flit": {"increase": 4, "per_s": None},
                                            "link2.replay": {"increase": 10, "per_s": None}}}
    # all links down now, all were active last run
    alldown = [NvLinkState(i, False) for i in range(4)]
    f = run(node_snapshot(1, gpu0={"nvlinks": alldown}), previous=prev)
    assert f[0].evidence == {"links_down": [0, 1, 2, 3], "never_up_by_design": []}
    # all down with no history (PCIe card reporting inactive links): not judged in the
    # hooks' live pass; a first reading warns (tests/test_nvlink_check.py)
    assert run(node_snapshot(1, gpu0={"nvlinks": alldown}), hook="prolog") == []


def test_thermal_and_idle_throttle():
    snap = node_snapshot(3, gpu0={"temp_c": 80.0},
                         gpu1={"clock_event_reasons": ["sw_power_cap", "hw_slowdown", "hw_power_brake_slowdown"]},
                         gpu2={"clock_event_reasons": ["hw_thermal_slowdown"], "gpu_util_pct": 99.0})
    f = run(snap)
    assert codes(f) == [("thermal.near_slowdown", "warning", 0), ("throttle.hw_slowdown_idle", "critical", 1)]
    assert f[1].message == "gpu1 (0000:29:00.0) hw_slowdown+hw_power_brake_slowdown active while idle"
    assert codes(run(snap, settings={"temp_margin_c": 5.0})) == [("throttle.hw_slowdown_idle", "critical", 1)]


def test_persistence_and_inventory():
    snap = node_snapshot(2, gpu0={"persistence_mode": False, "driver_version": "550.54.15"})
    inv = {g.uuid: {"driver_version": "535.183.01", "vbios_version": g.vbios_version} for g in node_snapshot(1).gpus}
    f = run(snap, previous_inventory=inv)
    assert codes(f) == [("config.persistence_off", "warning", 0), ("inventory.changed", "info", 0),
                        ("inventory.new_gpu", "info", 1)]
    ch = next(x for x in f if x.code == "inventory.changed")
    assert ch.evidence == {"field": "driver_version", "old": "535.183.01", "new": "550.54.15"}


def test_crashing_check_is_a_tool_error_not_a_finding(monkeypatch):
    import gpuguard.checks as checks

    def boom(ctx):
        raise RuntimeError("bug")
    monkeypatch.setitem(checks.REGISTRY, "ecc", boom)
    findings, errors = run_checks(CheckContext(snapshot=node_snapshot(1)))
    assert findings == []
    assert errors == ["check ecc crashed: RuntimeError: bug"]


def test_disabled_checks_are_skipped():
    snap = node_snapshot(1, gpu0={"persistence_mode": False})
    findings, _ = run_checks(CheckContext(snapshot=snap), disabled=["persistence"])
    assert findings == []


def test_xid_on_an_address_that_is_not_a_visible_gpu_still_counts():
    from gpuguard.xid.parse import parse_lines

    ev = parse_lines(["NVRM: Xid (PCI:0000:91:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."]).events
    [f] = run(node_snapshot(2), xid_events=ev)
    assert (f.code, f.severity, f.gpu_index) == ("xid.79", "critical", None)
    assert f.message == "XID 79 GPU has fallen off the bus on 0000:91:00 (not among the 2 visible GPUs)"
    assert f.evidence["catalog_action"] == "drain"


def test_xid_group_takes_its_strongest_event_and_154_its_last():
    """A Fatal NVLink5 row after a Nonfatal one on the same GPU drains; XID 154 acts on
    the last recovery action the driver printed, whatever came before."""
    from gpuguard.policy import decide
    from gpuguard.xid.parse import parse_lines

    lines = [
        "[1.000000] NVRM: Xid (PCI:0009:01:00): 149, NETIR_BER_EVENT Nonfatal XC0 i0 Link 03 (0x00086226)",
        "[2.000000] NVRM: Xid (PCI:0009:01:00): 149, NETIR_LINK_EVT  Fatal   XC0 i0 Link 01 (0x021425c6)",
        "[3.000000] NVRM: Xid (PCI:0018:01:00): 154, GPU recovery action changed from 0x4 (Drain and Reset) to 0x0 (None)",
        "[4.000000] NVRM: Xid (PCI:0018:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot)",
        "[5.000000] NVRM: Xid (PCI:0019:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)",
        "[6.000000] NVRM: Xid (PCI:0019:01:00): 154, GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)",
    ]
    found = run(node_snapshot(2), xid_events=parse_lines(lines, structured=True).events)
    got = {(f.code, f.evidence["pci_bus_id"]): (f.severity, f.evidence["catalog_action"], f.evidence["count"],
                                                f.evidence["message"]) for f in found}
    assert got == {
        ("xid.149", "0009:01:00"): ("critical", "drain", 2,
                                    "NETIR_LINK_EVT  Fatal   XC0 i0 Link 01 (0x021425c6)"),
        ("xid.154", "0018:01:00"): ("critical", "drain", 2,
                                    "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot)"),
        ("xid.154", "0019:01:00"): ("info", "record", 2,
                                    "GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)"),
    }
    assert decide(found).outcome == "drain"


def test_an_nvidia_smi_dump_with_unknown_error_in_auxiliary_fields_does_not_drain():
    """A healthy A100's real dump with 'Unknown Error' in its fan speed and power limits (as
    nvidia-smi prints for some working GPUs) reads as a warning; the same error in its
    temperature makes it lost."""
    from pathlib import Path

    from gpuguard.gpu.nvsmi_text import parse_nvsmi_text

    text = (Path(__file__).parent / "data" / "nvsmi-q-a100-525.60.13-single-gpu-with-process.txt").read_text()
    aux = text.replace("Fan Speed                             : N/A", "Fan Speed                             : Unknown Error")
    aux = aux.replace("Enforced Power Limit              : 400.00 W", "Enforced Power Limit              : Unknown Error")
    snap = parse_nvsmi_text(aux)
    assert snap.gpus[0].read_errors == {"power_limit_w": "Unknown"}
    assert codes(run(snap)) == [("gpu.read_error", "warning", 0)]
    hot = text.replace("GPU Current Temp                  : 28 C", "GPU Current Temp                  : Unknown Error")
    snap = parse_nvsmi_text(hot)
    assert snap.gpus[0].read_errors == {"temp_c": "Unknown"}
    assert codes(run(snap)) == [("gpu.lost", "critical", 0)]


def test_sram_threshold_flag_is_a_finding_that_alerts_and_outlives_a_reset():
    """After a reset the volatile count is 0 and the aggregate does not grow, but the
    driver's SRAM threshold flag stays: one warning (DCGM diag: WARN), never a drain."""
    from gpuguard.policy import decide

    snap = node_snapshot(2, gpu1={"sram_threshold_exceeded": True, "ecc_aggregate_uncorrected": 9})
    f = run(snap, previous={snap.gpus[1].uuid: {"ecc_aggregate_uncorrected": 9}})
    assert codes(f) == [("ecc.sram_threshold_exceeded", "warning", 1)]
    assert f[0].message == ("gpu1 (0000:29:00.0) SRAM uncorrectable ECC errors exceeded the driver's threshold "
                            "(run field diagnostics)")
    d = decide(f)
    assert (d.outcome, [a for _f, a in d.actions]) == ("proceed", ["alert"])
