"""A kernel log printed inside a container (a node agent's pod running ``dmesg`` or
``journalctl -k``) and saved by the container runtime: each line wrapped in the CRI
envelope (``TIMESTAMP stdout F ...``, containerd / CRI-O) or Docker's ``json-file``
object. Before, every such XID line was rejected as ``not a kernel-log prefix: 'stdout
F'`` (the XID missed) and the driver's three-line fallen-off-the-bus record was never
joined, so a lost GPU read as no event at all."""

from __future__ import annotations

import json
import pathlib


from xid_helpers import check_kernel_log
from gpuguard.xid.grouping import unwrapped
from gpuguard.xid.parse import parse_lines

DATA = pathlib.Path(__file__).parent / "data"
MSG = "NVRM: Xid (PCI:0000:18:00): 79, pid=1234, name=python3, GPU has fallen off the bus."


def _one(lines: list[str]) -> tuple:
    res = parse_lines(lines)
    assert res.unparsed == 0, res.rejected
    assert len(res.events) == 1
    e = res.events[0]
    return e.kind, e.xid, e.pci_bus_id, e.pid, e.process, e.monotonic_s, e.timestamp, e.line_no, e.message


def test_cri_full_line_dmesg_content() -> None:
    lines = ["2026-12-01T10:00:00.123456789Z stdout F [12345.678901] " + MSG]
    assert _one(lines) == ("xid", 79, "0000:18:00", 1234, "python3", 12345.678901, None, 1,
                           "GPU has fallen off the bus.")


def test_cri_journalctl_content_keeps_its_own_time() -> None:
    lines = ["2026-12-01T11:00:00.5+01:00 stderr F 2026-12-01T10:00:00+00:00 node01 kernel: " + MSG]
    assert _one(lines) == ("xid", 79, "0000:18:00", 1234, "python3", None, 1796119200.0, 1,
                           "GPU has fallen off the bus.")


def test_cri_partial_lines_are_joined_to_the_line_that_ends_them() -> None:
    lines = ["2026-12-01T10:00:00.1Z stdout P [12345.678901] NVRM: Xid (PCI:0000:18:",
             "2026-12-01T10:00:00.1Z stderr F [12345.600000] unrelated",
             "2026-12-01T10:00:00.1Z stdout F 00): 79, pid=1234, name=python3, GPU has fallen off the bus."]
    assert list(unwrapped(lines)) == [(2, "[12345.600000] unrelated"), (1, "[12345.678901] " + MSG)]
    assert _one(lines) == ("xid", 79, "0000:18:00", 1234, "python3", 12345.678901, None, 1,
                           "GPU has fallen off the bus.")


def test_docker_json_file_line() -> None:
    lines = [json.dumps({"log": "[12345.678901] " + MSG + "\n", "stream": "stdout",
                         "time": "2026-12-01T10:00:00.1Z"})]
    assert _one(lines) == ("xid", 79, "0000:18:00", 1234, "python3", 12345.678901, None, 1,
                           "GPU has fallen off the bus.")


def test_fallen_off_bus_record_in_cri_is_joined() -> None:
    src = (DATA / "xid-none-fallen-off-bus-multiline.txt").read_text().splitlines()
    lines = [f"2026-12-01T10:00:0{i}.00000000{i}Z stdout F {line}" for i, line in enumerate(src)]
    assert _one(lines) == ("fallen_off_bus", 79, "0000:b3:00", None, None, 1843.308145, None, 1,
                           "The NVIDIA GPU 0000:b3:00.0 (PCI ID: 10de:26b5) installed in this system "
                           "has fallen off the bus and is not responding to commands.")


def test_user_text_inside_the_envelope_is_still_rejected() -> None:
    res = parse_lines(["2026-12-01T10:00:00.1Z stdout F node01 alice: " + MSG])
    assert res.events == []
    assert dict(res.rejected) == {"not a kernel-log prefix: 'node01 alice:'": 1}


def test_other_lines_pass_through_unchanged() -> None:
    lines = ["Dec  1 10:00:00 node01 kernel: " + MSG, '{"log": 1}', '{"log":"x", bad']
    assert list(unwrapped(lines)) == list(enumerate(lines, 1))


def test_check_kernel_log_of_a_cri_file_finds_the_xid(tmp_path: pathlib.Path) -> None:
    log = tmp_path / "kernel.log"
    log.write_text("2026-12-01T10:00:00.123456789Z stdout F [12345.678901] " + MSG + "\n")
    rc, rows, out = check_kernel_log(log)
    assert rc == 2, out
    assert rows == [
        "critical,drain,xid.79,,XID 79 GPU has fallen off the bus on 0000:18:00 (not among the 1 visible GPUs)"]
