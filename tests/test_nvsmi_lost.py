"""Dead GPUs in nvidia-smi dumps, the GPU recovery action, pending page retirement, and
`check --kernel-log` on a `kernel:`-only file: the measured failures of issue class 7/1."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from conftest import DATA

from gpuguard.cli import main
from gpuguard.gpu.nvsmi import load_nvidia_smi, parse_nvidia_smi
from gpuguard.gpu.nvsmi_common import NvsmiParseError


def invoke(*args):
    return CliRunner().invoke(main, ["--config", "/dev/null", *args])


def check_json(path, *extra):
    r = invoke("check", "--json", "--from-nvidia-smi", str(path), *extra)
    return r.exit_code, json.loads(r.output)


def test_handle_error_line_alone_is_a_lost_gpu_not_bad_input():
    rc, doc = check_json(DATA / "nvsmi-a-device-handle-unknown-error.txt")
    assert rc == 2
    assert doc["outcome"] == "drain"
    [f] = doc["findings"]
    assert (f["code"], f["severity"], f["action"], f["gpu_index"]) == ("gpu.lost", "critical", "drain", 0)
    assert f["message"] == "gpu0 (0000:09:00.0) lost or hung: device_handle=Unknown"
    assert doc["reason"] == "gpuguard: gpu.lost gpu0 (0000:09:00.0) lost or hung: device_handle=Unknown"


def test_eight_gpu_dump_with_one_handle_error_is_seven_read_and_one_lost():
    snap = load_nvidia_smi(DATA / "nvsmi-q-h100x8-one-gpu-handle-error.txt")
    assert [(g.index, g.pci_bus_id, bool(g.read_errors)) for g in snap.gpus] == [
        (0, "0000:53:00.0", False), (1, "0000:64:00.0", True), (2, "0000:75:00.0", False),
        (3, "0000:86:00.0", False), (4, "0000:97:00.0", False), (5, "0000:a8:00.0", False),
        (6, "0000:b9:00.0", False), (7, "0000:ca:00.0", False)]
    assert snap.gpus[1].read_errors == {"device_handle": "Unknown"}
    assert snap.gpus[2].name == "NVIDIA H100 80GB HBM3"
    rc, doc = check_json(DATA / "nvsmi-q-h100x8-one-gpu-handle-error.txt")  # no [node] gpu_count
    assert rc == 2 and doc["outcome"] == "drain"
    lost = [(f["code"], f["gpu_index"]) for f in doc["findings"] if f["code"] == "gpu.lost"]
    assert lost == [("gpu.lost", 1)]


def test_fewer_sections_than_attached_gpus_is_not_a_fault():
    # `nvidia-smi -q -i 0` on an 8-GPU node: one section under "Attached GPUs : 8"
    text = (DATA / "nvsmi-q-a100-525.60.13-single-gpu-with-process.txt").read_text()
    assert "Attached GPUs                             : 8" in text
    rc, doc = check_json(DATA / "nvsmi-q-a100-525.60.13-single-gpu-with-process.txt")
    assert (rc, doc["outcome"], doc["gpus"], doc["findings"]) == (0, "proceed", 1, [])


@pytest.mark.parametrize("err,name", [("Unknown Error", "Unknown"), ("GPU is lost", "GpuIsLost"),
                                      ("Some New Error", "Unknown")])
def test_handle_error_variants_and_xml(err, name):
    xml = ('<?xml version="1.0" ?>\n<nvidia_smi_log><driver_version>550.54</driver_version>'
           '<attached_gpus>2</attached_gpus>\n<gpu id="00000000:07:00.0"><product_name>A100</product_name>'
           '<pci><pci_bus_id>00000000:07:00.0</pci_bus_id></pci></gpu>\n'
           f'Unable to determine the device handle for GPU 00000000:0F:00.0: {err}\n</nvidia_smi_log>\n')
    snap = parse_nvidia_smi(xml)
    assert [(g.index, g.pci_bus_id, g.read_errors) for g in snap.gpus] == [
        (0, "0000:07:00.0", {}), (1, "0000:0f:00.0", {"device_handle": name})]


def test_recovery_action_csv_reset_is_a_drain_finding():
    rc, doc = check_json(DATA / "nvsmi-query-gpu-recovery-action-reset.csv")
    assert (rc, doc["outcome"], doc["gpus"]) == (2, "drain", 8)
    assert [(f["code"], f["gpu_index"], f["action"]) for f in doc["findings"]] == [
        ("gpu.recovery_action.gpu_reset", 1, "drain")]
    assert doc["findings"][0]["message"] == "gpu1 driver requests recovery action 0x1 GPU Reset"


@pytest.mark.parametrize("value,code,action", [
    ("None", None, None), ("GPU Reset", "gpu.recovery_action.gpu_reset", "drain"),
    ("OS Reboot", "gpu.recovery_action.node_reboot", "drain"), ("0x2 (Whatever)", "gpu.recovery_action.node_reboot", "drain"),
    ("Drain P2P", "gpu.recovery_action.drain_p2p", "alert"), ("Drain and Reset", "gpu.recovery_action.drain_and_reset", "drain"),
])
def test_recovery_action_field_of_q_text(tmp_path, value, code, action):
    text = (DATA / "nvsmi-q-a100-525.60.13-single-gpu-with-process.txt").read_text()
    text = text.replace("    Product Name", f"    GPU Recovery Action                   : {value}\n    Product Name", 1)
    p = tmp_path / "q.txt"
    p.write_text(text)
    _rc, doc = check_json(p)
    assert [(f["code"], f["action"]) for f in doc["findings"]] == ([(code, action)] if code else [])


def test_recovery_action_field_of_xml():
    xml = ('<?xml version="1.0" ?>\n<nvidia_smi_log><gpu id="00000000:07:00.0">'
           '<gpu_recovery_action>Drain and Reset</gpu_recovery_action></gpu></nvidia_smi_log>\n')
    assert parse_nvidia_smi(xml).gpus[0].recovery_action == 4


@pytest.mark.parametrize("blacklist,retirement,expected", [
    ("No", "Yes", True), ("Yes", "No", True), ("No", "No", False), ("N/A", "N/A", None), ("N/A", "Yes", True)])
def test_pending_blacklist_or_retirement(blacklist, retirement, expected):
    xml = ('<?xml version="1.0" ?>\n<nvidia_smi_log><gpu id="00000000:07:00.0"><retired_pages>'
           f'<pending_blacklist>{blacklist}</pending_blacklist><pending_retirement>{retirement}</pending_retirement>'
           '</retired_pages></gpu></nvidia_smi_log>\n')
    assert parse_nvidia_smi(xml).gpus[0].retired_pages_pending is expected
    text = ("GPU 00000000:07:00.0\n    Product Name : A100\n    Retired Pages\n"
            f"        Pending Page Blacklist : {blacklist}\n        Pending Page Retirement : {retirement}\n")
    assert parse_nvidia_smi(text).gpus[0].retired_pages_pending is expected


def test_other_csv_is_still_refused():
    with pytest.raises(NvsmiParseError, match="comma-separated output"):
        parse_nvidia_smi("index, name\n0, A100\n")
    with pytest.raises(NvsmiParseError, match="unknown GPU recovery action 'Explode'"):
        parse_nvidia_smi("index, gpu_recovery_action\n0, Explode\n")


def test_check_kernel_log_with_kernel_prefix_only_xid79_drains(tmp_path):
    log = tmp_path / "pasted.log"
    log.write_text("kernel: NVRM: Xid (PCI:0000:dc:00): 79, pid=1818990, name=python3, GPU has fallen off the bus.\n")
    r = invoke("check", "--json", "--from-nvidia-smi", str(DATA / "nvsmi-q-a100-525.60.13-single-gpu-with-process.txt"),
               "--kernel-log", str(log))
    doc = json.loads(r.output)
    assert (r.exit_code, doc["outcome"]) == (2, "drain")
    assert [(f["code"], f["action"]) for f in doc["findings"]] == [("xid.79", "drain")]


def test_nvml_recovery_action_field_read_and_judged():
    from fake_pynvml import FakeNvml, h100_gpu

    from gpuguard.checks import CheckContext, run_checks
    from gpuguard.gpu.nvml import NvmlSource

    devs = [h100_gpu(i) for i in range(3)]
    devs[1]["recovery_action"] = 2  # NVML_GPU_RECOVERY_ACTION_NODE_REBOOT
    devs[2]["recovery_action"] = 0
    fake = FakeNvml(devs)
    src = NvmlSource(pynvml_module=fake.module)
    try:
        snap = src.snapshot()
    finally:
        src.close()
    assert [g.recovery_action for g in snap.gpus] == [None, 2, 0]
    assert all("recovery_action" not in g.read_errors for g in snap.gpus)  # unsupported is no error
    findings, errors = run_checks(CheckContext(snapshot=snap, previous={}, previous_inventory={},
                                               expected_gpu_count=None, job_gpu_indices=None, xid_events=[],
                                               settings={}, gpu_nodes_expected=True), [])
    rec = [(f.code, f.gpu_index) for f in findings if f.code.startswith("gpu.recovery_action")]
    assert (rec, errors) == ([("gpu.recovery_action.node_reboot", 1)], [])


def test_handle_error_with_the_drivers_advice_sentence_keeps_its_name():
    # nvidia-smi's full text for a lost GPU carries a second sentence after the error name
    # (NVIDIA developer forums, "GPU is lost. Reboot the system to recover this GPU")
    snap = parse_nvidia_smi("Unable to determine the device handle for GPU0000:3B:00.0: GPU is lost.  "
                            "Reboot the system to recover this GPU\n")
    assert [(g.index, g.pci_bus_id, g.read_errors) for g in snap.gpus] == [
        (0, "0000:3b:00.0", {"device_handle": "GpuIsLost"})]


@pytest.mark.parametrize("text", [
    "No devices were found\n",
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that "
    "the latest NVIDIA driver is installed and running.\n\n",
    "Failed to initialize NVML: Driver/library version mismatch\n",
    "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 535.183\n",
    "Failed to initialize NVML: Unknown Error\n",
])
def test_whole_node_nvidia_smi_failure_is_an_unusable_driver_not_bad_input(tmp_path, text):
    # what nvidia-smi prints instead of any dump when the driver or every GPU is gone: the
    # dump of a dead node, judged like NVML failing on a node configured for GPUs
    dump = tmp_path / "dump.txt"
    dump.write_text(text)
    first = text.splitlines()[0]
    snap = parse_nvidia_smi(text)
    assert (snap.gpus, snap.error) == ([], f"nvidia-smi: {first}")
    cfg = tmp_path / "g.toml"
    cfg.write_text("[node]\ngpu_count = 8\n")
    r = CliRunner().invoke(main, ["--config", str(cfg), "check", "--json", "--from-nvidia-smi", str(dump)])
    doc = json.loads(r.output)
    assert (r.exit_code, doc["outcome"]) == (2, "drain")
    assert [(f["code"], f["severity"], f["action"], f["message"]) for f in doc["findings"]] == [
        ("gpu.driver_unusable", "critical", "drain", f"GPU driver/NVML unusable: nvidia-smi: {first}")]


def test_query_csv_gpu_requires_reset_cells_are_a_lost_gpu():
    # real paste of a Slurm H100 node (--query-gpu with [GPU requires reset] cells)
    rc, doc = check_json(DATA / "nvsmi-query-gpu-csv-h100-gpu-requires-reset.csv")
    assert (rc, doc["outcome"], doc["gpus"]) == (2, "drain", 1)
    assert [(f["code"], f["gpu_index"], f["action"]) for f in doc["findings"]] == [("gpu.lost", 0, "drain")]
    assert doc["findings"][0]["message"] == "gpu0 lost or hung: gpu_util_pct=ResetRequired, temp_c=ResetRequired"


def test_recovery_action_cell_with_a_read_error_is_that_gpus_finding_not_bad_input():
    # a [GPU requires reset] in the gpu_recovery_action column refused the whole CSV: the
    # GPU that needs a reset got no finding and the healthy GPU was not read either
    snap = load_nvidia_smi(DATA / "nvsmi-query-gpu-recovery-action-reset-required-constructed.csv")
    assert [(g.index, g.pci_bus_id, g.recovery_action, g.read_errors) for g in snap.gpus] == [
        (0, "0000:18:00.0", None, {"recovery_action": "ResetRequired", "temp_c": "ResetRequired"}),
        (1, "0000:2a:00.0", 0, {})]
    rc, doc = check_json(DATA / "nvsmi-query-gpu-recovery-action-reset-required-constructed.csv")
    assert (rc, doc["outcome"], doc["gpus"]) == (2, "drain", 2)
    assert [(f["code"], f["gpu_index"]) for f in doc["findings"]] == [("gpu.lost", 0)]


@pytest.mark.parametrize("cell,action,errors", [
    ("[GPU requires reset]", None, {"recovery_action": "ResetRequired"}),
    ("[Unknown Error]", None, {"recovery_action": "Unknown"}),
    ("[Not Supported]", None, {}), ("[N/A]", None, {}), ("Reset", 1, {})])
def test_recovery_action_sentinels_in_every_format(cell, action, errors):
    bare = cell.strip("[]")
    header_less = parse_nvidia_smi(f"0, {cell}\n1, None\n")  # the GPU in trouble is the first row
    with_header = parse_nvidia_smi(f"index, gpu_recovery_action\n0, {cell}\n1, None\n")
    text = parse_nvidia_smi("GPU 00000000:07:00.0\n    Product Name : NVIDIA H200\n"
                            f"    GPU Recovery Action : {bare}\n")
    xml = parse_nvidia_smi('<?xml version="1.0" ?>\n<nvidia_smi_log><gpu id="00000000:07:00.0">'
                           f'<gpu_recovery_action>{bare}</gpu_recovery_action></gpu></nvidia_smi_log>\n')
    for snap in (header_less, with_header):
        assert [(g.recovery_action, g.read_errors) for g in snap.gpus] == [(action, errors), (0, {})]
    for snap in (text, xml):
        assert [(g.recovery_action, g.read_errors) for g in snap.gpus] == [(action, errors)]


@pytest.mark.parametrize("channel,tpc,unrepairable,codes", [
    ("No", "No", "No", []),
    ("Yes", "No", "No", [("ecc.repair_pending", "gpu0 (0000:01:00.0) channel repair pending (reset the GPU to apply)")]),
    ("Yes", "Yes", "N/A", [("ecc.repair_pending",
                            "gpu0 (0000:01:00.0) channel and TPC repair pending (reset the GPU to apply)")]),
    ("No", "No", "Yes", [("ecc.unrepairable_memory",
                          "gpu0 (0000:01:00.0) memory fault the GPU can no longer repair (replace the GPU)")]),
])
def test_blackwell_repair_fields_of_the_580_dump_are_judged(tmp_path, channel, tpc, unrepairable, codes):
    # R575+ `ECC Errors > Channel Repair Pending / TPC Repair Pending / Unrepairable Memory`
    # (real 580.173.02 layout) were not read: a GPU waiting for a repair reset got no finding
    text = (DATA / "nvsmi-q-rtx5080-580.173.02-blackwell-repair-fields.txt").read_text()
    text = (text.replace("Channel Repair Pending                         : No", f"Channel Repair Pending                         : {channel}")
                .replace("TPC Repair Pending                             : No", f"TPC Repair Pending                             : {tpc}")
                .replace("Unrepairable Memory                            : N/A", f"Unrepairable Memory                            : {unrepairable}"))
    p = tmp_path / "q.txt"
    p.write_text(text)
    g = load_nvidia_smi(p).gpus[0]
    assert (g.channel_repair_pending, g.tpc_repair_pending, g.unrepairable_memory) == (
        channel == "Yes", tpc == "Yes", None if unrepairable == "N/A" else unrepairable == "Yes")
    rc, doc = check_json(p)  # the laptop's x8 link and persistence off are warnings of their own
    assert [(f["code"], f["message"]) for f in doc["findings"] if f["code"].startswith("ecc.")] == codes
    assert [f["action"] for f in doc["findings"] if f["code"].startswith("ecc.")] == ["drain"] * len(codes)
    assert (rc, doc["outcome"]) == ((2, "drain") if codes else (1, "proceed"))  # 1: warnings only


def test_repair_pending_read_error_and_xml():
    # "Channel Repair Pending : GPU requires reset" is how a wedged GPU prints it
    text = ("GPU 00000000:9A:00.0\n    Product Name : NVIDIA B200\n    ECC Errors\n"
            "        Channel Repair Pending : GPU requires reset\n        TPC Repair Pending : GPU requires reset\n")
    g = parse_nvidia_smi(text).gpus[0]
    assert (g.channel_repair_pending, g.read_errors, g.lost) == (
        None, {"channel_repair_pending": "ResetRequired", "tpc_repair_pending": "ResetRequired"}, True)
    xml = ('<?xml version="1.0" ?>\n<nvidia_smi_log><gpu id="00000000:07:00.0"><ecc_errors>'
           '<channel_repair_pending>No</channel_repair_pending><tpc_repair_pending>Yes</tpc_repair_pending>'
           '</ecc_errors></gpu></nvidia_smi_log>\n')
    g = parse_nvidia_smi(xml).gpus[0]
    assert (g.channel_repair_pending, g.tpc_repair_pending, g.unrepairable_memory) == (False, True, None)
