"""Kernel-log parse cost: what a hook pays per 16 MiB of new log text (the most one read
returns, gpuguard.xid.kernel_log.MAX_READ_BYTES), and what `xid scan` holds in memory.

Three inputs of 16 MiB: a busy syslog of ordinary lines with 4 real XID lines, the same
flooded with a user's forged `NVRM: Xid` lines (each rejected with its reason), and a
dmesg-style kernel log. Product: gpuguard.xid.parse.parse_lines on the split lines;
reference: one compiled search of the Xid marker per line (finds markers, judges nothing).
Prints CPU seconds of each and their ratio, then `xid scan`'s peak memory on the first
input read from a file (tracemalloc).

    .venv/bin/python bench/xid_scan.py
"""

from __future__ import annotations

import os
import re
import tempfile
import time
import tracemalloc

from gpuguard.xid.parse import parse_lines
from gpuguard.xid.records import log_lines

SIZE = 16 * 2**20
XID = "NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."


def make(prefix: str, body: str, xid_prefix: str) -> bytes:
    line = f"{prefix}{body}\n"
    n = SIZE // len(line)
    lines = [line] * n
    for k in range(4):
        lines[(k + 1) * n // 5] = f"{xid_prefix}{XID}\n"
    return "".join(lines).encode()


def cpu(fn, *args):
    """(CPU seconds, result) of ``fn(*args)``."""
    t = time.process_time()
    out = fn(*args)
    return time.process_time() - t, out


def main() -> None:
    inputs = {
        "syslog, ordinary lines": make("Dec  1 03:00:00 node01 sshd[4242]: ",
                                       "Accepted publickey for alice from 10.0.0.7 port 51234 ssh2",
                                       "Dec  1 03:00:00 node01 kernel: "),
        "syslog, forged XID flood": make("Dec  1 03:00:00 node01 alice: ", XID, "Dec  1 03:00:00 node01 kernel: "),
        "dmesg": make("[ 1234.567890] ", "usb 1-1: new high-speed USB device number 2 using xhci_hcd",
                      "[ 1234.567891] "),
    }
    marker = re.compile(r"NVRM:\s*Xid\b")
    print(f"{'input (16 MiB)':28} {'product s':>10} {'reference s':>12} {'ratio':>6}  events")
    for name, data in inputs.items():
        lines = log_lines(data)
        prod, r = cpu(parse_lines, lines)
        ref, _ = cpu(lambda xs: [marker.search(x) for x in xs], lines)
        print(f"{name:28} {prod:10.3f} {ref:12.3f} {prod / ref:6.1f}  {len(r.events)} "
              f"(rejected {r.unparsed})")
    from click.testing import CliRunner

    from gpuguard.xid.cli import xid

    fd, path = tempfile.mkstemp(suffix=".log")
    try:
        os.write(fd, inputs["syslog, ordinary lines"] * 4)
        os.close(fd)
        tracemalloc.start()
        CliRunner().invoke(xid, ["scan", "--json", path])
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        print(f"xid scan of a {os.path.getsize(path) / 2**20:.0f} MiB file: peak {peak / 2**20:.1f} MiB (tracemalloc)")
    finally:
        os.unlink(path)


if __name__ == "__main__":
    main()
