"""nvidia-fabricmanager's own log line for an NVSwitch error (the layout GPUd's
fabric-manager component reads from /var/log/fabricmanager.log) is an SXid event, never
"no XID events"; another program's line holding the same text is rejected with its reason."""

from __future__ import annotations

import pytest

from gpuguard.xid.catalog import classify
from gpuguard.xid.parse import parse_lines

FATAL = ("[Jul 23 2024 07:53:55] [ERROR] [tid 841] detected NVSwitch fatal error 20034 on fid 0 on NVSwitch pci "
         "bus id 00000000:86:00.0 physical id 3 port 33")
NONFATAL = ("[Jul 09 2024 18:14:07] [ERROR] [tid 12727] detected NVSwitch non-fatal error 12028 on fid 0 on NVSwitch "
            "pci bus id 00000000:86:00.0 physical id 3 port 61")


@pytest.fixture(autouse=True)
def _utc(utc):
    """Fabric Manager prints local time: every test here runs in UTC (conftest ``utc``)."""


def test_fabric_manager_error_lines_are_sxid_events():
    info = "[Jul 23 2024 07:53:55] [INFO] [tid 841] Successfully configured all the available NVSwitches"
    res = parse_lines([NONFATAL, info, FATAL])
    assert [(e.kind, e.pci_bus_id, e.xid, e.message, e.timestamp, e.line_no, classify(e).action)
            for e in res.events] == [
        ("sxid", "0000:86:00.0", 12028, "Non-fatal, physical id 3 port 61 (nvidia-fabricmanager)", 1720548847.0, 1,
         "alert"),
        ("sxid", "0000:86:00.0", 20034, "Fatal, physical id 3 port 33 (nvidia-fabricmanager)", 1721721235.0, 3,
         "drain"),
    ]
    assert res.unparsed == 0


def test_a_pasted_fabric_manager_line_without_its_prefix_is_read():
    [event] = parse_lines([FATAL.split("] ", 3)[3]]).events
    assert (event.xid, event.pci_bus_id, event.timestamp) == (20034, "0000:86:00.0", None)


def test_another_programs_fabric_manager_text_is_rejected():
    forged = "Jul 23 07:53:56 n1 alice: " + FATAL
    res = parse_lines([forged])
    assert res.events == []
    assert res.rejected == {"not a Fabric Manager log prefix: 'Jul 23 07:53:56 n1 alice: [Jul 23 202...'": 1}
    res = parse_lines(["[    5.000000] " + FATAL.split("] ", 3)[3]], structured=True)
    assert res.events == []
    assert res.rejected == {"a Fabric Manager line in a kernel source (a program wrote it)": 1}
