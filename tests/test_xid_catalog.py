"""gpuguard.xid.catalog: table coverage, message-decoding rules, unknown codes."""

from __future__ import annotations

import pathlib

import pytest

from gpuguard.xid.catalog import (
    ACTIONS,
    SXID_TABLE,
    XID_TABLE,
    classify,
    fatal_flag,
    recovery_action,
)
from gpuguard.xid.parse import XidEvent, parse_lines

DATA = pathlib.Path(__file__).parent / "data"


def ev(xid: int, message: str = "", kind: str = "xid") -> XidEvent:
    return XidEvent(kind=kind, pci_bus_id="0000:01:00", xid=xid, pid=None, process=None, message=message,
                    timestamp=None, monotonic_s=None, mig_instance=None, raw="", line_no=1)


# Every XID of shared/XID.md plus the ones the brief adds, with the expected default.
REQUIRED = {
    13: "record", 31: "record", 32: "alert", 38: "alert", 43: "record", 45: "record", 46: "drain",
    48: "drain", 61: "alert", 62: "drain", 63: "alert", 64: "drain", 68: "alert", 74: "drain",
    79: "drain", 92: "alert", 94: "alert", 95: "drain", 109: "alert", 119: "drain", 120: "drain",
    140: "drain", 143: "drain",
}


@pytest.mark.parametrize("code,action", sorted(REQUIRED.items()))
def test_required_rows_and_default_actions(code, action):
    row = XID_TABLE[code]
    assert row.action == action
    assert classify(ev(code)).action == action


def test_every_row_is_well_formed():
    for table in (XID_TABLE, SXID_TABLE):
        for code, row in table.items():
            assert row.code == code
            assert row.action in ACTIONS
            assert row.source.strip() and row.name.strip() and row.meaning.strip()
    assert set(range(144, 151)) <= set(XID_TABLE)
    assert 154 in XID_TABLE and 20034 in SXID_TABLE


def test_severity_follows_action():
    assert (classify(ev(13)).severity, classify(ev(63)).severity, classify(ev(79)).severity) == (
        "info", "warning", "critical")


@pytest.mark.parametrize("message,action", [
    ("NETIR_LINK_EVT  Fatal   XC0 i0 Link 01 (0x021425c6 0x0)", "drain"),
    ("NETIR_BER_EVENT Nonfatal XC0 i0 Link 03 (0x00086226)", "alert"),
    ("RLW_RXPIPE Non-fatal XC0 i0 Link 13", "alert"),
    ("SAW_MVB something without a flag", "alert"),
])
def test_nvlink5_fatal_word(message, action):
    for code in (144, 149, 150):
        assert classify(ev(code, message)).action == action


@pytest.mark.parametrize("message,action", [
    ("GPU recovery action changed from 0x0 (None) to 0x4 (Drain and Reset)", "drain"),
    ("GPU recovery action changed from 0x4 (Drain and Reset) to 0x1 (GPU Reset Required)", "drain"),
    ("GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)", "drain"),
    ("GPU recovery action changed from 0x0 (None) to 0x3 (Drain P2P)", "alert"),
    ("GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)", "record"),
    ("GPU recovery action changed from 0x0 to 0x3", "alert"),
    ("GPU recovery action changed from 0x0 to 0x2", "drain"),
    ("garbled", "alert"),
    # the number decides, whatever name a driver prints (newer drivers: "OS Reboot")
    ("GPU recovery action changed from 0x0 (None) to 0x2 (OS Reboot)", "drain"),
    ("GPU recovery action changed from 0x0 (None) to 0x3 (Something New)", "alert"),
    ("GPU recovery action changed from 0x1 (GPU Reset) to 0x0 (Whatever)", "record"),
    ("GPU recovery action changed from 0x0 (None) to 0x4 (DRAIN_AND_RESET)", "drain"),
    ("GPU recovery action changed from 0x0 (None) to (Node Reboot Required)", "drain"),
    ("GPU recovery action changed from 0x0 (None) to 0x7 (Future)", "alert"),
])
def test_xid154_acts_on_new_recovery_action(message, action):
    assert classify(ev(154, message)).action == action


def test_recovery_action_and_fatal_flag_helpers():
    assert recovery_action("changed from 0x4 (Drain and Reset) to 0x1 (GPU Reset Required)") == 1
    assert recovery_action("changed from 0x0 (None) to 0x2 (OS Reboot)") == 2
    c = classify(ev(154, "GPU recovery action changed from 0x0 (None) to 0x2 (OS Reboot)"))
    assert (c.action, c.severity) == ("drain", "critical")
    assert c.meaning.endswith("(new action: 0x2 Node Reboot)")
    assert recovery_action("nothing here") is None
    assert (fatal_flag("Fatal, Link 48"), fatal_flag("Non-fatal, Link 2"), fatal_flag("Severity 1")) == (
        True, False, None)


@pytest.mark.parametrize("message,action", [
    ("Fatal, Link 48 LTSSM Fault Up", "drain"),
    ("Non-fatal, Link 7 something", "alert"),
    ("Severity 1 Engine instance 60 Sub-engine instance 00", "drain"),  # row default for 20034
])
def test_sxid_rule(message, action):
    assert classify(ev(20034, message, kind="sxid")).action == action


def test_unknown_codes_alert():
    c = classify(ev(9999, "whatever"))
    assert (c.action, c.severity, c.name) == ("alert", "warning", "unknown XID 9999")
    s = classify(ev(11012, "Severity 0", kind="sxid"))
    assert (s.action, s.name) == ("alert", "unknown SXid 11012")
    assert classify(ev(11012, "Fatal, ...", kind="sxid")).action == "drain"


def test_fallen_off_bus_is_xid79_and_bad_kind_raises():
    c = classify(ev(79, "The NVIDIA GPU ... fallen off the bus", kind="fallen_off_bus"))
    assert (c.action, c.name) == ("drain", "GPU has fallen off the bus")
    with pytest.raises(ValueError):
        classify(ev(79, kind="nvml"))


def test_corpus_actions_end_to_end():
    def actions(name):
        return [classify(e).action for e in parse_lines((DATA / name).read_text().splitlines()).events]

    assert actions("xid-145-149-gb200-nvlink-nots.txt") == ["alert"] * 5 + ["drain"]
    assert actions("xid-62-154-gsp-crashcat-blackwell.txt") == ["drain", "drain"]
    assert actions("xid-13-109-dmesg-ctime-peermem.txt") == ["record"] * 3 + ["alert"]
    assert actions("xid-79-sxid-20034-nvswitch.txt") == ["drain"] * 6


@pytest.mark.parametrize("code,name,action", [
    (137, "NVLink FLA privilege error", "alert"),
    (171, "uncorrectable memory error detail", "drain"),
    (172, "uncorrectable memory error detail", "drain"),
])
def test_catalog_rows_137_171_172_have_sources(code, name, action):
    c = classify(ev(code, "x"))
    assert (c.name, c.action) == (name, action)
    assert "NV catalog" in c.source


@pytest.mark.parametrize("comm,action", [
    ("ray::WorkerDict", "drain"),  # the real line's process (xid-145-149-gb200-nvlink-nots.txt)
    ("x, Nonfatal", "drain"),  # a name with a comma: its tail reads as message text
    ("Nonfatal", "drain"),
])
def test_a_process_name_cannot_turn_a_fatal_nvlink5_error_into_an_alert(comm, action):
    """The driver prints the name the program chose (prctl PR_SET_NAME, 15 bytes) before
    its own Fatal/Nonfatal flag: the flag read is the driver's, the last one."""
    line = (f"[ 1.0] NVRM: Xid (PCI:0019:01:00): 145, pid=876766, name={comm}, RLW_RXPIPE Fatal XC0 i0 Link 12 "
            "(0x040980c2 0x00000008 0x00000000 0x00000000 0x00000000 0x00000000)")
    [event] = parse_lines([line]).events
    assert (event.xid, classify(event).action) == (145, action)
    nonfatal = parse_lines([line.replace("RLW_RXPIPE Fatal", "RLW_RXPIPE Nonfatal")]).events[0]
    assert classify(nonfatal).action == "alert"
