"""NCCL probes carried from per-node stores to the cluster store through the spool, so
the fleet median works when every node keeps its own store."""

from __future__ import annotations

import json
import logging
import os

import pytest
from click.testing import CliRunner

from gpuguard import config as config_mod
from gpuguard.net.nccl_check import probe_node
from gpuguard.net.nccl_spool import SUBDIR, ProbeFileError, ingest_probes, parse_probe_file
from gpuguard.store import open_store
from nccl_fake import FakeProbe, healthy_text, scaled

LOG = logging.getLogger("test")


@pytest.fixture
def fleet(tmp_path):
    """Per-node stores ``{tmp}/{node}/node.db``, one spool, a separate cluster store."""
    fake = FakeProbe(tmp_path / "fake")
    spool = tmp_path / "spool"
    spool.mkdir()
    cluster = str(tmp_path / "ctl" / "cluster.db")

    def node_cfg(node):
        return config_mod.from_dict({
            "node": {"name": node, "gpu_count": 8}, "nccl": {"binary": str(fake.binary), "timeout_s": 30.0},
            "paths": {"store": str(tmp_path / node / "node.db"), "cluster_store": cluster,
                      "spool_dir": str(spool)}})
    return {"fake": fake, "spool": str(spool), "cluster": cluster, "cfg": node_cfg}


def _probe(fleet, node, text, runs=1):
    """One probe on ``node`` reading ``text`` (``runs`` 2: a low reading is re-measured)."""
    cfg = fleet["cfg"](node)
    store = open_store(cfg.store_path)
    try:
        for _ in range(runs):
            fleet["fake"].push(text)
        return probe_node(cfg, store, hook="health")
    finally:
        store.close()
        assert fleet["fake"].pending() == 0


def _probes(path):
    s = open_store(path)
    try:
        return (s.query("select node, hook, state, gpu_model, config_key, at from nccl_probes order by node, at"),
                s.query("select b.node, b.size_b, b.busbw_gbs, b.algbw_gbs from nccl_busbw b "
                        "order by b.node, b.size_b"))
    finally:
        s.close()


def test_probes_of_per_node_stores_reach_the_cluster_store_and_give_the_fleet_median(fleet):
    for node in ("gn2", "gn3", "gn4"):
        out = _probe(fleet, node, healthy_text())
        assert (out.state, out.tool_errors) == ("ok", [])
    files = sorted(os.listdir(os.path.join(fleet["spool"], SUBDIR)))
    assert [f.split(".")[0] for f in files] == ["gn2", "gn3", "gn4"] and all(f.endswith(".json") for f in files)
    # no fleet yet: a node without history has nothing to be low against
    low = scaled(healthy_text(), 0.7)
    out = _probe(fleet, "gn1", low)
    assert (out.state, out.judgement.against, out.judgement.ratio) == ("ok", [], {})

    cluster = open_store(fleet["cluster"])
    res = ingest_probes(cluster, fleet["spool"], log=LOG)
    cluster.close()
    assert (res.carried, res.known, res.errors) == (4, 0, [])
    assert os.listdir(os.path.join(fleet["spool"], SUBDIR)) == []
    probes, sizes = _probes(fleet["cluster"])
    assert [(p["node"], p["hook"], p["state"]) for p in probes] == [
        ("gn1", "health", "ok"), ("gn2", "health", "ok"), ("gn3", "health", "ok"), ("gn4", "health", "ok")]
    # every probe row and size reading arrives exactly as each node stored it
    for node in ("gn1", "gn2", "gn3", "gn4"):
        own = _probes(fleet["cfg"](node).store_path)
        assert [p for p in probes if p["node"] == node] == own[0]
        assert [s for s in sizes if s["node"] == node] == own[1] and len(own[1]) >= 3

    out = _probe(fleet, "gn1", low, runs=2)
    assert (out.state, out.judgement.against) == ("low", ["fleet"])
    assert out.judgement.ratio == {"fleet": pytest.approx(0.7, abs=0.01)}


def test_carrying_twice_inserts_once(fleet):
    _probe(fleet, "gn2", healthy_text())
    [name] = os.listdir(os.path.join(fleet["spool"], SUBDIR))
    path = os.path.join(fleet["spool"], SUBDIR, name)
    blob = open(path, "rb").read()
    cluster = open_store(fleet["cluster"])
    assert ingest_probes(cluster, fleet["spool"]).carried == 1
    with open(path, "wb") as fh:  # a crash after the insert, before the removal
        fh.write(blob)
    again = ingest_probes(cluster, fleet["spool"])
    assert (again.carried, again.known, again.errors) == (0, 1, [])
    assert cluster.query("select count(*) as n from nccl_probes")[0]["n"] == 1
    cluster.close()
    assert not os.path.exists(path)


def test_bad_probe_files_are_named_set_aside_and_the_good_ones_carried(fleet, tmp_path):
    _probe(fleet, "gn2", healthy_text())
    d = os.path.join(fleet["spool"], SUBDIR)
    [good] = os.listdir(d)
    doc = json.loads(open(os.path.join(d, good)).read())
    bad = {"a.json": b"{not json", "b.json": json.dumps({**doc, "v": 9}).encode(),
           "c.json": json.dumps({**doc, "busbw": [[1048576, "fast", None]]}).encode(),
           "d.json": json.dumps({**doc, "probe": {**doc["probe"], "state": "great"}}).encode()}
    for name, blob in bad.items():
        with open(os.path.join(d, name), "wb") as fh:
            fh.write(blob)
    (tmp_path / "target.json").write_text(json.dumps(doc))
    os.symlink(tmp_path / "target.json", os.path.join(d, "e.json"))
    cluster = open_store(fleet["cluster"])
    res = ingest_probes(cluster, fleet["spool"], log=LOG)
    cluster.close()
    assert res.carried == 1
    assert [e.split(": ", 1)[1] for e in res.errors] == [
        "not JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
        "version 9, this code reads 1",
        "busbw_gbs 'fast' is not a finite number",
        "probe needs a node, a config_key and a state in ['errors', 'failed', 'low', 'low_unconfirmed', 'ok']",
        "a symbolic link"]
    left = sorted(os.listdir(d))
    assert [n.split(".bad.")[0] for n in left] == ["a.json", "b.json", "c.json", "d.json", "e.json"]
    assert ingest_probes(open_store(fleet["cluster"]), fleet["spool"]).errors == []  # never read again


def test_not_a_finite_number_is_refused():
    with pytest.raises(ProbeFileError, match="probe at nan is not a finite number"):
        parse_probe_file(json.dumps({"format": "gpuguard-nccl-probe", "v": 1, "busbw": [],
                                     "probe": {"node": "n1", "config_key": "k", "state": "ok",
                                               "at": float("nan")}}).encode())


def test_single_host_spools_nothing(tmp_path):
    fake = FakeProbe(tmp_path / "fake")
    spool = tmp_path / "spool"
    spool.mkdir()
    cfg = config_mod.from_dict({"node": {"name": "gn1", "gpu_count": 8}, "nccl": {"binary": str(fake.binary)},
                                "paths": {"store": str(tmp_path / "node.db"), "spool_dir": str(spool)}})
    store = open_store(cfg.store_path)
    fake.push(healthy_text())
    out = probe_node(cfg, store, hook="health")
    store.close()
    assert (out.state, out.tool_errors, os.listdir(spool)) == ("ok", [], [])


def test_cluster_ingest_command_carries_the_probes(fleet, make_config, fake_slurm_bin):
    from gpuguard.cli import main as cli

    _probe(fleet, "gn2", healthy_text())
    path, _cfg = make_config()
    with open(path) as fh:
        text = fh.read().replace("[paths]\n", f'[paths]\nspool_dir = "{fleet["spool"]}"\n'
                                              f'cluster_store = "{fleet["cluster"]}"\n', 1)
    with open(path, "w") as fh:
        fh.write(text)
    r = CliRunner().invoke(cli, ["cluster", "ingest", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output) == {"judged": 0, "unchanged": 0, "waiting": 0, "removed": 0,
                                    "nccl_probes_carried": 1, "errors": []}
    assert [p["node"] for p in _probes(fleet["cluster"])[0]] == ["gn2"]
