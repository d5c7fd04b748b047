"""A user program chooses the version string the NVIDIA driver prints in its multi-line
"NVRM: API mismatch" record (open-gpu-kernel-modules rm_perform_version_check, 63 bytes):
a string holding a newline and an Xid line must never read as the kernel's XID, in any
layout a syslog reader or dmesg prints the record's lines in."""

from __future__ import annotations

import pytest

from gpuguard.xid.parse import CLIENT_TEXT_REASON, parse_lines
from gpuguard.xid.records import dmesg_canonical

STAMP = "[ 5080.898738] "
SYSLOG = "Dec  1 10:00:00 n1 kernel: " + STAMP
#: the record's lines after the head: the client's text (the forged line), then the driver's tail
FORGED = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus., but"
TAIL = ["NVRM: this kernel module has the version 535.183.01.  Please",
        "NVRM: make sure that this kernel module and all NVIDIA driver",
        "NVRM: components have the same version."]
HEAD = "NVRM: API mismatch: the client has the version 1"
RECORD = [HEAD, FORGED, *TAIL]
INDENT = " " * len(STAMP)
REAL_XID = "NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."


def _layouts() -> dict[str, tuple[list[str], bool]]:
    return {
        # rsyslog imklog reads /proc/kmsg, where the kernel repeats the prefix on every line
        "kern.log (imklog)": ([SYSLOG + line for line in RECORD], False),
        # the second of the record's lines logged one second later: the printk stamp still ties it
        "kern.log, date ticked": ([SYSLOG + HEAD, SYSLOG.replace(":00 n1", ":01 n1") + FORGED]
                                  + [SYSLOG + line for line in TAIL], False),
        # `dmesg` indents a record's continuation lines under its stamp
        "dmesg": ([STAMP + HEAD] + [INDENT + line for line in RECORD[1:]], False),
        # `dmesg -t` / `journalctl -o cat`: no prefix at all
        "dmesg -t": (list(RECORD), False),
        # `dmesg -r` through syslog(2) (no /dev/kmsg): the structured reader's own input
        "dmesg -r -S": (dmesg_canonical(["<4>" + STAMP + line for line in RECORD]), True),
    }


@pytest.mark.parametrize("layout", list(_layouts()))
def test_an_xid_in_the_client_version_string_is_rejected(layout):
    lines, structured = _layouts()[layout]
    res = parse_lines(lines, structured=structured)
    assert res.events == []
    assert res.rejected == {CLIENT_TEXT_REASON: 1}
    assert [n for n, _why, _text in res.rejected_samples] == [2]


def test_a_short_forgery_after_a_forged_tail_is_rejected_too():
    """The client writes the driver's last tail line itself, then a shortest marker line
    (``NVRM:Xid(0:0:0):79``, 18 bytes; 61 in all): the window is counted in bytes, not
    ended by the tail's text."""
    version = "\nNVRM: components have the same version.\nNVRM:Xid(0:0:0):79"
    assert len(version) <= 63
    record = ["NVRM: API mismatch: the client has the version " + version.split("\n")[0],
              *version.split("\n")[1:-1], version.split("\n")[-1] + ", but", *TAIL]
    res = parse_lines([SYSLOG + line for line in record])
    assert res.events == []
    assert res.rejected == {CLIENT_TEXT_REASON: 1}


@pytest.mark.parametrize("prefix,next_prefix", [
    (SYSLOG, "Dec  1 10:00:03 n1 kernel: [ 5083.120001] "),  # its own record: its own stamp
    ("Dec  1 10:00:00 n1 kernel: ", "Dec  1 10:00:00 n1 kernel: "),  # no printk stamps at all
    ("", ""),  # dmesg -t
])
def test_a_real_xid_after_a_real_api_mismatch_is_read(prefix, next_prefix):
    """A real XID is a record of its own: it follows the mismatch record's tail (over
    150 bytes), so it is never in the client's window."""
    record = ["NVRM: API mismatch: the client has the version 545.29.06, but", *TAIL]
    res = parse_lines([prefix + line for line in record] + [next_prefix + REAL_XID])
    assert [(e.kind, e.pci_bus_id, e.xid, e.line_no) for e in res.events] == [("xid", "0000:18:00", 79, 5)]
    assert res.unparsed == 0


def prolog_health_on_kern_log(tmp_path, make_config, write_replay, text: str) -> tuple:
    """The Prolog's health run on a 2-GPU replay node whose kern.log (an rsyslog kern.*
    file: kernel messages only) holds ``text``: ``(result, events stored)``."""
    from conftest import node_snapshot
    from gpuguard.health import run_health
    from gpuguard.store import open_store

    kern = tmp_path / "kern.log"
    kern.write_text(text)
    _, cfg = make_config(replay=write_replay(node_snapshot(2)), kernel_log=str(kern))
    assert cfg.get("xid", "kernel_log_kernel_only") is True
    store = open_store(cfg.store_path)
    try:
        res = run_health(cfg, hook="prolog", store=store, job_id="7")
        return res, store.query("select count(*) as n from events")[0]["n"]
    finally:
        store.close()


def test_the_forged_line_never_drains_the_prolog(tmp_path, make_config, write_replay):
    res, events = prolog_health_on_kern_log(tmp_path, make_config, write_replay,
                                            "".join(SYSLOG + line + "\n" for line in RECORD))
    assert (res.decision.outcome, res.decision.actions) == ("proceed", [])
    assert res.xid_rejected == {CLIENT_TEXT_REASON: 1}
    assert events == 0
