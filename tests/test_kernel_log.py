"""gpuguard.xid.kernel_log: cursors of every source, with fake kmsg files and fake
journalctl/dmesg executables on PATH."""

from __future__ import annotations

import os
import shutil
import json
import stat

import pytest

from gpuguard.xid import kernel_log, records
from gpuguard.xid.kernel_log import KernelLogError, read_since
from gpuguard.xid.parse import parse_lines

# Absolute paths: the fake tools run with PATH set to their own directory only.
CAT = shutil.which("cat")
SLEEP = shutil.which("sleep")

BOOT_A = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
BOOT_B = "11111111-2222-3333-4444-555555555555"


# ----------------------------------------------------------------- file source


def test_file_cursor_returns_only_new_lines(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("one\ntwo\n")
    lines, cur = read_since(str(log), None, 5)
    assert lines == ["one", "two"]
    st = log.stat()
    assert cur == f"file:{st.st_dev}:{st.st_ino}:8"

    lines, cur2 = read_since(str(log), cur, 5)
    assert (lines, cur2) == ([], cur)

    with log.open("a") as f:
        f.write("three\nfour-unfinished")
    lines, cur3 = read_since(str(log), cur, 5)
    assert lines == ["three"]  # the unfinished line waits for its newline
    with log.open("a") as f:
        f.write("\n")
    lines, _ = read_since(str(log), cur3, 5)
    assert lines == ["four-unfinished"]


def test_file_zero_filled_block_after_a_crash_does_not_hide_the_next_kernel_line(tmp_path):
    # after a hard reset a syslog file holds a block of NUL bytes where unflushed data was;
    # the kernel line written after the reboot must still be its own line (an XID 79)
    log = tmp_path / "kern.log"
    xid = (b"Nov 30 12:01:00 n1 kernel: NVRM: Xid (PCI:0000:06:00): 79, pid='<unknown>', "
           b"name=<unknown>, GPU has fallen off the bus.\n")
    log.write_bytes(b"Nov 30 12:00:00 n1 kernel: usb 1-1: new device" + b"\x00" * 4096 + xid)
    lines, cur = read_since(str(log), None, 5)
    res = parse_lines(lines)
    assert [(e.xid, e.pci_bus_id) for e in res.events] == [(79, "0000:06:00")]
    assert res.unparsed == 0
    assert cur == f"file:{log.stat().st_dev}:{log.stat().st_ino}:{log.stat().st_size}"


def test_file_lines_end_at_newline_only(tmp_path):
    # a user's syslog message may hold U+2028 / U+0085 / form feed: its tail is not a line
    log = tmp_path / "syslog"
    log.write_bytes("a: x\u2028k: y\u0085z\x0cw\r\nnext\n".encode())
    lines, cur = read_since(str(log), None, 5)
    assert lines == ["a: x\u2028k: y\u0085z\x0cw", "next"]
    assert cur.endswith(f":{log.stat().st_size}")


def test_file_truncation_and_new_inode_restart_at_zero(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("a much longer first line\nsecond\n")
    _, cur = read_since(str(log), None, 5)
    log.write_text("short\n")  # same inode, shorter than the offset
    lines, cur = read_since(str(log), cur, 5)
    assert lines == ["short"]

    rotated = tmp_path / "new.log"
    rotated.write_text("short\nfresh\n")  # longer than the old offset, but another file
    os.replace(rotated, log)
    lines, _ = read_since(str(log), cur, 5)
    assert lines == ["short", "fresh"]


XID79 = ("Nov 30 12:01:00 n1 kernel: NVRM: Xid (PCI:0000:06:00): 79, pid='<unknown>', "
         "name=<unknown>, GPU has fallen off the bus.")


@pytest.mark.parametrize("rotated_name", ["kern.log.1", "kern.log-20261201"])
def test_file_rotated_by_rename_keeps_the_lines_written_before_the_rename(tmp_path, rotated_name):
    # logrotate renames kern.log (delaycompress / dateext) and rsyslog opens a new one: the
    # XID written between the last read and the rename is in the renamed file
    log = tmp_path / "kern.log"
    log.write_text("Nov 30 12:00:00 n1 kernel: usb 1-1: new device\n")
    _, cur = read_since(str(log), None, 5)
    with log.open("a") as f:
        f.write(XID79 + "\nNov 30 12:01:01 n1 kernel: last line, no newline")
    os.rename(log, tmp_path / rotated_name)
    (tmp_path / "kern.log.2.gz").write_bytes(b"\x1f\x8b")  # an older rotation: not the inode
    log.write_text("Nov 30 12:02:00 n1 kernel: fresh\n")
    lines, cur2 = read_since(str(log), cur, 5)
    assert lines == [XID79, "Nov 30 12:01:01 n1 kernel: last line, no newline", "Nov 30 12:02:00 n1 kernel: fresh"]
    assert [(e.xid, e.pci_bus_id) for e in parse_lines(lines).events] == [(79, "0000:06:00")]
    st = log.stat()
    assert cur2 == f"file:{st.st_dev}:{st.st_ino}:{st.st_size}"
    assert read_since(str(log), cur2, 5) == ([], cur2)


def test_file_rotated_rest_over_the_cap_continues_in_the_rotated_file(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("aaaa\n")
    _, cur = read_since(str(log), None, 5)
    with log.open("a") as f:
        f.write("bbbb\ncccc\n")
    old_ino = log.stat().st_ino
    os.rename(log, tmp_path / "kern.log.1")
    log.write_text("dddd\n")
    lines, cur2 = read_since(str(log), cur, 5, max_bytes=5)
    assert (lines, cur2) == (["bbbb"], f"file:{log.stat().st_dev}:{old_ino}:10")
    lines, cur3 = read_since(str(log), cur2, 5, max_bytes=5)
    assert (lines, cur3) == (["cccc"], f"file:{log.stat().st_dev}:{log.stat().st_ino}:0")
    lines, _ = read_since(str(log), cur3, 5, max_bytes=5)
    assert lines == ["dddd"]


def test_file_rotated_file_gone_or_a_symlink_starts_the_new_file_at_zero(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("aaaa\n")
    _, cur = read_since(str(log), None, 5)
    os.rename(log, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", tmp_path / "kern.log.1")  # same inode behind a link
    log.write_text("bbbb\n")
    assert read_since(str(log), cur, 5)[0] == ["bbbb"]


def test_file_cap_limits_bytes_per_call(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("aaaa\nbbbb\ncccc\n")
    lines, cur = read_since(str(log), None, 5, max_bytes=11)
    assert lines == ["aaaa", "bbbb"]
    lines, _ = read_since(str(log), cur, 5, max_bytes=11)
    assert lines == ["cccc"]


def test_missing_file_raises_one_line(tmp_path):
    with pytest.raises(KernelLogError) as exc:
        read_since(str(tmp_path / "nope.log"), None, 5)
    assert "nope.log" in str(exc.value) and "\n" not in str(exc.value)


def test_bad_arguments():
    with pytest.raises(KernelLogError):
        read_since("/var/log/kern.log", None, 0)
    with pytest.raises(KernelLogError):
        read_since("", None, 5)


# ----------------------------------------------------------------------- kmsg


def write_kmsg(path, records):
    path.write_bytes(b"".join(r.encode() + b"\n" for r in records))


@pytest.fixture
def kmsg(tmp_path):
    boot = tmp_path / "boot_id"
    boot.write_text(BOOT_A + "\n")
    dev = tmp_path / "kmsg"
    write_kmsg(dev, [
        "6,100,5000000,-;NVRM: loading NVIDIA UNIX x86_64 Kernel Module",
        " SUBSYSTEM=pci",
        " DEVICE=+pci:0000:91:00.0",
        "4,101,6781741548779,-;NVRM: Xid (PCI:0000:91:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
        "12,102,6781741600000,-;NVRM: Xid (PCI:0000:92:00): 79, injected from userspace",
        "4,103,1843308145,-;NVRM: The NVIDIA GPU 0000:b3:00.0\\x0aNVRM: (PCI ID: 10de:26b5) installed in this system has\\x0aNVRM: fallen off the bus and is not responding to commands.",
    ])
    return dev, boot


def test_kmsg_formats_records_and_drops_userspace(kmsg):
    dev, boot = kmsg
    lines, cur = read_since("kmsg", None, 5, kmsg_path=str(dev), boot_id_path=str(boot))
    assert lines[0] == "[    5.000000] NVRM: loading NVIDIA UNIX x86_64 Kernel Module"
    assert lines[1] == ("[6781741.548779] NVRM: Xid (PCI:0000:91:00): 79, pid='<unknown>', name=<unknown>, "
                        "GPU has fallen off the bus.")
    assert lines[2] == "[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0"
    assert lines[3].startswith("               NVRM: (PCI ID")
    assert len(lines) == 5  # record 102 (facility user) is dropped
    assert cur == f"kmsg:{BOOT_A}:103"
    events = parse_lines(lines).events
    assert [(e.pci_bus_id, e.kind, e.monotonic_s) for e in events] == [
        ("0000:91:00", "xid", pytest.approx(6781741.548779)),
        ("0000:b3:00", "fallen_off_bus", pytest.approx(1843.308145)),
    ]


def test_kmsg_cursor_skips_seen_and_new_boot_resets(kmsg):
    dev, boot = kmsg
    lines, cur = read_since("kmsg", f"kmsg:{BOOT_A}:101", 5, kmsg_path=str(dev), boot_id_path=str(boot))
    assert len(lines) == 3 and lines[0].startswith("[ 1843.308145]")
    assert cur == f"kmsg:{BOOT_A}:103"
    lines, cur = read_since("kmsg", cur, 5, kmsg_path=str(dev), boot_id_path=str(boot))
    assert (lines, cur) == ([], f"kmsg:{BOOT_A}:103")

    boot.write_text(BOOT_B + "\n")  # rebooted: seq numbers start over
    write_kmsg(dev, ["6,0,1000,-;Linux version 6.8", "6,1,2000,-;second"])
    lines, cur = read_since("kmsg", f"kmsg:{BOOT_A}:103", 5, kmsg_path=str(dev), boot_id_path=str(boot))
    assert lines == ["[    0.001000] Linux version 6.8", "[    0.002000] second"]
    assert cur == f"kmsg:{BOOT_B}:1"


def test_kmsg_cap_continues_next_call(kmsg):
    dev, boot = kmsg
    lines, cur = read_since("kmsg", None, 5, kmsg_path=str(dev), boot_id_path=str(boot), max_bytes=60)
    assert len(lines) == 1 and cur == f"kmsg:{BOOT_A}:100"
    lines, cur = read_since("kmsg", cur, 5, kmsg_path=str(dev), boot_id_path=str(boot), max_bytes=60)
    assert lines[0].startswith("[6781741.548779]") and cur == f"kmsg:{BOOT_A}:101"


def test_kmsg_unreadable(tmp_path, kmsg):
    _, boot = kmsg
    with pytest.raises(KernelLogError, match="cannot open"):
        read_since("kmsg", None, 5, kmsg_path=str(tmp_path / "absent"), boot_id_path=str(boot))
    with pytest.raises(KernelLogError, match="boot id"):
        read_since("kmsg", None, 5, kmsg_path=str(kmsg[0]), boot_id_path=str(tmp_path / "absent"))


# ------------------------------------------------------- fake executables


def fake_tool(bindir, name, body):
    path = bindir / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


@pytest.fixture
def bindir(tmp_path, monkeypatch):
    d = tmp_path / "bin"
    d.mkdir()
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(d))
    monkeypatch.setattr(kernel_log, "FALLBACK_PATH", str(empty))
    return d


def _entry(cursor, mono_us, msg, transport="kernel", realtime_us=None):
    import json

    e = {"__CURSOR": cursor, "_TRANSPORT": transport, "MESSAGE": msg,
         "_SOURCE_MONOTONIC_TIMESTAMP": str(mono_us)}
    if realtime_us is not None:
        e["__REALTIME_TIMESTAMP"] = str(realtime_us)
    return json.dumps(e).replace("'", "'\\''")


# journalctl -k -o json: one object per line. The second boot-chunk holds a spoofed
# `logger -t kernel` entry (transport syslog) that must not come out.
JOURNAL = f"""echo "$@" >> "$0.args"
case "$*" in
  *after-cursor=s=bad*) echo "Failed to seek to cursor: Invalid argument" >&2; exit 1;;
  *after-cursor=s=3*) ;;
  *after-cursor=s=1*) echo '{_entry("s=2", 5_000_000, "NVRM: Xid (PCI:0000:02:00): 79, GPU has fallen off the bus.", realtime_us=1740823205_000000)}'
                      echo '{_entry("s=3", 6_000_000, "NVRM: Xid (PCI:0000:02:00): 48, pid=1, name=x, DBE", transport="syslog")}';;
  *) echo '{_entry("s=0", 1_500_000, "NVRM: Xid (PCI:0000:01:00): 13, pid=1, name=a, x")}'
     echo '{_entry("s=1", 2_000_000, "usual line")}';;
esac
"""


def test_journalctl_json_cursor_round_trip_and_kernel_transport_only(bindir):
    fake_tool(bindir, "journalctl", JOURNAL)
    lines, cur = read_since("journalctl", None, 5)
    assert lines == [
        "[    1.500000] NVRM: Xid (PCI:0000:01:00): 13, pid=1, name=a, x",
        "[    2.000000] usual line",
    ]
    assert cur == "journal:s=1"
    lines, cur = read_since("journalctl", cur, 5)
    assert lines == ["2025-03-01T10:00:05+00:00 [    5.000000] NVRM: Xid (PCI:0000:02:00): 79, "
                     "GPU has fallen off the bus."]
    res = parse_lines(lines, structured=True)
    assert [(e.xid, e.timestamp, e.monotonic_s) for e in res.events] == [(79, 1740823205.0, 5.0)]
    assert cur == "journal:s=3"  # the syslog entry is skipped but its cursor is passed
    lines, cur = read_since("journalctl", cur, 5)
    assert (lines, cur) == ([], "journal:s=3")
    args = (bindir / "journalctl.args").read_text().splitlines()
    assert args[0] == "-k -o json --no-pager"
    assert args[1] == "-k -o json --no-pager --after-cursor=s=1"


def test_journalctl_keeps_kernel_facility_entries_only(bindir):
    """A program's write to /dev/kmsg ("<4>kernel: NVRM: Xid ...": root, a privileged
    container) is _TRANSPORT=kernel in the journal too, with the user facility the kernel
    gives every write (journald strips the "kernel:" identifier from MESSAGE): it is not
    the kernel's XID. A kernel entry with SYSLOG_FACILITY=0 (newer journald sets it on
    every kmsg record) or without it (older journald) is."""
    def entry(cursor, mono_us, msg, facility):
        e = {"__CURSOR": cursor, "_TRANSPORT": "kernel", "MESSAGE": msg, "_SOURCE_MONOTONIC_TIMESTAMP": str(mono_us)}
        if facility is not None:
            e["SYSLOG_FACILITY"] = facility
        return "echo '" + json.dumps(e).replace("'", "'\\''") + "'"

    forged = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus."
    real = "NVRM: Xid (PCI:0000:18:00): 48, pid='<unknown>', name=<unknown>, DBE"
    body = "\n".join([entry("s=1", 1_000_000, forged, "1"),
                      entry("s=2", 2_000_000, forged.replace("3b:00", "3c:00"), "3"),
                      entry("s=3", 3_000_000, real, "0"),
                      entry("s=4", 4_000_000, real.replace("18:00", "19:00"), None)])
    fake_tool(bindir, "journalctl", body + "\n")
    lines, cur = read_since("journalctl", None, 5)
    assert lines == ["[    3.000000] " + real, "[    4.000000] " + real.replace("18:00", "19:00")]
    assert cur == "journal:s=4"


def test_journalctl_bad_cursor_reads_whole_boot(bindir):
    fake_tool(bindir, "journalctl", JOURNAL)
    lines, cur = read_since("journalctl", "journal:s=bad", 5)
    assert len(lines) == 2 and cur == "journal:s=1"


# The journal vacuumed under the stored cursor: journalctl rejects it. Its t= field names
# the realtime of the last entry read (1740823205 s = 0x62ef6f2a4b040 µs).
VACUUMED = f"""echo "$@" >> "$0.args"
case "$*" in
  *after-cursor=*) echo "Failed to seek to cursor: Cannot assign requested address" >&2; exit 1;;
  *since=@1740823205*)
     echo '{_entry("s=2", 5_000_000, "NVRM: Xid (PCI:0000:02:00): 79, GPU has fallen off the bus.",
                   realtime_us=1740823205_000000)}'
     echo '{_entry("s=4", 7_000_000, "NVRM: Xid (PCI:0000:03:00): 94, pid=1, name=x, Contained ECC error.",
                   realtime_us=1740823206_500000)}';;
  *) echo '{_entry("s=0", 1_500_000, "NVRM: Xid (PCI:0000:02:00): 79, GPU has fallen off the bus.",
                   realtime_us=1740823200_000000)}';;
esac
"""


def test_journalctl_rejecting_the_cursor_reads_on_from_its_time_not_the_whole_boot(bindir):
    """Re-reading the whole boot would act again on the XID 79 already acted on (a node an
    admin resumed, drained again): only the entry after the cursor's time comes out."""
    from gpuguard.xid.kernel_log import cursor_time_us

    fake_tool(bindir, "journalctl", VACUUMED)
    cur = f"journal:s=abc;i=2;b=def;m=4c4b40;t={1740823205_000000:x};x=99"
    assert cursor_time_us(cur[len("journal:"):]) == 1740823205_000000
    lines, new = read_since("journalctl", cur, 5)
    assert lines == ["2025-03-01T10:00:06.500000+00:00 [    7.000000] NVRM: Xid (PCI:0000:03:00): 94, pid=1, "
                     "name=x, Contained ECC error."]
    assert new == "journal:s=4"
    args = (bindir / "journalctl.args").read_text().splitlines()
    assert args[-1] == "-k -o json --no-pager --since=@1740823205"
    # a cursor naming no time: the whole boot, as before
    lines, new = read_since("journalctl", "journal:s=abc;i=2", 5)
    assert len(lines) == 1 and new == "journal:s=0"


def test_journalctl_overflow_continues_from_last_entry(bindir):
    fake_tool(bindir, "journalctl", JOURNAL)
    lines, cur = read_since("journalctl", None, 5, max_bytes=200)
    assert len(lines) == 1 and lines[0].endswith("name=a, x")
    assert cur == "journal:s=0"


def test_journal_message_as_byte_array():
    assert records.journal_lines({"MESSAGE": list(b"NVRM: Xid (PCI:0000:01:00): 13, \xff"),
                                      "__MONOTONIC_TIMESTAMP": "7000000"}) == [
        "[    7.000000] NVRM: Xid (PCI:0000:01:00): 13, \ufffd"]


def test_journalctl_failure_and_missing(bindir):
    fake_tool(bindir, "journalctl", 'echo "No journal files were found." >&2\nexit 1\n')
    with pytest.raises(KernelLogError, match=r"journalctl exited with status 1: No journal files were found\."):
        read_since("journalctl", None, 5)
    (bindir / "journalctl").unlink()
    with pytest.raises(KernelLogError, match="journalctl not found"):
        read_since("journalctl", None, 5)


def test_subprocess_timeout(bindir):
    fake_tool(bindir, "dmesg", f"{SLEEP} 30\n")
    with pytest.raises(KernelLogError, match="dmesg timed out after 0.5 s"):
        read_since("dmesg", None, 0.5)


def test_dmesg_cursor_by_count_and_hash(bindir, tmp_path):
    buf = tmp_path / "ring.txt"
    fake_tool(bindir, "dmesg", f'{CAT} "{buf}"\n')
    buf.write_text("<6>[    1.000000] a\n<4>[    2.000000] b\n")
    lines, cur = read_since("dmesg", None, 5)
    assert lines == ["[    1.000000] a", "[    2.000000] b"]
    assert cur.startswith("dmesg:2:")
    assert (bindir / "dmesg").exists()

    # a userspace write to /dev/kmsg (facility user: <12>) is not a kernel record
    buf.write_text("<6>[    1.000000] a\n<4>[    2.000000] b\n"
                   "<12>[    2.500000] NVRM: Xid (PCI:0000:01:00): 79, pid=1, name=x, spoof\n"
                   "<4>[    3.000000] c\n")
    lines, cur = read_since("dmesg", cur, 5)
    assert lines == ["[    3.000000] c"] and cur.startswith("dmesg:4:")

    # ring buffer rotated: the first lines fell out, the last seen line is still there
    buf.write_text("<4>[    3.000000] c\n<4>[    4.000000] d\n")
    lines, cur = read_since("dmesg", cur, 5)
    assert lines == ["[    4.000000] d"] and cur.startswith("dmesg:2:")

    # rebooted / cleared: the last seen line is gone, everything is new
    buf.write_text("<6>[    0.100000] boot\n")
    lines, _ = read_since("dmesg", cur, 5)
    assert lines == ["[    0.100000] boot"]


def test_auto_prefers_kmsg_then_journalctl(bindir, kmsg, tmp_path):
    dev, boot = kmsg
    fake_tool(bindir, "journalctl", JOURNAL)
    _, cur = read_since("auto", None, 5, kmsg_path=str(dev), boot_id_path=str(boot))
    assert cur.startswith("kmsg:")
    _, cur = read_since("auto", None, 5, kmsg_path=str(tmp_path / "absent"), boot_id_path=str(boot))
    assert cur == "journal:s=1"
    # the cursor names journalctl, so auto keeps using it although kmsg is readable
    _, cur = read_since("auto", cur, 5, kmsg_path=str(dev), boot_id_path=str(boot))
    assert cur == "journal:s=3"


def test_auto_falls_back_to_dmesg_when_journalctl_fails(bindir, tmp_path, kmsg):
    _, boot = kmsg
    fake_tool(bindir, "journalctl", 'echo "No journal files were found." >&2\nexit 1\n')
    fake_tool(bindir, "dmesg", 'echo "<6>[    1.000000] only line"\n')
    lines, cur = read_since("auto", None, 5, kmsg_path=str(tmp_path / "absent"), boot_id_path=str(boot))
    assert lines == ["[    1.000000] only line"] and cur.startswith("dmesg:1:")
    (bindir / "dmesg").unlink()
    with pytest.raises(KernelLogError, match="No journal files were found.*dmesg not found"):
        read_since("auto", None, 5, kmsg_path=str(tmp_path / "absent"), boot_id_path=str(boot))


def test_file_source_refuses_fifo_without_hanging(tmp_path):
    import os

    fifo = tmp_path / "kern.fifo"
    os.mkfifo(fifo)
    with pytest.raises(KernelLogError, match=f"cannot read {fifo}: not a regular file"):
        read_since(str(fifo), None, 1.0)


def test_dmesg_raw_caller_id_is_dmesgs_field_not_the_message():
    """On a kernel with CONFIG_PRINTK_CALLER, `dmesg -r` prints the caller id after the
    stamp: the kernel's XID still starts its message; a user's /dev/kmsg write (facility
    user) still never counts."""
    raw = ["<4>[ 1843.308145] [ T1234] NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, "
           "GPU has fallen off the bus.",
           "<4>[ 1843.400000] [    C3] NVRM: Xid (PCI:0000:19:00): 48, pid=12, name=python, DBE",
           "<12>[ 1843.500000] [ T4242] NVRM: Xid (PCI:0000:1a:00): 79, pid=1, name=x, GPU has fallen off the bus."]
    lines = records.dmesg_canonical(raw)
    assert lines[:2] == ["[ 1843.308145] NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, "
                         "GPU has fallen off the bus.",
                         "[ 1843.400000] NVRM: Xid (PCI:0000:19:00): 48, pid=12, name=python, DBE"]
    res = parse_lines(lines, structured=True)
    assert [(e.xid, e.pci_bus_id, e.monotonic_s) for e in res.events] == [(79, "0000:18:00", 1843.308145),
                                                                           (48, "0000:19:00", 1843.4)]
    assert res.unparsed == 0


def test_a_journal_entry_with_an_impossible_time_keeps_its_message():
    entry = {"_TRANSPORT": "kernel", "__REALTIME_TIMESTAMP": "99999999999999999999",
             "_SOURCE_MONOTONIC_TIMESTAMP": "1843308145",
             "MESSAGE": "NVRM: Xid (PCI:0000:18:00): 79, pid=1, name=x, GPU has fallen off the bus."}
    lines = records.journal_lines(entry)
    assert lines == ["[ 1843.308145] NVRM: Xid (PCI:0000:18:00): 79, pid=1, name=x, GPU has fallen off the bus."]
    assert [(e.xid, e.timestamp, e.monotonic_s) for e in parse_lines(lines, structured=True).events] == [
        (79, None, 1843.308145)]


def test_file_source_that_is_not_log_text_is_a_tool_error_not_no_xids(tmp_path):
    """`kernel_log = /var/log/kern.log.2.gz` by mistake (or a UTF-16 copy, a binary): the
    hooks' file source says what the file is instead of reading no XID from its bytes."""
    import gzip

    xid = b"Nov 30 12:01:00 n1 kernel: NVRM: Xid (PCI:0000:06:00): 79, pid=1, name=x, GPU has fallen off the bus.\n"
    cases = {"kern.log.2.gz": (gzip.compress(xid), "is gzip-compressed data, not kernel-log text"),
             "kern16.log": (xid.decode().encode("utf-16"), "is UTF-16 text, not kernel-log text"),
             "prog": (b"\x7fELF\x02\x01\x01" + bytes(64), "is an ELF binary, not kernel-log text")}
    for name, (data, why) in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(KernelLogError) as exc:
            read_since(str(path), None, 5)
        assert str(exc.value) == f"cannot read {path}: it {why}"
    # a text file is read as before
    log = tmp_path / "kern.log"
    log.write_bytes(xid)
    lines, _ = read_since(str(log), None, 5)
    assert [e.xid for e in parse_lines(lines).events] == [79]
