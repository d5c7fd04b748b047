"""gpuguard health (HealthCheckProgram): drain on a fault, resume only our own drains of
an 'auto' recovery kind after N clean runs, never an admin's, never in maintenance."""

from __future__ import annotations

import logging

import pytest
from conftest import node_snapshot
from ops_fake_slurm import FakeSlurm

from gpuguard.ops import healthcheck
from gpuguard.store import open_store

XID79 = "[  912.345678] NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"
LOG = logging.getLogger("test")
REASON79 = "gpuguard: xid.79 XID 79 GPU has fallen off the bus on gpu0 (0000:18:00)"


class H:
    def __init__(self, tmp_path, make_config, write_replay):
        self.tmp, self.make_config, self.write_replay = tmp_path, make_config, write_replay
        self.slurm = FakeSlurm(tmp_path)  # tmp_path/bin: make_config's [slurm] bin_dir
        self.kern = tmp_path / "kern.log"

    def config(self, extra="", snap=None, health=""):
        replay = self.write_replay(snap or node_snapshot(4))
        _, self.cfg = self.make_config(f"[health]\nsend_alerts = false\n{health}\n" + extra, replay=replay)
        return self.cfg

    def run(self):
        out = healthcheck.main_run(self.cfg, LOG)
        assert out.tool_errors == [], out.tool_errors
        return out

    def actions(self):
        st = open_store(self.cfg.store_path, create=False)
        try:
            return [(r["action"], r["by"], r["outcome"], r["recovery"])
                    for r in st.query("select * from node_actions order by id")]
        finally:
            st.close()


@pytest.fixture
def hc(tmp_path, make_config, write_replay):
    return H(tmp_path, make_config, write_replay)


def test_xid79_on_idle_node_drains_and_is_never_resumed(hc):
    hc.config()
    hc.kern.write_text(XID79)
    out = hc.run()
    assert out.result.decision.outcome == "drain"
    n1 = hc.slurm.node("n1")
    assert (n1["state"], n1["reason"]) == ("IDLE+DRAIN", REASON79)
    assert hc.actions() == [("drain", "health", "done", "reboot")]
    for _ in range(5):  # the kernel log has nothing new: clean runs, but XID 79 needs a reboot
        hc.run()
    assert hc.slurm.node("n1")["reason"] == REASON79
    assert hc.actions() == [("drain", "health", "done", "reboot")]
    assert [c for c in hc.slurm.updates() if "state=resume" in c] == []


def test_auto_fault_resumes_after_n_clean_runs(hc):
    hot = node_snapshot(4, gpu1={"clock_event_reasons": ["hw_slowdown"], "gpu_util_pct": 0.0})
    hc.config(health="resume_after_clean_runs = 3", snap=hot)
    out = hc.run()
    assert out.result.decision.outcome == "drain", out.result.decision
    reason = hc.slurm.node("n1")["reason"]
    assert reason.startswith("gpuguard: throttle.hw_slowdown_idle")
    hc.config(health="resume_after_clean_runs = 3")  # the fault has cleared
    hc.run()
    hc.run()
    assert hc.slurm.node("n1")["reason"] == reason  # 2 clean runs: still drained
    out = hc.run()
    assert hc.slurm.node("n1") == {"state": "IDLE", "reason": None, "stamp": None}
    assert hc.actions() == [("drain", "health", "done", "auto"), ("resume", "health", "done", "auto")]
    assert out.actions[0]["evidence"]["clean_runs"] == 3


def test_a_faulty_run_restarts_the_clean_count(hc):
    hot = node_snapshot(4, gpu1={"clock_event_reasons": ["hw_slowdown"]})
    hc.config(health="resume_after_clean_runs = 2", snap=hot)
    hc.run()
    hc.config(health="resume_after_clean_runs = 2")
    hc.run()
    hc.config(health="resume_after_clean_runs = 2", snap=hot)
    hc.run()  # fault back: already drained by us, nothing new
    hc.config(health="resume_after_clean_runs = 2")
    hc.run()
    assert hc.slurm.node("n1")["state"] == "IDLE+DRAIN"
    hc.run()
    assert hc.slurm.node("n1")["state"] == "IDLE"


def test_admin_drained_node_is_never_resumed_nor_redrained(hc):
    hc.config()
    hc.slurm.admin_drain("n1", "bad fan, ticket 4711")
    hc.kern.write_text(XID79)
    hc.run()
    assert hc.slurm.node("n1")["reason"] == "bad fan, ticket 4711"
    assert hc.actions() == [("drain", "health", "refused", "reboot")]
    for _ in range(4):
        hc.run()
    assert hc.slurm.node("n1")["reason"] == "bad fan, ticket 4711"
    assert hc.slurm.updates() == []
    assert len(hc.actions()) == 1  # the refusal is recorded once, not every run


def test_admin_redrain_over_our_reason_is_not_resumed_nhc_134(hc):
    hot = node_snapshot(4, gpu1={"clock_event_reasons": ["hw_slowdown"]})
    hc.config(health="resume_after_clean_runs = 1", snap=hot)
    hc.run()
    ours = hc.slurm.node("n1")["reason"]
    # The admin keeps the node out for repair and re-drains it with the very same text.
    hc.slurm.admin_drain("n1", ours)
    hc.config(health="resume_after_clean_runs = 1")
    hc.run()
    hc.run()
    assert hc.slurm.node("n1")["state"] == "IDLE+DRAIN"
    assert hc.actions() == [("drain", "health", "done", "auto"), ("resume", "health", "refused", "auto")]


def test_maint_reservation_suppresses_drain_and_alerts(hc):
    hc.config()
    hc.slurm.set(reservations="ReservationName=fix StartTime=2026-11-30T10:00:00 EndTime=2099-12-01T10:00:00 "
                              "Duration=1-00:00:00 Nodes=n[1-2] NodeCnt=2 CoreCnt=4 Features=(null) "
                              "PartitionName=(null) Flags=MAINT,SPEC_NODES TRES=cpu=4 Users=root Groups=(null) "
                              "Accounts=(null) Licenses=(null) State=ACTIVE BurstBuffer=(null) Watts=n/a\n")
    hc.kern.write_text(XID79)
    out = hc.run()
    assert out.maintenance.active and out.maintenance.source == "reservation fix"
    assert out.result.decision.outcome == "drain"  # decided and recorded ...
    assert hc.slurm.node("n1")["state"] == "IDLE"  # ... but not acted on
    assert hc.actions() == [("suppressed", "health", "refused", "reboot")]
    assert not (hc.tmp / "state" / "alerts.spool").exists()


def test_config_window_suppresses(hc):
    hc.config('[maintenance]\nslurm_reservations = false\nwindows = [{nodes = "n[1-4]", '
              'start = "2020-01-01T00:00:00Z", end = "2099-01-01T00:00:00Z", reason = "PSU swap"}]\n')
    hc.kern.write_text(XID79)
    out = hc.run()
    assert out.maintenance.line() == "in maintenance (window: PSU swap) until 2099-01-01T00:00:00Z"
    assert hc.slurm.node("n1")["state"] == "IDLE"


def test_hook_drain_is_recorded_and_traced_to_its_findings(hc):
    """A drain the Prolog made (same store) is recorded by the next health run, with the
    prolog's findings as evidence and their recovery kind."""
    from gpuguard.health import run_health
    from gpuguard.ops.nodes import record_action  # noqa: F401

    cfg = hc.config()
    hc.kern.write_text(XID79)
    st = open_store(cfg.store_path)
    res = run_health(cfg, hook="prolog", store=st, job_id="7")
    st.close()
    hc.slurm.admin_drain("n1", res.decision.reason, user="root")
    hc.run()
    assert hc.actions() == [("drain", "prolog", "done", "reboot")]
    assert hc.slurm.node("n1")["state"] == "IDLE+DRAIN"


def test_second_run_while_first_holds_the_lock_skips(hc):
    cfg = hc.config()
    fd = healthcheck._lock(cfg)
    try:
        out = healthcheck.main_run(cfg, LOG)
        assert out.skipped == "previous run still running"
    finally:
        import os

        os.close(fd)


def test_registered_step_every_s_reports_cached_findings(hc, monkeypatch):
    from gpuguard.model import Finding
    from gpuguard.ops import steps

    calls = []
    monkeypatch.setattr(steps, "STEPS", {})

    @steps.step("probe", every_s=3600)
    def probe(ctx):
        calls.append(ctx.node)
        return [Finding("nvlink.link_down", "critical", "probe says link 3 down", 2)]

    hc.config()
    hc.run()
    out = hc.run()
    assert calls == ["n1"]
    f = next(f for f, _ in out.result.decision.actions if f.code == "nvlink.link_down")
    assert f.gpu_index == 2 and "cached_at" in f.evidence
    assert out.result.decision.outcome == "drain"


def test_parse_node_reason_as_slurm_22_05_prints_it():
    from gpuguard.ops.nodes import parse_node

    text = ("NodeName=n1 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 State=IDLE+DRAIN ThreadsPerCore=1 "
            "ExtSensorsTemp=n/s Reason=gpuguard: xid.13 pid=77 name=python [y] [root@2026-11-30T18:18:32]\n")
    n = parse_node(text)
    assert (n.name, n.state, n.reason, n.stamp) == ("n1", "IDLE+DRAIN", "gpuguard: xid.13 pid=77 name=python [y]",
                                                    "root@2026-11-30T18:18:32")
    assert n.drained and n.ours
    assert parse_node("NodeName=n2 State=MIXED Partitions=gpu").reason is None


def test_a_failed_drain_is_retried_by_the_next_run(hc):
    hc.config()
    hc.kern.write_text(XID79)
    real = hc.slurm.bindir / "scontrol"
    saved = real.read_text()
    real.write_text("#!/bin/sh\n[ \"$1\" = update ] && { echo 'slurm_update error: Unable to contact slurm controller' >&2; exit 1; }\n"
                    + saved.split("\n", 1)[1].join(["exec python3 - \"$@\" <<'PY'\n", "\nPY\n"]))
    real.chmod(0o755)
    out = healthcheck.main_run(hc.cfg, LOG)
    assert [(a["action"], a["outcome"]) for a in out.actions] == [("drain", "failed")]
    assert hc.slurm.node("n1")["state"] == "IDLE"
    real.write_text(saved)
    hc.run()  # the kernel log has nothing new, but the failed drain is retried
    assert hc.slurm.node("n1")["reason"] == REASON79
    assert [a[:3] for a in hc.actions()] == [("drain", "health", "failed"), ("drain", "health", "done")]


def test_a_skipped_step_keeps_its_last_findings(hc, monkeypatch):
    from gpuguard.model import Finding
    from gpuguard.ops import steps

    monkeypatch.setattr(steps, "STEPS", {})
    answers = [[Finding("nvlink.link_down", "critical", "probe: link 3 down", 2)], steps.Skip("GPUs busy"), []]

    @steps.step("probe")  # no every_s: runs every time
    def probe(ctx):
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a

    hc.config()
    assert hc.run().result.decision.outcome == "drain"
    out = hc.run()  # skipped: the last findings stand (here: nothing stored without every_s)
    assert out.result.decision.outcome == "proceed"


def test_a_skipped_rate_limited_step_reports_its_last_findings(hc, monkeypatch):
    from gpuguard.model import Finding
    from gpuguard.ops import steps

    monkeypatch.setattr(steps, "STEPS", {})
    answers = [[Finding("nvlink.link_down", "critical", "probe: link 3 down", 2)], steps.Skip("GPUs busy")]

    @steps.step("probe", every_s=1e-9)  # always due
    def probe(ctx):
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a

    hc.config()
    hc.run()
    out = hc.run()
    f = next(f for f, _ in out.result.decision.actions if f.code == "nvlink.link_down")
    assert "cached_at" in f.evidence
    assert out.result.decision.outcome == "drain"


def test_a_second_fault_while_drained_blocks_the_resume(hc):
    hot = node_snapshot(4, gpu1={"clock_event_reasons": ["hw_slowdown"]})
    hc.config(health="resume_after_clean_runs = 1", snap=hot)
    hc.run()
    reason = hc.slurm.node("n1")["reason"]
    assert reason.startswith("gpuguard: throttle.hw_slowdown_idle")
    hc.kern.write_text(XID79)  # the GPU falls off the bus while the node is drained
    hc.run()
    assert hc.slurm.node("n1")["reason"] == reason  # the reason on the node stays the first one
    hc.config(health="resume_after_clean_runs = 1")  # the slowdown clears
    hc.run()
    hc.run()
    assert hc.slurm.node("n1")["state"] == "IDLE+DRAIN"
    assert hc.actions()[-1] == ("resume", "health", "refused", "reboot")


def test_console_script_as_slurmd_runs_it(hc, tmp_path):
    """``gpuguard-health`` with only SLURMD_NODENAME (+ the config path) in the
    environment, as slurmd runs HealthCheckProgram: drains, exits 0."""
    import os
    import subprocess
    import sys

    hc.config()
    hc.kern.write_text(XID79)
    exe = os.path.join(os.path.dirname(sys.executable), "gpuguard-health")
    env = {"SLURMD_NODENAME": "n1", "GPUGUARD_CONFIG": os.environ["GPUGUARD_CONFIG"]}
    cp = subprocess.run([exe], env=env, capture_output=True, text=True, timeout=120)
    assert (cp.returncode, cp.stdout) == (0, "")
    assert hc.slurm.node("n1")["reason"] == REASON79
    # a broken config: nothing is drained or resumed on the defaults, still exit 0
    bad = tmp_path / "bad.toml"
    bad.write_text("[health\n")
    cp = subprocess.run([exe], env=dict(env, GPUGUARD_CONFIG=str(bad)), capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0
