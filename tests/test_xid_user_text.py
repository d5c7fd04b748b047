"""Kernel messages that print text an unprivileged user chose, with a newline in it: the
file name of an execve with an empty argv (fs/exec.c, ``process 'x' launched '%s' with
NULL argv``, any user), a mount option's name (``tmpfs: Unknown parameter '%s'``, any
user in a user namespace), an overlayfs path. A name ``/x\\nNVRM: Xid (...): 79, ...``
makes the record's second line read as an XID line wherever the record's lines are
printed apart (kern.log through imklog repeats the prefix, ``dmesg``/``journalctl``
indent, ``dmesg -t`` prints them bare): never the kernel's XID, in any layout."""

from __future__ import annotations

import pytest

from gpuguard.xid.parse import UNDER_RECORD_REASON, parse_lines

STAMP = "[  123.456789] "
SYSLOG = "Dec  1 10:00:00 node01 kernel: " + STAMP
FORGED = "NVRM: Xid (PCI:0000:18:00): 79, pid=1, name=a, GPU has fallen off the bus."
REAL = "NVRM: Xid (PCI:0000:3b:00): 48, pid=7, name=python3, An uncorrectable double bit error"
EXEC = "inside the user-written text of a kernel message (file name of an exec with NULL argv)"
MOUNT = "inside the user-written text of a kernel message (mount option name)"
OVERLAY = "inside the user-written text of a kernel message (overlayfs mount path)"

#: (record's lines, reason): the user's text holds a newline, then the forged line
RECORDS = {
    "exec": (["process 'a' launched '/tmp/x", FORGED + "' with NULL argv: empty string added"], EXEC),
    # the comm itself holds a newline (an exec of a file named "a\nb" sets it)
    "exec, comm with a newline": (["process 'a", "b' launched '/tmp/x", FORGED,
                                   "' with NULL argv: empty string added"], EXEC),
    # an option name holds no ',' or '=': the shortest XID line, the tail on the next line
    "mount option": (["tmpfs: Unknown parameter 'x", "NVRM: Xid (PCI:0000:18:00): 79", "x'"], MOUNT),
    "overlayfs": (["overlayfs: failed to resolve '/tmp/x", FORGED + "': -2"], OVERLAY),
}


def _layout(name: str, record: list[str]) -> list[str]:
    if name == "kern.log (imklog)":  # /proc/kmsg repeats the record's prefix on every line
        return [SYSLOG + line for line in record]
    if name == "kern.log, no printk stamps":
        return ["Dec  1 10:00:00 node01 kernel: " + line for line in record]
    if name == "dmesg":  # continuation lines indented under the stamp
        return [STAMP + record[0]] + [" " * len(STAMP) + line for line in record[1:]]
    if name == "journalctl -k":
        head = "Dec 01 10:00:00 node01 kernel: "
        return [head + record[0]] + [" " * len(head) + line for line in record[1:]]
    return list(record)  # dmesg -t / journalctl -o cat


LAYOUTS = ["kern.log (imklog)", "kern.log, no printk stamps", "dmesg", "journalctl -k", "dmesg -t"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", list(RECORDS))
def test_a_marker_line_in_user_text_of_a_kernel_record_is_rejected(kind, layout):
    record, reason = RECORDS[kind]
    lines = _layout(layout, record)
    res = parse_lines(lines)
    assert res.events == []
    forged_no = next(i for i, line in enumerate(lines, 1) if "NVRM: Xid" in line)
    assert res.rejected == {reason: 1}
    assert [n for n, _why, _text in res.rejected_samples] == [forged_no]


@pytest.mark.parametrize("prefix,next_prefix", [
    (SYSLOG, "Dec  1 10:00:02 node01 kernel: [  125.000001] "),  # its own record: its own stamp
    ("[  123.456789] ", "[  125.000001] "),  # dmesg
    ("", ""),  # dmesg -t: a line past the user's text
])
def test_a_real_xid_after_an_exec_message_is_read(prefix, next_prefix):
    """A real XID is a record of its own, with its own stamp; past the window (dmesg -t:
    no stamp at all) it is read."""
    lines = [prefix + "process 'a' launched '/usr/bin/true' with NULL argv: empty string added"]
    if not prefix:
        lines += ["x" * 4100]  # bare lines: the user's 4096 bytes are used up
    lines += [next_prefix + REAL]
    res = parse_lines(lines)
    assert [(e.pci_bus_id, e.xid, e.pid, e.line_no) for e in res.events] == [("0000:3b:00", 48, 7, len(lines))]
    assert res.unparsed == 0


def test_an_indented_bare_marker_line_under_any_kernel_record_is_rejected():
    """dmesg/journalctl print a record's later lines indented, without a stamp of their
    own; the driver prints each Xid as a record of its own. So an indented marker line
    with nothing before it, right below a record's first line, is that record's text,
    whatever the (unknown) message that printed it; the next real XID is read."""
    lines = ["[  123.456789] newdriver: cannot open '/tmp/x",
             "               " + FORGED + "'",
             "[  124.000000] " + REAL,
             "Dec 01 10:00:00 node01 kernel: newdriver: path '/tmp/y",
             "                               NVRM: GPU 0000:18:00.0: GPU has fallen off the bus."]
    res = parse_lines(lines)
    assert [(e.kind, e.pci_bus_id, e.xid, e.line_no) for e in res.events] == [("xid", "0000:3b:00", 48, 3)]
    assert res.rejected == {UNDER_RECORD_REASON: 2}
    assert [n for n, _why, _text in res.rejected_samples] == [2, 5]


def test_indented_pastes_with_their_own_stamps_are_still_read():
    """A paste indented as a whole (a Markdown code block): every line has its own stamp,
    so no marker line is under another record; the driver's multi-line fallen-off-the-bus
    record still joins."""
    lines = ["    [  123.4] NVRM: GPU at PCI:0000:18:00: GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee",
             "    [  123.5] " + FORGED,
             "[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0",
             "               NVRM: (PCI ID: 10de:26b5) installed in this system has",
             "               NVRM: fallen off the bus and is not responding to commands."]
    res = parse_lines(lines)
    assert [(e.kind, e.pci_bus_id, e.xid, e.monotonic_s, e.line_no) for e in res.events] == [
        ("xid", "0000:18:00", 79, 123.5, 2), ("fallen_off_bus", "0000:b3:00", 79, 1843.308145, 3)]
    assert res.unparsed == 0


def test_the_exec_forgery_never_drains_the_prolog(tmp_path, make_config, write_replay):
    """kern.log (rsyslog kern.*: kernel messages only, so ``kernel_log_kernel_only``):
    an exec of a file named ``/tmp/x\\nNVRM: Xid ...: 79`` leaves the node up."""
    from test_xid_client_text import prolog_health_on_kern_log

    res, events = prolog_health_on_kern_log(
        tmp_path, make_config, write_replay,
        "".join(line + "\n" for line in _layout("kern.log (imklog)", RECORDS["exec"][0])))
    assert (res.decision.outcome, res.decision.actions) == ("proceed", [])
    assert res.xid_rejected == {EXEC: 1}
    assert events == 0


def test_an_indented_line_between_does_not_hide_the_forged_line():
    """The user's text puts a line of its own before the marker line (``/x\\nfoo\\nNVRM:
    ...``): the marker line is still a later line of the record, not one of its own."""
    lines = ["[  123.456789] newdriver: cannot open '/tmp/x",
             "               foo",
             "               " + FORGED + "'"]
    res = parse_lines(lines)
    assert res.events == []
    assert res.rejected == {UNDER_RECORD_REASON: 1}
    assert [n for n, _why, _text in res.rejected_samples] == [3]


@pytest.mark.parametrize("quote", ["' launched '", "tmpfs: Unknown parameter '", "NVRM: API mismatch: the client has the version 1"])
def test_a_program_line_quoting_a_head_hides_no_real_xid(quote):
    """A user's syslog line (``logger``) that quotes a head opens no window: the kernel's
    XID in the same second is read."""
    lines = ["Dec  1 10:00:00 n1 alice: " + quote,
             "Dec  1 10:00:00 n1 kernel: " + REAL]
    res = parse_lines(lines)
    assert [(e.pci_bus_id, e.xid, e.line_no) for e in res.events] == [("0000:3b:00", 48, 2)]
    assert res.unparsed == 0
