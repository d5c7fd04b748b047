"""gpuguard.xid.parse on every corpus kernel-log sample, with exact expected values."""

from __future__ import annotations

import pathlib

import pytest

from gpuguard.xid.parse import parse_lines, parse_text

DATA = pathlib.Path(__file__).parent / "data"


@pytest.fixture(autouse=True)
def _utc(utc):
    """ctime stamps are local time: every test here runs in UTC (conftest ``utc``)."""


def parse_file(name: str):
    return parse_lines((DATA / name).read_text().splitlines())


def tuples(result):
    return [(e.pci_bus_id, e.kind, e.xid, e.pid, e.process) for e in result.events]


G38 = ("0000:38:00", "xid", 13, None, None)

EXPECTED = {
    "xid-kernel-prefix-gb200-xid45.txt": [
        ("0000:dc:00", "xid", 45, 1818990, "python3"), ("0000:ed:00", "xid", 45, 1818992, "python3"),
        ("0000:ba:00", "xid", 45, 1818989, "python3"), ("0000:97:00", "xid", 45, 1818987, "python3"),
        ("0000:dc:00", "xid", 45, 1818990, "python3"), ("0000:ba:00", "xid", 45, 1818989, "python3"),
        ("0000:ed:00", "xid", 45, 1818992, "python3"),
    ],
    "xid-119-gsp-timeout-ctime.txt": [
        ("0000:9b:00", "xid", 119, 2024380, "nvidia-smi"),
        ("0000:9b:00", "xid", 119, 2024380, "nvidia-smi"),
        ("0000:9b:00", "xid", 119, 2024380, "nvidia-smi"),
        ("0000:9b:00", "xid", 119, 1263500, "cache_mgr_main"),
        ("0000:9b:00", "xid", 119, 1240590, "gpud"),
    ],
    "xid-13-109-dmesg-ctime-peermem.txt": [
        ("0000:cb:00", "xid", 13, None, None),
        ("0000:cb:00", "xid", 13, None, None),
        ("0000:cb:00", "xid", 13, None, None),
        ("0000:cb:00", "xid", 109, 1797828, "pt_main_thread"),
    ],
    "xid-13-43-dmesg-iso.txt": [G38] * 16 + [("0000:38:00", "xid", 43, 2924364, "pt_main_thread")],
    "xid-145-149-gb200-nvlink-nots.txt": [
        ("0018:01:00", "xid", 149, None, None),
        ("0018:01:00", "xid", 145, 876767, "ray::WorkerDict"),
        ("0019:01:00", "xid", 145, 876766, "ray::WorkerDict"),
        ("0008:01:00", "xid", 149, None, None),
        ("0019:01:00", "xid", 145, None, None),
        ("0019:01:00", "xid", 149, None, None),
    ],
    "xid-149-154-gb200-nvlink-timestamped.txt": [
        ("0009:01:00", "xid", 149, None, None),
        ("0009:01:00", "xid", 154, None, None),
        ("0008:01:00", "xid", 149, None, None),
        ("0019:01:00", "xid", 154, None, None),
        ("0009:01:00", "xid", 149, None, None),
        ("0009:01:00", "xid", 149, None, None),
        ("0008:01:00", "xid", 149, None, None),
        ("0018:01:00", "xid", 154, None, None),
        ("0008:01:00", "xid", 154, None, None),
    ],
    "xid-31-13-32-legacy-418-dmesg.txt": [
        ("0000:01:00", "xid", 31, None, None),
        ("0000:01:00", "xid", 13, None, None),
        ("0000:01:00", "xid", 13, None, None),
        ("0000:01:00", "xid", 13, None, None),
        ("0000:01:00", "xid", 13, None, None),
        ("0000:01:00", "xid", 32, None, None),
    ],
    "xid-31-mmu-fault-journalctl-450.txt": [
        ("0000:c1:00", "xid", 31, 12890, None),
        ("0000:c1:00", "xid", 31, 12890, None),
    ],
    "xid-31-nvdec-nots.txt": [("0000:00:06", "xid", 31, 2708, None)],
    "xid-31-wrapped-multiline-610.txt": [("0000:01:00", "xid", 31, None, "python3")],
    "xid-62-154-gsp-crashcat-blackwell.txt": [
        ("0000:01:00", "xid", 62, None, None),
        ("0000:01:00", "xid", 154, None, None),
    ],
    "xid-63-64-syslog-wrapped-alert.txt": [
        ("0000:10:1c", "xid", 63, 1850, None),
        ("0000:90:1c", "xid", 64, None, None),
    ],
    "xid-63-nots-a100.txt": [("0000:10:1c", "xid", 63, 1896, None)],
    "xid-74-nvlink-fatal-register-tuple.txt": [("0003:00:00", "xid", 74, None, None)],
    "xid-79-no-pid-serial-zero-595.txt": [("0000:06:00", "xid", 79, None, None)],
    "xid-79-sxid-20034-nvswitch.txt": [
        ("0000:91:00", "xid", 79, None, None),
        ("0000:06:00.0", "sxid", 20034, None, None),
        ("0000:05:00.0", "sxid", 20034, None, None),
        ("0000:07:00.0", "sxid", 20034, None, None),
        ("0000:07:00.0", "sxid", 20034, None, None),
        ("0000:05:00.0", "sxid", 20034, None, None),
    ],
    "xid-94-95-driver-source-format-examples.txt": [
        ("0000:01:00", "xid", 94, 7194, None),
        ("0000:01:00", "xid", 94, 7062, None),
        ("0000:01:00", "xid", 95, 7062, None),
    ],
    "xid-none-fallen-off-bus-multiline.txt": [("0000:b3:00", "fallen_off_bus", 79, None, None)],
    "xid-120-gsp-exception-575-and-nvlink5-nonfatal.txt": [
        ("0000:06:00", "xid", 120, None, None), ("0000:01:00", "xid", 144, None, None),
        ("0000:00:00", "xid", 149, None, None), ("0019:01:00", "xid", 149, None, None),
        ("0018:01:00", "xid", 145, None, None)],
}


def test_every_corpus_xid_file_is_covered():
    assert sorted(p.name for p in DATA.glob("xid-*.txt")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_corpus_file_events_exact(name):
    result = parse_file(name)
    assert tuples(result) == EXPECTED[name]
    assert result.unparsed == 0
    assert result.unparsed_samples == []


def test_ctime_prefix_gives_epoch_and_line_numbers():
    result = parse_file("xid-119-gsp-timeout-ctime.txt")
    first = result.events[0]
    assert first.timestamp == 1740327858.0  # Sun Feb 23 16:24:18 2025 UTC
    assert first.monotonic_s is None
    assert first.line_no == 3
    assert first.message == (
        "Timeout after 6s of waiting for RPC response from GPU4 GSP! "
        "Expected function 103 (GSP_RM_ALLOC) (0x2081 0x4)."
    )
    assert [e.line_no for e in result.events] == [3, 38, 40, 42, 43]
    assert result.gpu_uuids == {"0000:9b:00": "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"}


def test_iso_prefix_with_comma_microseconds():
    result = parse_file("xid-13-43-dmesg-iso.txt")
    assert result.events[0].timestamp == pytest.approx(1737434504.283302, abs=1e-6)
    assert result.events[-1].timestamp == pytest.approx(1737434504.287197, abs=1e-6)
    assert result.events[-1].message == "Ch 00000008"
    assert result.events[0].message == (
        "Graphics SM Global Exception on (GPC 8, TPC 5, SM 1): Multiple Warp Errors"
    )


def test_monotonic_prefix_and_no_epoch():
    event = parse_file("xid-74-nvlink-fatal-register-tuple.txt").events[0]
    assert event.monotonic_s == pytest.approx(449410.332316)
    assert event.timestamp is None
    assert event.message == "NVLink: fatal error detected on link 14(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)"


def test_syslog_wrapper_keeps_monotonic_and_truncated_message():
    first, second = parse_file("xid-63-64-syslog-wrapped-alert.txt").events
    assert first.timestamp is None  # "May 19 07:08:57" has no year
    assert first.monotonic_s == pytest.approx(680111.646286)
    assert first.message == "Row Remapper: New row marked for remapping, reset gpu to activate"
    assert second.message == "..."
    assert second.monotonic_s == pytest.approx(257087.812628)


def test_legacy_418_format_has_no_pid_and_elision_line_is_ignored():
    result = parse_file("xid-31-13-32-legacy-418-dmesg.txt")
    assert result.events[0].message.startswith("Ch 0000003a, intr 10000000. MMU Fault: ENGINE GRAPHICS")
    assert result.events[0].line_no == 2
    assert result.events[1].line_no == 4  # line 3 is the user's "..."
    assert result.events[-1].message == "Channel ID 00000052 intr 02000000"


def test_rewrapped_xid_is_joined():
    (event,) = parse_file("xid-31-wrapped-multiline-610.txt").events
    assert event.message == (
        "channel 0x00000002, intr 00000000. MMU Fault: ENGINE GRAPHICS GPC0 GPCCLIENT_T1_0 faulted "
        "@ 0x0_00019000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ"
    )
    assert event.raw.count("\n") == 2


def test_fallen_off_bus_without_xid_multiline():
    result = parse_file("xid-none-fallen-off-bus-multiline.txt")
    (event,) = result.events
    assert event.monotonic_s == pytest.approx(1843.308145)
    assert event.message == (
        "The NVIDIA GPU 0000:b3:00.0 (PCI ID: 10de:26b5) installed in this system has "
        "fallen off the bus and is not responding to commands."
    )
    assert len(event.raw.splitlines()) == 3


def test_fallen_off_bus_after_xid79_is_attached_not_duplicated():
    result = parse_file("xid-79-sxid-20034-nvswitch.txt")
    xid79 = result.events[0]
    assert xid79.raw.splitlines()[1] == "[6781741.548783] NVRM: GPU 0000:91:00.0: GPU has fallen off the bus."
    assert xid79.message == "GPU has fallen off the bus."
    assert xid79.line_no == 3


def test_sxid_detail_lines_attach_to_their_header():
    events = parse_file("xid-79-sxid-20034-nvswitch.txt").events[1:]
    assert [e.message for e in events] == [
        "Fatal, Link 48 LTSSM Fault Up",
        "Fatal, Link 63 LTSSM Fault Up",
        "Severity 1 Engine instance 60 Sub-engine instance 00",  # its header was not captured
        "Fatal, Link 37 LTSSM Fault Up",
        "Fatal, Link 62 LTSSM Fault Up",
    ]
    assert events[1].raw.splitlines()[1].endswith("20034, Data {0x10000000, 0x10000000, 0x00000000, "
                                                  "0x10000000, 0x00000000, 0x00000000, 0x00000000, "
                                                  "0x00000000, 0x00000000}")
    assert events[3].raw.splitlines()[1].endswith("Severity 1 Engine instance 37 Sub-engine instance 00")


def test_mig_instance_and_pid_without_name():
    events = parse_file("xid-94-95-driver-source-format-examples.txt").events
    assert [e.mig_instance for e in events] == ["GPU-I:05", None, None]
    assert events[2].message == "Uncontained: LTC TAG (0x2, 0x1). RST: Yes, D-RST: No"


def test_nvlink5_message_keeps_spacing_and_gb200_domains():
    events = parse_file("xid-149-154-gb200-nvlink-timestamped.txt").events
    assert events[0].message.startswith("NETIR_LINK_EVT  Fatal   XC0 i0 Link 01 (0x021425c6")
    assert events[1].message == "GPU recovery action changed from 0x0 (None) to 0x4 (Drain and Reset)"


def test_xid62_bare_hex_words():
    event = parse_file("xid-62-154-gsp-crashcat-blackwell.txt").events[0]
    assert event.message == "323f0f30 0000c3d8 00000000 206dae68 206da022 206da190 206d85f6 206d8d86"
    assert event.pid is None


def test_caused_by_previous_xid_is_not_the_code():
    result = parse_text(
        "[  10.5] NVRM: Xid (PCI:0000:3b:00): 45, pid=77, name=python, Ch 00000010, "
        "Preemptive Cleanup, caused by previous Xid 79\n"
    )
    (event,) = result.events
    assert (event.xid, event.pid, event.process) == (45, 77, "python")
    assert event.message == "Ch 00000010, Preemptive Cleanup, caused by previous Xid 79"


def test_journald_short_iso_and_long_domain():
    result = parse_text(
        "2025-03-01T10:00:00+0000 node01 kernel: NVRM: Xid (PCI:00000001:00:00): 48, "
        "pid='<unknown>', name=<unknown>, An uncorrectable double bit error (DBE) has been detected\n"
    )
    (event,) = result.events
    assert event.pci_bus_id == "0001:00:00"
    assert event.timestamp == 1740823200.0
    assert (event.pid, event.process) == (None, None)


def test_unparsable_nvrm_lines_are_counted_ordinary_lines_are_not():
    result = parse_text(
        "NVRM: Xid (PCI:zz:qq): 13, broken\n"
        "NVRM: Xid (PCI:0000:01:00): abc\n"
        "nvidia-nvswitch0: SXid (PCI:nope): 20034, Fatal\n"
        "NVRM: something has fallen off the bus with no address\n"
        "usual kernel line\n"
        "NVRM: loading NVIDIA UNIX x86_64 Kernel Module\n"
        "...\n"
    )
    assert result.events == []
    assert result.unparsed == 4
    assert result.unparsed_samples[1] == "NVRM: Xid (PCI:0000:01:00): abc"


def test_fallen_off_bus_for_another_gpu_is_its_own_event():
    result = parse_text(
        "[1.0] NVRM: Xid (PCI:0000:91:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"
        "[1.1] NVRM: GPU 0000:92:00.0: GPU has fallen off the bus.\n"
        "[99.0] NVRM: GPU 0000:92:00.0: GPU has fallen off the bus.\n"
    )
    assert tuples(result) == [
        ("0000:91:00", "xid", 79, None, None),
        ("0000:92:00", "fallen_off_bus", 79, None, None),
        ("0000:92:00", "fallen_off_bus", 79, None, None),  # 98 s later: a new incident
    ]


def test_stack_frames_are_not_joined_to_an_xid():
    result = parse_text(
        "NVRM: Xid (PCI:0000:01:00): 13, pid=5, name=a, Graphics Exception\n"
        "  show_stack+0x52/0x5c\n"
        " <TASK>\n"
    )
    (event,) = result.events
    assert event.message == "Graphics Exception"
    assert event.raw == "NVRM: Xid (PCI:0000:01:00): 13, pid=5, name=a, Graphics Exception"


# --- user-controlled text inside kernel messages must never count as an XID ----------

INJECTED = [
    # execve with NULL argv logs the user-chosen file name (reproduced on kernel 6.18)
    "[ 5012.114] process 'python3' launched '/tmp/evil/NVRM: Xid (PCI:0000:53:00): 79, pid=1, name=x, "
    "GPU has fallen off the bus' with NULL argv",
    # an audit record with a user-chosen path
    '[ 5013.2] audit: type=1400 apparmor="DENIED" name="/tmp/NVRM: Xid (PCI:0000:53:00): 48, pid=1, name=x, DBE"',
    # logger(1) into a syslog file
    "Nov 30 03:40:01 node01 alice: NVRM: Xid (PCI:0000:53:00): 79, pid=1, name=x, GPU has fallen off the bus.",
    # "NVRM" without a colon next to "fallen off the bus" used to crash the parser
    '[1234.5] audit: name="/tmp/NVRM GPU 0000:75:00.0 has fallen off the bus"',
    "[1234.6] nvidia-nvswitch0: hello SXid (PCI:0000:06:00.0): 20034, Fatal, Link 48 LTSSM Fault Up",
]


def test_injected_markers_are_ignored_and_real_lines_still_parse():
    real = "[1234.7] NVRM: Xid (PCI:0000:53:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
    res = parse_lines([*INJECTED, real])
    assert [(e.kind, e.pci_bus_id, e.xid) for e in res.events] == [("xid", "0000:53:00", 79)]
    assert res.events[0].line_no == 6
    # not silently dropped: each marker line is counted with the text that is not a prefix
    assert res.unparsed == 4
    assert res.rejected == {
        "not a kernel-log prefix: \"process 'python3' launched '/tmp/evil/\"": 1,
        "not a kernel-log prefix: 'audit: type=1400 apparmor=\"DENIED\" na...'": 1,
        "not a kernel-log prefix: 'node01 alice:'": 1,
        "not a kernel-log prefix: 'hello'": 1,
    }
    assert [n for n, _why, _text in res.rejected_samples] == [1, 2, 3, 5]


def test_structured_source_needs_the_marker_at_message_start():
    # kmsg / journal JSON / dmesg -r give the kernel's text exactly: nothing may precede NVRM:
    lines = [f"[ 5012.114000] {x.split('] ', 1)[-1]}" for x in INJECTED]
    lines += [
        "[  100.000000] kernel: NVRM: Xid (PCI:0000:53:00): 79, pid=1, name=x, y",  # a 'kernel:' inside the text
        "[  100.500000]  NVRM: Xid (PCI:0000:53:00): 79, pid=1, name=x, y",  # indented message
        "[  101.000000] NVRM: Xid (PCI:0000:53:00): 48, pid=1, name=x, DBE",
        "[  102.000000] nvidia-nvswitch2: SXid (PCI:0000:06:00.0): 20034, Fatal, Link 48 LTSSM Fault Up",
        "2025-03-01T10:00:05+00:00 [  103.000000] NVRM: Xid (PCI:0000:53:00): 95, pid=1, name=x, z",
    ]
    res = parse_lines(lines, structured=True)
    assert [(e.kind, e.xid, e.monotonic_s) for e in res.events] == [
        ("xid", 48, 101.0), ("sxid", 20034, 102.0), ("xid", 95, 103.0)]
    assert res.events[2].timestamp == 1740823205.0
    assert res.rejected == {"marker not at the start of the kernel message": 6}


def test_kernel_prefixes_accepted():
    lines = [
        "2025-01-21T04:41:44+0000 node01 kernel: NVRM: Xid (PCI:0000:53:00): 13, pid=1, name=a, x",
        "Nov 29 11:28:11 host02 kernel: [ 12.5] NVRM: Xid (PCI:0000:53:00): 31, pid=2, name=b, y",
        "kern  :warn  : 2025-01-21T04:41:44,283302+00:00 NVRM: Xid (PCI:0000:53:00): 43, pid=3, name=c, z",
        "<4>NVRM: Xid (PCI:0000:53:00): 45, pid=4, name=d, w",
    ]
    assert [e.xid for e in parse_lines(lines).events] == [13, 31, 43, 45]


def test_fallen_off_bus_split_by_syslog_into_prefixed_lines_is_one_event():
    """rsyslog/imklog (the kernel's syslog interface) repeats the prefix on every line of
    the driver's three-line record: joined back, it is XID 79 on its GPU, not three
    lines of which one is rejected for having no PCI address."""
    pre = "May 17 07:08:57 node01 kernel: [ 1843.308145] "
    lines = [pre + "NVRM: The NVIDIA GPU 0000:b3:00.0",
             pre + "NVRM: (PCI ID: 10de:26b5) installed in this system has",
             pre + "NVRM: fallen off the bus and is not responding to commands.",
             "May 17 07:08:57 node01 kernel: [ 1843.439662] NVRM: The NVIDIA probe routine failed for 1 device(s)."]
    res = parse_lines(lines)
    assert res.unparsed == 0
    assert [(e.kind, e.pci_bus_id, e.xid, e.line_no, e.monotonic_s, e.message, e.raw) for e in res.events] == [
        ("fallen_off_bus", "0000:b3:00", 79, 1, 1843.308145,
         "The NVIDIA GPU 0000:b3:00.0 (PCI ID: 10de:26b5) installed in this system has fallen off the bus "
         "and is not responding to commands.", "\n".join(lines[:3]))]


def test_split_fallen_off_bus_joins_only_lines_with_the_heads_prefix():
    # another stamp, or a user's line, is not the same kernel record: still counted, never joined
    head = "May 17 07:08:57 node01 kernel: [ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0"
    for tail in ("May 17 07:08:58 node01 kernel: [ 1900.000000] NVRM: fallen off the bus and is not responding.",
                 "May 17 07:08:57 node01 alice: [ 1843.308145] NVRM: fallen off the bus and is not responding."):
        res = parse_lines([head, tail])
        assert res.events == []
        assert res.unparsed == 1


def test_a_utf8_byte_order_mark_before_the_first_line_is_not_a_prefix():
    line = "[ 1843.308145] NVRM: Xid (PCI:0000:18:00): 79, pid=1, name=x, GPU has fallen off the bus."
    res = parse_lines(["\ufeff" + line, "\ufeff" + line])
    # the mark starts a file only: on a later line it is text before the stamp
    assert [(e.xid, e.line_no) for e in res.events] == [(79, 1)]
    assert res.rejected == {"not a kernel-log prefix: '\\ufeff[ 1843.308145]'": 1}


def test_an_impossible_ctime_stamp_loses_the_time_not_the_event():
    res = parse_lines(["[Sun Feb 30 16:24:18 2025] NVRM: Xid (PCI:0000:18:00): 79, pid=1, name=x, "
                       "GPU has fallen off the bus.",
                       "[Sun Feb 23 25:61:18 2025] NVRM: Xid (PCI:0000:19:00): 48, pid=1, name=x, DBE"])
    assert [(e.xid, e.pci_bus_id, e.timestamp) for e in res.events] == [(79, "0000:18:00", None),
                                                                          (48, "0000:19:00", None)]
    assert res.unparsed == 0


def test_xid_120_gsp_exception_575_and_nvlink5_fatal_flags():
    # real lines: open-gpu-kernel-modules#829 (575.51.02, GSP register dump lines carry their own
    # stamp: separate NVRM records, not Xids) and the GB200 kmsg inputs of leptonai/gpud #1160/#1174
    from gpuguard.xid.catalog import classify

    r = parse_text((DATA / "xid-120-gsp-exception-575-and-nvlink5-nonfatal.txt").read_text())
    assert (r.unparsed, r.gpu_uuids) == (0, {"0000:06:00": "GPU-1b2c3d4e-5f60-4718-8a9b-0c1d2e3f4a5b"})
    assert [(e.pci_bus_id, e.xid, e.pid, e.monotonic_s, classify(e).action) for e in r.events] == [
        ("0000:06:00", 120, None, 605633.376794, "drain"), ("0000:01:00", 144, None, None, "alert"),
        ("0000:00:00", 149, None, None, "drain"), ("0019:01:00", 149, None, None, "drain"),
        ("0018:01:00", 145, None, None, "alert")]
    assert r.events[0].message == ("GSP task exception: store access page fault (cause:0xf) @ pc:0x13ebd80, "
                                   "partition:2#0, task:3")
