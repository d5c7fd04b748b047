"""Offline triage of DCGM outputs: dcgmi diag tables (every corpus layout), -j JSON,
dcgmi dmon -e 230, detection against the other kinds, hostile tables, CLI exit codes."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuguard import config as config_mod
from gpuguard.cli import main
from gpuguard.net.dcgm_diag import DiagFormatError, parse, parse_text
from gpuguard.net.dcgm_triage import parse_dmon
from gpuguard.net.triage import TriageError, detect, triage
from conftest import cli_runner

DATA = Path(__file__).parent / "data"
TRI = DATA / "triage"


def _read(name: str) -> str:
    return (TRI / name if (TRI / name).exists() else DATA / name).read_text()


def _triage(name: str, text: str | None = None):
    return triage([(name, _read(name) if text is None else text)], config_mod.from_dict({}))


def _found(res):
    return [(f.code, f.severity, f.gpu_index, f.message) for f in res.findings]


def _row(name: str, value: str) -> str:
    """A row as dcgmi/Diag.cpp's DIAG_DATA stencil prints it (25 + 46 wide cells)."""
    return f"| {name:<25} | {value:<46} |"


RULE = "+---------------------------+------------------------------------------------+"
HEAD = ["Successfully ran diagnostic for group.", RULE, _row("Diagnostic", "Result"),
        "+===========================+================================================+"]


def _table(*rows: str, footer: bool = True) -> str:
    return "\n".join([*HEAD, *rows, *([RULE] if footer else [])]) + "\n"


def _wrapped(name: str, msg: str) -> list[str]:
    return [_row(name if i == 0 else "", msg[i:i + 45]) for i in range(0, len(msg), 45)]


@pytest.mark.parametrize("name,kind", [
    ("dcgmi-diag-4.2.3-l40s-new-layout-partial.txt", "dcgmi diag"),
    ("dcgmi-diag-r2-2.4.6-pcie-fail-nvlink-down-wrapped.txt", "dcgmi diag"),
    ("dcgmi-diag-r2-3.3.1-t4-fail-wrapped-fragment.txt", "dcgmi diag"),
    ("dcgmi-diag-r2-3.3.1-t4-head-partial.txt", "dcgmi diag"),
    ("dcgmi-diag-r2-3.3.7-h100nvl-head-partial.txt", "dcgmi diag"),
    ("dcgmi-diag-r3-3.0.4-head-partial.txt", "dcgmi diag"),
    ("dcgmi-diag-r3-3.3.5-a100-head-partial.txt", "dcgmi diag"),
    ("dcgmi-diag-j-3x-memory-fail.json", "dcgmi diag -j"),
    ("dcgmi-diag-j-4x-warn-and-fail.json", "dcgmi diag -j"),
    ("dcgmi-dmon-e230-xid-field.txt", "dcgmi dmon"),
    ("dcgmi-nvlink-link-status-all-down-3.3.7.txt", "dcgmi nvlink --link-status"),
    ("dcgmi-health-c-j-healthy.json", None),
])
def test_detect_dcgm_kinds(name, kind):
    assert detect(_read(name)) == kind


def test_dcgmi_health_is_refused_by_name():
    with pytest.raises(TriageError, match="dcgmi-health-c-j-healthy.json: dcgmi health output is not read"):
        _triage("dcgmi-health-c-j-healthy.json")
    text = ("+---------------------------+------------------------------+\n| Health Monitor Report"
            "                                    |\n| Overall Health            | Warning                      |\n")
    assert detect(text) is None


def test_metadata_blocks_and_heads():
    rep = parse(_read("dcgmi-diag-r2-3.3.1-t4-head-partial.txt"))
    assert rep.metadata == {"DCGM Version": "3.3.1", "Driver Version Detected": "535.129.03",
                            "GPU Device IDs Detected": "1eb8"}
    assert [(t.category, t.name, t.status) for t in rep.tests] == [("Deployment", n, "Pass") for n in (
        "Denylist", "NVML Library", "CUDA Main Library", "Permissions and OS Blocks", "Persistence Mode",
        "Environment Variables", "Page Retirement/Row Remap", "Graphics Processes")]
    assert rep.problems == ["the table ends early (no closing +---+ rule): tests after the last row were not seen"]
    assert parse(_read("dcgmi-diag-r2-3.3.7-h100nvl-head-partial.txt")).device_ids == ["2321", "2321"]
    assert parse(_read("dcgmi-diag-r3-3.3.5-a100-head-partial.txt")).device_ids == ["20b5"] * 4
    old = parse(_read("dcgmi-diag-r3-3.0.4-head-partial.txt"))
    assert old.metadata == {} and len(old.tests) == 9 and old.tests[-1].name == "Inforom"


def test_dcgm4_layout_entity_rows():
    rep = parse(_read("dcgmi-diag-4.2.3-l40s-new-layout-partial.txt"))
    assert rep.device_ids == ["26b9"] * 4 and rep.metadata["DCGM Version"] == "4.2.3"
    (t,) = rep.tests
    assert (t.name, t.category, t.status, t.per_gpu) == ("software", "Deployment", "Pass",
                                                         {0: "Pass", 1: "Pass", 2: "Pass", 3: "Pass"})
    res = _triage("dcgmi-diag-4.2.3-l40s-new-layout-partial.txt")
    assert res.summary == ["dcgmi-diag-4.2.3-l40s-new-layout-partial.txt: dcgmi diag (DCGM 4.2.3, driver "
                           "570.148.08, 4 GPU device id(s)), 1 test(s): 1 Pass"]
    # a head with all Pass is not a healthy reading: the rest of the table is missing
    assert [f.code for f in res.findings] == ["dcgm.diag_unreadable"]


def test_wrapped_warning_rejoined_exactly_fragment_starting_mid_message():
    rep = parse(_read("dcgmi-diag-r2-3.3.1-t4-fail-wrapped-fragment.txt"))
    (t,) = rep.tests
    assert (t.name, t.category, t.per_gpu, t.cells) == ("GPU Memory", "Hardware", {1: "Pass", 0: "Fail"},
                                                        ["Pass - GPU: 1", "Fail - GPU: 0"])
    assert [(m.kind, m.gpu, m.text) for m in t.messages] == [(
        "Warning", 0, "GPU 0 Error using CUDA API cuCtxCreate Check DCGM and system logs for errors. Reset GPU. "
        "Restart DCGM. Rerun diagnostics. Unable to create CUDA context: 'CUDA-capable device(s) is/are busy or "
        "unavailable'.")]
    assert [(m.kind, m.gpu, m.text) for m in rep.orphans] == [
        ("?", None, "able''' Check DCGM and system logs for errors. Reset GPU. Restart DCGM. Rerun diagnostics."),
        ("Info", 0, "GPU 0 API call cudaStreamCreate failed: 'CUDA-capable device(s) is/are busy or unavailable' "
                    "Check DCGM and system logs for errors. Reset GPU. Restart DCGM. Rerun diagnostics."),
        # the space that fell at the cut ("GPU" | " 1 Host") is kept, and the double space DCGM printed
        ("Info", 1, "GPU 1 GPU to Host bandwidth:  12.33 GB/s, GPU 1 Host to GPU bandwidth:  13.15 GB/s, "
                    "GPU 1 bidirectional bandwidth: 22.63 GB/s")]
    res = _triage("dcgmi-diag-r2-3.3.1-t4-fail-wrapped-fragment.txt")
    assert _found(res) == [("dcgm.diag_fail", "critical", 0, "gpu0 DCGM diag GPU Memory (Hardware) Fail: "
                            + t.messages[0].text)]
    assert res.problems == [
        "dcgmi-diag-r2-3.3.1-t4-fail-wrapped-fragment.txt: the paste starts inside a message "
        "(\"able''' Check DCGM and system logs for e\"...): the test it belongs to is not in it",
        "dcgmi-diag-r2-3.3.1-t4-fail-wrapped-fragment.txt: the table ends early (no closing +---+ rule): "
        "tests after the last row were not seen"]


NVLINK_MSG = ", ".join(f"GPU 0's NvLink link {i} is currently down Run a field diagnostic on the GPU." for i in range(5))


def test_fail_all_duplicated_prefix_open_last_row_and_elision():
    rep = parse(_read("dcgmi-diag-r2-2.4.6-pcie-fail-nvlink-down-wrapped.txt"))
    (t,) = rep.tests
    assert (t.name, t.category, t.status, t.all_gpus, t.per_gpu) == ("PCIe", "Integration", "Fail", "Fail", {})
    (m,) = t.messages
    assert (m.kind, m.gpu, m.truncated, m.text) == ("Warning", 0, True, NVLINK_MSG + ",")
    res = _triage("dcgmi-diag-r2-2.4.6-pcie-fail-nvlink-down-wrapped.txt")
    # no Metadata and no per-GPU row: the GPUs are unknown, the finding is the node's
    (f,) = res.findings
    assert (f.code, f.severity, f.gpu_index) == ("dcgm.diag_fail", "critical", None)
    assert f.message == f"all GPUs DCGM diag PCIe (Integration) Fail - All: {NVLINK_MSG}, [paste ends here]"
    assert f.evidence["messages"] == [NVLINK_MSG + ","]
    assert res.problems[0] == "dcgmi-diag-r2-2.4.6-pcie-fail-nvlink-down-wrapped.txt: line 12: elision '...': rows left out of the paste"


def test_fail_all_applies_to_metadata_gpus_and_gpu_lists():
    text = _table("|-----  Metadata  ----------+------------------------------------------------|",
                  _row("DCGM Version", "3.3.5"), _row("GPU Device IDs Detected", "20b5,20b5,20b5"),
                  "+-----  Integration  -------+------------------------------------------------+",
                  _row("PCIe", "Fail - All"),
                  "+-----  Stress  ------------+------------------------------------------------+",
                  _row("Targeted Stress", "Skip - All"), _row("Memory Bandwidth", "Not Run"))
    res = _triage("t.txt", text)
    assert [(f.code, f.gpu_index, f.message) for f in res.findings] == [
        ("dcgm.diag_fail", g, f"gpu{g} DCGM diag PCIe (Integration) Fail - All") for g in (0, 1, 2)]
    assert res.summary == ["t.txt: dcgmi diag (DCGM 3.3.5, 3 GPU device id(s)), 3 test(s): 1 Fail, 1 Skip, "
                           "1 Not Run; Skip: Targeted Stress; Not Run: Memory Bandwidth"]
    assert res.problems == []
    text = _table("+-----  Hardware  ----------+------------------------------------------------+",
                  _row("Diagnostic", "Pass - GPUs: 1, 3"), _row("", "Fail - GPUs: 0, 2"),
                  *_wrapped("Warning", "GPU 2 Detected 3 SBE errors in the framebuffer during the test run."))
    rep = parse(text)
    assert rep.tests[0].per_gpu == {1: "Pass", 3: "Pass", 0: "Fail", 2: "Fail"} and rep.complete
    assert [(f.gpu_index, f.message) for f in _triage("t.txt", text).findings] == [
        (0, "gpu0 DCGM diag Diagnostic (Hardware) Fail"),
        (2, "gpu2 DCGM diag Diagnostic (Hardware) Fail: GPU 2 Detected 3 SBE errors in the framebuffer during "
            "the test run.")]


def test_dcgm4_warn_printed_as_fail_in_entity_rows_and_named_warning_rows():
    text = _table("+-----  Hardware  ----------+------------------------------------------------+",
                  _row("memory", "Warn"), _row("", "GPU0: Pass"), _row("", "GPU1: Fail"),
                  *_wrapped("Warning: GPU1", "ECC memory is not currently active on this device, so memory errors "
                                             "cannot be found"),
                  _row("pcie", "Fail"), _row("", "GPU0: Fail"),
                  _row("Warning: GPU0", "Bandwidth below limit"), _row("", "GPU1: Pass"),
                  _row("", "CPU0: Pass"), _row("", "GPU_I1: Pass"), _row("Warning: GPU_I1", "MIG note"))
    rep = parse(text)
    mem, pcie = rep.tests
    assert mem.per_gpu == {0: "Pass", 1: "Warn"} and pcie.per_gpu == {0: "Fail", 1: "Pass"}
    assert pcie.entities == {"CPU0": "Pass", "GPU_I1": "Pass"} and pcie.messages[-1].gpu is None
    assert mem.messages[0].text == ("ECC memory is not currently active on this device, so memory errors "
                                    "cannot be found") and mem.messages[0].gpu == 1
    assert [(f.code, f.gpu_index) for f in _triage("t", text).findings] == [("dcgm.diag_warn", 1),
                                                                             ("dcgm.diag_fail", 0)]


def test_deployment_failures_are_setup_unless_memory_health(tmp_path):
    text = _table("|-----  Deployment  --------+------------------------------------------------|",
                  _row("Persistence Mode", "Fail"),
                  *_wrapped("Warning", "Persistence mode for GPU 1 is disabled. Enable persistence mode by running"),
                  _row("Page Retirement/Row Remap", "Fail"),
                  *_wrapped("Warning", "GPU 0 had uncorrectable memory errors and row remapping failed."))
    res = _triage("t", text)
    assert [(f.code, f.severity, f.gpu_index) for f in res.findings] == [
        ("dcgm.diag_setup_fail", "warning", 1), ("dcgm.diag_fail", "critical", 0)]
    (tmp_path / "d.txt").write_text(text.replace(_row("Page Retirement/Row Remap", "Fail"),
                                                 _row("Page Retirement/Row Remap", "Pass")))
    r = cli_runner().invoke(main, ["check", "--from-file", str(tmp_path / "d.txt")])
    assert r.exit_code == 1 and "decision: proceed" in r.output  # setup only: alert, no drain


def test_json_3x_and_4x():
    rep = parse(_read("dcgmi-diag-j-3x-memory-fail.json"))
    assert rep.metadata == {"DCGM Version": "3.3.5", "Driver Version Detected": "535.129.03",
                            "GPU Device IDs Detected": "20b5, 20b5"}
    assert [(t.category, t.name, t.status, t.per_gpu) for t in rep.tests] == [
        # printed "Fail", read "Warn": its one warning has a workable error_severity (1, monitor)
        ("Deployment", "Denylist", "Pass", {}), ("Deployment", "Persistence Mode", "Warn", {1: "Warn"}),
        ("Hardware", "GPU Memory", "Fail", {0: "Fail", 1: "Pass"}),
        ("Stress", "Targeted Power", "Skip", {0: "Skip", 1: "Skip"})]
    res = _triage("dcgmi-diag-j-3x-memory-fail.json")
    assert _found(res) == [
        ("dcgm.diag_warn", "warning", 1, 'gpu1 DCGM diag Persistence Mode (Deployment) Warn: Persistence mode '
         'for GPU 1 is disabled. Enable persistence mode by running "nvidia-smi -i <gpuId> -pm 1 " as root.'),
        ("dcgm.diag_fail", "critical", 0, "gpu0 DCGM diag GPU Memory (Hardware) Fail: Pending page retirements "
         "together with a DBE were detected on GPU 0. Drain the GPU and reset it or reboot the node to resolve "
         "this issue.")]
    rep = parse(_read("dcgmi-diag-j-4x-warn-and-fail.json"))
    assert rep.metadata == {"DCGM Version": "4.2.3", "Driver Version Detected": "570.148.08",
                            "GPU Device IDs Detected": "2330, 2330"}
    assert [(t.name, t.status, t.per_gpu) for t in rep.tests] == [
        ("software", "Pass", {0: "Pass", 1: "Pass"}), ("memory", "Warn", {0: "Pass", 1: "Warn"}),
        ("pcie", "Fail", {0: "Fail", 1: "Pass"})]
    assert [(m.kind, m.gpu, m.text) for m in rep.tests[2].messages] == [
        ("Warning", 0, "GPU 0's NvLink link 3 is currently down Run a field diagnostic on the GPU."),
        ("Info", 0, "GPU 0 GPU to Host bandwidth:  24.97 GB/s")]
    assert [(f.code, f.gpu_index) for f in _triage("dcgmi-diag-j-4x-warn-and-fail.json").findings] == [
        ("dcgm.diag_warn", 1), ("dcgm.diag_fail", 0)]


def test_json_warn_printed_as_fail_and_the_summarys_own_warnings():
    # dcgmi -j prints a Warn result as "Fail" (dcgmi/Diag.cpp HelperJsonAddResult, default
    # DDR_NO_DISPLAY_WARN; dcgmi/tests/DiagTests.cpp: a WARN test's summary reads "Fail"); the
    # warnings' error_severity tells them apart. The test summary also carries the warnings
    # of no entity (the table prints them as the test's own Warning rows).
    rep = parse(_read("dcgmi-diag-j-4x-warn-printed-as-fail.json"))
    assert [(t.name, t.status, t.per_gpu, t.cells) for t in rep.tests] == [
        ("software", "Warn", {0: "Warn", 1: "Pass"}, ["Fail", "Pass"]),
        ("memory", "Fail", {0: "Pass", 1: "Pass"}, ["Pass", "Pass"]),
        ("diagnostic", "Warn", {0: "Pass", 1: "Warn"}, ["Pass", "Fail"]),
        ("pcie", "Fail", {0: "Fail", 1: "Pass"}, ["Fail", "Pass"])]
    assert [(m.kind, m.gpu, m.text) for m in rep.tests[1].messages] == [
        ("Warning", None, "There was an internal error during the test: 'Couldn't find the memory test binary'")]
    assert [(m.kind, m.gpu) for m in rep.tests[3].messages] == [("Warning", 0), ("Info", 0)]  # no duplicate
    assert _found(_triage("dcgmi-diag-j-4x-warn-printed-as-fail.json")) == [
        ("dcgm.diag_warn", "warning", 0, 'gpu0 DCGM diag software (Deployment) Warn: Persistence mode for GPU 0 '
         'is disabled. Enable persistence mode by running "nvidia-smi -i <gpuId> -pm 1 " as root.'),
        ("dcgm.diag_fail", "critical", None, "node DCGM diag memory (Hardware) Fail: There was an internal error "
         "during the test: 'Couldn't find the memory test binary'"),
        ("dcgm.diag_warn", "warning", 1, "gpu1 DCGM diag diagnostic (Hardware) Warn: Detected clocks event due to "
         "thermal violation in GPU 1."),
        ("dcgm.diag_fail", "critical", 0, "gpu0 DCGM diag pcie (Integration) Fail: GPU 0's NvLink link 3 is "
         "currently down Run a field diagnostic on the GPU.")]


def test_json_runtime_error_iterations_and_foreign_json():
    doc = '{"DCGM Diagnostic": {"version": "4.2.3", "runtime_error": "Error: no GPUs in the group"}}'
    res = _triage("e.json", doc)
    assert _found(res) == [("dcgm.diag_unreadable", "warning", None, "e.json: dcgmi diag output unreadable: "
                            "dcgmi diag did not run: Error: no GPUs in the group")]
    it = ('{"iterations": [{"DCGM GPU Diagnostic": {"test_categories": [{"category": "Hardware", "tests": '
          '[{"name": "GPU Memory", "results": [{"gpu_id": "3", "status": "Fail", "warnings": [{"warning": '
          '"GPU 3 DBE"}]}]}]}]}, "version": "3.3.5"}], "Overall Result": "Fail", "warning": "Fail"}')
    assert [(f.code, f.gpu_index) for f in _triage("i.json", it).findings] == [("dcgm.diag_fail", 3)]
    with pytest.raises(DiagFormatError, match="not dcgmi diag -j output"):
        parse('{"iterations": [{"something": 1}]}')
    with pytest.raises(TriageError, match="x.json: no 'DCGM Diagnostic'"):
        _triage("x.json", '{"iterations": [{"something": 1}]}')


def test_hostile_tables():
    # an unknown result word: unreadable, never healthy
    res = _triage("u", _table(_row("PCIe", "Flaky - GPU: 0")))
    assert [f.code for f in res.findings] == ["dcgm.diag_unreadable"]
    assert res.problems == ["u: line 5: PCIe: result 'Flaky - GPU: 0' not understood"]
    # cut mid-row: the last row has no second cell, or half a word
    res = _triage("c", "\n".join([*HEAD, _row("Denylist", "Pass"), "| NVML Libr"]))
    assert [f.code for f in res.findings] == ["dcgm.diag_unreadable"]
    assert res.problems == ["c: line 6: not a table row: '| NVML Libr'",
                            "c: the table ends early (no closing +---+ rule): tests after the last row were not seen"]
    res = _triage("h", "\n".join(HEAD))  # the header only
    assert _found(res) == [("dcgm.diag_unreadable", "warning", None,
                            "h: dcgmi diag output unreadable: no dcgmi diag result row could be read")]
    res = _triage("p", _table(_row("Denylist", "Pa")))
    assert res.problems == ["p: line 5: Denylist: result 'Pa' not understood"]
    with pytest.raises(TriageError, match="empty"):
        _triage("e", "  \n")
    # a huge wrapped message, with spaces at the cuts, rejoins exactly and in linear time
    words = " ".join(f"link{i}  down" for i in range(3000))
    rep = parse_text(_table(_row("Memtest", "Fail - GPU: 1"), *_wrapped("Warning", "GPU 1 " + words)))
    assert rep.tests[0].messages[0].text == "GPU 1 " + words and rep.complete and rep.problems == []
    f = _triage("w", _table(_row("Memtest", "Fail - GPU: 1"), *_wrapped("Warning", "GPU 1 " + words))).findings[0]
    assert len(f.message) == 600 and f.evidence["messages"] == ["GPU 1 " + words]


def test_other_kinds_are_not_taken():
    for name in ("ibstat-hdr-port-down-rate-degraded.txt", "nvsmi-nvlink-s-a100-sxm4-80gb-12links.txt",
                 "nvsmi-topo-m-dgxa100-gpu3-nv8.txt", "nccl-allreduce-h100-a3mega-16rank-2.2x.txt",
                 "perfquery-saturated.txt", "nvsmi-q-h100x8-535.183.01-full.txt",
                 "nvsmi-default-v100-inforom-corrupt.txt", "dcgmi-nvlink-link-status-all-down-3.3.7.txt"):
        assert detect(_read(name)) not in ("dcgmi diag", "dcgmi diag -j", "dcgmi dmon"), name
    # dcgmi nvlink -e (error counters) is a +---+ table too, with no result word in it
    nvlink_e = ("+----------------------------------+------------------+\n| NVLINK Error Counts               "
                "                  |\n| GPU 0                            |                  |\n"
                "+==================================+==================+\n| Link 0                           | "
                "CRC FLIT Error => 0 |\n")
    assert detect(nvlink_e) is None


def test_dmon_last_xid_is_the_catalogs_xid_finding():
    reading = parse_dmon(_read("dcgmi-dmon-e230-xid-field.txt"))
    assert reading.columns == ["XIDER"] and reading.problems == []
    assert {k: v["XIDER"] for k, v in reading.values.items()} == {("GPU", i): ("120" if i == 1 else "0")
                                                                   for i in range(8)}
    res = _triage("dcgmi-dmon-e230-xid-field.txt")
    (f,) = res.findings
    assert (f.code, f.severity, f.gpu_index, f.evidence["catalog_action"], f.evidence["timestamp"]) == (
        "xid.120", "critical", 1, "drain", None)
    assert f.message == ("XID 120 GSP error on gpu1 (last XID DCGM saw, field 230; no timestamp: it may predate "
                         "the last GPU reset)")
    assert res.summary == ["dcgmi-dmon-e230-xid-field.txt: dcgmi dmon, 8 entity row(s), field(s) XIDER; "
                           "last XID: gpu1 120"]
    many = "#Entity   XIDER   GPUTL\nID\nGPU 0     0       12\nGPU 0     13      40\nGPU 1     N/A     0\nGPU 2  7\n"
    reading = parse_dmon(many)
    assert reading.values[("GPU", 0)] == {"XIDER": "13", "GPUTL": "40"}
    assert reading.problems == ["line 6: not a dmon row of 2 field(s): 'GPU 2  7'"]
    assert [(f.code, f.severity) for f in _triage("m", many).findings] == [("xid.13", "info")]


def test_cli_exit_codes():
    run = cli_runner().invoke
    r = run(main, ["check", "--from-file", str(DATA / "dcgmi-diag-r2-3.3.1-t4-fail-wrapped-fragment.txt")])
    assert r.exit_code == 2 and "decision: drain (gpuguard: dcgm.diag_fail gpu0 DCGM diag GPU Memory" in r.output
    r = run(main, ["check", "--from-file", str(DATA / "dcgmi-diag-r3-3.0.4-head-partial.txt")])
    assert r.exit_code == 1 and "dcgm.diag_unreadable" in r.output and "decision: proceed" in r.output
    r = run(main, ["check", "--from-file", str(DATA / "dcgmi-dmon-e230-xid-field.txt"), "--json"])
    assert r.exit_code == 2 and '"code": "xid.120"' in r.output
    r = run(main, ["check", "--from-file", str(DATA / "dcgmi-health-c-j-healthy.json")])
    assert r.exit_code == 3 and "dcgmi health output is not read" in r.stderr
    r = run(main, ["check", "--from-file", str(TRI / "dcgmi-diag-j-4x-warn-and-fail.json")])
    assert r.exit_code == 2 and "dcgm.diag_warn" in r.output


def test_text_around_the_table_iterations_and_dcgmi_errors():
    table = _table(_row("Denylist", "Pass"), _row("PCIe", "Fail - GPU: 1"))
    text = "$ dcgmi diag -r 2 -i 2\nRunning iteration 1 of 2...\n" + table + "\nRunning iteration 2 of 2...\n" \
        + table + "user@node01:~$ \n"
    rep = parse(text)
    assert rep.complete and rep.problems == [] and [t.name for t in rep.tests] == ["Denylist", "PCIe"] * 2
    assert [(f.code, f.gpu_index) for f in _triage("it", text).findings] == [("dcgm.diag_fail", 1)]
    err = "Error: Unable to complete diagnostic for group 2. Return: (-30) The NVVS returned an error.\n"
    assert detect(err) == "dcgmi diag"
    res = _triage("err", err)
    assert _found(res) == [("dcgm.diag_unreadable", "warning", None, "err: dcgmi diag output unreadable: line 1: "
                            "dcgmi: " + err.strip())]
    assert res.problems == ["err: line 1: dcgmi: " + err.strip(), "err: no dcgmi diag result row could be read"]


def test_metadata_only_and_a_paste_cut_inside_a_message():
    meta = _table("|-----  Metadata  ----------+------------------------------------------------|",
                  _row("DCGM Version", "3.3.7"))
    res = _triage("m", meta)
    assert res.problems == ["m: no dcgmi diag result row could be read"]
    assert [f.code for f in res.findings] == ["dcgm.diag_unreadable"]
    msg = "GPU 0 Error using CUDA API cuCtxCreate Check DCGM and system logs for errors. Reset GPU. R"
    rep = parse("\n".join([*HEAD, _row("GPU Memory", "Fail - GPU: 0"), *_wrapped("Warning", msg)]))
    (m,) = rep.tests[0].messages
    assert (m.text, m.truncated) == (msg, True)
    f = _triage("c", "\n".join([*HEAD, _row("GPU Memory", "Fail - GPU: 0"), *_wrapped("Warning", msg)])).findings[0]
    assert f.message == f"gpu0 DCGM diag GPU Memory Fail: {msg} [paste ends here]"


def test_a_fragment_of_messages_only_is_read_as_dcgmi_diag():
    text = "\n".join(_wrapped("Info", "GPU 1 GPU to Host bandwidth:  12.33 GB/s, GPU 1 Host to GPU bandwidth")) + "\n"
    assert detect(text) == "dcgmi diag"
    res = _triage("f", text)
    assert [f.code for f in res.findings] == ["dcgm.diag_unreadable"]
    assert res.problems == ["f: no dcgmi diag result row could be read"]


def test_json_pasted_with_its_command_line():
    text = "$ dcgmi diag -r 2 -j\n" + _read("dcgmi-diag-j-4x-warn-and-fail.json") + "$ \n"
    assert detect(text) == "dcgmi diag -j"
    assert [(f.code, f.gpu_index) for f in _triage("p", text).findings] == [("dcgm.diag_warn", 1),
                                                                          ("dcgm.diag_fail", 0)]
    with pytest.raises(TriageError, match=r"b.json: not valid JSON"):
        _triage("b.json", '{"DCGM Diagnostic": {"test_categories": [')


def test_cli_rows_not_read_and_nothing_worse_could_not_check_3(tmp_path):
    """A saved output whose rows could not be read (a NUL or damaged byte before a dmon row,
    an overlong line) may have held the fault: with nothing worse found `check --from-file`
    exits 3 (could not check), never 0. Before, it printed the unreadable rows and
    ``decision: proceed`` with exit 0 although GPU 1's row said XID 120."""
    text = (DATA / "dcgmi-dmon-e230-xid-field.txt").read_text()
    p = tmp_path / "dmon.txt"
    p.write_text(text.replace("GPU 1 ", "\0GPU 1 "))
    r = cli_runner().invoke(main, ["check", "--from-file", str(p)])
    assert r.exit_code == 3
    assert f"unreadable: {p}: line 4: not a dmon row of 1 field(s): '\\x00GPU 1      120'" in r.output
    assert "decision: proceed" in r.output
