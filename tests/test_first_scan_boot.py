"""The first kernel-log scan of a text file reads the current boot only (``[xid]
first_scan_lookback = "boot"``, the default): kern.log keeps earlier boots, and an XID a
reboot dealt with weeks ago must not drain the node the day gpuguard is installed. A
GPU still lost after the reboot is the live checks' finding (GPU count, ECC, remapping)."""

from __future__ import annotations

import time

import pytest
from conftest import node_snapshot

from gpuguard.xid.logfile import boot_cursor

OLD_XID = "Nov  2 03:40:01 n1 kernel: [81234.123456] NVRM: Xid (PCI:0000:29:00): 79, pid=1, name=x, " \
          "GPU has fallen off the bus.\n"
BOOT = "Nov  3 09:00:00 n1 kernel: [    0.000000] Linux version 6.8.0-49-generic (buildd@lcy02) #49-Ubuntu SMP\n"
NEW_XID = "Nov 30 11:00:00 n1 kernel: [12.500000] NVRM: Xid (PCI:0000:29:00): 48, pid=7, name=y, " \
          "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 0.\n"
QUIET = "Nov 30 10:00:00 n1 kernel: [    5.000000] nvidia: loading out-of-tree module taints kernel.\n"


def _scan(cfg):
    from gpuguard.health import scan_kernel_log

    events, cursor, errors = scan_kernel_log(cfg, None)
    return [e.xid for e in events], cursor, errors


def test_boot_cursor_points_at_the_last_boot_line(tmp_path):
    f = tmp_path / "kern.log"
    f.write_text(OLD_XID + BOOT + QUIET + OLD_XID.replace("Nov  2", "Nov  4") + BOOT.replace("Nov  3", "Nov 29") + QUIET)
    st = f.stat()
    at = len((OLD_XID + BOOT + QUIET + OLD_XID).encode())
    assert boot_cursor(str(f), deadline=time.monotonic() + 5) == f"file:{st.st_dev}:{st.st_ino}:{at}"
    # no boot line: None (the file started after the boot: all of it is this boot)
    g = tmp_path / "short.log"
    g.write_text(QUIET + NEW_XID)
    assert boot_cursor(str(g), deadline=time.monotonic() + 5) is None
    # the boot line's marker across the edge of the first 1 MiB block searched back
    h = tmp_path / "big.log"
    head = QUIET * 100
    tail_len = (1 << 20) - len(BOOT) + BOOT.index("Linux")  # the block starts inside "Linux version"
    tail = QUIET * (tail_len // len(QUIET) - 1)
    tail += "x" * (tail_len - len(tail) - 1) + "\n"
    h.write_text(head + BOOT + tail)
    assert h.stat().st_size - (1 << 20) == len(head) + BOOT.index("Linux")
    assert boot_cursor(str(h), deadline=time.monotonic() + 5).endswith(f":{len(head)}")
    # searched back no further than asked (whole blocks): not found, the caller reads all
    far = tmp_path / "far.log"
    far.write_text(head + BOOT + QUIET * ((3 << 20) // len(QUIET)))
    assert boot_cursor(str(far), deadline=time.monotonic() + 5, max_scan_bytes=1 << 20) is None
    assert boot_cursor(str(far), deadline=time.monotonic() + 5).endswith(f":{len(head)}")
    assert boot_cursor(str(tmp_path / "missing.log"), deadline=time.monotonic() + 5) is None


@pytest.mark.parametrize("lookback, want", [("boot", [48]), ("all", [79, 48]), ("none", [])])
def test_first_scan_of_a_kern_log_reads_the_current_boot(tmp_path, make_config, write_replay, lookback, want):
    kern = tmp_path / "kern.log"
    kern.write_text(OLD_XID + BOOT + QUIET + NEW_XID)
    _, cfg = make_config(replay=write_replay(node_snapshot(2)), kernel_log=str(kern))
    cfg.values["xid"]["first_scan_lookback"] = lookback
    xids, cursor, errors = _scan(cfg)
    assert (xids, errors) == (want, [])
    assert cursor.endswith(f":{kern.stat().st_size}")


def test_a_healthy_node_with_an_old_boots_xid_proceeds_on_its_first_prolog(tmp_path, make_config, write_replay):
    from gpuguard.health import run_health

    kern = tmp_path / "kern.log"
    kern.write_text(OLD_XID + BOOT + QUIET)
    _, cfg = make_config(replay=write_replay(node_snapshot(2)), kernel_log=str(kern))  # kernel_only = true
    res = run_health(cfg, hook="prolog")
    assert (res.decision.outcome, [f.code for f in res.findings]) == ("proceed", [])
    # the next XID, written after the cursor, drains as ever
    with open(kern, "a") as fh:
        fh.write(OLD_XID.replace("Nov  2", "Nov 30"))
    res = run_health(cfg, hook="prolog")
    assert res.decision.outcome == "drain" and [f.code for f in res.findings] == ["xid.79"]


def test_an_operators_check_of_a_file_reads_all_of_it(tmp_path, make_config, write_replay):
    from gpuguard.health import scan_kernel_log

    kern = tmp_path / "kern.log"
    kern.write_text(OLD_XID + BOOT + QUIET)
    _, cfg = make_config(replay=write_replay(node_snapshot(2)))
    events, _, errors = scan_kernel_log(cfg, None, source=str(kern), read_all_s=10)
    assert ([e.xid for e in events], errors) == ([79], [])


_XID79 = "NVRM: Xid (PCI:0000:29:00): 79, pid=1, name=x, GPU has fallen off the bus."
_BANNER = "Linux version 6.8.0-49-generic (buildd@lcy02) #49-Ubuntu SMP"
#: (layout, its line for a message at a printk stamp): kern.log layouts whose boot line has
#: no ``kernel:`` before the banner
BOOT_LAYOUTS = [
    ("rfc5424", "<6>1 2026-11-03T09:00:00.000000+00:00 n1 kernel - - - [{mono}] {msg}"),
    ("rfc5424-no-pri", "2026-11-03T09:00:00.000000+00:00 n1 kernel - - - [{mono}] {msg}"),
    ("printk-caller", "Nov  3 09:00:00 n1 kernel: [{mono}] [    T0] {msg}"),
    ("dmesg-x", "kern  :notice: [{mono}] {msg}"),
    ("cri", "2026-11-03T09:00:00.123456789Z stdout F [{mono}] {msg}"),
    ("rfc5424-nil-time", "<6>1 - n1 kernel - - - [{mono}] {msg}"),
    ("rfc5424-procid-0", "<6>1 2026-11-03T09:00:00.000000+00:00 n1 kernel 0 - - [{mono}] {msg}"),
    ("year-after-day", "Nov 03 2026 09:00:00 n1 kernel: [{mono}] {msg}"),
    ("syslog-ng-full", "2026 Nov  3 09:00:00 n1 kernel: [{mono}] {msg}"),
    ("syslog-ng-unix", "1793696400 n1 kernel: [{mono}] {msg}"),
]


@pytest.mark.parametrize("layout, fmt", BOOT_LAYOUTS, ids=[n for n, _ in BOOT_LAYOUTS])
def test_first_scan_finds_the_boot_line_in_every_layout(tmp_path, make_config, write_replay, layout, fmt):
    """Before, only ``kernel:`` before the banner was a boot line: in these layouts the
    first Prolog after install read every earlier boot and drained a healthy node for an
    XID 79 that the reboot had dealt with."""
    from gpuguard.health import run_health

    old = fmt.format(mono="81234.123456", msg=_XID79) + "\n"
    boot = fmt.format(mono="    0.000000", msg=_BANNER) + "\n"
    quiet = fmt.format(mono="    5.000000", msg="nvidia: loading out-of-tree module taints kernel.") + "\n"
    kern = tmp_path / "kern.log"
    kern.write_text(old + boot + quiet)
    st = kern.stat()
    assert boot_cursor(str(kern), deadline=time.monotonic() + 5) == f"file:{st.st_dev}:{st.st_ino}:{len(old)}"
    _, cfg = make_config(replay=write_replay(node_snapshot(2)), kernel_log=str(kern))  # kernel_only = true
    res = run_health(cfg, hook="prolog")
    assert (res.decision.outcome, [f.code for f in res.findings]) == ("proceed", [])
    with open(kern, "a") as fh:  # this boot's XID still drains
        fh.write(fmt.format(mono="12.500000", msg=_XID79) + "\n")
    res = run_health(cfg, hook="prolog")
    assert (res.decision.outcome, [f.code for f in res.findings]) == ("drain", ["xid.79"])


def test_text_a_user_chose_before_the_banner_is_no_boot_line(tmp_path):
    from gpuguard.xid.logfile import is_boot_line

    assert is_boot_line(b"Nov  3 09:00:00 n1 kernel: [    0.000000] " + _BANNER.encode())
    assert is_boot_line(_BANNER.encode())  # journalctl -o cat
    assert not is_boot_line(b"Nov  3 09:00:00 n1 alice: " + _BANNER.encode())
    assert not is_boot_line(b"Nov  3 09:00:00 n1 kernel: [   12.000000] audit: name=\"" + _BANNER.encode())
    f = tmp_path / "kern.log"
    f.write_text(BOOT + QUIET + f"Nov 30 10:00:00 n1 alice: {_BANNER}\n" + QUIET)
    st = f.stat()
    assert boot_cursor(str(f), deadline=time.monotonic() + 5) == f"file:{st.st_dev}:{st.st_ino}:0"


def test_an_indented_banner_under_a_users_record_is_no_boot_line(tmp_path, make_config, write_replay):
    """``journalctl`` (and ``dmesg``) print a record's later lines indented under its first
    line, with no prefix of their own; any user's multi-line message
    (``sd_journal_send("MESSAGE=hi\\nLinux version 6.1")``) prints so. The kernel prints its
    banner as a record of its own, with its own prefix. Before, such an indented line was
    the boot line: the first scan began after this boot's XID 79 and missed it."""
    from gpuguard.xid.logfile import is_boot_line

    user = "Dec 02 05:12:00 n1 alice[4242]: hi\n                                   " + _BANNER + "\n"
    kern = tmp_path / "kern.log"
    kern.write_text(BOOT + QUIET + OLD_XID.replace("Nov  2", "Nov 30") + user)
    st = kern.stat()
    assert not is_boot_line(b"                                   " + _BANNER.encode())
    assert not is_boot_line(b"\t" + _BANNER.encode())
    assert boot_cursor(str(kern), deadline=time.monotonic() + 5) == f"file:{st.st_dev}:{st.st_ino}:0"
    _, cfg = make_config(replay=write_replay(node_snapshot(2)), kernel_log=str(kern))
    xids, cursor, errors = _scan(cfg)
    assert (xids, cursor, errors) == ([79], f"file:{st.st_dev}:{st.st_ino}:{st.st_size}", [])


def test_an_operators_check_reads_a_last_line_without_its_newline(tmp_path, make_config, write_replay):
    """A saved log cut without its final newline (``head -c``, a paste). A hook holds such a
    line back until its newline comes; an operator's check of the file must read it, as
    ``xid scan`` does. Before, `check --kernel-log FILE` passed it: XID 79 on the last line
    gave no finding and exit 0. The cursor stays before it, so a hook that goes on from
    this cursor reads the finished line: never missed."""
    from gpuguard.health import scan_kernel_log

    kern = tmp_path / "kern.log"
    kern.write_text(BOOT + QUIET + OLD_XID.replace("Nov  2", "Nov 30").rstrip("\n"))
    st = kern.stat()
    _, cfg = make_config(replay=write_replay(node_snapshot(2)))
    events, cursor, errors = scan_kernel_log(cfg, None, source=str(kern), read_all_s=10)
    assert ([e.xid for e in events], errors) == ([79], [])
    assert cursor == f"file:{st.st_dev}:{st.st_ino}:{len(BOOT + QUIET)}"
    events, _, _ = scan_kernel_log(cfg, None, source=str(kern))  # a hook: waits for the newline
    assert events == []
