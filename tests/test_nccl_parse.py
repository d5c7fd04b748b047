"""nccl-tests output parser: every corpus layout to exact figures, and messy pastes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuguard.net.nccl_parse import parse

DATA = Path(__file__).parent / "data"


def _read(name: str) -> str:
    return (DATA / name).read_text()


def test_modern_table_a3mega_16_ranks():
    log = parse(_read("nccl-allreduce-h100-a3mega-16rank-2.2x.txt"))
    assert log.readable and not log.has_errors and not log.incomplete
    (t,) = log.tables
    assert (t.ngpus, t.min_bytes, t.max_bytes) == (1, 8, 8589934592)
    assert len(t.devices) == 16
    assert t.devices[8] == (8, "a3mega-node-2", 0, "0000:04:00", "NVIDIA H100 80GB HBM3")
    assert t.avg_busbw_gbs == 70.742 and t.out_of_bounds == 0
    assert len(t.rows) == 31
    first, last = t.rows[0], t.rows[-1]
    assert (first.size_b, first.count, first.dtype, first.redop, first.root) == (8, 2, "float", "sum", -1)
    assert (first.out_of_place.time_us, first.in_place.time_us) == (135.8, 123.5)
    assert last.size_b == 8589934592
    assert (last.out_of_place.time_us, last.out_of_place.algbw_gbs, last.out_of_place.busbw_gbs,
            last.out_of_place.wrong) == (47535.0, 180.71, 338.82, 0)
    assert (last.in_place.algbw_gbs, last.in_place.busbw_gbs) == (179.92, 337.35)
    assert last.busbw_gbs == pytest.approx((338.82 + 337.35) / 2)
    assert [r.size_b for r in t.rows] == [8 * 2**i for i in range(31)]
    assert log.gpu_models() == ["NVIDIA H100 80GB HBM3"]


def test_wrong_nonzero_with_elision():
    log = parse(_read("nccl-allreduce-2.18.3-dgxh100-wrong-nonzero.txt"))
    assert log.readable and log.has_errors
    assert log.elided_lines == 1
    assert [r.size_b for r in log.rows] == [8, 262144, 524288]
    bad = log.rows[-1]
    assert (bad.out_of_place.wrong, bad.in_place.wrong) == (237858, 238038)
    assert (bad.out_of_place.busbw_gbs, bad.in_place.busbw_gbs) == (0.79, 0.92)
    assert log.wrong_total == 237858 + 238038
    assert log.tables[0].avg_busbw_gbs is None  # the paste ends before the footer


def test_header_fragment_ring_ib():
    log = parse(_read("nccl-allreduce-ring-ib-fragment-header.txt"))
    assert log.readable and not log.has_errors
    assert [r.size_b for r in log.rows] == [536870912, 1073741824, 2147483648, 4294967296, 8589934592]
    assert [(r.out_of_place.busbw_gbs, r.in_place.busbw_gbs) for r in log.rows] == [
        (93.46, 97.09), (93.58, 97.54), (94.26, 95.49), (97.37, 94.32), (95.10, 94.80)]
    assert log.rows[0].in_place.time_us == 9676.9
    assert log.tables[0].avg_busbw_gbs == 95.3009


def test_legacy_error_column_no_redop():
    log = parse(_read("nccl-legacy-error-column-2.6.4-partial.txt"))
    assert log.readable and not log.has_errors
    first_table, broadcast = log.tables
    assert len(first_table.rows) == 12 and first_table.avg_busbw_gbs == 6.6972
    r = first_table.rows[0]
    assert (r.size_b, r.count, r.dtype, r.redop, r.root) == (65536, 8192, "float", None, None)
    assert (r.out_of_place.time_us, r.out_of_place.busbw_gbs, r.out_of_place.wrong,
            r.out_of_place.max_error) == (16.57, 1.98, None, 0.0)
    assert first_table.rows[-1].in_place.busbw_gbs == 21.86
    # the next test's header follows, then the paste ends: incomplete, not healthy
    assert (broadcast.test, broadcast.ngpus, broadcast.rows) == ("broadcast_perf", 2, [])
    assert log.incomplete == ["broadcast_perf: no results (output ends early)"]


def test_legacy_error_column_with_root():
    log = parse(_read("nccl-legacy-error-column-2.6.4-root-partial.txt"))
    assert log.readable
    assert len(log.rows) == 12
    r = log.rows[-1]
    assert (r.size_b, r.redop, r.root, r.out_of_place.busbw_gbs, r.in_place.max_error) == (524288, "sum", 0, 12.81, 0.0)


def test_header_only_2_10_is_not_healthy():
    log = parse(_read("nccl-header-2.10-era-no-group-error-col.txt"))
    assert not log.readable
    (t,) = log.tables
    assert t.columns[:5] == ["size", "count", "type", "redop", "time"]
    assert len(t.devices) == 4 and t.devices[0] == (0, "gpu9", 0, "0x3d", "NVIDIA GeForce RTX 2080 Ti")
    assert log.incomplete == ["test: no results (output ends early)"]


def test_collective_test_starting_with_info_lines():
    log = parse(_read("nccl-header-collective-test-starting-2.19.3.txt"))
    assert not log.readable and log.nccl_version == "2.19.3+cuda12.2"
    (t,) = log.tables
    assert (t.test, t.ngpus, t.min_bytes, t.max_bytes, len(t.devices)) == ("all_reduce_perf", 4, 1024, 2147483648, 4)
    assert log.problems == [] and log.incomplete == ["all_reduce_perf: no results (output ends early)"]


def test_ib_completion_error():
    log = parse(_read("nccl-ib-completion-error-vendor-err-2024.txt"))
    assert log.has_errors and not log.readable
    assert log.ib_errors == [{"peer": "10.0.0.1<49189>", "wc_status": 4, "wc_status_name": "IBV_WC_LOC_PROT_ERR",
                              "opcode": 5327, "vendor_err": 81, "direction": "Send"}]
    assert len(log.warnings) == 1


def test_unhandled_system_error_and_mpi_abort():
    log = parse(_read("nccl-tests-failure-unhandled-system-error-2020.txt"))
    assert log.failures == ["pkb-00000000-1: NCCL failure common.cu:345 'unhandled system error'",
                            "pkb-00000000-0: NCCL failure common.cu:345 'unhandled system error'",
                            "mpirun: a rank exited with a non-zero status or was killed"]
    assert log.has_errors and not log.rows


def test_warn_with_timestamp_prefix():
    log = parse(_read("nccl-warn-nvls-bind-timestamped-2026.txt"))
    assert log.warnings == ["Failed to bind NVLink SHARP (NVLS) Multicast memory of size 2097152 : CUDA error 401 "
                            "'the operation cannot be performed in the present state'."]


# --- messy variants of real output ---------------------------------------------------

def _a3() -> str:
    return _read("nccl-allreduce-h100-a3mega-16rank-2.2x.txt")


@pytest.mark.parametrize("prefix", ["[0] ", "[0]", "[1,0]<stdout>:", "0: ", "[2026-06-23 15:45:07] "])
def test_rank_labels_and_stamps_are_removed(prefix):
    text = "\n".join(prefix + ln for ln in _a3().splitlines())
    log = parse(text)
    assert log.readable and len(log.rows) == 31
    assert log.rows[-1].out_of_place.busbw_gbs == 338.82 and log.tables[0].avg_busbw_gbs == 70.742


def test_indentation_lost_and_mpi_banner_inside_device_list():
    lines = [ln.strip() for ln in _a3().splitlines()]
    lines.insert(5, "--------------------------------------------------------------------------")
    lines.insert(6, "WARNING: There was an error initializing an OpenFabrics device.")
    log = parse("\n".join(lines))
    assert log.readable and len(log.rows) == 31 and len(log.tables[0].devices) == 16


def test_cut_row_is_a_problem_not_a_healthy_row():
    lines = _a3().splitlines()
    cut = [*lines[:30], lines[30][:60]]
    log = parse("\n".join(cut))
    assert not log.readable
    assert log.problems[0][0] == 31 and "result row not understood" in log.problems[0][1]


def test_nan_busbw_is_a_problem():
    text = _a3().replace("  338.82  ", "    -nan  ")
    log = parse(text)
    assert not log.readable and len(log.rows) == 30


def test_size_zero_rows_and_na_wrong_and_exponent_time():
    hdr = "\n".join(_a3().splitlines()[20:23])
    rows = ("           0             0     float     sum      -1     0.10    0.00    0.00    N/A     0.09    0.00    0.00    N/A\n"
            "  8589934592    2147483648     float     sum      -1  1.2e+05   71.58  134.21    N/A  1.3e+05   66.07  123.88    N/A\n")
    log = parse(hdr + "\n" + rows)
    assert log.readable
    z, big = log.rows
    assert (z.size_b, z.busbw_gbs, z.out_of_place.wrong) == (0, 0.0, None)
    assert (big.out_of_place.time_us, big.in_place.busbw_gbs) == (120000.0, 123.88)


def test_in_place_only_row_and_timestamp_column():
    hdr = ("#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong  timestamp\n")
    rows = ("     1048576        262144     float     sum      -1    203.2    5.16    9.68      0    207.2    5.06    9.49      0 2026-11-30 18:00:01\n"
            "     2097152        524288     float     sum      -1                                    252.9    8.29   15.55      0\n")
    log = parse(hdr + rows)
    assert log.readable
    a, b = log.rows
    assert (a.out_of_place.busbw_gbs, a.in_place.busbw_gbs) == (9.68, 9.49)
    assert b.out_of_place is None and b.in_place.busbw_gbs == 15.55 and b.busbw_gbs == 15.55


def test_out_of_bounds_failed_counts_as_error():
    text = _a3().replace("# Out of bounds values : 0 OK", "# Out of bounds values : 12 FAILED")
    log = parse(text)
    assert log.readable and log.has_errors and log.out_of_bounds_total == 12


@pytest.mark.parametrize("text", ["", "\n\n", "garbage line\nanother one\n", "# nThread 1 nGpus 8 minBytes 8 maxBytes 8\n"])
def test_nothing_useful_is_never_readable(text):
    assert not parse(text).readable


def test_per_iteration_and_cputime_headers():
    hdr = ("#       size         count      type   redop    root  cputime   algbw   busbw  #wrong    i_min    i_max"
           "    i_p99    i_cv%  cputime   algbw   busbw  #wrong    i_min    i_max    i_p99    i_cv%\n")
    row = ("   134217728      33554432     float     sum      -1   1652.2   81.24  152.32       0   1601.0   1710.3"
           "   1705.9     1.42   1636.7   82.01  153.76       0   1600.2   1690.1   1688.0     1.21\n")
    log = parse(hdr + row)
    assert log.readable
    (r,) = log.rows
    assert (r.out_of_place.time_us, r.out_of_place.busbw_gbs, r.in_place.algbw_gbs, r.wrong) == (1652.2, 152.32, 82.01, 0)


def test_wrong_printed_in_exponent_form_is_a_count():
    text = _a3().replace("  338.82      0    47743", "  338.82  1.23457e+06    47743")
    log = parse(text)
    assert log.readable and log.rows[-1].out_of_place.wrong == 1234570 and log.has_errors


# NET/IB completion errors in every layout NCCL printed (transport/net_ib WARN format).
@pytest.mark.parametrize("name, expected", [
    # NCCL 2.21+: "with status=12 opcode=0 len=0 vendor err 129 (Recv)" (NVIDIA/nccl#1405)
    ("nccl-ib-completion-status-eq-2.2x.txt", [
        {"peer": "10.0.210.236<54862>", "wc_status": 12, "wc_status_name": "IBV_WC_RETRY_EXC_ERR",
         "opcode": 0, "vendor_err": 129, "direction": "Recv"},
        {"peer": "10.0.210.236<54862>", "wc_status": 12, "wc_status_name": "IBV_WC_RETRY_EXC_ERR",
         "opcode": 32616, "vendor_err": 129, "direction": "Recv"}]),
    # the same on RoCE (localGid/remoteGids trail the message; NVIDIA/nccl#1814)
    ("nccl-ib-completion-status-eq-roce-2.2x.txt", [
        {"peer": "172.36.143.59<44206>", "wc_status": 12, "wc_status_name": "IBV_WC_RETRY_EXC_ERR",
         "opcode": 129, "vendor_err": 129, "direction": "Recv"},
        {"peer": "172.36.143.59<44206>", "wc_status": 5, "wc_status_name": "IBV_WC_WR_FLUSH_ERR",
         "opcode": 32656, "vendor_err": 249, "direction": "Recv"}]),
    # NCCL <= 2.11: no peer, no direction (NVIDIA/nccl#426, NCCL 2.8.3)
    ("nccl-ib-completion-no-peer-2.8.3-title.txt", [
        {"peer": None, "wc_status": 12, "wc_status_name": "IBV_WC_RETRY_EXC_ERR",
         "opcode": 0, "vendor_err": 129, "direction": None}]),
])
def test_ib_completion_error_every_nccl_layout(name, expected):
    log = parse(_read(name))
    assert log.ib_errors == expected
    assert log.has_errors and len(log.warnings) == len(expected)


def test_ib_completion_error_nccl_2_28_named_status():
    # NCCL 2.28+ printf (src/transport/net_ib/p2p.cc ncclIbLogCompletionWithError): names and codes
    line = ("node-1:1:2 [0] NCCL WARN NET/IB: Got completion from peer 10.0.0.2<41234> with "
            "status=IBV_WC_RETRY_EXC_ERR(12) opcode=IBV_WC_RECV(128) vendor_err=129  hca mlx5_3")
    assert parse(line).ib_errors == [{"peer": "10.0.0.2<41234>", "wc_status": 12,
                                      "wc_status_name": "IBV_WC_RETRY_EXC_ERR", "opcode": 128,
                                      "vendor_err": 129, "direction": None}]


_TABLE_2_18 = """\
# nccl-tests version 2.18.3 nccl-headers=23003 nccl-library=23003
# Collective test starting: all_reduce_perf
# nThread 1 nGpus 1 minBytes 1024 maxBytes 2048 step: 2(factor) warmup iters: 1 iters: 20 agg iters: 1 validation: 1 graph: 0 unalign: 0
#
#       size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw   busbw  #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)             (us)  (GB/s)  (GB/s)
        1024           256     float     sum      -1    38.67    0.03    0.05       0    32.09    0.03    0.06       0
        2048           512     float     sum      -1    35.10    0.06    0.10       0    32.68    0.06    0.11       0
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 0.08
#
# Collective test concluded: all_reduce_perf
"""


def test_last_error_line_of_nccl_tests_2_17_is_a_warning():
    # nccl-tests 2.17+ writeErrors(): "# error: <ncclGetLastError()>" closes the output; with
    # NCCL_DEBUG unset it is the only trace of the WARN
    err = ("NET/IB : Got completion from peer 10.0.0.2<41234> with status=12 opcode=0 len=0 "
           "vendor err 129 (Recv) localGid ::ffff:10.0.0.1 remoteGids::ffff:10.0.0.2")
    log = parse(_TABLE_2_18 + f"# error: {err}\n#\n")
    assert log.readable and len(log.rows) == 2
    assert log.warnings == [err]
    assert [(e["wc_status"], e["vendor_err"], e["direction"]) for e in log.ib_errors] == [(12, 129, "Recv")]
    clean = parse(_TABLE_2_18 + "\n#\n")  # no error recorded: writeErrors prints an empty line
    assert clean.warnings == [] and not clean.has_errors


def test_bare_last_error_of_nccl_tests_2_13_to_2_16_is_read():
    # 2.13-2.16 print ncclGetLastError() bare after the footer (common.cu: PRINT("%s\n", ...))
    err = "NET/IB : Got completion from peer 10.0.0.2<41234> with error 12, opcode 0, len 0, vendor err 129 (Recv)"
    log = parse(_TABLE_2_18 + err + "\n")
    assert log.readable and log.warnings == [err]
    assert [(e["peer"], e["wc_status"]) for e in log.ib_errors] == [("10.0.0.2<41234>", 12)]


def test_readable_run_with_ib_completion_error_gets_a_finding():
    from gpuguard.net.nccl_check import errors_finding

    err = "NET/IB : Got completion with error 12, opcode 0, len 0, vendor err 129"
    f = errors_finding(parse(_TABLE_2_18 + f"# error: {err}\n"), what="saved log")
    assert (f.code, f.severity) == ("nccl.failure", "warning")
    assert f.message == "saved log: IB completion error IBV_WC_RETRY_EXC_ERR (vendor err 129)"


def test_srun_label_padded_for_16_tasks_and_validation_off():
    # srun --label pads the task id to the width of the largest (" 0: " with 16 tasks);
    # -c 0 prints N/A in #wrong (NVIDIA/nccl-tests#290, two H100 nodes)
    log = parse(_read("nccl-allreduce-srun-label-padded-2node-h100.txt"))
    assert log.readable and not log.has_errors and log.problems == [] and log.incomplete == []
    (t,) = log.tables
    assert (t.ngpus, t.min_bytes, t.max_bytes, t.avg_busbw_gbs, t.out_of_bounds) == (1, 8388608, 8589934592, 142.735, 0)
    assert len(t.devices) == 16 and t.devices[10] == (10, "node007", 2, "0x97", "NVIDIA H100 80GB HBM3")
    assert [r.size_b for r in t.rows] == [8388608 << i for i in range(11)]
    last = t.rows[-1]
    assert (last.out_of_place.time_us, last.out_of_place.busbw_gbs, last.out_of_place.wrong) == (103530.0, 155.57, None)
    assert (last.in_place.algbw_gbs, last.in_place.busbw_gbs) == (82.96, 155.56)


def test_nccl_failure_quoting_the_last_ib_warn_is_a_failure_and_an_ib_error():
    # nccl-tests 2.13+ NCCLCHECK: "%s: Test NCCL failure %s:%d '%s / %s'" (error string / ncclGetLastError)
    line = ("node-1: Test NCCL failure common.cu:1005 'remote process exited or there was a network error / "
            "NET/IB : Got completion from peer 10.0.0.2<41234> with status=12 opcode=0 len=0 vendor err 129 (Recv)'")
    log = parse(line + "\n .. node-1 pid 4242: Test failure common.cu:1054\n")
    assert log.failures == ["node-1: NCCL failure common.cu:1005 'remote process exited or there was a network "
                            "error / NET/IB : Got completion from peer 10.0.0.2<41234> with status=12 opcode=0 "
                            "len=0 vendor err 129 (Recv)'"]
    assert [(e["wc_status"], e["vendor_err"], e["direction"]) for e in log.ib_errors] == [(12, 129, "Recv")]
    assert log.warnings == []


def _json_report(**over):
    # the key order and shapes of nccl-tests 2.17+ -J output (src/util.cu jsonOutputInit,
    # writeResultHeader, writeBenchmarkLine*, writeResultFooter, writeErrors)
    doc = {"version": 1, "start_time": "2026-01-05 10:00:00", "args": ["./build/all_reduce_perf", "-b", "1G", "-J",
                                                                       "r.json"],
           "env": ["NCCL_DEBUG=WARN"], "nccl_version": 22703,
           "config": {"nthreads": 1, "ngpus": 1, "minimum_bytes": 1073741824, "maximum_bytes": 2147483648},
           "devices": [{"rank": 0, "group": 0, "pid": 4242, "hostname": "node005", "device": 0,
                        "device_hex": "0000:18:00", "device_info": "NVIDIA H100 80GB HBM3"}],
           "results": [
               {"size": 1073741824, "count": 268435456, "type": "float", "redop": "sum", "root": "    -1",
                "out_of_place": {"time": 4038.8, "alg_bw": 265.85, "bus_bw": 465.25, "nwrong": 0.0},
                "in_place": {"time": 4043.6, "alg_bw": 265.54, "bus_bw": 464.7, "nwrong": 0.0},
                "actual_iterations": 20, "experiment_name": "all_reduce_perf"},
               {"size": 2147483648, "count": 536870912, "type": "float", "redop": "sum", "root": "    -1",
                "out_of_place": {"time": 8020.3, "alg_bw": 267.76, "bus_bw": 468.57, "nwrong": 3.0},
                "in_place": {"time": 8002.1, "alg_bw": 268.36, "bus_bw": 469.64, "nwrong": None},
                "actual_iterations": 20, "experiment_name": "all_reduce_perf"}],
           "out_of_bounds": {"count": 3, "okay": False},
           "average_bus_bandwidth": {"bandwidth": 466.54, "okay": "unchecked"},
           "errors": [], "end_time": "2026-01-05 10:00:09"}
    doc.update(over)
    return json.dumps(doc, indent=1)


def test_json_report_of_nccl_tests_2_17():
    log = parse(_json_report())
    assert log.readable and log.has_errors and log.nccl_version == "2.27.3"
    (t,) = log.tables
    assert (t.test, t.ngpus, t.min_bytes, t.max_bytes, t.out_of_bounds, t.avg_busbw_gbs) == (
        "all_reduce_perf", 1, 1073741824, 2147483648, 3, 466.54)
    assert t.devices == [(0, "node005", 0, "0000:18:00", "NVIDIA H100 80GB HBM3")]
    a, b = t.rows
    assert (a.size_b, a.count, a.dtype, a.redop, a.root, a.out_of_place.busbw_gbs, a.in_place.time_us) == (
        1073741824, 268435456, "float", "sum", -1, 465.25, 4043.6)
    assert (b.out_of_place.wrong, b.in_place.wrong, log.wrong_total) == (3, None, 3)


def test_json_report_errors_are_nccls_last_warn():
    err = "NET/IB : Got completion from peer 10.0.0.2<41234> with status=12 opcode=0 len=0 vendor err 129 (Recv)"
    log = parse(_json_report(errors=[err], results=[]))
    assert log.warnings == [err] and [e["wc_status"] for e in log.ib_errors] == [12]
    assert not log.readable and log.incomplete == ["all_reduce_perf: no results (output ends early)"]
    bad = parse(_json_report(results=[{"size": 8, "count": 2, "type": "float", "redop": "sum", "root": "-1",
                                       "out_of_place": {"time": "nan", "alg_bw": 0, "bus_bw": 0, "nwrong": 0},
                                       "in_place": None}]))
    assert bad.problems == [(1, "results[0] not understood: non-finite value 'nan'")] and not bad.readable


def test_json_report_is_triaged_as_nccl_tests():
    from gpuguard import config as config_mod
    from gpuguard.net.triage import detect, triage

    text = _json_report()
    assert detect(text) == "nccl-tests"
    res = triage([("r.json", text)], config_mod.from_dict({}))
    assert [(f.code, f.message) for f in res.findings] == [("nccl.errors", "r.json: #wrong 3; 3 out-of-bounds values")]


def test_nccl_tests_1x_layout():
    # nccl-tests 1.0.0 (src/common.cu, all_reduce.cu printf): "nThread" and the footer without
    # '#', devices without Pid, columns bytes/N/op/res, time in ms
    text = ("nThread 1 nGpus 2 minBytes 8 maxBytes 16 step: 2(factor) warmup iters: 5 iters: 20 validation: 1 \n"
            "# Using devices\n"
            "#   Rank  0 on       ncrh device  0 [0x05] GeForce RTX 2080 Ti\n"
            "#   Rank  1 on       ncrh device  1 [0x06] GeForce RTX 2080 Ti\n\n"
            "#                                                 out-of-place                    in-place\n"
            "#      bytes             N    type      op     time  algbw  busbw      res     time  algbw  busbw      res\n"
            "           8             2   float     sum    0.010   0.00   0.00    0e+00    0.009   0.00   0.00    0e+00\n"
            "          16             4   float     sum    0.011   0.00   0.00    2e+00    0.009   0.00   0.00    0e+00\n"
            " Out of bounds values : 1 FAILED\n Avg bus bandwidth    : 0.00123 \n\n")
    log = parse(text)
    assert log.readable and log.problems == []
    (t,) = log.tables
    assert (t.ngpus, t.min_bytes, t.max_bytes, t.out_of_bounds, t.avg_busbw_gbs) == (2, 8, 16, 1, 0.00123)
    assert t.devices == [(0, "ncrh", 0, "0x05", "GeForce RTX 2080 Ti"), (1, "ncrh", 1, "0x06", "GeForce RTX 2080 Ti")]
    a, b = t.rows
    assert (a.size_b, a.count, a.dtype, a.redop, a.root, a.out_of_place.time_us, a.in_place.time_us) == (
        8, 2, "float", "sum", None, 10.0, 9.0)
    assert (b.out_of_place.max_error, b.out_of_place.wrong) == (2.0, None)
    assert log.has_errors and log.out_of_bounds_total == 1


def test_json_report_of_nccl_tests_2_17_3_to_2_17_8_misspelled_footer():
    # nccl-tests v2.17.3-v2.17.8 src/util.cu writeResultFooter wrote
    # jsonKey("average_bus_bandwidith") / jsonKey("bandwidith") (fixed by commit 85ca91d, v2.17.9)
    doc = json.loads(_json_report(version=1))
    doc["average_bus_bandwidith"] = {"bandwidith": 466.54, "okay": "unchecked"}
    del doc["average_bus_bandwidth"]
    log = parse(json.dumps(doc))
    (t,) = log.tables
    assert (t.avg_busbw_gbs, t.out_of_bounds, len(t.rows)) == (466.54, 3, 2)


def test_nccl_tests_2_19_6_two_node_gb10_table_and_library_version():
    # real 2.19.6 output: "# nccl-tests version ... nccl-library=22809" is the only NCCL version
    # printed with NCCL_DEBUG unset; host names right-aligned by "%10s" ("on  spark-101")
    log = parse((DATA / "nccl-allgather-2.19.6-gb10-roce-2node.txt").read_text())
    assert (log.readable, log.has_errors, log.nccl_version, log.problems, log.incomplete) == (True, False, "2.28.9", [], [])
    (t,) = log.tables
    assert (t.test, t.ngpus, t.min_bytes, t.max_bytes, t.out_of_bounds, t.avg_busbw_gbs) == (
        "all_gather_perf", 1, 536870912, 17179869184, 0, 22.1205)
    assert t.devices == [(0, "spark-101", 0, "000f:01:00", "NVIDIA GB10"), (1, "spark-102", 0, "000f:01:00", "NVIDIA GB10")]
    last = t.rows[-1]
    assert (last.size_b, last.count, last.dtype, last.redop, last.root) == (17179869184, 2147483648, "float", "none", -1)
    assert (last.out_of_place.time_us, last.out_of_place.busbw_gbs, last.in_place.time_us, last.in_place.busbw_gbs) == (
        361820.0, 23.74, 354934.0, 24.2)
    assert [r.wrong for r in t.rows] == [0] * 6
