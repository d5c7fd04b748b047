"""NCCL probe + node baseline with a fake all_reduce_perf replaying corpus outputs."""

from __future__ import annotations

import time

import pytest

from gpuguard import config as config_mod
from gpuguard.net.nccl_baseline import config_key, node_reference
from gpuguard.net.nccl_check import errors_finding, probe_node, prolog_wants_probe
from gpuguard.net.nccl_probe import build_argv
from gpuguard.policy import decide
from gpuguard.store import open_store
from nccl_fake import DATA, FakeProbe, healthy_text, scaled


@pytest.fixture
def env(tmp_path):
    fake = FakeProbe(tmp_path / "fake")
    cfg = config_mod.from_dict({"node": {"name": "gn1", "gpu_count": 8},
                                "nccl": {"binary": str(fake.binary), "timeout_s": 30.0}})
    store = open_store(str(tmp_path / "node.db"))
    yield cfg, store, fake
    store.close()


def _seed(cfg, store, fake, n=5):
    for _ in range(n):
        fake.push(healthy_text())
        out = probe_node(cfg, store, hook="health")
        assert (out.state, out.findings) == ("ok", [])


def _codes(out):
    return [f.code for f in out.findings]


def test_default_argv():
    cfg = config_mod.from_dict({"node": {"gpu_count": 8}})
    assert build_argv(cfg) == ["/usr/local/bin/all_reduce_perf", "-b", "67108864", "-e", "1073741824", "-f", "2",
                               "-g", "8", "-n", "20", "-w", "5", "-c", "1"]
    cfg = config_mod.from_dict({"nccl": {"command": ["/opt/nt/all_reduce_perf", "-b", "1G", "-e", "1G", "-g", "{gpus}"],
                                         "gpus": 4}})
    assert build_argv(cfg) == ["/opt/nt/all_reduce_perf", "-b", "1G", "-e", "1G", "-g", "4"]


def test_healthy_probes_build_the_baseline(env):
    cfg, store, fake = env
    _seed(cfg, store, fake, 3)
    ref = node_reference(store, "gn1", config_key(build_argv(cfg)), 10)
    assert sorted(ref.by_size) == [67108864 * 2**i for i in range(8)]
    med, mad, n = ref.by_size[8589934592]
    assert (med, mad, n) == (pytest.approx((338.82 + 337.35) / 2), 0.0, 3)
    rows = store.query("select state, gpu_model, hook from nccl_probes")
    assert rows == [{"state": "ok", "gpu_model": "NVIDIA H100 80GB HBM3", "hook": "health"}] * 3


def test_low_three_times_in_a_row_is_busbw_low_and_drains(env):
    cfg, store, fake = env
    _seed(cfg, store, fake)
    low = scaled(healthy_text(), 0.6)
    for i in (1, 2):
        fake.push(low)
        fake.push(low)  # the re-measure
        out = probe_node(cfg, store, hook="health")
        assert (out.state, _codes(out), out.consecutive) == ("low", ["nccl.busbw_low_pending"], i)
        assert len(out.runs) == 2
        assert decide(out.findings).outcome == "proceed"
    fake.push(low)
    fake.push(low)
    out = probe_node(cfg, store, hook="health")
    assert (out.state, _codes(out), out.consecutive) == ("low", ["nccl.busbw_low"], 3)
    assert out.judgement.against == ["node"] and out.judgement.ratio["node"] == pytest.approx(0.6, abs=0.01)
    d = decide(out.findings)
    assert d.outcome == "drain"
    assert d.reason == "gpuguard: nccl.busbw_low NCCL all-reduce busbw at 60% of node baseline, 3 probes in a row"
    assert fake.pending() == 0


def test_single_low_reading_that_does_not_repeat_is_healthy(env):
    cfg, store, fake = env
    _seed(cfg, store, fake)
    fake.push(scaled(healthy_text(), 0.6))
    fake.push(healthy_text())
    out = probe_node(cfg, store, hook="health")
    assert (out.state, out.findings, len(out.runs)) == ("ok", [], 2)


def test_an_ok_probe_resets_the_run_of_lows(env):
    cfg, store, fake = env
    _seed(cfg, store, fake)
    low = scaled(healthy_text(), 0.6)
    for text in (low, low, low, low, healthy_text(), low, low):
        fake.push(text)
    states = [probe_node(cfg, store, hook="health").state for _ in range(4)]
    assert states == ["low", "low", "ok", "low"]
    assert store.query("select count(*) n from nccl_probes where state = 'low'")[0]["n"] == 3


def test_small_dip_within_noise_is_not_low(env):
    cfg, store, fake = env
    _seed(cfg, store, fake)
    fake.push(scaled(healthy_text(), 0.9))
    out = probe_node(cfg, store, hook="health")
    assert (out.state, out.findings, len(out.runs)) == ("ok", [], 1)


def test_wrong_nonzero_is_nccl_errors(env):
    cfg, store, fake = env
    fake.push((DATA / "nccl-allreduce-2.18.3-dgxh100-wrong-nonzero.txt").read_text())
    out = probe_node(cfg, store, hook="health")
    assert (out.state, _codes(out)) == ("errors", ["nccl.errors"])
    assert out.findings[0].message == "NCCL probe: #wrong 475896"
    assert decide(out.findings).reason == "gpuguard: nccl.errors NCCL probe: #wrong 475896"


def test_nccl_failure_exit_3_alerts_without_draining(env):
    """'unhandled system error' (shared memory, container setup) is no evidence against
    the hardware: nccl.failure alerts, the fabric checks drain on link evidence."""
    cfg, store, fake = env
    fake.push((DATA / "nccl-tests-failure-unhandled-system-error-2020.txt").read_text(), rc=3)
    out = probe_node(cfg, store, hook="health")
    assert _codes(out) == ["nccl.failure"]
    assert out.findings[0].evidence["returncode"] == 3
    assert decide(out.findings).outcome == "proceed"
    assert [a for _f, a in decide(out.findings).actions] == ["alert"]


@pytest.mark.parametrize("name", ["nccl-warn-nvls-bind-timestamped-2026.txt",
                                  "nccl-ib-completion-error-vendor-err-2024.txt"])
def test_setup_faults_in_saved_logs_alert(name):
    """NVLS bind failures (IMEX / fabric manager) and IBV_WC_LOC_PROT_ERR (memory
    registration) are setup faults: nccl.failure, alert, never a drain."""
    from gpuguard.net.nccl_parse import parse

    f = errors_finding(parse((DATA / name).read_text()))
    assert (f.code, f.severity) == ("nccl.failure", "warning")
    assert decide([f]).outcome == "proceed"


def test_hang_is_a_tool_fault_within_budget(env):
    cfg, store, fake = env
    fake.push_hang()
    t0 = time.monotonic()
    out = probe_node(cfg, store, hook="prolog", budget_left_s=8.0)
    took = time.monotonic() - t0
    assert took < 8.0
    assert (out.state, _codes(out)) == ("failed", ["nccl.probe_failed"])
    assert out.findings[0].message == "NCCL probe failed: timed out after 6 s (hung; process group killed)"
    assert decide(out.findings).outcome == "proceed"
    assert store.query("select state from nccl_probes") == [{"state": "failed"}]


def test_no_budget_left_does_not_start(env):
    cfg, store, fake = env
    fake.push(healthy_text())
    out = probe_node(cfg, store, hook="prolog", budget_left_s=3.0)
    assert out.findings[0].message == "NCCL probe failed: no time left to probe (1.0 s < 5 s)"
    assert fake.pending() == 1


def test_missing_binary_is_a_tool_fault(tmp_path):
    cfg = config_mod.from_dict({"node": {"name": "gn1", "gpu_count": 8},
                                "nccl": {"binary": str(tmp_path / "nope" / "all_reduce_perf")}})
    out = probe_node(cfg, None, hook="health")
    assert _codes(out) == ["nccl.probe_failed"]
    assert out.findings[0].message.startswith("NCCL probe failed: cannot run ")
    assert decide(out.findings).outcome == "proceed"


def test_header_only_output_is_a_tool_fault_not_healthy(env):
    cfg, store, fake = env
    fake.push((DATA / "nccl-header-collective-test-starting-2.19.3.txt").read_text())
    out = probe_node(cfg, store, hook="health")
    assert (out.state, _codes(out)) == ("failed", ["nccl.probe_failed"])
    assert out.findings[0].message == "NCCL probe failed: no results (all_reduce_perf: no results (output ends early))"


def test_low_against_the_fleet_without_own_history(env, tmp_path):
    cfg, store, fake = env
    for node in ("gn2", "gn3", "gn4"):
        other = config_mod.from_dict({"node": {"name": node, "gpu_count": 8},
                                      "nccl": {"binary": str(fake.binary), "timeout_s": 30.0}})
        fake.push(healthy_text())
        assert probe_node(other, store, hook="health").state == "ok"
    low = scaled(healthy_text(), 0.7)
    fake.push(low)
    fake.push(low)
    out = probe_node(cfg, store, hook="health")
    assert out.state == "low" and out.judgement.against == ["fleet"]
    assert out.judgement.ratio == {"fleet": pytest.approx(0.7, abs=0.01)}


@pytest.mark.parametrize("mode,nodes,want", [("never", "4", False), ("multi-node", "1", False),
                                             ("multi-node", "2", True), ("always", "1", True),
                                             ("multi-node", "9" * 5000, False), ("multi-node", "4294967296", False),
                                             ("multi-node", "-2", False), ("multi-node", "\u0662", False)])
def test_prolog_mode(mode, nodes, want):
    cfg = config_mod.from_dict({"nccl": {"prolog": mode}})
    assert prolog_wants_probe(cfg, {"SLURM_JOB_NUM_NODES": nodes}) is want


# --- in the Prolog -------------------------------------------------------------------

@pytest.fixture
def prolog_node(tmp_path, make_config, write_replay, fake_slurm_bin):
    from conftest import node_snapshot

    fake = FakeProbe(tmp_path / "fake")
    replay = write_replay(node_snapshot(4))
    make_config(f'[prolog]\nstart_collector = false\ntime_budget_s = 20.0\n'
                f'[nccl]\nprolog = "multi-node"\nbinary = "{fake.binary}"\n', replay=replay)
    return fake, fake_slurm_bin, str(tmp_path / "node.db")


PENV = {"SLURM_JOB_ID": "42", "SLURM_JOB_GPUS": "0,1,2,3", "SLURMD_NODENAME": "n1", "SLURM_JOB_NUM_NODES": "2"}


def test_prolog_probe_errors_drain_with_reason(prolog_node):
    from gpuguard.prolog import hook

    fake, calls, db = prolog_node
    fake.push((DATA / "nccl-allreduce-2.18.3-dgxh100-wrong-nonzero.txt").read_text())
    assert hook.run(PENV) == 1
    assert calls() == [["scontrol", "update", "nodename=n1", "state=drain",
                        "reason=gpuguard: nccl.errors NCCL probe: #wrong 475896"]]
    rows = open_store(db).query("select code, action, job_id from findings where code like 'nccl.%'")
    assert rows == [{"code": "nccl.errors", "action": "drain", "job_id": "42"}]


def test_prolog_probe_drains_when_the_pending_list_cannot_be_written(prolog_node, monkeypatch):
    """The Prolog exits 1 for the probe's drain, so it drains with gpuguard's reason even
    when the pending-drain list cannot be written (as the live check's drain does):
    otherwise Slurm drains with 'Prolog error', a reason gpuguard never resumes, while the
    run records a gpuguard drain."""
    from gpuguard import drainq
    from gpuguard.prolog import hook

    fake, calls, db = prolog_node
    monkeypatch.setattr(drainq.PendingDrains, "add", lambda self, *a, **k: False)
    fake.push((DATA / "nccl-allreduce-2.18.3-dgxh100-wrong-nonzero.txt").read_text())
    assert hook.run(PENV) == 1
    assert calls() == [["scontrol", "update", "nodename=n1", "state=drain",
                        "reason=gpuguard: nccl.errors NCCL probe: #wrong 475896"]]
    assert open_store(db).query("select decision, reason from health_runs") == [
        {"decision": "drain", "reason": "gpuguard: nccl.errors NCCL probe: #wrong 475896"}]


def test_prolog_probe_hang_stays_inside_the_budget_and_proceeds(prolog_node):
    from gpuguard.prolog import hook

    fake, calls, db = prolog_node
    fake.push_hang()
    t0 = time.monotonic()
    assert hook.run(PENV) == 0
    assert time.monotonic() - t0 < 10.0  # half of the 20 s budget at most
    assert calls() == []
    rows = open_store(db).query("select code, action from findings where code like 'nccl.%'")
    assert rows == [{"code": "nccl.probe_failed", "action": "record"}]


def test_prolog_single_node_job_is_not_probed(prolog_node):
    from gpuguard.prolog import hook

    fake, _calls, _db = prolog_node
    fake.push(healthy_text())
    assert hook.run(dict(PENV, SLURM_JOB_NUM_NODES="1")) == 0
    assert fake.pending() == 1


def test_cli_probe_and_baseline(tmp_path, make_config):
    from click.testing import CliRunner

    from gpuguard.cli import main

    fake = FakeProbe(tmp_path / "fake")
    path, _cfg = make_config(f'[nccl]\nbinary = "{fake.binary}"\n')
    for _ in range(3):
        fake.push(healthy_text())
        r = CliRunner().invoke(main, ["--config", path, "nccl", "probe"])
        assert r.exit_code == 0 and r.output.startswith("state: ok (NVIDIA H100 80GB HBM3)")
    fake.push(scaled(healthy_text(), 0.6))
    fake.push(scaled(healthy_text(), 0.6))
    r = CliRunner().invoke(main, ["--config", path, "nccl", "probe", "--json"])
    assert r.exit_code == 1
    import json

    doc = json.loads(r.output)
    assert doc["state"] == "low" and doc["consecutive_low"] == 1
    assert doc["busbw_gbs_by_size"]["8589934592"] == pytest.approx(338.09 * 0.6, abs=0.01)
    assert [f["code"] for f in doc["findings"]] == ["nccl.busbw_low_pending"]
    r = CliRunner().invoke(main, ["--config", path, "nccl", "baseline"])
    assert r.exit_code == 0
    assert "  8589934592 B  median  338.085 GB/s  MAD  0.000  (3 probes)" in r.output
    r = CliRunner().invoke(main, ["--config", path, "nccl", "baseline", "--format", "csv"])
    assert r.exit_code == 0 and r.output.splitlines()[0] == "size_b,median_gbs,mad_gbs,probes"
    assert r.output.splitlines()[-1] == "8589934592,338.085,0.0,3"
    fake.push_hang()
    r = CliRunner().invoke(main, ["--config", path, "nccl", "probe", "--timeout", "5", "--no-record"])
    assert r.exit_code == 1 and "nccl.probe_failed  NCCL probe failed: timed out after 5 s" in r.output


# --- as a gpuguard health step -------------------------------------------------------

def _step_ctx(cfg, store, snap):
    from gpuguard.ops.steps import StepContext

    return StepContext(cfg, store, cfg.node_name, snap, time.monotonic() + 40.0)


def test_health_step_registered_with_the_nccl_interval():
    from gpuguard.ops.steps import load_steps

    st = load_steps()["nccl_probe"]
    assert st.interval_s(config_mod.from_dict({})) == 21600.0
    assert st.interval_s(config_mod.from_dict({"nccl": {"interval_s": 60.0}})) == 60.0


def test_health_step_probes_idle_gpus_only(env):
    from conftest import node_snapshot

    from gpuguard.net.health_step import gpus_busy, nccl_probe
    from gpuguard.ops.steps import Skip

    cfg, store, fake = env
    busy = node_snapshot(4, gpu2={"gpu_util_pct": 97.0}, gpu3={"mem_used_mib": 40000.0})
    assert gpus_busy(busy, cfg) == [2, 3]
    fake.push(healthy_text())
    with pytest.raises(Skip):
        nccl_probe(_step_ctx(cfg, store, busy))
    assert fake.pending() == 1  # a job's GPUs are never taken
    assert nccl_probe(_step_ctx(cfg, store, node_snapshot(4))) == []
    assert fake.pending() == 0
    assert store.query("select hook, state from nccl_probes") == [{"hook": "health", "state": "ok"}]


def test_health_step_off_when_nccl_tests_is_not_installed(tmp_path):
    from conftest import node_snapshot

    from gpuguard.net.health_step import nccl_probe
    from gpuguard.ops.steps import Skip

    cfg = config_mod.from_dict({"nccl": {"binary": str(tmp_path / "none" / "all_reduce_perf")}})
    with pytest.raises(Skip):
        nccl_probe(_step_ctx(cfg, None, node_snapshot(2)))
    cfg = config_mod.from_dict({"nccl": {"command": [str(tmp_path / "none" / "all_reduce_perf"), "-g", "{gpus}"]}})
    (f,) = nccl_probe(_step_ctx(cfg, None, node_snapshot(2)))
    assert f.code == "nccl.probe_failed"


def test_store_opened_before_the_net_set_gets_its_tables(tmp_path):
    """gpuguard health opens its store before loading its steps: the probe creates the
    ``net`` tables itself instead of letting an insert invent a table without its key."""
    from gpuguard.store import CORE

    fake = FakeProbe(tmp_path / "fake")
    cfg = config_mod.from_dict({"node": {"name": "gn1", "gpu_count": 8}, "nccl": {"binary": str(fake.binary)}})
    store = open_store(str(tmp_path / "early.db"), sets=[CORE])
    assert store.query("select name from sqlite_master where name = 'nccl_probes'") == []
    fake.push(healthy_text())
    out = probe_node(cfg, store, hook="health")
    assert (out.state, out.probe_id, out.tool_errors) == ("ok", 1, [])
    cols = [r["name"] for r in store.query("select name from pragma_table_info('nccl_probes')")]
    assert cols[:3] == ["id", "node", "at"]
    store.close()


def test_fleet_median_read_from_a_separate_cluster_store(tmp_path):
    fake = FakeProbe(tmp_path / "fake")
    cluster_path = str(tmp_path / "cluster.db")
    for node in ("gn2", "gn3", "gn4"):  # rows the cluster store holds for other nodes
        other = config_mod.from_dict({"node": {"name": node, "gpu_count": 8}, "nccl": {"binary": str(fake.binary)}})
        cs = open_store(cluster_path)
        fake.push(healthy_text())
        assert probe_node(other, cs, hook="health").state == "ok"
        cs.close()
    cfg = config_mod.from_dict({"node": {"name": "gn1", "gpu_count": 8}, "nccl": {"binary": str(fake.binary)},
                                "paths": {"store": str(tmp_path / "node.db"), "cluster_store": cluster_path}})
    store = open_store(cfg.store_path)
    low = scaled(healthy_text(), 0.7)
    fake.push(low)
    fake.push(low)
    out = probe_node(cfg, store, hook="health")
    assert (out.state, out.judgement.against, out.tool_errors) == ("low", ["fleet"], [])
    store.close()


def test_missing_or_broken_cluster_store_leaves_the_node_baseline_judging(env, tmp_path):
    cfg0, store, fake = env
    _seed(cfg0, store, fake)
    low = scaled(healthy_text(), 0.6)
    for cluster, errors in ((tmp_path / "absent.db", []), (tmp_path / "bad.db", ["nccl fleet baseline"])):
        if cluster.name == "bad.db":
            cluster.write_text("not a database " * 100)
        cfg = config_mod.from_dict({"node": {"name": "gn1", "gpu_count": 8},
                                    "nccl": {"binary": str(fake.binary), "timeout_s": 30.0},
                                    "paths": {"cluster_store": str(cluster)}})
        fake.push(low)
        fake.push(low)
        out = probe_node(cfg, store, hook="health")
        assert (out.state, out.judgement.against) == ("low", ["node"])
        assert [e.split(":")[0] for e in out.tool_errors] == errors


def test_prolog_probe_drain_is_suppressed_in_maintenance(tmp_path, make_config, write_replay, fake_slurm_bin):
    """A node in maintenance is not drained by the NCCL probe, exactly as the live check's
    drain is suppressed: the job proceeds (exit 0, not Slurm's 'Prolog error' drain), no
    scontrol call, the finding is recorded and the suppression is a node action."""
    from conftest import node_snapshot

    from gpuguard.prolog import hook

    fake = FakeProbe(tmp_path / "fake")
    make_config(f'[prolog]\nstart_collector = false\ntime_budget_s = 20.0\n'
                f'[nccl]\nprolog = "multi-node"\nbinary = "{fake.binary}"\n'
                '[maintenance]\nslurm_reservations = false\nwindows = [{nodes = "n[1-2]", '
                'start = "2020-01-01T00:00:00Z", end = "2099-01-01T00:00:00Z", reason = "PSU swap"}]\n',
                replay=write_replay(node_snapshot(4)))
    fake.push((DATA / "nccl-allreduce-2.18.3-dgxh100-wrong-nonzero.txt").read_text())
    assert hook.run(PENV) == 0
    assert fake_slurm_bin() == []
    st = open_store(str(tmp_path / "node.db"))
    assert st.query("select code, action, job_id from findings where code like 'nccl.%'") == [
        {"code": "nccl.errors", "action": "drain", "job_id": "42"}]
    assert st.query("select action, by, outcome, why, reason from node_actions") == [
        {"action": "suppressed", "by": "prolog", "outcome": "refused",
         "why": "would drain: in maintenance (window: PSU swap) until 2099-01-01T00:00:00Z",
         "reason": "gpuguard: nccl.errors NCCL probe: #wrong 475896"}]
    assert "pending" not in {p.name.split("_")[0] for p in (tmp_path / "state").iterdir()}


def test_a_node_reads_the_cluster_store_without_writing_it(env, tmp_path):
    """The cluster store has one writer (the controller): a node's probe reads the fleet
    reference read-only, never migrates it, and a store with no probe carried in yet gives
    no fleet reference and no tool error."""
    import hashlib
    import sqlite3

    cfg0, store, fake = env
    _seed(cfg0, store, fake)
    cluster = tmp_path / "cluster.db"
    con = sqlite3.connect(cluster)
    con.execute("create table verdicts (job_id text)")  # a cluster store the judge made, no probes yet
    con.commit()
    con.close()
    before = hashlib.sha256(cluster.read_bytes()).hexdigest()
    cfg = config_mod.from_dict({"node": {"name": "gn1", "gpu_count": 8},
                                "nccl": {"binary": str(fake.binary), "timeout_s": 30.0},
                                "paths": {"cluster_store": str(cluster)}})
    low = scaled(healthy_text(), 0.6)
    fake.push(low)
    fake.push(low)
    out = probe_node(cfg, store, hook="health")
    assert (out.state, out.judgement.against, out.tool_errors) == ("low", ["node"], [])
    assert hashlib.sha256(cluster.read_bytes()).hexdigest() == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("cluster.db")) == ["cluster.db"]
