"""NVLink against the node's own link inventory, and error counters as rates."""

from __future__ import annotations

from conftest import node_snapshot

from gpuguard.checks import CheckContext, counters_of, run_checks
from gpuguard.model import NvLinkState

# azurehpc-health-checks #162: H100 PCIe on NCv5 wires 12 of 18 links; these are inactive by design
NCV5_UNWIRED = {4, 5, 10, 11, 16, 17}


def _links(n=18, down=(), **counters):
    return [NvLinkState(i, i not in down, counters.get(f"replay{i}", 0), counters.get(f"recovery{i}", 0),
                        counters.get(f"flit{i}", 0), 0) for i in range(n)]


def _run(snap, previous=None, *, hook="check", history=False, **settings):
    findings, errors = run_checks(CheckContext(snapshot=snap, previous=previous or {}, settings=settings,
                                               hook=hook, history=history))
    assert errors == []
    return [f for f in findings if f.code.startswith("nvlink.")]


def _brief(findings):
    return [(f.code, f.severity, f.gpu_index, f.message) for f in findings]


def test_links_never_up_on_the_sku_warn_once_on_the_first_reading():
    """Unwired by design or down: a first reading cannot tell (DCGM#198: all links down,
    diag passed), so it warns once; the stored inventory then says they were never up."""
    snap = node_snapshot(2, gpu0={"nvlinks": _links(down=NCV5_UNWIRED), "name": "NVIDIA H100 PCIe"},
                         gpu1={"nvlinks": _links(down=NCV5_UNWIRED), "name": "NVIDIA H100 PCIe"})
    msg = ("NVLink link(s) 4,5,10,11,16,17 inactive on the first reading (12 up): down, or not wired on this SKU "
           "(no history to tell)")
    first = [("nvlink.inactive_first_reading", "warning", 0, f"gpu0 (0000:18:00.0) {msg}"),
             ("nvlink.inactive_first_reading", "warning", 1, f"gpu1 (0000:29:00.0) {msg}")]
    assert _brief(_run(snap)) == first  # a one-off gpuguard check
    assert _brief(_run(snap, hook="prolog", history=True)) == first  # the hook's pass with an empty store
    assert _run(snap)[0].evidence == {"links_inactive": [4, 5, 10, 11, 16, 17], "links_up": 12}
    assert _run(snap, hook="prolog") == []  # the hook's live pass reads no history: the pass with it says it
    # and none on the next run, with the stored inventory
    assert _run(snap, counters_of(snap)) == []
    assert _run(snap, counters_of(snap), hook="prolog", history=True) == []
    # nor in MIG mode (NVML reports such links down; DCGM counts them disabled), nor with a configured count
    mig = node_snapshot(1, gpu0={"nvlinks": _links(down=NCV5_UNWIRED), "mig_mode": True})
    assert _run(mig) == []
    assert _run(node_snapshot(1, gpu0={"nvlinks": _links(n=18, down={12, 13})}), nvlink_expected_links=12) == []


def test_link_up_on_every_peer_but_down_here_is_down_without_history():
    snap = node_snapshot(3, gpu0={"nvlinks": _links(down=NCV5_UNWIRED)},
                         gpu1={"nvlinks": _links(down=NCV5_UNWIRED | {7})},
                         gpu2={"nvlinks": _links(down=NCV5_UNWIRED)})
    (f,) = _run(snap, hook="prolog")
    assert (f.code, f.gpu_index, f.message) == ("nvlink.link_down", 1, "gpu1 (0000:29:00.0) NVLink link(s) 7 down")
    assert f.evidence == {"links_down": [7], "never_up_by_design": [4, 5, 10, 11, 16, 17]}


def test_link_seen_up_before_is_down_now():
    before = node_snapshot(1, gpu0={"nvlinks": _links(down={4})})
    stored = counters_of(before)
    assert stored[before.gpus[0].uuid]["nvlink_ever_up"] == [i for i in range(18) if i != 4]
    later = node_snapshot(1, gpu0={"nvlinks": _links(down={4, 9})})
    (f,) = _run(later, stored)
    assert f.evidence["links_down"] == [9]
    # the inventory survives a run where the link was down
    again = counters_of(later, stored)
    assert 9 in again[later.gpus[0].uuid]["nvlink_ever_up"]


def test_all_links_down_with_history_is_down_and_on_a_first_reading_a_warning():
    up = node_snapshot(2)
    down = node_snapshot(2, gpu0={"nvlinks": _links(n=4, down=range(4))}, gpu1={"nvlinks": _links(n=4, down=range(4))})
    assert _run(down, hook="prolog") == []  # no history read: not judged here
    # a first reading: an alert, not a drain (a PCIe card without a bridge reads the same)
    assert _brief(_run(down)) == [
        ("nvlink.inactive_first_reading", "warning", i,
         f"gpu{i} (0000:{0x18 + 0x11 * i:02x}:00.0) NVLink link(s) 0,1,2,3 inactive on the first reading (0 up): "
         "down, or not wired on this SKU (no history to tell)") for i in (0, 1)]
    assert [f.evidence["links_down"] for f in _run(down, counters_of(up))] == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert [f.code for f in _run(down, counters_of(up))] == ["nvlink.link_down"] * 2


def test_configured_link_count():
    snap = node_snapshot(1, gpu0={"nvlinks": _links(n=12, down={3})})
    (f,) = _run(snap, nvlink_expected_links=12)
    assert f.evidence["links_down"] == [3]


def test_crc_growth_judged_as_rate_replay_as_count():
    before = node_snapshot(1, gpu0={"nvlinks": _links(n=4)})
    stored = counters_of(before)
    slow = node_snapshot(1, gpu0={"nvlinks": _links(n=4, flit2=500)})
    slow.taken_at = before.taken_at + 60  # 500 CRC errors in 60 s = 8.3/s: under DCGM's 100/s
    assert _run(slow, stored) == []
    fast = node_snapshot(1, gpu0={"nvlinks": _links(n=4, flit2=12000, replay1=2)})
    fast.taken_at = before.taken_at + 60  # 200/s
    (f,) = _run(fast, stored)
    assert f.code == "nvlink.errors_rising"
    assert f.evidence == {"increase": {"link2.crc_flit": {"increase": 12000, "per_s": 200.0},
                                       "link1.replay": {"increase": 2, "per_s": 0.033333}}}
    assert f.message == "gpu0 (0000:18:00.0) NVLink errors rising: link1.replay+2, link2.crc_flit+12000"


def test_counter_reset_by_driver_reload_is_not_growth():
    before = node_snapshot(1, gpu0={"nvlinks": _links(n=4, replay0=50)})
    after = node_snapshot(1, gpu0={"nvlinks": _links(n=4, replay0=0)})
    assert _run(after, counters_of(before)) == []
