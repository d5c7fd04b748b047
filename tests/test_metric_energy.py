"""GPU energy, added as one metric-table row (``energy_j``), end to end: the collector's
NVML read (batched field value, and the single getter where the field is missing) ->
the collector row -> the compact store (and the named migration step that adds its
column to an older store) -> the job summary per GPU and per node -> the published
summary path the reports read -> ``gpuguard job show`` (JSON and the per-GPU table).
Energy is not compared by the verdict (a job's energy grows with its length)."""

from __future__ import annotations

import json
import sqlite3

import fake_pynvml as fp
import pytest
from click.testing import CliRunner

from gpuguard.cli import main
from gpuguard.collector.run import Collector
from gpuguard.epilog import summary_shape
from gpuguard.epilog.summary import load_summaries, save_summary, summarize_job
from gpuguard.gpu.nvml import NvmlSource
from gpuguard.metrics import COMPARED, document_fields
from gpuguard.store import open_store

MJ0 = 81_234_567_890  # fake_pynvml.h100_gpu: energy counter of GPU 0 at the start, in mJ


def _collect(fake: fp.FakeNvml, store, ticks: int, *, watts: tuple[int, int]) -> None:
    """``ticks`` ticks of the collector's own path (its per-job NVML reader, its rows, its
    buffer flush), every one a slow tick; between ticks GPU i's energy counter grows by
    ``watts[i]`` J."""
    src = NvmlSource(pynvml_module=fake.module)
    c = Collector(job_id="9", node="n1", source=src, gpus="0,1", host=None, liveness=None,
                  open_store=lambda: store, interval_s=1.0, flush_s=1.0, slow_every_s=1e-9)
    try:
        for _ in range(ticks):
            rows = c.gpu_rows()
            assert rows is not None and len(rows) == 2
            c.buffer.add("samples", rows)
            c.buffer.flush(store)
            for i in (0, 1):
                fake.devices[i]["energy_mj"] += watts[i] * 1000
    finally:
        src.close()


@pytest.fixture
def fake():
    return fp.FakeNvml(fp.h100_node()[:2])


def test_read_by_field_value_and_by_getter(fake):
    src = NvmlSource(pynvml_module=fake.module)
    (g0, g1) = src.telemetry([0, 1], [], slow=True).gpus
    # mJ -> J in real units (the collector's own reader gives the store's whole joules)
    assert (g0.energy_j, g1.energy_j) == (MJ0 / 1000, (MJ0 + 1) / 1000)
    assert ("nvmlDeviceGetTotalEnergyConsumption", 0) not in fake.calls  # the batched field value served it
    assert src.telemetry([0, 1], [], slow=False).gpus[0].energy_j is None  # a slow counter: not every tick
    src.close()
    fake.hide("nvmlDeviceGetFieldValues")  # an older nvidia-ml-py: the getter
    src = NvmlSource(pynvml_module=fake.module)
    (g0, _g1) = src.telemetry([0, 1], [], slow=True).gpus
    assert g0.energy_j == MJ0 / 1000 and ("nvmlDeviceGetTotalEnergyConsumption", 0) in fake.calls
    src.close()


def test_unsupported_energy_is_none_not_zero(fake):
    del fake.devices[1]["energy_mj"]  # a GPU before Volta: NVML answers NOT_SUPPORTED
    src = NvmlSource(pynvml_module=fake.module)
    (g0, g1) = src.telemetry([0, 1], [], slow=True).gpus
    assert (g0.energy_j is not None, g1.energy_j, g1.read_errors) == (True, None, {})
    src.close()


def test_energy_from_collector_to_job_show(fake, tmp_path, monkeypatch):
    db = str(tmp_path / "node.db")
    store = open_store(db)
    _collect(fake, store, 11, watts=(700, 350))  # 10 intervals of 1 s
    s = summarize_job(store, "9", "n1", exit_status_raw=0, collector_status="ok")
    # stored in whole joules: GPU 0 from 81,234,568 J (81,234,567.89 rounded) to +7,000 J
    assert [(g.gpu_index, g.energy_increase_j) for g in s.gpus] == [(0, 7000), (1, 3500)]
    assert s.energy_increase_j == 10500
    save_summary(store, s)
    assert load_summaries(store, "9")[0].energy_increase_j == 10500
    # the published path reads it out of the stored document, node and per GPU
    node_f, gpu_f = summary_shape.PUBLISHED["node.energy_increase_j"], summary_shape.PUBLISHED["gpu.energy_increase_j"]
    assert (node_f.path, node_f.unit, gpu_f.path) == ("$.energy_increase_j", "J", "$.energy_increase_j")
    doc = store.query("select summary from job_summaries where job_id = '9'")[0]["summary"]
    conn = store.db.conn
    assert conn.execute("select json_extract(?, ?)", [doc, node_f.path]).fetchone()[0] == 10500
    assert [r[0] for r in conn.execute(f"select json_extract(value, '{gpu_f.path}') from json_each(?, '$.gpus')",
                                       [doc])] == [7000, 3500]
    store.close()
    # not compared by the verdict
    assert "energy_j" not in {c.metric for c in COMPARED}

    cfg = tmp_path / "noslurm.toml"
    cfg.write_text(f'[slurm]\nbin_dir = "{tmp_path}/no-slurm-here"\n')
    monkeypatch.setenv("GPUGUARD_CONFIG", str(cfg))
    monkeypatch.setenv("COLUMNS", "400")  # one table, not split for the terminal
    r = CliRunner().invoke(main, ["job", "show", "9", "--json", "--store", db])
    assert r.exit_code == 0, r.output
    (summ,) = json.loads(r.output)["summaries"]
    assert (summ["energy_increase_j"], [g["energy_increase_j"] for g in summ["gpus"]]) == (10500, [7000, 3500])
    r = CliRunner().invoke(main, ["job", "show", "9", "--full", "--store", db])
    assert r.exit_code == 0, r.output
    out = r.output.splitlines()
    assert [x.split()[1:] for x in out if x.startswith("energy_increase_j")] == [["10500", "J"]]
    i = out.index("Per GPU (n1)")
    head = out[i + 1].split()
    col = head.index("ENERGY_NEW_J")
    assert [out[i + 3].split()[col], out[i + 4].split()[col]] == ["7000", "3500"]


def test_migration_step_adds_the_column_to_an_older_store(tmp_path):
    """A store from before the row: no ``energy_j`` column, no ``metric_energy_j`` step.
    Opening it adds the column (and rebuilds the view) once, recorded as that step; old
    rows read NULL."""
    db = str(tmp_path / "old.db")
    open_store(db).close()
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("drop view samples")
    conn.execute("alter table gpu_slow drop column energy_j")
    conn.execute("create view samples as select 1 as x")  # the older view, without the column
    conn.execute("delete from _sqlite_migrations where name = 'metric_energy_j'")
    conn.close()
    s = open_store(db)
    assert "energy_j" in {r[1] for r in s.db.conn.execute("pragma table_info(gpu_slow)")}
    assert "energy_j" in {r[1] for r in s.db.conn.execute("pragma table_info(samples)")}
    assert s.query("select count(*) as n from _sqlite_migrations where migration_set = 'collector' "
                   "and name = 'metric_energy_j'") == [{"n": 1}]
    s.close()
    open_store(db).close()  # idempotent: nothing pending the second time


def test_summary_fields_come_from_the_table():
    assert ("energy_increase_j", "float | None", None, "sample_count") in document_fields(
        per_gpu=True, after={"gpu": "sample_count"})
