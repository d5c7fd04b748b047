"""Offline triage of saved interconnect outputs: parsers, merged findings, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuguard import config as config_mod
from gpuguard.cli import main
from gpuguard.net.ib_text import TextFormatError, parse_ibstat, parse_ibstatus, parse_ibv_devinfo, parse_perfquery
from gpuguard.net.nvlink_text import (parse_dcgmi_link_status, parse_nvlink_errors, parse_nvlink_status, parse_topo,
                                      topo_nvlink_counts)
from gpuguard.net.triage import TriageError, detect, triage

DATA = Path(__file__).parent / "data"
TRI = DATA / "triage"


#: A port DOWN without link partner and no sign of use, in a paste (no history, no counters).
UNUSED = ("{port} port DOWN, physical state Disabled, no sign of use (never seen ACTIVE, no traffic counted): "
          "taken as a port nobody cabled (name the ports jobs need in [fabric] ports to have it judged)")

def _t(name: str) -> str:
    return (TRI / name if (TRI / name).exists() else DATA / name).read_text()


def _codes(names):
    res = triage([(n, _t(n)) for n in names], config_mod.from_dict({}))
    return [(f.code, f.message) for f in res.findings], res


@pytest.mark.parametrize("name,kind", [
    ("ibstat-hdr-port-down-rate-degraded.txt", "ibstat"), ("ibstat-indent-lost.txt", "ibstat"),
    ("ibv_devinfo-v-hdr-and-vf.txt", "ibv_devinfo"), ("perfquery-saturated.txt", "perfquery"),
    ("perfquery-x-extended.txt", "perfquery"), ("nvsmi-nvlink-e-a100-link-errors.txt", "nvidia-smi nvlink -e"),
    ("nvsmi-nvlink-s-h100-pcie-all-inactive.txt", "nvidia-smi nvlink -s"),
    ("nvsmi-nvlink-s-a100-sxm4-80gb-12links.txt", "nvidia-smi nvlink -s"),
    ("nvsmi-nvlink-s-gb200-18links-partial.txt", "nvidia-smi nvlink -s"),
    ("dcgmi-nvlink-link-status-all-down-3.3.7.txt", "dcgmi nvlink --link-status"),
    ("nvsmi-topo-m-dgxa100-gpu3-nv8.txt", "nvidia-smi topo -m"),
    ("nccl-legacy-error-column-2.6.4-root-partial.txt", "nccl-tests"),
    ("nccl-ib-completion-error-vendor-err-2024.txt", "nccl-tests"),
    ("nccl-warn-nvls-bind-timestamped-2026.txt", "nccl-tests"),
])
def test_detect(name, kind):
    assert detect(_t(name)) == kind


def test_ibstat_fields_and_lost_indentation_read_alike():
    ports = parse_ibstat(_t("ibstat-hdr-port-down-rate-degraded.txt"))
    assert [(p.name, p.state, p.phys_state, p.rate_gbps, p.lid, p.hca_type, p.link_layer) for p in ports] == [
        ("mlx5_0/1", "ACTIVE", "LinkUp", 200.0, 425, "MT4123", "InfiniBand"),
        ("mlx5_1/1", "DOWN", "Disabled", 10.0, 0, "MT4123", "InfiniBand"),
        ("mlx5_2/1", "ACTIVE", "LinkUp", 200.0, 427, "MT4123", "InfiniBand"),
        ("mlx5_3/1", "ACTIVE", "LinkUp", 100.0, 428, "MT4123", "InfiniBand")]
    assert parse_ibstat(_t("ibstat-indent-lost.txt")) == ports
    with pytest.raises(TextFormatError):
        parse_ibstat("hello\n")


def test_ibv_devinfo_rate_from_width_and_speed_and_odd_vf():
    ports = parse_ibv_devinfo(_t("ibv_devinfo-v-hdr-and-vf.txt"))
    assert [(p.name, p.state, p.phys_state, p.rate_gbps, p.width, p.speed) for p in ports] == [
        ("mlx5_0/1", "ACTIVE", "LinkUp", 200.0, "4X", "HDR"), ("mlx5_1/1", "ACTIVE", "LinkUp", 100.0, "2X", "HDR"),
        ("mlx5_an0/1", "ACTIVE", None, None, None, None), ("mlx5_2/1", "INIT", "LinkUp", 200.0, "4X", "HDR")]
    assert ports[2].problems == ["active_width 'invalid width' / active_speed '25.0 Gbps': rate unknown"]


def test_perfquery_plain_saturates_extended_does_not():
    (p,) = parse_perfquery(_t("perfquery-saturated.txt"))
    assert (p.name, p.lid, p.wide_counters, p.has_state) == ("lid427/1", 427, False, False)
    assert p.counters["symbol_error"] == 65535 and p.counters["link_downed"] == 2 and p.counters["port_xmit_wait"] == 1223
    (x,) = parse_perfquery(_t("perfquery-x-extended.txt"))
    assert x.wide_counters and x.counters["port_xmit_data"] == 16623415620421


def test_ibstat_with_perfquery_merged_by_lid():
    got, _res = _codes(["ibstat-hdr-port-down-rate-degraded.txt", "perfquery-saturated.txt"])
    assert got == [
        ("ib.port_unused", UNUSED.format(port="mlx5_1/1")),
        ("ib.counter_saturated",
         "mlx5_2/1 counter(s) stuck at maximum, growth unknown: local_link_integrity_errors=15, symbol_error=65535"),
        ("ib.errors_present", "mlx5_2/1 error counters (first reading): link_downed=2, port_rcv_errors=12"),
        ("ib.rate_degraded", "mlx5_3/1 at 100 Gb/s, expected 200 Gb/s")]


def test_extended_perfquery_65535_is_a_count():
    got, _ = _codes(["perfquery-x-extended.txt"])
    assert got == [("ib.errors_present", "lid425/1 error counters (first reading): symbol_error=65535")]


def test_ibv_devinfo_findings():
    got, res = _codes(["ibv_devinfo-v-hdr-and-vf.txt"])
    assert got == [("ib.rate_degraded", "mlx5_1/1 at 100 Gb/s (2X HDR), expected 200 Gb/s"),
                   ("ib.port_down", "mlx5_2/1 port INIT, physical state LinkUp "
                                    "(not ACTIVE: no subnet manager has brought it up)")]
    assert res.problems == ["ibv_devinfo-v-hdr-and-vf.txt: mlx5_an0/1: active_width 'invalid width' / "
                            "active_speed '25.0 Gbps': rate unknown"]


def test_nvlink_status_corpus_and_all_inactive_message():
    gpus, probs = parse_nvlink_status(_t("nvsmi-nvlink-s-a100-sxm4-80gb-12links.txt"))
    assert len(gpus) == 8 and probs == []
    assert [len(g.links) for g in gpus] == [12] * 8 and all(x.active for g in gpus for x in g.links.values())
    assert gpus[0].uuid == "GPU-d7e59a70-3c77-8126-9c9c-a888796d231b" and gpus[0].name == "NVIDIA A100-SXM4-80GB"
    gpus, probs = parse_nvlink_status(_t("nvsmi-nvlink-s-h100-pcie-all-inactive.txt"))
    assert gpus[1].all_inactive and len(gpus[1].links) == 18 and not any(x.active for x in gpus[1].links.values())
    got, res = _codes(["nvsmi-nvlink-s-h100-pcie-all-inactive.txt"])
    assert got == [("nvlink.inactive_first_reading", "gpu0 NVLink link(s) 4,5,10,11,16,17 inactive on the first "
                    "reading (12 up): down, or not wired on this SKU (no history to tell)"),
                   ("nvlink.link_down", "gpu1 NVLink link(s) 0,1,2,3,6,7,8,9,12,13,14,15 down")]
    assert res.summary == ["nvsmi-nvlink-s-h100-pcie-all-inactive.txt: nvidia-smi nvlink -s, 2 GPU(s); links up: "
                           "gpu0 12/18, gpu1 none (NVML: all links inactive)"]


def test_links_inactive_on_a_paste_are_a_warning_and_elided_lists_are_not_findings():
    """A paste has no history: a link never seen up is unwired by design or down, which
    it cannot tell (DCGM#198: all 18 links D and diag passed); a warning, never a drain."""
    inactive = ("inactive on the first reading ({up} up): down, or not wired on this SKU (no history to tell)")
    got, _ = _codes(["nvsmi-nvlink-s-h100-pcie-by-design.txt"])
    assert got == [("nvlink.inactive_first_reading", f"gpu{i} NVLink link(s) 4,5,10,11,16,17 " + inactive.format(up=12))
                   for i in (0, 1)]
    assert _codes(["nvsmi-nvlink-s-gb200-18links-partial.txt"])[0] == []
    got, res = _codes(["dcgmi-nvlink-link-status-all-down-3.3.7.txt"])
    every = ",".join(map(str, range(18)))
    assert got == [("nvlink.inactive_first_reading", f"gpu{i} NVLink link(s) {every} " + inactive.format(up=0))
                   for i in (0, 1)]
    assert [(f.severity, f.evidence) for f in res.findings] == [
        ("warning", {"links_inactive": list(range(18)), "links_up": 0})] * 2
    assert "no link up on any GPU" in res.summary[0]
    cfg = config_mod.from_dict({"checks": {"nvlink_expected_links": 18}})
    res = triage([("d", _t("dcgmi-nvlink-link-status-all-down-3.3.7.txt"))], cfg)
    assert [(f.code, f.gpu_index) for f in res.findings] == [("nvlink.link_down", 0), ("nvlink.link_down", 1)]


def test_dcgmi_and_nvlink_errors_parsers():
    gpus, _ = parse_dcgmi_link_status(_t("dcgmi-nvlink-link-status-all-down-3.3.7.txt"))
    assert [(g.index, len(g.links)) for g in gpus] == [(0, 18), (1, 18)]
    gpus, probs = parse_nvlink_errors(_t("nvsmi-nvlink-e-a100-link-errors.txt"))
    link = gpus[1].links[3]
    assert (link.replay_errors, link.recovery_errors, link.crc_flit_errors, probs) == (7, 0, 131, [])


def test_status_and_errors_merge_per_gpu():
    got, _ = _codes(["nvsmi-nvlink-s-a100-sxm4-80gb-12links.txt", "nvsmi-nvlink-e-a100-link-errors.txt"])
    assert got == [("nvlink.errors_present", "gpu1 NVLink error counters (first reading): link3.crc_flit=131, link3.replay=7")]


def test_topo_matrix():
    m, probs = parse_topo(_t("nvsmi-topo-m-dgxa100-gpu3-nv8.txt"))
    assert probs == [] and sorted(m) == list(range(8)) and m[0][1] == "NV12" and m[3][0] == "NV8"
    assert topo_nvlink_counts(m) == {0: 80, 1: 80, 2: 80, 3: 56, 4: 80, 5: 80, 6: 80, 7: 80}
    got, _ = _codes(["nvsmi-topo-m-dgxa100-gpu3-nv8.txt"])
    assert got == [("nvlink.link_down", "gpu3 has 56 NVLink(s) to its peers in topo -m, the best-linked GPU 80")]
    # azhpc-images #443: no NVLink between the two GPUs at all -> equal counts, nothing to say
    sys_only = "\tGPU0\tGPU1\tNIC0\tCPU Affinity\nGPU0\t X \tSYS\tNODE\t0-39\nGPU1\tSYS\t X \tSYS\t40-79\n"
    assert triage([("t", sys_only)], config_mod.from_dict({})).findings == []


def test_nccl_logs_in_triage():
    got, res = _codes(["nccl-allreduce-2.18.3-dgxh100-wrong-nonzero.txt"])
    assert got == [("nccl.errors", "nccl-allreduce-2.18.3-dgxh100-wrong-nonzero.txt: #wrong 475896")]
    got, res = _codes(["nccl-header-2.10-era-no-group-error-col.txt"])
    assert got == [("nccl.output_unreadable", "nccl-header-2.10-era-no-group-error-col.txt: nccl-tests output "
                                              "unreadable: test: no results (output ends early)")]
    # a complete table, then the next test's header and the end: read, and named unreadable
    got, res = _codes(["nccl-legacy-error-column-2.6.4-partial.txt"])
    assert got == [("nccl.output_unreadable", "nccl-legacy-error-column-2.6.4-partial.txt: nccl-tests output "
                                              "unreadable: broadcast_perf: no results (output ends early)")]
    assert res.summary == ["nccl-legacy-error-column-2.6.4-partial.txt: nccl-tests, 12 result row(s), "
                           "busbw 21.10 GB/s at 134217728 B, Avg bus bandwidth 6.6972 GB/s"]
    r = CliRunner().invoke(main, ["check", "--from-file", str(DATA / "nccl-legacy-error-column-2.6.4-partial.txt")])
    assert r.exit_code == 1 and "decision: proceed" in r.output
    got, res = _codes(["nccl-allreduce-h100-a3mega-16rank-2.2x.txt"])
    assert got == [] and res.summary == ["nccl-allreduce-h100-a3mega-16rank-2.2x.txt: nccl-tests, 31 result row(s), "
                                         "busbw 338.09 GB/s at 8589934592 B, Avg bus bandwidth 70.742 GB/s"]


def test_empty_and_unknown_inputs_are_errors():
    with pytest.raises(TriageError, match="nvsmi-nvlink-s-a10-empty-output.txt: empty"):
        triage([("nvsmi-nvlink-s-a10-empty-output.txt", _t("nvsmi-nvlink-s-a10-empty-output.txt"))],
               config_mod.from_dict({}))
    with pytest.raises(TriageError, match="x.txt: not a format gpuguard reads"):
        triage([("x.txt", "hello world\n")], config_mod.from_dict({}))


def test_cli_from_file_exit_codes(tmp_path):
    r = CliRunner().invoke(main, ["check", "--from-file", str(TRI / "ibstat-hdr-port-down-rate-degraded.txt")])
    assert r.exit_code == 2
    assert "decision: drain (gpuguard: ib.rate_degraded mlx5_3/1 at 100 Gb/s, expected 200 Gb/s)" in r.output
    # the down port named in [fabric] ports is judged, never-used or not
    cfg = tmp_path / "g.toml"
    cfg.write_text('[fabric]\nports = ["mlx5_1/1"]\n')
    r = CliRunner().invoke(main, ["--config", str(cfg), "check", "--from-file",
                                  str(TRI / "ibstat-hdr-port-down-rate-degraded.txt")])
    assert r.exit_code == 2
    assert "decision: drain (gpuguard: ib.port_down mlx5_1/1 port DOWN, physical state Disabled)" in r.output
    r = CliRunner().invoke(main, ["check", "--from-file", str(DATA / "nccl-allreduce-h100-a3mega-16rank-2.2x.txt")])
    assert r.exit_code == 0 and "no findings" in r.output
    r = CliRunner().invoke(main, ["check", "--from-file", str(TRI / "perfquery-saturated.txt"), "--json"])
    assert r.exit_code == 1 and '"code": "ib.counter_saturated"' in r.output
    r = CliRunner().invoke(main, ["check", "--from-file", str(DATA / "nvsmi-nvlink-s-a10-empty-output.txt")])
    # could not check (3, the monitoring-plugin UNKNOWN), never the critical finding's 2
    assert r.exit_code == 3 and r.output.startswith("Error: ") and "empty" in r.output
    r = CliRunner().invoke(main, ["check", "--from-file", "/nonexistent/ibstat.txt"])
    assert r.exit_code == 3 and "cannot open" in r.output
    # DCGM#198: every link D and no history: a warning (exit 1), not a pass, not a drain
    r = CliRunner().invoke(main, ["check", "--from-file", str(DATA / "dcgmi-nvlink-link-status-all-down-3.3.7.txt"),
                                  "--json"])
    doc = json.loads(r.output)
    assert (r.exit_code, doc["outcome"], [(f["code"], f["action"], f["gpu_index"]) for f in doc["findings"]]) == (
        1, "proceed", [("nvlink.inactive_first_reading", "alert", 0), ("nvlink.inactive_first_reading", "alert", 1)])


def test_ibstat_with_umad_debug_lines_and_fabric_port_selection():
    # rdma-core PR #847: ibstat run with umad debug (ibwarn: lines) after `ibportstate ... disable`
    name = "ibstat-mlx4-ibwarn-debug-port1-disabled.txt"
    p1, p2 = parse_ibstat(_t(name))
    assert (p1.name, p1.state, p1.phys_state, p1.rate_gbps, p1.lid, p1.link_layer, p1.hca_type, p1.problems) == (
        "mlx4_0/1", "DOWN", "Disabled", 10.0, 38, "InfiniBand", "MT4099", [])
    assert (p2.name, p2.state, p2.phys_state, p2.rate_gbps) == ("mlx4_0/2", "ACTIVE", "LinkUp", 56.0)
    codes, _ = _codes([name])
    assert codes == [("ib.port_unused", UNUSED.format(port="mlx4_0/1"))]
    # the live check's port selection applies to a pasted output too
    for fabric in ({"ports": ["mlx4_0/2"]}, {"ignore_link_layers": ["InfiniBand"]}):
        res = triage([(name, _t(name))], config_mod.from_dict({"fabric": fabric}))
        assert res.findings == []


def test_ibstat_stopped_by_ibpanic_leaves_the_device_unknown():
    # leptonai/gpud#752: ibstat lists mlx5_7 then dies on mlx5_8 (and lists nothing after it)
    name = "ibstat-ibpanic-device-stat-failed.txt"
    p7, p8 = parse_ibstat(_t(name))
    assert (p7.name, p7.state, p7.rate_gbps, p7.lid) == ("mlx5_7/1", "ACTIVE", 200.0, 13305)
    assert (p8.name, p8.state, p8.problems) == (
        "mlx5_8/0", None, ["ibstat stopped: stat of IB device 'mlx5_8' failed: No such file or directory"])
    codes, _ = _codes([name])
    assert codes == [("ib.unreadable", "mlx5_8/0 state unknown: ibstat stopped: stat of IB device 'mlx5_8' failed: "
                                        "No such file or directory")]


def test_ibstatus_two_roce_ports_one_disabled():
    # ibstatus (infiniband-diags' sysfs printer) on a ConnectX RoCE host where only mlx5_1 is used
    name = "ibstatus-roce-one-port-disabled.txt"
    assert detect(_t(name)) == "ibstatus"
    p0, p1 = parse_ibstatus(_t(name))
    assert (p0.name, p0.state, p0.phys_state, p0.rate_gbps, p0.width, p0.speed, p0.link_layer, p0.lid) == (
        "mlx5_0/1", "DOWN", "Disabled", 100.0, "4X", "EDR", "Ethernet", 0)
    assert (p1.name, p1.state, p1.phys_state, p1.rate_gbps, p1.problems) == ("mlx5_1/1", "ACTIVE", "LinkUp", 100.0, [])
    codes, _ = _codes([name])
    assert codes == [("ib.port_unused", UNUSED.format(port="mlx5_0/1"))]
    res = triage([(name, _t(name))], config_mod.from_dict({"fabric": {"ports": ["mlx5_1/1"]}}))
    assert res.findings == []
    with pytest.raises(TextFormatError, match="not ibstatus output"):
        parse_ibstatus("state: 4: ACTIVE\n")
