"""Kernel-log layouts real tools print, each read with its exact fields.

Before, these were rejected as "not a kernel-log prefix" (the XID counted but given no
finding) or read without their time: RFC 5424 with PROCID ``0`` or the NILVALUE
timestamp (rsyslog/syslog-ng forwarding), a year after the day (``Dec 01 2026``; grok's
CISCOTIMESTAMP) or first (syslog-ng ``ts-format(full)``: ``2026 Dec  1``), syslog-ng
``ts-format(unix)`` (whole seconds), a dev_printk device prefix (``nvidia 0000:3b:00.0:``)
before ``NVRM:``, ``[12345.678 ]`` (monotonic time lost), ``journalctl -o short-full
--utc`` (``UTC`` read as local time). User text in each of these layouts is still
rejected, and the boot banner in each is a boot line.

Times: the local zone is pinned to ``XST-1`` (UTC+1, no DST), so a stamp read as local
time and one read as UTC differ by an hour. 2026-12-01T10:00:00Z is 1796119200."""

from __future__ import annotations

import pathlib
import time

import pytest
from click.testing import CliRunner

from gpuguard.cli import main
from xid_helpers import check_kernel_log
from gpuguard.xid.logfile import is_boot_line
from gpuguard.xid.parse import parse_lines

DATA = pathlib.Path(__file__).parent / "data"
MSG = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus."
UTC_10 = 1796119200.0  # 2026-12-01T10:00:00Z
LOCAL_10 = UTC_10 - 3600  # 10:00 local time in XST-1


@pytest.fixture(autouse=True)
def _utc_plus_one(monkeypatch):
    monkeypatch.setenv("TZ", "XST-1")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def _fields(prefix: str, structured: bool = False) -> tuple:
    res = parse_lines([prefix + MSG], structured=structured)
    assert res.unparsed == 0, res.rejected
    [e] = res.events
    return e.kind, e.xid, e.pci_bus_id, e.pid, e.process, e.message, e.timestamp, e.monotonic_s


def _want(timestamp, mono) -> tuple:
    return "xid", 79, "0000:3b:00", 1234, "python", "GPU has fallen off the bus.", timestamp, mono


#: (layout, prefix, UTC epoch seconds or None, seconds since boot or None): rejected, or
#: read without their time, before
NEW_LAYOUTS = [
    ("rfc5424 procid 0", "<4>1 2026-12-01T10:00:00.123456+00:00 node01 kernel 0 - - ", UTC_10 + 0.123456, None),
    ("rfc5424 nil time", "<4>1 - node01 kernel - - - ", None, None),
    ("rfc5424 nil time, procid 0, stamp", "<4>1 - node01 kernel 0 - - [12345.678901] ", None, 12345.678901),
    ("rfc5424 nil time and host", "<4>1 - - kernel - - - ", None, None),
    ("rfc5424 ipv4 host, procid 0", "<4>1 2026-12-01T10:00:00Z 10.1.2.3 kernel 0 - - ", UTC_10, None),
    ("rfc5424 fqdn host, msgid", "<4>1 2026-12-01T10:00:00Z gpu01.cluster.example.com kernel - kmsg - ",
     UTC_10, None),
    ("year after day", "Dec 01 2026 10:00:00 node01 kernel: ", LOCAL_10, None),
    ("year after space-padded day", "Dec  1 2026 10:00:00 node01 kernel: ", LOCAL_10, None),
    ("year after day, zone", "Dec  1 2026 10:00:00 UTC node01 kernel: [12345.678901] ", UTC_10, 12345.678901),
    ("syslog-ng ts-format(full)", "2026 Dec  1 10:00:00 node01 kernel: ", LOCAL_10, None),
    ("year after time, no weekday", "Dec  1 10:00:00 2026 node01 kernel: ", LOCAL_10, None),
    ("syslog-ng ts-format(unix)", "1796119200 node01 kernel: ", UTC_10, None),
    ("dev_printk after kernel:", "Dec 01 10:00:00 node01 kernel: nvidia 0000:3b:00.0: ", None, None),
    ("dev_printk in dmesg", "[12345.678901] nvidia 0000:3b:00.0: ", None, 12345.678901),
    ("dev_printk, no driver bound", "Dec  1 10:00:00 node01 kernel: [12345.678901] pci 0000:3b:00.0: ",
     None, 12345.678901),
    ("stamp with a space before ]", "[12345.678 ] ", None, 12345.678),
    ("stamp padded both sides", "[ 12345.678901 ] node01 kernel: ", None, 12345.678901),
    ("journalctl short-full --utc", "Tue 2026-12-01 10:00:00 UTC node01 kernel: ", UTC_10, None),
    # a zone with no abbreviation (Asia/Dubai): journalctl prints the offset as its name
    ("journalctl short-full, numeric zone", "Tue 2026-12-01 14:00:00 +04 node01 kernel: ", UTC_10, None),
]


@pytest.mark.parametrize("layout,prefix,timestamp,mono", NEW_LAYOUTS, ids=[r[0] for r in NEW_LAYOUTS])
def test_new_layout_gives_the_event_with_its_fields(layout, prefix, timestamp, mono):
    assert _fields(prefix) == _want(timestamp, mono)


#: what the tools print, as their documentation gives the format (journalctl(1) --output,
#: dmesg(1), rsyslog's reserved templates, syslog-ng's ts-format and default file template,
#: BusyBox syslogd); these were read before too (a guard: they must stay read)
TOOL_LAYOUTS = [
    ("journalctl -o short", "Dec 01 10:00:00 node01 kernel: ", None, None),
    ("journalctl --no-hostname", "Dec 01 10:00:00 kernel: ", None, None),
    ("journalctl -o short-iso", "2026-12-01T10:00:00+0000 node01 kernel: ", UTC_10, None),
    ("journalctl -o short-iso-precise", "2026-12-01T10:00:00.123456+00:00 node01 kernel: ", UTC_10 + 0.123456,
     None),
    ("journalctl -o short-precise", "Dec 01 10:00:00.123456 node01 kernel: ", None, None),
    ("journalctl -o short-monotonic", "[12345.678901] node01 kernel: ", None, 12345.678901),
    ("journalctl -o short-unix", "1796119200.123456 node01 kernel: ", UTC_10 + 0.123456, None),
    ("journalctl -o short-full", "Tue 2026-12-01 10:00:00 XST node01 kernel: ", LOCAL_10, None),
    ("journalctl -o short-delta", "[12345.678901 <    0.000123>] node01 kernel: ", None, 12345.678901),
    ("dmesg", "[12345.678901] ", None, 12345.678901),
    ("dmesg -T", "[Tue Dec  1 10:00:00 2026] ", LOCAL_10, None),
    ("dmesg --time-format iso", "2026-12-01T10:00:00,123456+00:00 ", UTC_10 + 0.123456, None),
    ("dmesg -x", "kern  :warn  : [12345.678901] ", None, 12345.678901),
    ("dmesg -r", "<4>[12345.678901] ", None, 12345.678901),
    ("dmesg -t", "", None, None),
    ("RSYSLOG_TraditionalFileFormat", "Dec  1 10:00:00 node01 kernel: [12345.678901] ", None, 12345.678901),
    ("RSYSLOG_FileFormat", "2026-12-01T10:00:00.123456+00:00 node01 kernel: [12345.678901] ", UTC_10 + 0.123456,
     12345.678901),
    ("RSYSLOG_SyslogProtocol23Format", "<4>1 2026-12-01T10:00:00.123456+00:00 node01 kernel - - - ",
     UTC_10 + 0.123456, None),
    ("RSYSLOG_ForwardFormat", "<4>2026-12-01T10:00:00.123456+00:00 node01 kernel: ", UTC_10 + 0.123456, None),
    ("RSYSLOG_TraditionalForwardFormat", "<4>Dec  1 10:00:00 node01 kernel: ", None, None),
    ("syslog-ng default", "Dec  1 10:00:00 node01 kernel: ", None, None),
    ("syslog-ng ts-format(iso)", "2026-12-01T10:00:00+00:00 node01 kernel: ", UTC_10, None),
    ("syslog-ng rfc5424 with meta", '<4>1 2026-12-01T10:00:00+00:00 node01 kernel - - [meta sequenceId="7"] ',
     UTC_10, None),
    ("FQDN host", "Dec  1 10:00:00 gpu01.cluster.example.com kernel: ", None, None),
    ("IPv4 host", "Dec  1 10:00:00 10.1.2.3 kernel: ", None, None),
    ("BusyBox syslogd", "Dec  1 10:00:00 node01 kern.warn kernel: [12345.678901] ", None, 12345.678901),
]


@pytest.mark.parametrize("layout,prefix,timestamp,mono", TOOL_LAYOUTS, ids=[r[0] for r in TOOL_LAYOUTS])
def test_tool_layout_gives_the_event_with_its_fields(layout, prefix, timestamp, mono):
    assert _fields(prefix) == _want(timestamp, mono)


def test_dev_printk_prefix_in_a_structured_source():
    """/dev/kmsg, the journal and ``dmesg -r`` give the message as the kernel printed it:
    a dev_printk message starts with the device (``nvidia 0000:3b:00.0: ``), then NVRM."""
    assert _fields("[12345.678901] nvidia 0000:3b:00.0: ", structured=True) == _want(None, 12345.678901)
    assert _fields("2026-12-01T10:00:00+00:00 [12345.678901] nvidia 0000:3b:00.0: ", structured=True) == _want(
        UTC_10, 12345.678901)
    res = parse_lines(["[12345.678901] alice 0000:3b:00.0 x: " + MSG], structured=True)
    assert (res.events, res.rejected) == ([], {"marker not at the start of the kernel message": 1})


#: (a user's line in a new layout, the reason it is rejected with)
SPOOFS = [
    ("<4>1 2026-12-01T10:00:00Z node01 kernel 4242 - - ", "not a kernel-log prefix: 'node01 kernel 4242 - -'"),
    ("<4>1 2026-12-01T10:00:00Z node01 alice 0 - - ", "not a kernel-log prefix: 'node01 alice 0 - -'"),
    ("<4>1 - node01 alice - - - ", "not a kernel-log prefix: '- node01 alice - - -'"),
    ("<13>1 - node01 kernel - - - ", "not a kernel-log prefix: '<13>1 - node01 kernel - - -'"),
    ("<4>1 - node01 alice - - - kernel: ", "not a kernel-log prefix: '- node01 alice - - - kernel:'"),
    ("Dec 01 2026 10:00:00 node01 alice: ", "not a kernel-log prefix: 'node01 alice:'"),
    ("Dec  1 2026 10:00:00 node01 alice: kernel: ", "not a kernel-log prefix: 'node01 alice: kernel:'"),
    ("2026 Dec  1 10:00:00 node01 alice[77]: ", "not a kernel-log prefix: 'node01 alice[77]:'"),
    ("1796119200 node01 alice: ", "not a kernel-log prefix: 'node01 alice:'"),
    ("Dec 01 10:00:00 node01 alice: nvidia 0000:3b:00.0: ",
     "not a kernel-log prefix: 'node01 alice: nvidia 0000:3b:00.0:'"),
    ("Dec 01 10:00:00 node01 kernel: nvidia 0000:3b:00.0 alice: ",
     "not a kernel-log prefix: 'nvidia 0000:3b:00.0 alice:'"),
    # a tag a user chose that looks like a device: no kernel tag before it
    ("Dec 01 10:00:00 node01 0000:3b:00.0: ", "not a kernel-log prefix: 'node01 0000:3b:00.0:'"),
    ("Dec 01 2026 10:00:00 node01 nvidia 0000:3b:00.0: ",
     "not a kernel-log prefix: 'node01 nvidia 0000:3b:00.0:'"),
    # a tag a user chose that looks like a facility (``logger -t kern.warn``)
    ("Dec  1 10:00:00 node01 kern.warn: ", "not a kernel-log prefix: 'node01 kern.warn:'"),
    # a host name in capitals is no time zone (the zone name needs a weekday first)
    ("2026-12-01T10:00:00+00:00 GPUA ", "not a kernel-log prefix: 'GPUA'"),
    ("Dec  1 2026 10:00:00 GPUA ", "not a kernel-log prefix: 'GPUA'"),
    ("[12345.678 ] alice: ", "not a kernel-log prefix: 'alice:'"),
]


@pytest.mark.parametrize("prefix,reason", SPOOFS)
def test_user_text_in_a_new_layout_is_rejected_with_its_reason(prefix, reason):
    res = parse_lines([prefix + MSG])
    assert res.events == []
    assert res.rejected == {reason: 1}


def test_user_lines_in_the_new_layouts_never_drain(tmp_path, make_config, write_replay):
    """A kern.log (kernel messages only, so its XIDs drain) holding users' lines in the
    new layouts: no finding, no event; each line counted by its reason."""
    from test_xid_client_text import prolog_health_on_kern_log

    text = "".join(p + MSG + "\n" for p, _ in SPOOFS)
    res, events = prolog_health_on_kern_log(tmp_path, make_config, write_replay, text)
    assert (res.decision.outcome, res.decision.actions, events) == ("proceed", [], 0)
    want: dict[str, int] = {}
    for _, reason in SPOOFS:
        want[reason] = want.get(reason, 0) + 1
    assert res.xid_rejected == want


EXEC = "inside the user-written text of a kernel message (file name of an exec with NULL argv)"


@pytest.mark.parametrize("prefix", ["Dec 01 2026 10:00:00 node01 kernel: ", "<4>1 - node01 kernel - - - ",
                                    "<4>1 2026-12-01T10:00:00Z node01 kernel 0 - - ", "1796119200 node01 kernel: "])
def test_forged_line_in_an_exec_file_name_is_rejected_in_a_new_layout(prefix):
    """The kernel prints an exec's file name (any user's text, with a newline in it) and a
    syslog reader repeats the prefix on its second line: that line is no XID, in the new
    layouts as in the old ones."""
    lines = [prefix + "process 'a' launched '/tmp/x", prefix + MSG + "' with NULL argv: empty string added"]
    res = parse_lines(lines)
    assert res.events == []
    assert res.rejected == {EXEC: 1}


_BANNER = "Linux version 6.8.0-49-generic (buildd@lcy02) #49-Ubuntu SMP"


@pytest.mark.parametrize("prefix", [
    "<6>1 - n1 kernel - - - [    0.000000] ",
    "<6>1 2026-11-03T09:00:00.000000+00:00 n1 kernel 0 - - ",
    "Nov 03 2026 09:00:00 n1 kernel: [    0.000000] ",
    "2026 Nov  3 09:00:00 n1 kernel: ",
    "1793696400 n1 kernel: [    0.000000] ",
])
def test_boot_banner_in_a_new_layout_is_a_boot_line(prefix):
    assert is_boot_line((prefix + _BANNER).encode())


@pytest.mark.parametrize("prefix", ["<6>1 - n1 alice - - - ", "Nov 03 2026 09:00:00 n1 alice: ",
                                    "1793696400 n1 alice: "])
def test_user_text_before_the_banner_in_a_new_layout_is_no_boot_line(prefix):
    assert not is_boot_line((prefix + _BANNER).encode())


@pytest.mark.parametrize("layout", ["<4>1 - node01 kernel - - - ", "Dec 01 2026 10:00:00 node01 kernel: ",
                                    "Dec 01 10:00:00 node01 kernel: nvidia 0000:3b:00.0: "])
def test_check_kernel_log_gives_the_drain_finding(tmp_path, layout):
    log = tmp_path / "kern.log"
    log.write_text(layout + MSG + "\n")
    rc, rows, out = check_kernel_log(log)
    assert rc == 2, out
    assert rows == [
        "critical,drain,xid.79,,XID 79 GPU has fallen off the bus on 0000:3b:00 (not among the 1 visible GPUs)"]


def test_xid_scan_of_a_file_in_the_new_layouts(tmp_path):
    """``gpuguard xid scan FILE``: every line read, nothing rejected."""
    import json

    log = tmp_path / "kern.log"
    log.write_text("".join(p + MSG + "\n" for _, p, _, _ in NEW_LAYOUTS))
    r = CliRunner().invoke(main, ["xid", "scan", "--json", str(log)])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert [(e["line_no"], e["xid"], e["pci_bus_id"], e["pid"], e["process"], e["timestamp"], e["monotonic_s"])
            for e in rows] == [(n, 79, "0000:3b:00", 1234, "python", ts, mono)
                               for n, (_, _, ts, mono) in enumerate(NEW_LAYOUTS, 1)]
    assert r.stderr == "unparsed NVRM lines: 0\n"
