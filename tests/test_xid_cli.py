"""`xid scan` through click's CliRunner on the group itself."""

from __future__ import annotations

import json
import pathlib

from conftest import cli_runner

from gpuguard.xid.cli import xid

DATA = pathlib.Path(__file__).parent / "data"


def test_scan_table():
    result = cli_runner().invoke(xid, ["scan", str(DATA / "xid-79-sxid-20034-nvswitch.txt")])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["TIME", "PCI", "KIND", "XID", "NAME", "PID", "PROCESS", "ACTION", "MESSAGE"]
    assert len(lines) == 8
    assert lines[2].split()[:4] == ["+6781741.548779s", "0000:91:00", "xid", "79"]
    assert lines[2].rstrip().endswith("drain   GPU has fallen off the bus.")
    assert lines[3].split()[:4] == ["+6781753.400584s", "0000:06:00.0", "sxid", "20034"]
    assert result.stderr.strip() == "unparsed NVRM lines: 0"


def test_scan_json_from_stdin():
    text = (DATA / "xid-13-109-dmesg-ctime-peermem.txt").read_text()
    result = cli_runner().invoke(xid, ["scan", "-", "--json"], input=text)
    assert result.exit_code == 0
    rows = json.loads(result.stdout)
    assert [(r["xid"], r["pid"], r["process"], r["action"], r["severity"]) for r in rows] == [
        (13, None, None, "record", "info"),
        (13, None, None, "record", "info"),
        (13, None, None, "record", "info"),
        (109, 1797828, "pt_main_thread", "alert", "warning"),
    ]
    assert rows[3]["message"] == "Ch 00000008, errorString CTX SWITCH TIMEOUT, Info 0x58005"
    assert rows[3]["pci_bus_id"] == "0000:cb:00"


def test_scan_counts_unparsed_on_stderr_and_truncates_message():
    text = ("NVRM: Xid (PCI:0000:01:00): abc\n"
            "NVRM: Xid (PCI:0000:01:00): 31, pid=9, name=p, " + "x" * 100 + "\n")
    result = cli_runner().invoke(xid, ["scan"], input=text)
    assert result.exit_code == 0
    row = result.stdout.splitlines()[2]
    assert row.endswith("x" * 57 + "...")
    assert result.stderr.splitlines() == [
        "unparsed NVRM lines: 1",
        "  1 x no '(PCI:...): <code>' after the Xid marker",
        "  line 1: NVRM: Xid (PCI:0000:01:00): abc",
    ]


def test_scan_kernel_prefix_only_file_gives_seven_xid45():
    # lines pasted from a GB200 node's log whose only prefix is "kernel: "
    result = cli_runner().invoke(xid, ["scan", "--json", str(DATA / "xid-kernel-prefix-gb200-xid45.txt")])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [(r["pci_bus_id"], r["xid"], r["pid"], r["action"]) for r in rows] == [
        ("0000:dc:00", 45, 1818990, "record"), ("0000:ed:00", 45, 1818992, "record"),
        ("0000:ba:00", 45, 1818989, "record"), ("0000:97:00", 45, 1818987, "record"),
        ("0000:dc:00", 45, 1818990, "record"), ("0000:ba:00", 45, 1818989, "record"),
        ("0000:ed:00", 45, 1818992, "record"),
    ]
    assert result.stderr.splitlines() == ["unparsed NVRM lines: 0"]


def test_scan_shows_spoofed_lines_with_their_reason():
    text = ("Nov 30 03:40:01 node01 alice: NVRM: Xid (PCI:0000:53:00): 79, pid=1, name=x, y\n"
            "Nov 30 03:40:02 node01 kernel: NVRM: Xid (PCI:0000:53:00): 48, pid=1, name=x, DBE\n")
    result = cli_runner().invoke(xid, ["scan", "--json"], input=text)
    assert [r["xid"] for r in json.loads(result.stdout)] == [48]
    assert result.stderr.splitlines() == [
        "unparsed NVRM lines: 1",
        "  1 x not a kernel-log prefix: 'node01 alice:'",
        "  line 1: Nov 30 03:40:01 node01 alice: NVRM: Xid (PCI:0000:53:00): 79, pid=1, name=x, y",
    ]


def test_scan_missing_file_exit_2(tmp_path):
    missing = tmp_path / "nope.log"
    result = cli_runner().invoke(xid, ["scan", str(missing)])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"Error: cannot read {missing}: cannot open: No such file or directory"


def test_scan_reads_a_rotated_gzip_log(tmp_path):
    # logrotate compresses kern.log.2.gz: read like zgrep, never "no XID events" on it
    import gzip

    gz = tmp_path / "kern.log.2.gz"
    gz.write_bytes(gzip.compress((DATA / "xid-79-no-pid-serial-zero-595.txt").read_bytes()))
    r = cli_runner().invoke(xid, ["scan", "--json", str(gz)])
    assert r.exit_code == 0
    assert [(e["xid"], e["pci_bus_id"], e["action"]) for e in json.loads(r.stdout)] == [(79, "0000:06:00", "drain")]


def test_scan_broken_gzip_is_one_line_and_nul_runs_hide_nothing(tmp_path):
    bad = tmp_path / "cut.gz"
    bad.write_bytes(b"\x1f\x8b\x08\x00" + b"\x00" * 12)
    r = cli_runner().invoke(xid, ["scan", str(bad)])
    assert r.exit_code == 2
    assert r.stderr.strip().startswith(f"Error: cannot read {bad}: broken gzip data")
    # a syslog file after a hard reset: a zero-filled block, then the kernel's lines
    crash = tmp_path / "syslog"
    crash.write_bytes(b"Nov 30 12:00:00 n1 systemd[1]: ok" + b"\x00" * 4096
                      + b"Nov 30 12:01:00 n1 kernel: NVRM: Xid (PCI:0000:06:00): 79, pid='<unknown>', "
                        b"name=<unknown>, GPU has fallen off the bus.\n")
    r = cli_runner().invoke(xid, ["scan", "--json", str(crash)])
    assert r.exit_code == 0
    assert [(e["xid"], e["pci_bus_id"]) for e in json.loads(r.stdout)] == [(79, "0000:06:00")]


def test_scan_truncated_gzip_shows_the_events_before_the_cut_and_exits_2(tmp_path):
    """A rotated log cut short (a full disk, a partial copy): the events before the cut
    are printed, the cut is named on stderr, exit 2 (never a silent partial read)."""
    import gzip

    text = (DATA / "xid-79-sxid-20034-nvswitch.txt").read_bytes()
    whole = gzip.compress(text)
    cut = tmp_path / "kern.log.3.gz"
    cut.write_bytes(whole[:len(whole) // 2])
    r = cli_runner().invoke(xid, ["scan", "--json", str(cut)])
    assert r.exit_code == 2
    events = json.loads(r.stdout)
    assert events and events[0]["xid"] == 79 and events[0]["pci_bus_id"] == "0000:91:00"
    full = json.loads(cli_runner().invoke(xid, ["scan", "--json", str(DATA / "xid-79-sxid-20034-nvswitch.txt")]).stdout)
    assert len(events) < len(full)
    assert r.stderr.strip().splitlines()[-1] == (
        f"Error: {cut}: gzip data ends early (truncated file); the events before the cut are shown")


def test_scan_binary_files_are_one_line_exit_2_and_real_logs_with_bad_bytes_still_read(tmp_path):
    import gzip
    import random

    rng = random.Random(7)
    noise = bytes(rng.randrange(256) for _ in range(65536))
    cases = {
        "prog": (b"\x7fELF\x02\x01\x01" + noise, "is an ELF binary, not a kernel log"),
        "logs.zip": (b"PK\x03\x04" + noise, "is a zip archive, not a kernel log"),
        "kern.log.1.xz": (b"\xfd7zXZ\x00" + noise,
                          "is xz-compressed data (decompress it first: xz -dc FILE | gpuguard xid scan -), "
                          "not a kernel log"),
        "zeros": (b"\x00" * 8192, "holds only NUL bytes (8192 bytes), not a kernel log"),
    }
    for name, (data, why) in cases.items():
        f = tmp_path / name
        f.write_bytes(data)
        r = cli_runner().invoke(xid, ["scan", str(f)])
        assert (r.exit_code, r.stdout, r.stderr) == (2, "", f"Error: {f} {why}\n"), name
    # random bytes (no magic), also behind gzip and on stdin: counted, not "no XID events"
    (tmp_path / "blob").write_bytes(noise)
    (tmp_path / "blob.gz").write_bytes(gzip.compress(noise))
    for args, kw, shown in ((["scan", str(tmp_path / "blob")], {}, str(tmp_path / "blob")),
                            (["scan", str(tmp_path / "blob.gz")], {}, str(tmp_path / "blob.gz")),
                            (["scan", "-"], {"input": noise}, "stdin")):
        r = cli_runner().invoke(xid, args, **kw)
        assert r.exit_code == 2 and r.stdout == "", args
        assert r.stderr.startswith(f"Error: {shown} is binary data, not a kernel log (") and r.stderr.count("\n") == 1
    # a real log with a few corrupt bytes (non-UTF-8, stray control characters) keeps its event
    log = (DATA / "xid-79-no-pid-serial-zero-595.txt").read_bytes()
    f = tmp_path / "kern.log"
    f.write_bytes(b"Nov 30 11:59:59 n1 kernel: junk \xff\xfe\x01\x02\x03\n" + log)
    r = cli_runner().invoke(xid, ["scan", "--json", str(f)])
    assert r.exit_code == 0, r.stderr
    assert [(e["xid"], e["pci_bus_id"]) for e in json.loads(r.stdout)] == [(79, "0000:06:00")]
    # an empty file is an empty log
    (tmp_path / "empty").write_bytes(b"")
    r = cli_runner().invoke(xid, ["scan", str(tmp_path / "empty")])
    assert (r.exit_code, r.stdout) == (0, "no XID events\n")


def test_scan_reads_a_journalctl_json_export_kernel_entries_only(tmp_path):
    """`journalctl -o json > f` (and `-o json-seq`): the kernel's entry is an event at its
    line, a `logger -t kernel` entry (_TRANSPORT=syslog) is counted as rejected, never an
    event, and never "no XID events" for the kernel's XID 79."""
    msg = "NVRM: Xid (PCI:0000:91:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
    base = {"__REALTIME_TIMESTAMP": "1716000000000000", "__MONOTONIC_TIMESTAMP": "6781741548779",
            "SYSLOG_IDENTIFIER": "kernel", "PRIORITY": "4"}
    entries = [
        {**base, "__CURSOR": "s=1", "_TRANSPORT": "kernel", "MESSAGE": "usb 1-1: new device"},
        {**base, "__CURSOR": "s=2", "_TRANSPORT": "syslog", "MESSAGE": msg.replace("91:00", "18:00")},
        {**base, "__CURSOR": "s=3", "_TRANSPORT": "kernel", "MESSAGE": msg},
    ]
    for sep in ("", "\x1e"):
        path = tmp_path / f"journal{len(sep)}.json"
        path.write_text("".join(sep + json.dumps(e) + "\n" for e in entries))
        result = cli_runner().invoke(xid, ["scan", str(path), "--json"])
        assert result.exit_code == 0, result.output
        rows = json.loads(result.stdout)
        assert [(r["pci_bus_id"], r["xid"], r["action"], r["line_no"], r["timestamp"], r["monotonic_s"])
                for r in rows] == [("0000:91:00", 79, "drain", 3, 1716000000.0, 6781741.548779)]
        assert result.stderr.splitlines() == [
            "unparsed NVRM lines: 1",
            "  1 x journal entry not from the kernel (_TRANSPORT=syslog)",
            "  line 2: " + msg.replace("91:00", "18:00"),
        ]


def test_scan_of_a_journal_export_counts_a_programs_kmsg_write_as_rejected(tmp_path):
    """In a saved `journalctl -o json` export, an entry a program wrote to /dev/kmsg is
    _TRANSPORT=kernel with the user facility: rejected with its reason, not an event."""
    msg = "NVRM: Xid (PCI:0000:91:00): 79, pid=1, name=x, GPU has fallen off the bus."
    entries = [{"__CURSOR": "s=1", "_TRANSPORT": "kernel", "SYSLOG_FACILITY": "1", "PRIORITY": "4",
                "SYSLOG_IDENTIFIER": "kernel", "__MONOTONIC_TIMESTAMP": "1000000", "MESSAGE": msg}]
    path = tmp_path / "journal.json"
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))
    result = cli_runner().invoke(xid, ["scan", str(path), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == []
    assert result.stderr.splitlines() == [
        "unparsed NVRM lines: 1",
        "  1 x journal entry written to /dev/kmsg by a program (SYSLOG_FACILITY=1)",
        "  line 1: " + msg,
    ]


def test_scan_a_line_is_what_ends_in_newline_not_a_unicode_separator(tmp_path):
    """A user's syslog message holding U+2028 (or U+0085, a form feed, an ASCII
    separator) before a forged kernel line stays one line, rejected for its prefix:
    str.splitlines would have read the forged tail as a kernel XID 79."""
    forged = "Dec  1 03:00:00 node1 kernel: NVRM: Xid (PCI:0000:18:00): 79, pid=1, name=x, GPU has fallen off the bus."
    for sep in ("\u2028", "\u0085", "\x0c", "\x1c", "\x1e"):
        path = tmp_path / "syslog"
        path.write_text(f"Dec  1 03:00:00 node1 alice: hello{sep}{forged}\r\n", encoding="utf-8")
        result = cli_runner().invoke(xid, ["scan", str(path), "--json"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout) == []
        shown = f"node1 alice: hello{sep}Dec  1 03:00:00 node1"[:37] + "..."
        assert result.stderr.splitlines()[:2] == ["unparsed NVRM lines: 1", f"  1 x not a kernel-log prefix: {shown!r}"]


def test_scan_reads_journalctl_export_and_verbose_kernel_entries_only(tmp_path):
    """`journalctl -o export` (KEY=value, blank line between entries) and `-o verbose`
    (header line, indented fields): the kernel's XID is an event at its MESSAGE line, a
    `logger -t kernel` entry is counted as rejected, never an event."""
    msg = "NVRM: Xid (PCI:0000:91:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
    forged = msg.replace("91:00", "18:00")
    export = "\n".join([
        "__CURSOR=s=739ad463348b4ceca5a9e69c95a3c93f;i=4ece7;b=6c7c;m=1;t=2;x=3",
        "__REALTIME_TIMESTAMP=1716000000000000", "__MONOTONIC_TIMESTAMP=6781741548779", "_TRANSPORT=kernel",
        "PRIORITY=4", "SYSLOG_IDENTIFIER=kernel", f"MESSAGE={msg}", "_HOSTNAME=n1", "",
        "__CURSOR=s=739ad463348b4ceca5a9e69c95a3c93f;i=4ece8;b=6c7c;m=2;t=3;x=4",
        "__REALTIME_TIMESTAMP=1716000001000000", "_TRANSPORT=syslog", "SYSLOG_IDENTIFIER=kernel",
        f"MESSAGE={forged}", ""]) + "\n"
    verbose = "\n".join([
        "Sat 2024-05-18 02:40:00.000000 UTC [s=739ad463348b4ceca5a9e69c95a3c93f;i=4ece7;b=6c7c;m=1;t=2;x=3]",
        "    _TRANSPORT=kernel", "    PRIORITY=4", "    _SOURCE_MONOTONIC_TIMESTAMP=6781741548779",
        f"    MESSAGE={msg}",
        "Sat 2024-05-18 02:40:01.000000 UTC [s=739ad463348b4ceca5a9e69c95a3c93f;i=4ece8;b=6c7c;m=2;t=3;x=4]",
        "    _TRANSPORT=syslog", "    SYSLOG_IDENTIFIER=kernel", f"    MESSAGE={forged}"]) + "\n"
    for name, text, want in (("export", export, ("0000:91:00", 79, 7, 1716000000.0, 6781741.548779), ),
                             ("verbose", verbose, ("0000:91:00", 79, 5, None, 6781741.548779))):
        path = tmp_path / f"journal.{name}"
        path.write_text(text)
        result = cli_runner().invoke(xid, ["scan", str(path), "--json"])
        assert result.exit_code == 0, result.output
        assert [(r["pci_bus_id"], r["xid"], r["line_no"], r["timestamp"], r["monotonic_s"])
                for r in json.loads(result.stdout)] == [want], name
        line = 14 if name == "export" else 9
        assert result.stderr.splitlines() == ["unparsed NVRM lines: 1",
                                              "  1 x journal entry not from the kernel (_TRANSPORT=syslog)",
                                              f"  line {line}: {forged}"], name


def test_scan_reads_a_journalctl_json_pretty_export_kernel_entries_only(tmp_path):
    """`journalctl -o json-pretty > f` (each entry from a `{` line to a `}` line, fields
    indented): the kernel's XID is an event at its entry's first line, a `logger -t kernel`
    entry is counted as rejected; a cut-off last entry is counted, never an event."""
    msg = "NVRM: Xid (PCI:0000:91:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
    forged = msg.replace("91:00", "18:00")
    base = {"__REALTIME_TIMESTAMP": "1716000000000000", "__MONOTONIC_TIMESTAMP": "6781741548779",
            "SYSLOG_IDENTIFIER": "kernel"}
    entries = [{**base, "__CURSOR": "s=1", "_TRANSPORT": "syslog", "MESSAGE": forged},
               {**base, "__CURSOR": "s=2", "_TRANSPORT": "kernel", "MESSAGE": msg}]
    text = "".join(json.dumps(e, indent=8) + "\n" for e in entries)
    cut = json.dumps({**base, "_TRANSPORT": "kernel", "MESSAGE": msg.replace("91:00", "3b:00")}, indent=8)
    path = tmp_path / "journal.json"
    path.write_text(text + cut[:-2] + "\n")
    result = cli_runner().invoke(xid, ["scan", str(path), "--json"])
    assert result.exit_code == 0, result.output
    assert [(r["pci_bus_id"], r["xid"], r["line_no"], r["timestamp"], r["monotonic_s"])
            for r in json.loads(result.stdout)] == [("0000:91:00", 79, 9, 1716000000.0, 6781741.548779)]
    assert result.stderr.splitlines()[:3] == [
        "unparsed NVRM lines: 2", "  1 x journal entry not from the kernel (_TRANSPORT=syslog)",
        "  1 x not a journal entry in a journalctl -o json-pretty export"]
