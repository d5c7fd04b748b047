"""`xid scan` reads its input as a stream (gpuguard.xid.stream): the same lines as the
whole-text split whatever the chunking, gzip members decompressed as read, constant
memory on a file far larger than any cap."""

from __future__ import annotations

import gzip
import json
import pathlib
import random
import tracemalloc

from conftest import cli_runner

from gpuguard.xid import stream
from gpuguard.xid.cli import xid
from gpuguard.xid.records import log_lines

DATA = pathlib.Path(__file__).parent / "data"
XID79 = (b"Nov 30 12:01:00 n1 kernel: NVRM: Xid (PCI:0000:06:00): 79, pid='<unknown>', "
         b"name=<unknown>, GPU has fallen off the bus.\n")


def test_split_lines_equals_the_whole_text_split_for_every_chunking():
    rng = random.Random(3)
    alphabet = [b"a", b"b", b"\n", b"\r\n", b"\x00", b"\x00\x00\x00", b"\xe2\x80\xa8", b"\xff"]
    for _ in range(300):
        data = b"".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))
        cuts = sorted(rng.sample(range(len(data) + 1), min(len(data) + 1, rng.randrange(0, 6))))
        chunks = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        assert list(stream.split_lines(iter(chunks))) == log_lines(data), (data, chunks)


def test_split_lines_cuts_a_long_line_as_the_whole_text_split_does(monkeypatch):
    """Lines over MAX_LINE_CHARS are cut to it, by the stream (which holds only their head)
    and the whole-text split alike, whatever the chunking and the characters at the cut."""
    from gpuguard.xid import records

    monkeypatch.setattr(records, "MAX_LINE_CHARS", 5)
    monkeypatch.setattr(stream, "MAX_LINE_CHARS", 5)
    monkeypatch.setattr(stream, "MAX_LINE_BYTES", 4 * 5 + 8)
    rng = random.Random(5)
    alphabet = [b"a", b"b", b"\n", b"\r\n", b"\r", b"\x00", b"\xe2\x80\xa8", b"\xff", b"\xf0\x9f\x98\x80", b"\xe2"]
    for _ in range(1500):
        data = b"".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 120)))
        cuts = sorted(rng.sample(range(len(data) + 1), min(len(data) + 1, rng.randrange(0, 8))))
        chunks = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        assert list(stream.split_lines(iter(chunks))) == log_lines(data), (data, chunks)
    assert log_lines(b"abcdefgh\r\nxy\n" + b"z" * 40) == ["abcde", "xy", "zzzzz"]


def test_a_file_of_one_huge_line_is_scanned_in_bounded_memory(tmp_path, monkeypatch):
    """A 24 MiB file that is one line (no newline) then a real XID: the stream held every
    byte of the line and re-joined it to each 64 KiB chunk (a 200 MB line took 6.5 min and
    489 MB); now it holds the line's head only, and the XID after it is read."""
    monkeypatch.setattr(stream, "CHUNK_BYTES", 1 << 16)
    path = tmp_path / "kern.log"
    with path.open("wb") as f:
        f.write(b"Nov 30 12:00:00 n1 kernel: ")
        for _ in range(24):
            f.write(b"x" * (1 << 20))
        f.write(b"\n" + XID79)
    tracemalloc.start()
    r = cli_runner().invoke(xid, ["scan", "--json", str(path)])
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert r.exit_code == 0, r.stderr
    assert [(e["pci_bus_id"], e["line_no"]) for e in json.loads(r.stdout)] == [("0000:06:00", 2)]
    assert peak < 6 << 20, peak


def test_scan_streams_a_file_in_constant_memory(tmp_path, monkeypatch):
    # 12 MiB of ordinary kernel lines around two XIDs, read in 64 KiB chunks: the events,
    # their line numbers, and a peak allocation that is a small fraction of the file (the
    # whole-file read held it twice: bytes and decoded lines)
    monkeypatch.setattr(stream, "CHUNK_BYTES", 1 << 16)
    filler = b"Nov 30 12:00:00 n1 kernel: usb 1-1: new high-speed USB device number 2 using xhci_hcd\n"
    n = (12 << 20) // len(filler)
    path = tmp_path / "kern.log"
    with path.open("wb") as f:
        f.write(XID79)
        for _ in range(n // 1000):
            f.write(filler * 1000)
        f.write(XID79.replace(b"06:00", b"07:00"))
    tracemalloc.start()
    r = cli_runner().invoke(xid, ["scan", "--json", str(path)])
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert r.exit_code == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(e["pci_bus_id"], e["line_no"]) for e in rows] == [("0000:06:00", 1), ("0000:07:00", n // 1000 * 1000 + 2)]
    assert peak < 4 << 20, peak  # about 3 MiB: the 1 MiB head judged by not_a_log, twice


def test_scan_reads_every_member_of_a_multi_member_gzip_and_zero_padding(tmp_path, monkeypatch):
    monkeypatch.setattr(stream, "CHUNK_BYTES", 64)  # members and padding across chunks
    path = tmp_path / "kern.log.1.gz"
    path.write_bytes(gzip.compress(XID79) + gzip.compress(XID79.replace(b"06:00", b"07:00")) + b"\x00" * 512)
    r = cli_runner().invoke(xid, ["scan", "--json", str(path)])
    assert r.exit_code == 0, r.stderr
    assert [(e["pci_bus_id"], e["line_no"]) for e in json.loads(r.stdout)] == [("0000:06:00", 1), ("0000:07:00", 2)]
    assert r.stderr == "unparsed NVRM lines: 0\n"


def test_scan_a_nul_run_across_chunks_is_one_line_end_and_a_long_nul_file_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(stream, "CHUNK_BYTES", 7)
    path = tmp_path / "syslog"
    path.write_bytes(b"Nov 30 12:00:00 n1 systemd[1]: ok" + b"\x00" * 50 + XID79)
    r = cli_runner().invoke(xid, ["scan", "--json", str(path)])
    assert [(e["xid"], e["line_no"]) for e in json.loads(r.stdout)] == [(79, 2)]
    zeros = tmp_path / "zeros"
    zeros.write_bytes(b"\x00" * 100)
    r = cli_runner().invoke(xid, ["scan", str(zeros)])
    assert (r.exit_code, r.stderr) == (2, f"Error: {zeros} holds only NUL bytes (100 bytes), not a kernel log\n")


def test_scan_reads_a_utf16_copy_of_a_log(tmp_path, monkeypatch):
    """A log copied through Windows tools is UTF-16 with a byte-order mark: its NUL bytes
    are text, not line ends ("no XID events" on it would hide the fault); any chunking."""
    monkeypatch.setattr(stream, "CHUNK_BYTES", 5)
    text = "[ 1.000000] usb 1-1: new device\r\n" + XID79.decode() + "\u00e9t\u00e9\n"
    for codec in ("utf-16", "utf-16-be"):
        path = tmp_path / f"kern-{codec}.log"
        data = text.encode(codec)
        path.write_bytes(data if codec == "utf-16" else b"\xfe\xff" + data)
        r = cli_runner().invoke(xid, ["scan", "--json", str(path)])
        assert r.exit_code == 0, r.stderr
        assert [(e["pci_bus_id"], e["line_no"], e["xid"]) for e in json.loads(r.stdout)] == [("0000:06:00", 2, 79)]
