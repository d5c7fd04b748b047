"""The CLI on real corpus dumps: exact exit codes, decisions and errors."""

import json

import pytest

from click.testing import CliRunner
from conftest import DATA, cli_runner, node_snapshot

from gpuguard.cli import main
from gpuguard.gpu.replay import ReplaySource


def invoke(*args):
    return CliRunner().invoke(main, ["--config", "/dev/null", *args])


def test_check_power_brake_dump_reports_the_right_gpu():
    r = invoke("check", "--json", "--from-nvidia-smi", str(DATA / "nvsmi-q-h100-535.161.08-powerbrake.txt"))
    assert r.exit_code == 2
    doc = json.loads(r.output)
    assert doc["outcome"] == "drain"
    assert doc["gpus"] == 1
    [f] = doc["findings"]
    assert (f["code"], f["gpu_index"], f["action"]) == ("throttle.hw_slowdown_idle", 0, "drain")
    assert f["evidence"]["reasons"] == ["hw_slowdown", "hw_power_brake_slowdown"]
    assert f["message"] == "gpu0 (0000:19:00.0) hw_slowdown+hw_power_brake_slowdown active while idle"


def test_check_8gpu_dump_only_gpu_75_power_brake():
    r = invoke("check", "--json", "--from-nvidia-smi", str(DATA / "nvsmi-q-h100x8-535.183.01-full.txt"))
    assert r.exit_code == 2
    doc = json.loads(r.output)
    assert doc["gpus"] == 8
    assert sorted((f["code"], f["gpu_index"]) for f in doc["findings"]) == [
        ("throttle.hw_slowdown_idle", 2), ("throttle.sw_thermal_idle", 2)]
    assert doc["reason"] == ("gpuguard: throttle.hw_slowdown_idle gpu2 (0000:75:00.0) "
                             "hw_power_brake_slowdown active while idle")


def test_check_row_remap_pending_dump():
    r = invoke("check", "--from-nvidia-smi", str(DATA / "nvsmi-q-a100-510.73.08-row-remap-pending-partial.txt"))
    assert r.exit_code == 2
    assert "critical  drain   ecc.row_remap_pending    0  gpu0 (0000:10:1c.0) row remap pending" in r.output


CORPUS_DECISIONS = {
    "nvsmi-q-a100-460.32.03-throttle-reasons.txt": (1, "proceed", [("config.persistence_off", 0)]),
    "nvsmi-q-a100-510.73.08-row-remap-pending-partial.txt": (2, "drain", [("ecc.row_remap_pending", 0)]),
    "nvsmi-q-a100-525.60.13-single-gpu-with-process.txt": (0, "proceed", []),
    # volatile 1 drains; the lifetime 5 is reported once beside it (a dump has no history)
    "nvsmi-q-a100-ecc-sram-uncorrectable-partial.txt": (2, "drain", [("ecc.uncorrectable_aggregate_present", 0),
                                                                      ("ecc.uncorrectable_volatile", 0)]),
    "nvsmi-q-titanv-560.35.03-volta-ecc.txt": (1, "proceed", [("config.persistence_off", 0)]),
    "nvsmi-qx-a100-mig-510.47.03.xml": (1, "proceed", [("config.persistence_off", 0)]),
}


@pytest.mark.parametrize("name", sorted(CORPUS_DECISIONS))
def test_corpus_dump_decisions(name):
    rc, outcome, findings = CORPUS_DECISIONS[name]
    r = invoke("check", "--json", "--from-nvidia-smi", str(DATA / name))
    doc = json.loads(r.output)
    assert (r.exit_code, doc["outcome"]) == (rc, outcome)
    assert sorted((f["code"], f["gpu_index"]) for f in doc["findings"]) == findings


def test_check_missing_and_wrong_format_files():
    r = invoke("check", "--from-nvidia-smi", "/nonexistent/dump.txt")
    assert r.exit_code == 3  # could not check: not the critical finding's 2
    assert r.output.strip() == "Error: /nonexistent/dump.txt: No such file or directory"
    r = invoke("check", "--from-nvidia-smi", str(DATA / "nvsmi-default-v100-inforom-corrupt.txt"))
    assert r.exit_code == 3
    assert r.output.count("\n") == 1 and "default nvidia-smi table" in r.output


def test_snapshot_roundtrip_and_replay_steps(tmp_path):
    out = tmp_path / "snap.json"
    r = invoke("gpu", "snapshot", "-o", str(out), "--from-nvidia-smi", str(DATA / "nvsmi-q-h100x8-535.183.01-full.txt"))
    assert r.exit_code == 0, r.output
    assert r.output == f"wrote 8 GPU(s) to {out}\n"
    snap = ReplaySource(str(out)).snapshot()
    assert [g.pcie_replay_count for g in snap.gpus] == [120, 111, 58, 60, 63, 93, 69, 78]
    r = CliRunner().invoke(main, ["--config", "/dev/null", "check", "--json", "--gpu-source", "replay",
                                  "--replay", str(out), "--kernel-log", "none"])
    assert json.loads(r.output)["gpus"] == 8


def test_replay_timed_steps(write_replay):
    p = write_replay(node_snapshot(2), steps=[{"after_s": 10, "gpus": {"1": {"ecc_volatile_uncorrected": 2}}},
                                              {"after_s": 20, "gpus": {"1": {"sm_clock_mhz": 990.0}}}], t0=1000.0)
    src = ReplaySource(p)
    assert src.snapshot(now=1005).gpus[1].ecc_volatile_uncorrected == 0
    s = src.snapshot(now=1015)
    assert (s.gpus[1].ecc_volatile_uncorrected, s.gpus[1].sm_clock_mhz) == (2, 345.0)
    s = src.snapshot(now=1025)
    assert (s.gpus[1].ecc_volatile_uncorrected, s.gpus[1].sm_clock_mhz, s.gpus[0].sm_clock_mhz) == (2, 990.0, 345.0)


def test_replay_errors(tmp_path):
    from gpuguard.gpu.replay import ReplayError

    bad = tmp_path / "b.json"
    bad.write_text('{"format": "gpuguard-snapshot/1", "snapshot": {"taken_at": 0, "source": "x", "gpus": '
                   '[{"index": 0, "tempc": 3}]}}')
    with pytest.raises(ReplayError, match=r"b.json: bad snapshot: unknown GPU field\(s\): tempc"):
        ReplaySource(str(bad))
    bad.write_text("{not json")
    with pytest.raises(ReplayError, match="b.json: invalid JSON"):
        ReplaySource(str(bad))
    with pytest.raises(ReplayError, match="cannot read replay file"):
        ReplaySource(str(tmp_path / "missing.json"))


def test_check_list_names_every_check():
    r = invoke("check", "--list")
    assert r.exit_code == 0
    assert [ln.split()[0] for ln in r.output.splitlines()] == sorted(
        ["driver", "gpu_count", "gpu_lost", "gpu_recovery_action", "ecc", "retired_pages", "row_remap", "memory_repair", "pcie_link", "pcie_replay",
         "nvlink", "temperature", "idle_throttle", "idle_baseline", "persistence", "inventory", "xid", "ib",
         "gpu_fabric"])


def test_text_that_is_not_nvidia_smi_is_refused():
    r = invoke("check", "--from-nvidia-smi", str(DATA / "xid-13-43-dmesg-iso.txt"))
    assert r.exit_code == 3
    assert r.output == (f"Error: GPU source: {DATA / 'xid-13-43-dmesg-iso.txt'}: no GPU section and no "
                        "nvidia-smi -q GPU field; not nvidia-smi -q output\n")


@pytest.mark.parametrize("field,value,msg", [
    ("ecc_volatile_uncorrected", "3", "ecc_volatile_uncorrected must be int, got '3'"),
    ("index", "one", "index must be int, got 'one'"),
    ("persistence_mode", 1, "persistence_mode must be bool, got 1"),
    ("clock_event_reasons", ["hw_slowdwn"], "clock_event_reasons: unknown reason(s) ['hw_slowdwn']"),
])
def test_replay_values_are_type_checked(write_replay, field, value, msg):
    from gpuguard.gpu.replay import ReplayError

    p = write_replay(node_snapshot(2))
    doc = json.loads(open(p).read())
    doc["snapshot"]["gpus"][1][field] = value
    open(p, "w").write(json.dumps(doc))
    with pytest.raises(ReplayError) as e:
        ReplaySource(p)
    assert str(e.value) == f"{p}: bad snapshot: {msg}"


def test_replay_step_keys_checked(write_replay):
    from gpuguard.gpu.replay import ReplayError

    p = write_replay(node_snapshot(1), steps=[{"after_s": 1, "gpus": {"x": {"temp_c": 90}}}])
    with pytest.raises(ReplayError, match=r"steps\[0\].gpus: key 'x' is not a GPU index"):
        ReplaySource(p)
    p = write_replay(node_snapshot(1), steps=[{"after_s": 1, "gpus": {"0": {"temp_c": "hot"}}}])
    with pytest.raises(ReplayError, match=r"steps\[0\].gpus.0: temp_c must be int/float, got 'hot'"):
        ReplaySource(p)


@pytest.mark.parametrize("args,rc", [(["check", "--from-nvidia-smi"], 3), (["gpu", "show", "--from-nvidia-smi"], 2)])
def test_fifo_device_and_directory_inputs_fail_in_one_line(tmp_path, args, rc):
    import os

    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    for path, why in ((fifo, "not a regular file"), ("/dev/zero", "not a regular file"),
                      (tmp_path, "not a regular file")):
        r = invoke(*args, str(path))
        assert r.exit_code == rc
        assert r.output.count("\n") == 1 and r.output.rstrip().endswith(f"{path}: {why}")


def test_gpu_show_of_a_cut_dump_prints_what_it_read_and_exits_2(tmp_path):
    """A dump cut inside its first GPU: the GPU's identity is shown, every value the
    dump did not reach reads '-' (not 'None/None', 'genNone xNone'), and the cut is an
    error on stderr with exit 2, as `check` calls it incomplete."""
    cut = tmp_path / "cut.txt"
    cut.write_text("GPU 00000000:18:00.0\n    Product Name : NVIDIA H100\n    Persistence Mo")
    r = invoke("gpu", "show", "--from-nvidia-smi", str(cut))
    assert r.exit_code == 2
    assert r.stdout.splitlines()[2].split() == ["0", "NVIDIA", "H100", "0000:18:00.0", "-", "-", "-", "-/-", "-", "-",
                                                "-", "-"]
    assert r.stderr == f"Error: incomplete: {cut}: the last line has no newline (the dump is cut short)\n"


def test_snapshot_refuses_to_write_through_a_symlink(tmp_path):
    target = tmp_path / "victim"
    target.write_text("precious")
    link = tmp_path / "out.json"
    link.symlink_to(target)
    r = invoke("gpu", "snapshot", "-o", str(link), "--from-nvidia-smi", str(DATA / "nvsmi-q-h100-535.161.08-powerbrake.txt"))
    assert r.exit_code == 2
    assert r.output.count("\n") == 1 and "symbolic link" in r.output
    assert target.read_text() == "precious"


def test_snapshot_keeps_an_existing_file_unless_forced(tmp_path):
    out = tmp_path / "snap.json"
    out.write_text("precious")
    dump = str(DATA / "nvsmi-q-h100-535.161.08-powerbrake.txt")
    r = invoke("gpu", "snapshot", "-o", str(out), "--from-nvidia-smi", dump)
    assert (r.exit_code, r.output) == (2, f"Error: {out}: already exists; not replaced (--force replaces it)\n")
    assert out.read_text() == "precious"
    r = invoke("gpu", "snapshot", "-o", str(out), "--force", "--from-nvidia-smi", dump)
    assert (r.exit_code, r.output) == (0, f"wrote 1 GPU(s) to {out}\n")
    assert json.loads(out.read_text())["format"] == "gpuguard-snapshot/1"


def test_check_separates_could_not_check_3_from_critical_2(tmp_path):
    """Critical findings exit 2 (documented); anything that stops the check (a bad option,
    a bad config, a missing or binary input) exits 3, the monitoring-plugin UNKNOWN,
    with one line on stderr."""
    dump = str(DATA / "nvsmi-q-h100x8-535.183.01-full.txt")
    healthy = str(DATA / "nvsmi-q-a100-525.60.13-single-gpu-with-process.txt")
    r = invoke("check", "--json", "--from-nvidia-smi", dump)
    assert (r.exit_code, json.loads(r.output)["outcome"]) == (2, "drain")
    r = invoke("check", "--json", "--from-nvidia-smi", healthy)
    assert (r.exit_code, json.loads(r.output)["outcome"]) == (0, "proceed")
    bad_cfg = tmp_path / "bad.toml"
    bad_cfg.write_text("x = [\n")
    r = CliRunner().invoke(main, ["--config", str(bad_cfg), "check", "--from-nvidia-smi", healthy])
    assert (r.exit_code, r.output.splitlines()) == (3, [f"Error: {bad_cfg}: invalid TOML: Invalid value (at end of document)"])
    r = invoke("check", "--format", "yaml")
    assert r.exit_code == 3 and r.output.splitlines()[-1] == (
        "Error: Invalid value for '--format': 'yaml' is not one of 'text', 'json', 'csv'.")
    r = invoke("check", "--gpu-source", "replay")
    assert r.exit_code == 3 and r.output.splitlines()[-1] == "Error: --gpu-source replay needs --replay FILE"
    # a kernel log named by the operator that cannot be scanned: never a silent pass
    elf = tmp_path / "prog"
    elf.write_bytes(b"\x7fELF\x02\x01\x01" + bytes(range(256)) * 64)
    gz = tmp_path / "kern.log.2.gz"
    gz.write_bytes(b"\x1f\x8b\x08\x00" + b"\x00" * 12)
    for path, line in ((tmp_path / "none.log", f"Error: kernel log {tmp_path / 'none.log'}: cannot open: No such file or directory"),
                       (elf, f"Error: kernel log {elf} is an ELF binary, not a kernel log"),
                       (gz, f"Error: kernel log {gz} is gzip-compressed; --kernel-log reads plain text "
                            "(zcat it to a file, or use gpuguard xid scan FILE)")):
        r = invoke("check", "--from-nvidia-smi", healthy, "--kernel-log", str(path))
        assert (r.exit_code, r.output) == (3, line + "\n"), path
    r = invoke("check", "--json", "--from-nvidia-smi", healthy, "--kernel-log", str(DATA / "xid-13-43-dmesg-iso.txt"))
    assert r.exit_code == 0 and json.loads(r.output)["outcome"] == "proceed"
    r = invoke("gpu", "show", "--from-nvidia-smi", "/nonexistent/dump.txt")  # other commands: bad input is 2
    assert r.exit_code == 2


def test_check_with_an_unreadable_kernel_log_is_unknown_not_healthy(monkeypatch):
    """The XID scan could not happen (here /dev/kmsg refused): with nothing worse found,
    `check` exits 3 (could not check) with the reason on stderr, not 0; a warning or a
    critical finding still exits 1 or 2."""
    from gpuguard.xid import kernel_log

    def refused(*_a, **_kw):
        raise kernel_log.KernelLogError("cannot open /dev/kmsg: Permission denied")

    monkeypatch.setattr(kernel_log, "read_kmsg", refused)
    healthy = str(DATA / "nvsmi-q-a100-525.60.13-single-gpu-with-process.txt")
    runner = cli_runner()
    r = runner.invoke(main, ["--config", "/dev/null", "check", "--from-nvidia-smi", healthy, "--kernel-log", "kmsg"])
    assert (r.exit_code, r.stdout.splitlines()[-1]) == (3, "decision: proceed")
    assert r.stderr == "tool error: kernel log: cannot open /dev/kmsg: Permission denied\n"
    dump = str(DATA / "nvsmi-q-h100x8-535.183.01-full.txt")
    r = runner.invoke(main, ["--config", "/dev/null", "check", "--from-nvidia-smi", dump, "--kernel-log", "kmsg"])
    assert r.exit_code == 2
    r = runner.invoke(main, ["--config", "/dev/null", "check", "--from-nvidia-smi", healthy, "--kernel-log", "none"])
    assert r.exit_code == 0


def test_check_reads_a_named_kernel_log_to_its_end(tmp_path, monkeypatch):
    """The hooks read a log in steps of MAX_READ_BYTES; `check --kernel-log FILE` reads the
    whole file: an XID 79 after the first step drains, not 'no findings'. A file larger
    than gpuguard's input cap is read too; one that cannot be read to its end in time
    cannot pass (exit 3)."""
    from gpuguard import health
    from gpuguard.xid import kernel_log

    filler = "Dec  1 03:00:00 node01 kernel: usb 1-1: new high-speed USB device number 2 using xhci_hcd\n"
    log = tmp_path / "kern.log"
    steps = kernel_log.MAX_READ_BYTES // len(filler) + 1000  # the XID is past the first step
    log.write_text(filler * steps + "Dec  1 03:00:01 node01 kernel: NVRM: Xid (PCI:0000:18:00): 79, pid=1, "
                   "name=x, GPU has fallen off the bus.\n")
    healthy = str(DATA / "nvsmi-q-a100-525.60.13-single-gpu-with-process.txt")
    r = invoke("check", "--json", "--from-nvidia-smi", healthy, "--kernel-log", str(log))
    doc = json.loads(r.output)
    assert (r.exit_code, doc["outcome"], doc["tool_errors"]) == (2, "drain", [])
    monkeypatch.setattr(health, "READ_ALL_S", 0.0)
    r = invoke("check", "--from-nvidia-smi", healthy, "--kernel-log", str(log))
    assert r.exit_code == 3
    assert f"tool error: kernel log: {log} not read to its end within the time limit" in r.output


FORGED = ("Nov 30 03:40:01 n1 alice: NVRM: Xid (PCI:0000:3a:00): 79, pid=1, name=x, spoof\n"
          "Nov 30 03:40:02 n1 alice: NVRM: Xid (PCI:0000:3a:00): 79, pid=1, name=x, spoof\n"
          "Nov 30 03:40:03 n1 kernel: NVRM: Xid (PCI:0000:3a:00): garbage\n")
REJECTED = ["kernel log: 2 XID/SXid line(s) not accepted: not a kernel-log prefix: 'n1 alice:'",
            "kernel log: 1 XID/SXid line(s) not accepted: no '(PCI:...): <code>' after the Xid marker"]


def test_check_with_xid_lines_it_could_not_accept_is_unknown_not_healthy(tmp_path):
    """XID-marked lines `check --kernel-log FILE` did not accept (a forged `logger` line, an
    unparseable one) may be the XID it is for: with nothing worse found it exits 3 (could
    not check), one line per reason on stderr; a critical finding still exits 2."""
    healthy = str(DATA / "nvsmi-q-a100-525.60.13-single-gpu-with-process.txt")
    log = tmp_path / "kern.log"
    log.write_text("Nov 30 03:39:00 n1 kernel: usb 1-1: new high-speed USB device\n" + FORGED)
    runner = cli_runner()
    r = runner.invoke(main, ["--config", "/dev/null", "check", "--from-nvidia-smi", healthy, "--kernel-log", str(log)])
    assert (r.exit_code, r.stdout.splitlines()[-2:]) == (3, ["no findings", "decision: proceed"])
    assert r.stderr.splitlines() == REJECTED
    r = runner.invoke(main, ["--config", "/dev/null", "check", "--json", "--from-nvidia-smi", healthy,
                             "--kernel-log", str(log)])
    doc = json.loads(r.stdout)
    assert (r.exit_code, doc["outcome"], doc["xid_rejected"]) == (
        3, "proceed", {"not a kernel-log prefix: 'n1 alice:'": 2, "no '(PCI:...): <code>' after the Xid marker": 1})
    assert doc["tool_errors"] == ["kernel log: XID/SXid line(s) not accepted: 3 (not a kernel-log prefix: "
                                  "'n1 alice:' x2; no '(PCI:...): <code>' after the Xid marker x1)"]
    log.write_text(FORGED + "Nov 30 03:40:04 n1 kernel: NVRM: Xid (PCI:0000:18:00): 79, pid=1, name=x, "
                            "GPU has fallen off the bus.\n")
    r = runner.invoke(main, ["--config", "/dev/null", "check", "--from-nvidia-smi", healthy, "--kernel-log", str(log)])
    assert (r.exit_code, r.stderr.splitlines()) == (2, REJECTED)
    log.write_text("Nov 30 03:39:00 n1 kernel: usb 1-1: new high-speed USB device\n")
    r = runner.invoke(main, ["--config", "/dev/null", "check", "--from-nvidia-smi", healthy, "--kernel-log", str(log)])
    assert (r.exit_code, r.stderr) == (0, "")


def _store_cfg(tmp_path, store):
    cfg = tmp_path / "g.toml"
    cfg.write_text(f'[paths]\nstore = "{store}"\n')
    return str(cfg)


@pytest.mark.parametrize("args", [["template", "list"], ["baseline", "show", "x"]])
def test_reader_on_a_store_without_tables_is_one_line_exit_2(tmp_path, args):
    """An empty file (a valid, table-less SQLite database no writer has migrated) read by
    a listing command: one line naming the store, exit 2, no traceback, file untouched."""
    store = tmp_path / "node.db"
    store.write_bytes(b"")
    r = CliRunner().invoke(main, ["--config", _store_cfg(tmp_path, store), *args])
    assert (r.exit_code, r.output) == (2, f"Error: store {store}: query failed: no such table: templates\n")
    assert store.read_bytes() == b""


@pytest.mark.parametrize("args", [["template", "list"], ["baseline", "show", "x"]])
def test_reader_refuses_a_store_from_a_newer_gpuguard(tmp_path, args):
    """A store whose schema version is above this code's: the read-only commands say so
    (as the writers do) instead of reading tables that may mean something else."""
    import sqlite3

    from gpuguard.store import NAMED_SETS_VERSION, open_store

    store = tmp_path / "node.db"
    open_store(str(store)).close()
    with sqlite3.connect(store) as c:
        c.execute("PRAGMA user_version = 999")
    before = store.read_bytes()
    r = CliRunner().invoke(main, ["--config", _store_cfg(tmp_path, store), *args])
    assert (r.exit_code, r.output) == (
        2, f"Error: store {store}: schema version 999 is newer than this gpuguard ({NAMED_SETS_VERSION})\n")
    assert store.read_bytes() == before
