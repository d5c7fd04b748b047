"""A lifetime hardware count on a node's first reading gets a finding once; the next run,
with the value stored, is silent while it is unchanged and reports growth.

Inputs are real dumps of shared/corpus (copied to tests/data) with one value edited, each
edit asserted to hit exactly one line: a first reading is a new node, a wiped store, or a
one-off ``gpuguard check`` of a saved dump (no history).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import node_snapshot

from gpuguard.checks import CheckContext, counters_of, first_reading, run_checks
from gpuguard.cli import main
from gpuguard.gpu.nvsmi import load_nvidia_smi
from gpuguard.store import open_store

DATA = Path(__file__).parent / "data"
A100 = "nvsmi-q-a100-525.60.13-single-gpu-with-process.txt"  # healthy: exit 0, no finding
V100 = "nvsmi-q-v100-570.124.06-avg-power-na.txt"  # page retirement (Volta); persistence off
A100_GPU = "gpu0 (0000:07:00.0)"
FIRST = "(first reading, no earlier value)"


def edited(tmp_path, name: str, *edits: tuple[str, str], out: str | None = None) -> str:
    """``name`` from tests/data with each ``(old, new)`` applied; ``old`` must occur once."""
    text = (DATA / name).read_text()
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    p = tmp_path / (out or name)
    p.write_text(text)
    return str(p)


def check(*args: str, config: str = "/dev/null"):
    r = CliRunner().invoke(main, ["--config", config, "check", "--json", *args])
    doc = json.loads(r.output)
    return r.exit_code, doc["outcome"], [(f["code"], f["severity"], f["action"], f["gpu_index"], f["message"])
                                         for f in doc["findings"]]


AGG_DBE = ("            DRAM Uncorrectable            : 0\n    Retired Pages",
           "            DRAM Uncorrectable            : 3\n    Retired Pages")
UNC_ROWS = ("        Uncorrectable Error               : 0", "        Uncorrectable Error               : 2")
BANK_NONE = (("            Max                           : 640 bank(s)",
              "            Max                           : 639 bank(s)"),
             ("            None                          : 0 bank(s)",
              "            None                          : 1 bank(s)"))


def test_aggregate_uncorrectable_ecc_on_a_dump_is_a_warning(tmp_path):
    dump = edited(tmp_path, A100, AGG_DBE)
    assert check("--from-nvidia-smi", dump) == (1, "proceed", [
        ("ecc.uncorrectable_aggregate_present", "warning", "alert", 0,
         f"{A100_GPU} lifetime uncorrectable ECC count 3 {FIRST}")])


def test_rows_remapped_for_uncorrectable_errors_on_a_dump_are_a_warning(tmp_path):
    dump = edited(tmp_path, A100, UNC_ROWS)
    assert check("--from-nvidia-smi", dump) == (1, "proceed", [
        ("ecc.row_remap_uncorrectable_present", "warning", "alert", 0,
         f"{A100_GPU} 2 row(s) remapped for uncorrectable ECC errors {FIRST}")])


def test_a_bank_with_no_spare_row_left_is_a_warning(tmp_path):
    dump = edited(tmp_path, A100, *BANK_NONE)
    (g,) = load_nvidia_smi(dump).gpus
    assert g.remap_banks_none == 1
    assert check("--from-nvidia-smi", dump) == (1, "proceed", [
        ("ecc.remap_banks_exhausted", "warning", "alert", 0,
         f"{A100_GPU} 1 memory bank(s) with no spare row left for remapping ({FIRST[1:-1]}; run field diagnostics)")])


def test_pages_retired_for_dbe_on_a_volta_dump_are_a_warning_and_pending_still_drains(tmp_path):
    dbe = ("        Double Bit ECC                    : 0", "        Double Bit ECC                    : 2")
    persistence = ("config.persistence_off", "warning", "alert", 0, "gpu0 (0001:00:00.0) persistence mode off")
    dump = edited(tmp_path, V100, dbe)
    assert check("--from-nvidia-smi", dump) == (1, "proceed", [
        ("ecc.retired_pages_dbe_present", "warning", "alert", 0,
         f"gpu0 (0001:00:00.0) 2 page(s) retired for double-bit ECC errors {FIRST}"), persistence])
    pending = edited(tmp_path, V100, dbe, ("        Pending Page Blacklist            : No",
                                           "        Pending Page Blacklist            : Yes"), out="pending.txt")
    rc, outcome, found = check("--from-nvidia-smi", pending)
    assert (rc, outcome, [f[0] for f in found]) == (2, "drain", ["ecc.retired_pages_pending", "config.persistence_off"])


def test_xml_dump_aggregate_and_bank_histogram(tmp_path):
    xml = "nvsmi-qx-a100-mig-510.47.03.xml"
    rows = ("<remapped_rows>\n<remapped_row_corr>0</remapped_row_corr>\n<remapped_row_unc>0</remapped_row_unc>\n"
            "<remapped_row_pending>No</remapped_row_pending>\n<remapped_row_failure>No</remapped_row_failure>\n"
            "<row_remapper_histogram>\n<row_remapper_histogram_max>638 bank(s)</row_remapper_histogram_max>\n"
            "<row_remapper_histogram_high>0 bank(s)</row_remapper_histogram_high>\n"
            "<row_remapper_histogram_partial>0 bank(s)</row_remapper_histogram_partial>\n"
            "<row_remapper_histogram_low>0 bank(s)</row_remapper_histogram_low>\n"
            "<row_remapper_histogram_none>2 bank(s)</row_remapper_histogram_none>\n"
            "</row_remapper_histogram>\n</remapped_rows>")
    dump = edited(tmp_path, xml, ("<remapped_rows>N/A</remapped_rows>", rows),
                  ("<dram_uncorrectable>0</dram_uncorrectable>\n            </aggregate>",
                   "<dram_uncorrectable>4</dram_uncorrectable>\n            </aggregate>"))
    rc, outcome, found = check("--from-nvidia-smi", dump)
    assert (rc, outcome) == (1, "proceed")
    assert [(c, s, a) for c, s, a, _g, _m in found] == [
        ("ecc.uncorrectable_aggregate_present", "warning", "alert"), ("ecc.remap_banks_exhausted", "warning", "alert"),
        ("config.persistence_off", "warning", "alert")]
    assert found[0][4].endswith(f"lifetime uncorrectable ECC count 4 {FIRST}")
    assert found[1][4].endswith(f"2 memory bank(s) with no spare row left for remapping ({FIRST[1:-1]}; "
                                "run field diagnostics)")


def test_query_gpu_csv_aggregate_and_retired_dbe(tmp_path):
    name = "nvsmi-query-gpu-csv-rtx2080s-471.11-full.csv"
    head, row = (DATA / name).read_text().splitlines()
    cols = [c.strip() for c in head.split(",")]
    cells = row.split(", ")
    for col, val in (("ecc.errors.uncorrected.aggregate.total", "3"), ("retired_pages.double_bit.count", "1"),
                     ("retired_pages.pending", "No")):
        cells[cols.index(col)] = val
    dump = tmp_path / name
    dump.write_text(head + "\n" + ", ".join(cells) + "\n")
    rc, outcome, found = check("--from-nvidia-smi", str(dump))
    assert (rc, outcome, [(c, s, a) for c, s, a, _g, _m in found]) == (1, "proceed", [
        ("ecc.uncorrectable_aggregate_present", "warning", "alert"),
        ("ecc.retired_pages_dbe_present", "warning", "alert")])


@pytest.fixture
def node_store(tmp_path, make_config):
    """A node config with a store; ``run(dump)`` is ``gpuguard check --record`` on the
    dump's GPUs through a replay file (``--from-nvidia-smi`` reads no store)."""
    path, _cfg = make_config()

    def run(dump: str):
        snap = tmp_path / "snap.json"
        r = CliRunner().invoke(main, ["--config", path, "gpu", "snapshot", "--force", "-o", str(snap),
                                      "--from-nvidia-smi", dump])
        assert r.exit_code == 0, r.output
        return check("--gpu-source", "replay", "--replay", str(snap), "--kernel-log", "none", "--record",
                     config=path)
    return run, str(tmp_path / "node.db")


def test_first_reading_once_then_silence_then_growth(tmp_path, node_store):
    run, db = node_store
    three = edited(tmp_path, A100, AGG_DBE, UNC_ROWS, *BANK_NONE)
    first = run(three)
    assert first == (1, "proceed", [
        ("ecc.uncorrectable_aggregate_present", "warning", "alert", 0,
         f"{A100_GPU} lifetime uncorrectable ECC count 3 {FIRST}"),
        ("ecc.row_remap_uncorrectable_present", "warning", "alert", 0,
         f"{A100_GPU} 2 row(s) remapped for uncorrectable ECC errors {FIRST}"),
        ("ecc.remap_banks_exhausted", "warning", "alert", 0,
         f"{A100_GPU} 1 memory bank(s) with no spare row left for remapping ({FIRST[1:-1]}; run field diagnostics)")])
    stored = open_store(db).get_counters("n1")["GPU-a305392e-6305-9509-15f5-948569609543"]
    assert (stored["ecc_aggregate_uncorrected"], stored["remapped_rows_uncorrectable"], stored["remap_banks_none"]) == (
        3, 2, 1)
    # the same values on the next run: nothing, exit 0
    assert run(three) == (0, "proceed", [])
    assert run(three) == (0, "proceed", [])
    # growth keeps its finding
    more = edited(tmp_path, A100, ("            DRAM Uncorrectable            : 0\n    Retired Pages",
                                   "            DRAM Uncorrectable            : 4\n    Retired Pages"),
                  ("        Uncorrectable Error               : 0", "        Uncorrectable Error               : 3"),
                  *BANK_NONE[:1], (BANK_NONE[1][0], "            None                          : 2 bank(s)"),
                  out="more.txt")
    assert run(more) == (1, "proceed", [
        ("ecc.uncorrectable_aggregate", "warning", "alert", 0, f"{A100_GPU} lifetime uncorrectable ECC rose 3 -> 4"),
        ("ecc.row_remap_uncorrectable_rising", "warning", "alert", 0,
         f"{A100_GPU} row(s) remapped for uncorrectable ECC errors rose 2 -> 3"),
        ("ecc.remap_banks_exhausted", "warning", "alert", 0,
         f"{A100_GPU} 2 memory bank(s) with no spare row left for remapping (was 1; run field diagnostics)")])
    assert run(more) == (0, "proceed", [])
    rows = open_store(db).query("select code from findings order by id")
    assert [r["code"] for r in rows] == ["ecc.uncorrectable_aggregate_present", "ecc.row_remap_uncorrectable_present",
                                         "ecc.remap_banks_exhausted", "ecc.uncorrectable_aggregate",
                                         "ecc.row_remap_uncorrectable_rising", "ecc.remap_banks_exhausted"]


def test_retired_dbe_pages_once_then_growth():
    snap = node_snapshot(1, gpu0={"retired_pages_dbe": 2, "retired_pages_sbe": 1, "retired_pages_pending": False})
    (f,) = [x for x in run_checks(CheckContext(snapshot=snap, hook="prolog", history=True))[0]]
    assert (f.code, f.severity, f.message, f.evidence) == (
        "ecc.retired_pages_dbe_present", "warning",
        f"gpu0 (0000:18:00.0) 2 page(s) retired for double-bit ECC errors {FIRST}",
        {"sbe": 1, "dbe": 2, "previous": None})
    prev = counters_of(snap)
    assert run_checks(CheckContext(snapshot=snap, previous=prev, hook="prolog", history=True)) == ([], [])
    later = node_snapshot(1, gpu0={"retired_pages_dbe": 3, "retired_pages_pending": False})
    (f,) = run_checks(CheckContext(snapshot=later, previous=prev, hook="prolog", history=True))[0]
    assert (f.code, f.message) == ("ecc.retired_pages_dbe_rising",
                                   "gpu0 (0000:18:00.0) page(s) retired for double-bit ECC errors rose 2 -> 3")


def test_when_a_reading_is_first():
    snap = node_snapshot(1, gpu0={"ecc_aggregate_uncorrected": 3})
    g = snap.gpus[0]
    # the hooks' live pass reads no history: the pass with the store reports it
    assert not first_reading(CheckContext(snapshot=snap, hook="prolog"), g, "ecc_aggregate_uncorrected")
    assert run_checks(CheckContext(snapshot=snap, hook="prolog")) == ([], [])
    assert first_reading(CheckContext(snapshot=snap, hook="prolog", history=True), g, "ecc_aggregate_uncorrected")
    assert first_reading(CheckContext(snapshot=snap), g, "ecc_aggregate_uncorrected")  # gpuguard check
    # a GPU without a UUID cannot be stored: in the hooks it would repeat every run
    g.uuid = None
    assert not first_reading(CheckContext(snapshot=snap, hook="epilog", history=True), g, "ecc_aggregate_uncorrected")


def test_a_failed_read_keeps_the_stored_value():
    """A lifetime count that one run could not read is neither first-read again nor its
    growth missed."""
    before = counters_of(node_snapshot(1, gpu0={"ecc_aggregate_uncorrected": 3, "remap_banks_none": 1}))
    unread = node_snapshot(1, gpu0={"ecc_aggregate_uncorrected": None, "remap_banks_none": None})
    kept = counters_of(unread, before)
    uuid = unread.gpus[0].uuid
    assert (kept[uuid]["ecc_aggregate_uncorrected"], kept[uuid]["remap_banks_none"]) == (3, 1)
    again = node_snapshot(1, gpu0={"ecc_aggregate_uncorrected": 3, "remap_banks_none": 1})
    assert run_checks(CheckContext(snapshot=again, previous=kept, hook="prolog", history=True)) == ([], [])


def test_healthy_counts_stay_silent_on_a_first_reading():
    """Zero counts, and a pending remap or a remap failure (drained for), add no warning."""
    assert run_checks(CheckContext(snapshot=node_snapshot(2, gpu0={"remap_banks_none": 0}))) == ([], [])
    snap = node_snapshot(2, gpu0={"remapped_rows_uncorrectable": 1, "remapped_rows_pending": True},
                         gpu1={"remapped_rows_uncorrectable": 8, "remapped_rows_failure": True, "remap_banks_none": 1})
    found, _ = run_checks(CheckContext(snapshot=snap))
    assert [(f.code, f.gpu_index) for f in found] == [("ecc.row_remap_pending", 0), ("ecc.row_remap_failure", 1)]


def test_prolog_reports_a_first_reading_once_never_drains(tmp_path, make_config, write_replay, fake_slurm_bin):
    """The Prolog's live pass reads no history (no first-reading finding there); its pass
    with the store records the warning and queues its alert once; the next job's Prolog is
    silent. No drain, no scontrol call."""
    from gpuguard.prolog import hook

    replay = write_replay(node_snapshot(2, gpu1={"ecc_aggregate_uncorrected": 3, "remap_banks_none": 1}))
    make_config('[prolog]\nstart_collector = false\n', replay=replay)
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_GPUS": "0,1", "SLURMD_NODENAME": "n1"}
    spool = tmp_path / "state" / "alerts.spool"

    def alerts():
        return [(a["code"], a["gpu_index"], a["action"], a["source"], a["job_id"])
                for a in map(json.loads, spool.read_text().splitlines())] if spool.exists() else []

    assert hook.run(env) == 0
    store = open_store(str(tmp_path / "node.db"))
    assert [(r["code"], r["severity"], r["action"], r["gpu_index"], r["message"]) for r in
            store.query("select * from findings order by id")] == [
        ("ecc.uncorrectable_aggregate_present", "warning", "alert", 1,
         f"gpu1 (0000:29:00.0) lifetime uncorrectable ECC count 3 {FIRST}"),
        ("ecc.remap_banks_exhausted", "warning", "alert", 1,
         f"gpu1 (0000:29:00.0) 1 memory bank(s) with no spare row left for remapping ({FIRST[1:-1]}; "
         "run field diagnostics)")]
    assert alerts() == [("ecc.uncorrectable_aggregate_present", 1, "alert", "prolog", "42"),
                        ("ecc.remap_banks_exhausted", 1, "alert", "prolog", "42")]
    assert store.query("select decision from health_runs") == [{"decision": "proceed"}]
    assert hook.run(dict(env, SLURM_JOB_ID="43")) == 0
    assert len(store.query("select * from findings")) == 2 and len(alerts()) == 2
    assert fake_slurm_bin() == []
