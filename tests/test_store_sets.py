"""Named per-stage migration sets: fresh stores, adopting a numbered-era store
(user_version 5), refusing newer stores, dependency order, and the summary's published
shape that the reports' triggers read."""

from __future__ import annotations

import json
import pathlib
import shutil
import sqlite3

import pytest
from test_epilog_summary import fill

from gpuguard import store as store_mod
from gpuguard.epilog import summary_shape
from gpuguard.epilog.summary import save_summary, summarize_job
from gpuguard.store import NAMED_SETS_VERSION, MigrationSet, StoreError, open_store, registered_sets

#: A store written by the numbered-migration gpuguard (user_version 5): a cursor, a
#: health run and one summary with two per-GPU readings.
V5 = pathlib.Path(__file__).parent / "data" / "store-user-version-5.db"

ALL_STEPS = {("core", "health_tables"), ("core", "job_indexes"), ("core", "node_idle"),
             ("collector", "samples"), ("collector", "samples_by_gpu"), ("collector", "compact_samples"),
             ("collector", "compact_minutes"),
             ("epilog", "job_records"), ("epilog", "baselines"), ("epilog", "baseline_relearn"),
             ("epilog", "cluster_jobs"),
             ("reports", "sacct_jobs"), ("reports", "job_gpu_util"), ("reports", "sacct_attempts"), ("reports", "sacct_pending_index")}


def every_registered_step() -> set[tuple[str, str]]:
    """The core sets above plus whatever other stages register (ops, net, ...)."""
    got = {(m.name, n) for m in registered_sets() for n in m.names}
    assert ALL_STEPS <= got
    return got


def steps(s) -> set[tuple[str, str]]:
    return {(r["migration_set"], r["name"]) for r in s.query("select migration_set, name from _sqlite_migrations")}


def test_order_follows_requires():
    names = [m.name for m in registered_sets()]
    assert names.index("core") < names.index("collector") < names.index("epilog") < names.index("reports")


def test_fresh_store_records_every_step(tmp_path):
    s = open_store(str(tmp_path / "n.db"))
    assert steps(s) == every_registered_step()
    assert s.query("PRAGMA user_version")[0]["user_version"] == NAMED_SETS_VERSION == 6


def test_user_version_5_store_is_adopted_not_rebuilt(tmp_path):
    p = tmp_path / "v5.db"
    shutil.copy(V5, p)
    s = open_store(str(p))
    assert s.query("PRAGMA user_version")[0]["user_version"] == 6
    assert steps(s) == every_registered_step()
    # the data of the old store is there, and the reports' triggers still fire
    assert s.get_cursor("kernel_log") == "abc"
    assert s.query("select util from job_gpu_util where job_id = '7' order by util") == [{"util": 40.0},
                                                                                         {"util": 60.0}]
    s.db.conn.execute("INSERT INTO job_summaries (job_id, node, summary) VALUES ('8', 'n1', ?)",
                      [json.dumps({"gpu_util_mean_pct": 12.5, "gpus": []})])
    assert s.query("select util from job_gpu_util where job_id = '8'") == [{"util": 12.5}]


def test_a_new_step_is_applied_to_an_adopted_store(tmp_path, monkeypatch):
    p = tmp_path / "v5.db"
    shutil.copy(V5, p)
    extra = MigrationSet("extra", requires=("epilog",))

    @extra(name="notes")
    def _notes(db):
        db["notes"].create({"job_id": str, "text": str})

    s = open_store(str(p), sets=[*registered_sets(), extra])
    assert ("extra", "notes") in steps(s) and "notes" in s.db.table_names()


def test_store_with_unknown_step_is_refused(tmp_path):
    p = str(tmp_path / "n.db")
    open_store(p).db.conn.execute("INSERT INTO _sqlite_migrations (migration_set, name, applied_at) "
                                  "VALUES ('epilog', 'from_the_future', 'x')")
    with pytest.raises(StoreError, match="migration set 'epilog' has step\\(s\\) from_the_future unknown to this "
                                         "gpuguard"):
        open_store(p)


def test_newer_user_version_refused(tmp_path):
    p = tmp_path / "n.db"
    conn = sqlite3.connect(p)
    conn.execute("PRAGMA user_version = 7")
    conn.close()
    with pytest.raises(StoreError, match="schema version 7 is newer than this gpuguard \\(6\\)"):
        open_store(str(p))


def test_failed_step_rolls_back_everything(tmp_path):
    bad = MigrationSet("bad", requires=("core",))

    @bad(name="boom")
    def _boom(db):
        db["half"].create({"x": int})
        db.execute("select * from no_such_table")

    p = str(tmp_path / "n.db")
    with pytest.raises(StoreError, match="no such table: no_such_table"):
        open_store(p, sets=[*registered_sets(), bad])
    conn = sqlite3.connect(p)
    assert conn.execute("select count(*) from sqlite_master where name = 'half'").fetchone() == (0,)
    assert conn.execute("PRAGMA user_version").fetchone() == (0,)


def test_missing_requirement_is_an_error():
    orphan = MigrationSet("orphan", requires=("nope",))
    store_mod._SETS["orphan"] = orphan
    try:
        with pytest.raises(ValueError, match="'orphan' requires 'nope', which is not registered"):
            registered_sets()
    finally:
        del store_mod._SETS["orphan"]


def test_published_summary_shape_matches_a_real_summary(tmp_path):
    """Every published path reads a value out of a summary the epilog wrote: renaming a
    summary field fails here instead of silently emptying the efficiency report."""
    s = open_store(str(tmp_path / "n.db"))
    fill(s)
    save_summary(s, summarize_job(s, "7", "n1", exit_status_raw=0, collector_status="ok", ended_at=1500.0))
    doc = s.query("select summary from job_summaries where job_id = '7' and node = 'n1'")[0]["summary"]
    conn = s.db.conn
    node_val = conn.execute("select json_extract(?, ?)", [doc, summary_shape.NODE_GPU_UTIL_MEAN.path]).fetchone()[0]
    assert node_val == json.loads(doc)["gpu_util_mean_pct"] and node_val is not None
    gpus = conn.execute(f"select json_extract(value, '{summary_shape.GPU_INDEX.path}'), "
                        f"json_extract(value, '{summary_shape.GPU_UTIL_MEAN.path}') "
                        f"from json_each(?, '{summary_shape.GPUS}')", [doc]).fetchall()
    assert [g[0] for g in gpus] == [0, 1] and all(g[1] is not None for g in gpus)
    assert sorted(r["util"] for r in s.query("select util from job_gpu_util where job_id = '7'")) == \
        sorted(g[1] for g in gpus)


def test_gpu_model_step_backfills_verdicts_from_the_inventory(tmp_path):
    """Step ('epilog', 'baseline_gpu_model') on a store with verdicts: each gets the GPU
    model of its nodes' inventory (GPUs first seen before the job ended), '' where a node
    is not in the inventory or had two models by then; cached baseline rows stay, keyed ''."""
    p = tmp_path / "v5.db"
    shutil.copy(V5, p)
    conn = sqlite3.connect(p)
    h100, a100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"
    for node, uuid, name, first in (("n1", "G1", h100, 100.0), ("n1", "G2", h100, 100.0), ("n2", "G3", a100, 100.0),
                                    ("n3", "G4", h100, 100.0), ("n3", "G5", a100, 5000.0)):
        conn.execute("insert into inventory (node, uuid, name, first_seen, last_seen) values (?, ?, ?, ?, ?)",
                     (node, uuid, name, first, first))
    for job, nodes, end in (("j1", ["n1"], 1000.0), ("j2", ["n1", "n2"], 1000.0), ("j3", ["n3"], 1000.0),
                            ("j4", ["n3"], 6000.0), ("j5", ["n1", "n9"], 1000.0)):
        conn.execute("insert into verdicts (job_id, template, at, nodes, start_at, end_at, baseline_ok) "
                     "values (?, 'tpl', ?, ?, ?, ?, 1)", (job, end, json.dumps(nodes), end - 500, end))
    conn.execute("insert into baselines values ('tpl', 'step_time_p50_s', 1.5, 0.1, 5, 1000.0)")
    conn.commit()
    conn.close()
    s = open_store(str(p))
    assert ("epilog", "baseline_gpu_model") in steps(s)
    assert {r["job_id"]: r["gpu_model"] for r in s.query("select job_id, gpu_model from verdicts")} == {
        "j1": h100, "j2": f"{a100} + {h100}", "j3": h100, "j4": "", "j5": ""}
    assert s.query("select * from baselines") == [{"template": "tpl", "gpu_model": "", "metric": "step_time_p50_s",
                                                   "median": 1.5, "mad": 0.1, "n": 5, "updated_at": 1000.0}]
    s.close()
