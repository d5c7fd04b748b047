"""gpuguard health and the kernel-log cursor lock: the lock is held from the kernel-log
read to the cursor's move only (as in the hooks), never while the slow registered steps
(the NCCL probe) run; a step that crashes or is killed loses nothing the log showed."""

from __future__ import annotations

import threading

import pytest
from test_ops_health import LOG, REASON79, XID79, H

from gpuguard import cursorlock
from gpuguard.health import read_cursor_file
from gpuguard.model import Finding
from gpuguard.ops import healthcheck, steps
from gpuguard.store import open_store

LINK_DOWN = "gpuguard: nvlink.link_down probe: link 3 down"


@pytest.fixture
def hc(tmp_path, make_config, write_replay, monkeypatch):
    steps.load_steps()  # the shipped steps register in the real registry, not in this test's
    monkeypatch.setattr(steps, "STEPS", {})
    return H(tmp_path, make_config, write_replay)


def _rows(cfg, sql):
    st = open_store(cfg.store_path, create=False)
    try:
        return [tuple(r.values()) for r in st.query(sql)]
    finally:
        st.close()


def test_a_hook_gets_the_cursor_lock_while_a_slow_step_runs(hc):
    """A Prolog starting while the health run's NCCL probe runs takes the real lock at
    once (before: it waited its bounded 3 s and skipped its kernel-log scan); by then the
    XID 79 drain is on the node and the cursor has moved past it."""
    in_step, finish = threading.Event(), threading.Event()
    seen = {}

    @steps.step("slow_probe")
    def slow_probe(ctx):
        in_step.set()
        assert finish.wait(30)
        return []

    cfg = hc.config()
    hc.kern.write_text(XID79)
    t = threading.Thread(target=lambda: seen.update(out=healthcheck.main_run(cfg, LOG)))
    t.start()
    try:
        assert in_step.wait(60)
        lock = cursorlock.acquire(cfg, wait_s=0.5)  # raises LockNotTaken when the step holds it
        assert (lock.fd is not None, lock.why) == (True, "")
        lock.release()
        assert read_cursor_file(cfg) is not None
        assert hc.slurm.node("n1")["reason"] == REASON79
    finally:
        finish.set()
        t.join(60)
    out = seen["out"]
    assert (out.result.decision.outcome, out.result.decision.reason, out.tool_errors) == ("drain", REASON79, [])
    assert hc.actions() == [("drain", "health", "done", "reboot")]


def test_a_run_killed_in_its_steps_loses_no_xid(hc):
    """The watchdog kills the run while a step hangs (here: SystemExit out of the step):
    the drain is on the node, the run and its XID 79 are in the store, and the next run
    neither reads the XID again nor drains again."""
    calls = []

    @steps.step("hung_probe")
    def hung_probe(ctx):
        calls.append(1)
        if len(calls) == 1:
            raise SystemExit("killed by the watchdog")
        return []

    cfg = hc.config()
    hc.kern.write_text(XID79)
    with pytest.raises(SystemExit):
        healthcheck.main_run(cfg, LOG)
    assert hc.slurm.node("n1")["reason"] == REASON79
    assert _rows(cfg, "select kind, code from events") == [("xid", 79)]
    assert _rows(cfg, "select decision, reason from health_runs") == [("drain", REASON79)]
    out = hc.run()
    assert out.result.decision.outcome == "proceed"
    assert _rows(cfg, "select kind, code from events") == [("xid", 79)]
    assert len([c for c in hc.slurm.updates() if "state=drain" in c]) == 1


def test_a_crashing_step_is_a_tool_error_and_the_xid_drain_stands(hc):
    @steps.step("bad_probe")
    def bad_probe(ctx):
        raise RuntimeError("nccl-tests segfaulted")

    cfg = hc.config()
    hc.kern.write_text(XID79)
    out = healthcheck.main_run(cfg, LOG)
    assert out.tool_errors == ["health step bad_probe crashed: RuntimeError: nccl-tests segfaulted"]
    assert (out.result.decision.outcome, hc.slurm.node("n1")["reason"]) == ("drain", REASON79)
    assert _rows(cfg, "select kind, code from events") == [("xid", 79)]


def test_a_drain_only_a_step_finds_goes_through_the_pending_list(hc):
    """No XID: the step's finding drains, recorded on the run with its decision."""
    @steps.step("probe")
    def probe(ctx):
        return [Finding("nvlink.link_down", "critical", "probe: link 3 down", 2)]

    cfg = hc.config()
    out = hc.run()
    assert (out.result.decision.outcome, out.result.decision.reason) == ("drain", LINK_DOWN)
    assert hc.slurm.node("n1")["reason"] == LINK_DOWN
    assert _rows(cfg, "select decision, reason from health_runs") == [("drain", LINK_DOWN)]
    assert _rows(cfg, "select code, action from findings") == [("nvlink.link_down", "drain")]
    assert [a[:3] for a in hc.actions()] == [("drain", "health", "done")]


def test_a_step_finding_beside_an_xid_drain_keeps_the_reason_on_the_node(hc):
    @steps.step("probe")
    def probe(ctx):
        return [Finding("nvlink.link_down", "critical", "probe: link 3 down", 2)]

    cfg = hc.config()
    hc.kern.write_text(XID79)
    out = hc.run()
    assert (out.result.decision.reason, hc.slurm.node("n1")["reason"]) == (REASON79, REASON79)
    assert _rows(cfg, "select decision, reason from health_runs") == [("drain", REASON79)]
    assert sorted(_rows(cfg, "select code, action from findings")) == [("nvlink.link_down", "drain"),
                                                                      ("xid.79", "drain")]
    assert hc.actions() == [("drain", "health", "done", "reboot")]


def test_a_dry_run_drains_nothing_keeps_nothing_pending_and_moves_the_cursor(hc):
    """[slurm] drain = false: the XID 79 is recorded and a refusal logged, no scontrol
    update, nothing pending to fire once drains are switched on; read once only."""
    from gpuguard import config as config_mod
    from gpuguard.drainq import PendingDrains

    hc.config()
    path = hc.tmp / "gpuguard.toml"  # make_config's file
    path.write_text(path.read_text().replace("[slurm]\n", "[slurm]\ndrain = false\n"))
    hc.cfg = cfg = config_mod.load(str(path))
    hc.kern.write_text(XID79)
    out = hc.run()
    assert (out.result.decision.outcome, out.result.decision.reason) == ("drain", REASON79)
    assert hc.slurm.updates() == []
    assert PendingDrains(cfg, None).entries() == {}
    assert read_cursor_file(cfg) is not None
    # recorded as what was done: a dry run held the drain back (as maintenance's "suppressed")
    assert hc.actions() == [("dry-run", "health", "refused", "reboot")]
    assert hc.run().result.decision.outcome == "proceed"  # the XID is not read again
    assert _rows(cfg, "select kind, code from events") == [("xid", 79)]
