"""What a run did is what health_runs.decision and node_actions.action say, the policy's
verdict beside it in policy_decision: a drain held back by maintenance is `suppressed`, by
`[slurm] drain = false` `dry-run` (from `gpuguard health` and from the hooks alike), as an
escalated fail-job is recorded as the drain it became."""

from __future__ import annotations

import logging

import pytest
from conftest import node_snapshot
from ops_fake_slurm import FakeSlurm

from gpuguard.ops import healthcheck
from gpuguard.ops.nodes import clean_runs_since
from gpuguard.store import open_store

XID79 = "[  912.345678] NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"
WINDOW = ('[maintenance]\nslurm_reservations = false\nwindows = [{nodes = "n[1-2]", start = "2020-01-01T00:00:00Z", '
          'end = "2099-01-01T00:00:00Z", reason = "PSU swap"}]\n')
MAINT = "in maintenance (window: PSU swap) until 2099-01-01T00:00:00Z"
DRY = "[slurm]\ndrain = false\n"
ENV = {"SLURM_JOB_ID": "7", "SLURMD_NODENAME": "n1", "SLURM_JOB_GPUS": "0"}
LOG = logging.getLogger("test")


def _rows(cfg):
    st = open_store(cfg.store_path, create=False)
    try:
        runs = [(r["hook"], r["decision"], r["policy_decision"])
                for r in st.query("select * from health_runs order by id")]
        acts = [(r["action"], r["by"], r["outcome"], r["why"], r["policy_decision"])
                for r in st.query("select * from node_actions order by id")]
        return runs, acts
    finally:
        st.close()


@pytest.fixture
def faulty(tmp_path, make_config, write_replay):
    (tmp_path / "kern.log").write_text(XID79)
    slurm = FakeSlurm(tmp_path)

    def config(extra):
        from gpuguard import config as config_mod

        path, cfg = make_config("[prolog]\nstart_collector = false\n[health]\nsend_alerts = false\n"
                                + ("" if extra == DRY else extra), replay=write_replay(node_snapshot(4)))
        if extra == DRY:  # into the [slurm] table make_config writes
            with open(path) as fh:
                text = fh.read()
            with open(path, "w") as fh:
                fh.write(text.replace("[slurm]\n", DRY, 1))
            cfg = config_mod.load(path)
        return cfg
    return config, slurm


def _prolog():
    from gpuguard.prolog.hook import run
    return run(dict(ENV))


def _epilog():
    from gpuguard.epilog.hook import run
    return run(dict(ENV))


@pytest.mark.parametrize("hook, rc", [("prolog", 0), ("epilog", 0)])
def test_hook_in_maintenance_records_suppressed(faulty, hook, rc):
    config, slurm = faulty
    cfg = config(WINDOW)
    assert (_prolog if hook == "prolog" else _epilog)() == rc
    assert slurm.updates() == []
    runs, acts = _rows(cfg)
    assert runs == [(hook, "suppressed", "drain")]
    assert acts == [("suppressed", hook, "refused", f"would drain: {MAINT}", "drain")]  # no dry-run row beside it


@pytest.mark.parametrize("hook, rc", [("prolog", 0), ("epilog", 0)])
def test_hook_dry_run_records_dry_run(faulty, hook, rc):
    config, slurm = faulty
    cfg = config(DRY)
    assert (_prolog if hook == "prolog" else _epilog)() == rc
    assert slurm.updates() == []
    runs, acts = _rows(cfg)
    assert runs == [(hook, "dry-run", "drain")]
    assert acts == [("dry-run", hook, "refused", "would drain: dry run ([slurm] drain = false)", "drain")]


@pytest.mark.parametrize("extra, done, action, why", [
    (WINDOW, "suppressed", "suppressed", f"would drain: {MAINT}"),
    (DRY, "dry-run", "dry-run", "would drain: dry run ([slurm] drain = false)"),
])
def test_health_records_what_it_did_once(faulty, extra, done, action, why):
    config, slurm = faulty
    cfg = config(extra)
    for _ in range(3):
        out = healthcheck.main_run(cfg, LOG)
        assert out.tool_errors == []
    assert slurm.node("n1")["state"] == "IDLE"
    runs, acts = _rows(cfg)
    assert runs[0] == ("health", done, "drain")
    assert acts == [(action, "health", "refused", why, "drain")]
    st = open_store(cfg.store_path, create=False)
    try:
        assert clean_runs_since(st, "n1", 0.0) == 2  # the held-back run is not clean; the later two are
    finally:
        st.close()


def test_a_store_from_before_the_step_reads_policy_decision_null(tmp_path):
    st = open_store(str(tmp_path / "n.db"))
    try:
        cols = {r[1] for r in st.conn.execute("pragma table_info(health_runs)")}
        assert "policy_decision" in cols
        cols = {r[1] for r in st.conn.execute("pragma table_info(node_actions)")}
        assert "policy_decision" in cols
    finally:
        st.close()
