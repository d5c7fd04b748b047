"""InfiniBand/RoCE from recorded sysfs trees: exact ports, exact findings."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuguard import config as config_mod
from gpuguard.health import run_health
from gpuguard.net.ib_judge import judge_ports, port_memory
from gpuguard.net.ib_model import parse_phys_state, parse_rate, parse_state
from gpuguard.net.ib_sysfs import read_port, read_ports
from gpuguard.store import open_store

TREES = Path(__file__).parent / "data" / "ib-sysfs"
RUN1, RUN2 = str(TREES / "ndv4-run1"), str(TREES / "ndv4-run2")
T1, T2 = 1764460800.0, 1764460800.0 + 3600


def test_value_formats():
    assert parse_state("4: ACTIVE") == "ACTIVE" and parse_state("1: DOWN") == "DOWN" and parse_state("2: INIT") == "INIT"
    assert parse_state("Active") == "ACTIVE" and parse_state("9: WHAT") is None
    assert parse_phys_state("5: LinkUp") == "LinkUp" and parse_phys_state("3: Disabled") == "Disabled"
    assert parse_phys_state("0: <unknown>") is None
    assert parse_rate("200 Gb/sec (4X HDR)") == (200.0, "4X", "HDR")
    assert parse_rate("10 Gb/sec (4X)") == (10.0, "4X", "SDR")
    assert parse_rate("2.5 Gb/sec (1X SDR)") == (2.5, "1X", "SDR")
    assert parse_rate("400 Gb/sec (4X NDR)") == (400.0, "4X", "NDR")
    with pytest.raises(ValueError):
        parse_rate("")


def test_read_recorded_tree():
    ports = read_ports(RUN1)
    assert [p.name for p in ports] == ["mlx5_0/1", "mlx5_1/1", "mlx5_2/1", "mlx5_3/1", "mlx5_4/1"]
    p0 = ports[0]
    assert (p0.state, p0.phys_state, p0.rate_gbps, p0.width, p0.speed, p0.link_layer, p0.hca_type) == \
        ("ACTIVE", "LinkUp", 200.0, "4X", "HDR", "InfiniBand", "MT4123")
    assert p0.counters["local_link_integrity_errors"] == 15 and p0.counters["port_xmit_data"] == 4153367263
    assert "lifespan" not in p0.hw_counters and p0.hw_counters["local_ack_timeout_err"] == 0
    eth = ports[4]
    assert (eth.state, eth.phys_state, eth.link_layer, eth.hw_counters["np_cnp_sent"]) == ("ACTIVE", None, "Ethernet", 12)
    assert all(p.problems == [] for p in ports)
    assert [p.name for p in read_ports(RUN1, ["mlx5_2/1"])] == ["mlx5_2/1"]
    assert read_ports(str(TREES / "missing")) == []


def test_first_reading_healthy_tree():
    f = judge_ports(read_ports(RUN1), {}, T1)
    # a 4-bit counter at its maximum (15) is a lower bound, never "no growth"
    assert [(x.code, x.message) for x in f] == [
        ("ib.counter_saturated", "mlx5_0/1 counter(s) stuck at maximum, growth unknown: local_link_integrity_errors=15")]


def test_port_down_rising_symbol_errors_degraded_rate():
    run1 = read_ports(RUN1)
    previous = {p.name: port_memory(p, None, T1) for p in run1}
    f = judge_ports(read_ports(RUN2), previous, T2)
    assert [(x.code, x.severity, x.message) for x in f] == [
        ("ib.counter_saturated", "warning",
         "mlx5_0/1 counter(s) stuck at maximum, growth unknown: local_link_integrity_errors=15"),
        ("ib.port_down", "critical", "mlx5_1/1 port DOWN, physical state Disabled"),
        ("ib.link_flapping", "warning", "mlx5_1/1 link went down 1 time(s) since the last run"),
        ("ib.errors_rising", "warning", "mlx5_2/1 errors rising: port_rcv_errors+40, symbol_error+1247"),
        ("ib.rate_degraded", "critical", "mlx5_3/1 at 100 Gb/s (2X HDR), expected 200 Gb/s"),
    ]
    down = f[1].evidence
    assert down == {"port": "mlx5_1/1", "state": "DOWN", "phys_state": "Disabled", "link_layer": "InfiniBand",
                    "rate_printed_gbps": 10.0}  # a down port still prints a rate; it is not judged
    assert f[3].evidence["increase"] == {"port_rcv_errors": {"increase": 40, "per_hour": 40.0},
                                         "symbol_error": {"increase": 1247, "per_hour": 1247.0}}


def test_degraded_rate_seen_from_the_port_history_alone():
    p = read_port(RUN2, "mlx5_3", 1)
    prev = {"mlx5_3/1": port_memory(read_port(RUN1, "mlx5_3", 1), None, T1)}
    assert [x.code for x in judge_ports([p], prev, T2)] == ["ib.rate_degraded"]
    assert judge_ports([p], {}, T2) == []  # nothing to compare with: not a finding
    assert [x.code for x in judge_ports([p], {}, T2, expected_rate_gbps=200)] == ["ib.rate_degraded"]


def test_counter_reset_is_a_new_start():
    p1 = read_port(RUN2, "mlx5_2", 1)
    p2 = read_port(RUN1, "mlx5_2", 1)  # lower counters than before: perfquery -R
    assert judge_ports([p2], {"mlx5_2/1": port_memory(p1, None, T1)}, T2) == []


def test_unreadable_state_and_rate_are_reported(tmp_path):
    import shutil

    root = tmp_path / "ib"
    shutil.copytree(RUN1, root)
    os.remove(root / "mlx5_2" / "ports" / "1" / "state")
    os.remove(root / "mlx5_4" / "ports" / "1" / "rate")
    os.mkdir(root / "mlx5_4" / "ports" / "1" / "rate")  # a read that fails (EINVAL on a VF)
    ports = read_ports(str(root))
    assert ports[2].state is None and ports[2].problems[0].startswith("state unreadable")
    assert ports[4].rate_gbps is None and ports[4].problems[0].startswith("rate unreadable")
    f = judge_ports(ports, {}, T1)
    assert [x.code for x in f] == ["ib.counter_saturated", "ib.unreadable"]
    assert f[1].message.startswith("mlx5_2/1 state unknown: state unreadable")


def test_health_run_reads_stores_and_compares(tmp_path, monkeypatch):
    """Two prolog-like runs on a replayed GPU node: the second sees the fabric change."""
    from conftest import node_snapshot

    from gpuguard.gpu.replay import dump_snapshot

    snap = tmp_path / "snap.json"
    snap.write_text(dump_snapshot(node_snapshot(2)))
    cfgd = {"node": {"name": "gn1"}, "gpu": {"source": "replay", "replay_path": str(snap)},
            "paths": {"state_dir": str(tmp_path / "state")}, "fabric": {"sysfs_root": RUN1}}
    store = open_store(str(tmp_path / "node.db"))
    res = run_health(config_mod.from_dict(cfgd), hook="prolog", store=store, scan_xid=False)
    assert [f.code for f in res.findings if f.code.startswith("ib.")] == ["ib.counter_saturated"]
    assert res.tool_errors == []
    cfgd["fabric"]["sysfs_root"] = RUN2
    res = run_health(config_mod.from_dict(cfgd), hook="prolog", store=store, scan_xid=False)
    assert sorted(f.code for f in res.findings if f.code.startswith("ib.")) == [
        "ib.counter_saturated", "ib.errors_rising", "ib.link_flapping", "ib.port_down", "ib.rate_degraded"]
    assert res.decision.outcome == "drain"
    assert res.decision.reason.startswith("gpuguard: ib.")
    rows = store.query("select distinct port from fabric_counters where node = 'gn1' order by port")
    assert [r["port"] for r in rows] == ["mlx5_0/1", "mlx5_1/1", "mlx5_2/1", "mlx5_3/1", "mlx5_4/1"]
    store.close()


def _down_port(tmp_path, phys="2: Polling", state="1: DOWN", **counters):
    """mlx5_1/1 of run 2 turned into a port that was never used (all use counters 0)
    unless ``counters`` says otherwise."""
    import shutil

    root = tmp_path / "ib"
    shutil.copytree(RUN2, root)
    port = root / "mlx5_1" / "ports" / "1"
    (port / "state").write_text(state + "\n")
    (port / "phys_state").write_text(phys + "\n")
    for f in os.listdir(port / "counters"):
        (port / "counters" / f).write_text(f"{counters.get(f, 0)}\n")
    return read_port(str(root), "mlx5_1", 1)


NEVER_USED = ("mlx5_1/1 port DOWN, physical state Polling, no sign of use (never seen ACTIVE, no traffic counted): "
              "taken as a port nobody cabled (name the ports jobs need in [fabric] ports to have it judged)")


def test_a_port_never_used_is_not_a_fault_unless_the_operator_named_it(tmp_path):
    p = _down_port(tmp_path)
    assert [(x.code, x.severity, x.message) for x in judge_ports([p], {}, T2)] == [("ib.port_unused", "info", NEVER_USED)]
    assert [(x.code, x.severity) for x in judge_ports([p], {}, T2, listed=True)] == [("ib.port_down", "critical")]
    disabled = _down_port(tmp_path / "d", phys="3: Disabled")
    assert [x.code for x in judge_ports([disabled], {}, T2)] == ["ib.port_unused"]


def test_a_port_with_signs_of_use_is_down_not_unused(tmp_path):
    for counters in ({"port_xmit_data": 81920}, {"port_rcv_packets": 3}, {"link_downed": 1}):
        p = _down_port(tmp_path / next(iter(counters)), **counters)
        assert next((x.code, x.message) for x in judge_ports([p], {}, T2)) == (
            "ib.port_down", "mlx5_1/1 port DOWN, physical state Polling"), counters
    p = _down_port(tmp_path / "mem")
    was_up = port_memory(read_port(RUN1, "mlx5_1", 1), None, T1)  # an earlier run saw it ACTIVE
    assert was_up["used"] is True
    assert [x.code for x in judge_ports([p], {"mlx5_1/1": was_up}, T2)] == ["ib.port_down"]
    older = {k: v for k, v in was_up.items() if k != "used"}  # a reading stored before "used" was kept
    assert [x.code for x in judge_ports([p], {"mlx5_1/1": older}, T2)] == ["ib.port_down"]
    # once seen used, the memory keeps it while the port stays down
    assert port_memory(p, was_up, T2)["used"] is True
    assert port_memory(p, None, T2)["used"] is False


def test_a_cabled_port_no_subnet_manager_brought_up_is_down_even_if_never_used(tmp_path):
    p = _down_port(tmp_path, phys="5: LinkUp", state="2: INIT")
    assert [(x.code, x.severity) for x in judge_ports([p], {}, T2)] == [("ib.port_down", "critical")]
