"""Kernel-log prefixes: every real layout is read; user text before the marker is not.

The layouts are those the tools print (util-linux dmesg, journalctl -o ..., rsyslog
traditional / RFC 3339 / RFC 5424, talosctl dmesg), in several locales, plus the corpus
file pasted from a GB200 node (``kernel:`` only)."""

from __future__ import annotations

import pathlib

import pytest

from gpuguard.xid.parse import parse_lines
from gpuguard.xid.prefix import check_prefix, text_prefix_tokens

DATA = pathlib.Path(__file__).parent / "data"
MSG = "NVRM: Xid (PCI:0000:dc:00): 79, pid=1, name=python3, GPU has fallen off the bus."

PREFIXES = [
    ("kernel: ", ["kernel"]),
    ("May 19 07:08:57 kernel: ", ["syslog_date", "kernel"]),  # journalctl --no-hostname
    ("May 19 07:08:57.123456 node01 kernel: ", ["syslog_date", "host_kernel"]),  # -o short-precise
    ("May  9 07:08:57 node01 kernel: [ 12.500000] ", ["syslog_date", "host_kernel", "bracket"]),
    ("[May19 07:08] ", ["bracket"]),  # dmesg -H, first line of a minute
    ("[  +0.000123] ", ["bracket"]),  # dmesg -H, relative
    ("[Sun Feb 23 16:24:18 2025] ", ["bracket"]),  # dmesg -T
    ("[ 1234.5678] ", ["bracket"]),
    ("Mai 19 07:08:57 node01 kernel: ", ["syslog_date", "host_kernel"]),  # de_DE
    ("févr. 19 07:08:57 node01 kernel: ", ["syslog_date", "host_kernel"]),  # fr_FR
    ("19 мая 07:08:57 node01 kernel: ", ["syslog_date", "host_kernel"]),  # ru_RU, day first
    (" 5月 19 07:08:57 node01 kernel: ", ["syslog_date", "host_kernel"]),  # ja_JP
    ("12월 03 07:08:57 node01 kernel: ", ["syslog_date", "host_kernel"]),  # ko_KR
    ("2025-01-21T04:41:44,283302+00:00 ", ["iso"]),  # dmesg --time-format iso
    ("2025-01-21T04:41:44.283302+0000 node01 kernel: ", ["iso", "host_kernel"]),  # short-iso-precise
    ("Fri 2024-05-17 07:08:57 UTC node01 kernel: ", ["iso", "host_kernel"]),  # -o short-full
    ("<4>1 2024-05-17T07:08:57.123+00:00 node01 kernel - - - ", ["priority", "iso", "rfc5424_kernel"]),
    # RFC 5424 with several SD-ELEMENTs (an escaped "]" in a value), and the BOM of a UTF-8 MSG
    ('<4>1 2024-05-17T07:08:57+00:00 node01 kernel - - [timeQuality tzKnown="1"][origin ip="10.0.0.1" x="a\\]b"] ',
     ["priority", "iso", "rfc5424_kernel"]),
    ("<4>1 2024-05-17T07:08:57+00:00 - kernel - - - \ufeff", ["priority", "iso", "rfc5424_kernel"]),
    ("<4>[ 12.5] ", ["priority", "bracket"]),  # dmesg -r
    ("kern  :warn  : [ 12.5] ", ["kern_level", "bracket"]),  # dmesg -x
    ("172.20.0.5: kern:    warn: [2024-07-09T19:12:01.426396139Z]: ", ["kern_level", "bracket"]),  # talosctl dmesg
    ("node01 kern.warning kernel: ", ["facility", "kernel"]),  # rsyslog %syslogfacility-text%.%syslogseverity-text%
    ("May 19 07:08:57 node01 kernel[0]: ", ["syslog_date", "host_kernel"]),
    ("1715929737.123456 node01 kernel: ", ["epoch", "host_kernel"]),  # journalctl -o short-unix
    ("[ 1234.567890 <    0.000123>] node01 kernel: ", ["bracket", "host_kernel"]),  # -o short-delta
    ("Xid errors on instance: ip-10-0-0-11, Error: May 19 07:08:57 ip-10-0-0-11 kernel: [680111.646286] ",
     ["wrapper", "syslog_date", "host_kernel", "bracket"]),
    # a relay with no name for the sender writes its address as HOSTNAME (RFC 3164 §4.1.2)
    ("Dec  1 10:20:31 fe80::1 kernel: ", ["syslog_date", "host_kernel"]),
    ("Dec  1 10:20:31 ::ffff:10.1.2.3 kernel: [ 12.5] ", ["syslog_date", "host_kernel", "bracket"]),
    ("<4>1 2026-12-01T10:20:31Z 2001:db8::17 kernel - - - ", ["priority", "iso", "rfc5424_kernel"]),
    ("Dec  1 10:20:31 10.1.2.3 kernel: ", ["syslog_date", "host_kernel"]),
    ("<0>[ 12.5] ", ["priority", "bracket"]),  # KERN_EMERG, the lowest kernel PRI
    ("<7>[ 12.5] ", ["priority", "bracket"]),  # KERN_DEBUG, the highest kernel PRI
    ("4,1234,5678901234,-;", ["kmsg_record"]),  # `cat /dev/kmsg` saved to a file
    ("3,1234,5678901234,c,caller=T123;", ["kmsg_record"]),
]


@pytest.mark.parametrize("prefix,tokens", PREFIXES)
def test_every_real_prefix_layout_gives_the_event(prefix, tokens):
    res = parse_lines([prefix + MSG])
    assert [(e.xid, e.pci_bus_id) for e in res.events] == [(79, "0000:dc:00")], res.rejected
    assert res.unparsed == 0
    if tokens is not None:
        names, rest = text_prefix_tokens(prefix)
        assert (names, rest) == (tokens, "")


@pytest.mark.parametrize("prefix,reason", [
    ("Nov 30 03:40:01 node01 alice: ", "not a kernel-log prefix: 'node01 alice:'"),
    ("Nov 30 03:40:01 node01 python3[123]: ", "not a kernel-log prefix: 'node01 python3[123]:'"),
    ('[ 5013.2] audit: name="/tmp/', "not a kernel-log prefix: 'audit: name=\"/tmp/'"),
    ("[user] ", "not a kernel-log prefix: '[user]'"),
    ("echo ", "not a kernel-log prefix: 'echo'"),
    # `logger -i -t kernel`: the kernel is pid 0, a tag with another pid is a user process
    ("Nov 30 03:40:01 node01 kernel[4242]: ", "not a kernel-log prefix: 'node01 kernel[4242]:'"),
    ("kernel[4242]: ", "not a kernel-log prefix: 'kernel[4242]:'"),
    # a PRI of another facility than kern (0) says user space wrote it: <13> user.notice
    # (`logger`), <12> a user write to /dev/kmsg as `dmesg -r` prints it, <30> daemon
    ("<13>Dec  1 10:20:31 node01 kernel: ", "not a kernel-log prefix: '<13>Dec  1 10:20:31 node01 kernel:'"),
    ("<13>1 2026-12-01T10:20:31Z node01 kernel - - - ",
     "not a kernel-log prefix: '<13>1 2026-12-01T10:20:31Z node01 ker...'"),
    ("<12>[ 1234.567890] ", "not a kernel-log prefix: '<12>[ 1234.567890]'"),
    ("<30>[ 1234.567890] ", "not a kernel-log prefix: '<30>[ 1234.567890]'"),
    ("12,1234,5678901234,-;", "not a kernel-log prefix: '12,1234,5678901234,-;'"),
    ("alice: fe80::1 kernel: ", "not a kernel-log prefix: 'alice: fe80::1 kernel:'"),
])
def test_user_text_before_the_marker_is_rejected_with_its_reason(prefix, reason):
    res = parse_lines([prefix + MSG])
    assert res.events == []
    assert res.rejected == {reason: 1}
    assert check_prefix(prefix, structured=False) == reason


def test_timestamps_read_from_prefixes():
    ev = parse_lines(["2025-01-21T04:41:44.5+00:00 node01 kernel: [  12.25] " + MSG]).events[0]
    assert (ev.timestamp, ev.monotonic_s) == (1737434504.5, 12.25)
    ev = parse_lines(["Mai 19 07:08:57 node01 kernel: " + MSG]).events[0]
    assert (ev.timestamp, ev.monotonic_s) == (None, None)  # no year in a syslog date


@pytest.mark.parametrize("prefix,times", [
    ("1715929737.123456 node01 kernel: ", (1715929737.123456, None)),  # journalctl -o short-unix
    ("<4>1715929737.5 ", (1715929737.5, None)),
    ("[ 1234.567890 <    0.000123>] node01 kernel: ", (None, 1234.56789)),  # journalctl -o short-delta
    ("Fri May 17 07:08:57 2024 node01 kernel: ", (1715929737.0, None)),  # unbracketed ctime (TZ=UTC)
    ("[Fri May 17 07:08:57 2024] ", (1715929737.0, None)),  # dmesg -T
])
def test_more_timestamps_read_from_prefixes(prefix, times, monkeypatch):
    import time

    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    try:
        res = parse_lines([prefix + MSG])
        assert res.unparsed == 0, res.rejected
        assert [(e.timestamp, e.monotonic_s) for e in res.events] == [times]
    finally:
        monkeypatch.undo()
        time.tzset()


def test_corpus_kernel_prefix_only_file():
    res = parse_lines((DATA / "xid-kernel-prefix-gb200-xid45.txt").read_text().splitlines())
    assert [(e.pci_bus_id, e.xid) for e in res.events] == [
        ("0000:dc:00", 45), ("0000:ed:00", 45), ("0000:ba:00", 45), ("0000:97:00", 45),
        ("0000:dc:00", 45), ("0000:ba:00", 45), ("0000:ed:00", 45)]
    assert res.events[0].message == "Ch 00000001 caused by previous Xid 149"
    assert res.unparsed == 0


def test_indented_marker_line_is_its_own_record_not_a_continuation():
    lines = ["[ 1.0] NVRM: Xid (PCI:0000:01:00): 13, pid=1, name=a, x",
             " 5月 19 07:08:57 node01 kernel: " + MSG]
    assert [e.xid for e in parse_lines(lines).events] == [13, 79]


def test_a_saved_coloured_dmesg_is_read_as_the_plain_one():
    """`dmesg --color=always > f` (or a `script` capture) wraps the stamp and the
    subsystem ``NVRM: `` in SGR colour codes: the XID is read, not rejected."""
    line = ("\x1b[32m[ 1843.308145] \x1b[0m\x1b[33mNVRM: \x1b[0mXid (PCI:0000:18:00): 79, pid=1, name=x, "
            "GPU has fallen off the bus.")
    res = parse_lines([line])
    assert res.unparsed == 0
    assert [(e.xid, e.pci_bus_id, e.monotonic_s, e.raw) for e in res.events] == [
        (79, "0000:18:00", 1843.308145,
         "[ 1843.308145] NVRM: Xid (PCI:0000:18:00): 79, pid=1, name=x, GPU has fallen off the bus.")]


def test_saved_kmsg_record_time_and_property_lines():
    """A saved /dev/kmsg record: USEC is the monotonic time; its SUBSYSTEM=/DEVICE=
    property lines are not message text, while a real wrapped line still is."""
    res = parse_lines([
        "4,1234,5678901234,-;NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has",
        " fallen off the bus.",
        " SUBSYSTEM=pci",
        " DEVICE=+pci:0000:3b:00.0",
        "12,1235,5678901300,-;NVRM: Xid (PCI:0000:3b:00): 48, pid=1, name=x, forged",
    ])
    assert [(e.xid, e.pci_bus_id, e.timestamp, e.monotonic_s, e.message) for e in res.events] == [
        (79, "0000:3b:00", None, 5678.901234, "GPU has fallen off the bus.")]
    assert res.rejected == {"not a kernel-log prefix: '12,1235,5678901300,-;'": 1}
