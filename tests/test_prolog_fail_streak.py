"""``fail-job`` escalates to a drain when the same finding code failed
``[prolog] fail_job_escalate_count`` jobs in a row on the node within
``fail_job_escalate_window_s`` (gpuguard.failstreak): without it a node with a persistent
fault stays up, attracts every job and the Prolog cancels each one."""

import json

import pytest
from conftest import node_snapshot

from gpuguard import failstreak
from gpuguard.config import from_dict
from gpuguard.prolog import hook

ENV = {"SLURM_JOB_ID": "42", "SLURM_JOB_GPUS": "0,1", "SLURMD_NODENAME": "n1"}
FAIL_REASON = "gpuguard: config.persistence_off gpu2 (0000:3a:00.0) persistence mode off"
DRAIN_REASON = ("gpuguard: config.persistence_off failed 3 jobs in a row within 3600 s; drained: "
                "gpu2 (0000:3a:00.0) persistence mode off")
POLICY = '[prolog]\nstart_collector = false\n[policy]\n"config.persistence_off" = "fail-job"\n'


@pytest.fixture
def node(tmp_path, make_config, write_replay, fake_slurm_bin):
    kl = tmp_path / "kern.log"
    kl.write_text("")
    faulty = write_replay(node_snapshot(4, gpu2={"persistence_mode": False}))

    def config(extra: str = "", healthy: bool = False):
        snap = write_replay(node_snapshot(4), name="healthy.json") if healthy else faulty
        return make_config(POLICY.replace("[policy]", extra + "[policy]"), replay=snap, kernel_log=str(kl))[1]

    config()
    return {"config": config, "calls": fake_slurm_bin, "tmp": tmp_path}


def _fail(job):
    return [["scontrol", "update", f"job={job}", f"AdminComment={FAIL_REASON}"], ["scancel", job]]


def _drain():
    return [["scontrol", "update", "nodename=n1", "state=drain", f"reason={DRAIN_REASON}"]]


def test_third_job_failed_in_a_row_drains_the_node(node):
    assert [hook.run(dict(ENV, SLURM_JOB_ID=j)) for j in ("42", "43", "44")] == [0, 0, 1]
    assert node["calls"]() == _fail("42") + _fail("43") + _drain()
    log = (node["tmp"] / "gpuguard.log").read_text()
    assert f"fail-job escalated to drain after 3 jobs: {DRAIN_REASON}" in log


def test_escalated_drain_is_recorded_as_the_drain_with_the_policys_fail_job_beside_it(node):
    from gpuguard.store import open_store

    assert [hook.run(dict(ENV, SLURM_JOB_ID=j)) for j in ("42", "43", "44")] == [0, 0, 1]
    st = open_store(str(node["tmp"] / "node.db"), create=False)
    try:
        assert [(r["job_id"], r["decision"], r["policy_decision"]) for r in
                st.query("select * from health_runs order by id")] == [
            ("42", "fail-job", "fail-job"), ("43", "fail-job", "fail-job"), ("44", "drain", "fail-job")]
        assert [(r["action"], r["by"], r["outcome"], r["reason"], r["policy_decision"]) for r in
                st.query("select * from node_actions order by id")] == [
            ("drain", "prolog", "done", DRAIN_REASON, "fail-job")]
    finally:
        st.close()


def test_a_fault_that_clears_starts_the_count_afresh(node):
    assert [hook.run(dict(ENV, SLURM_JOB_ID=j)) for j in ("42", "43")] == [0, 0]
    node["config"](healthy=True)
    assert hook.run(dict(ENV, SLURM_JOB_ID="44")) == 0  # proceeds: the fault cleared
    node["config"]()
    assert [hook.run(dict(ENV, SLURM_JOB_ID=j)) for j in ("45", "46", "47")] == [0, 0, 1]
    assert node["calls"]() == _fail("42") + _fail("43") + _fail("45") + _fail("46") + _drain()


def test_a_job_counts_once_and_the_count_is_configurable(node):
    node["config"]("fail_job_escalate_count = 2\n")
    assert [hook.run(dict(ENV, SLURM_JOB_ID=j)) for j in ("42", "42", "43")] == [0, 0, 1]
    assert node["calls"]() == _fail("42") + _fail("42") + [
        ["scontrol", "update", "nodename=n1", "state=drain",
         "reason=" + DRAIN_REASON.replace("failed 3 jobs", "failed 2 jobs")]]


def test_zero_never_escalates(node):
    node["config"]("fail_job_escalate_count = 0\n")
    assert [hook.run(dict(ENV, SLURM_JOB_ID=str(j))) for j in range(42, 47)] == [0] * 5
    assert node["calls"]() == [c for j in range(42, 47) for c in _fail(str(j))]


def test_a_broken_config_counts_nothing(node):
    """Our fault: with a config error no job is failed and nothing is counted."""
    from gpuguard.hookrun import load_config

    cfg, _ = load_config()
    for j in ("40", "41", "42"):
        assert hook.run(dict(ENV, SLURM_JOB_ID=j), loaded=(cfg, "c.toml: broken")) == 0
    assert node["calls"]() == []
    assert [hook.run(dict(ENV, SLURM_JOB_ID=j)) for j in ("43", "44", "45")] == [0, 0, 1]


def test_an_unwritable_streak_fails_the_job_as_before(node, monkeypatch):
    from gpuguard import durable

    def refuse(*a, **k):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(durable, "write", refuse)
    assert [hook.run(dict(ENV, SLURM_JOB_ID=j)) for j in ("42", "43", "44")] == [0, 0, 0]
    assert node["calls"]() == _fail("42") + _fail("43") + _fail("44")
    assert "tool error: fail-job streak: [Errno 30] Read-only file system" in (node["tmp"] / "gpuguard.log").read_text()


def _cfg(tmp_path, count=3, window=3600.0):
    return from_dict({"paths": {"state_dir": str(tmp_path / "s"), "run_dir": ""},
                      "prolog": {"fail_job_escalate_count": count, "fail_job_escalate_window_s": window}}, "c.toml")


def test_note_counts_within_the_window_per_code(tmp_path):
    (tmp_path / "s").mkdir()
    cfg = _cfg(tmp_path)
    assert failstreak.note(cfg, ["a", "b"], "1", now=1000.0) is None
    assert failstreak.note(cfg, ["b"], "2", now=2000.0) is None  # a's run: cleared
    assert failstreak.note(cfg, ["a", "b"], "3", now=3000.0) == ("b", 3)
    # 1000, 2000 and 3000 are out of the 1 h window at 7000: b counts afresh
    assert failstreak.note(cfg, ["b"], "4", now=7000.0) is None
    assert failstreak.note(cfg, ["b"], "5", now=7100.0) is None
    assert failstreak.note(cfg, ["b"], "6", now=7200.0) == ("b", 3)
    assert failstreak.note(cfg, [], None, now=7300.0) is None  # a job proceeded
    assert failstreak.note(cfg, ["b"], "7", now=7400.0) is None
    assert failstreak.note(cfg, ["b"], "8", now=7500.0) is None


def test_escalation_reason_is_cut_like_every_drain_reason():
    r = failstreak.reason("xid.48", 3, 3600.0, "x" * 300)
    assert len(r) == 200 and r.startswith("gpuguard: xid.48 failed 3 jobs in a row within 3600 s; drained: xxx")
    assert r.endswith("...")


def test_an_escalated_drain_slurm_refuses_stays_pending(node):
    """The escalation drains through the pending-drain list: when scontrol fails, the
    drain is kept for the next run, and the Prolog still exits 1."""
    from gpuguard import durable, drainq

    sc = node["tmp"] / "bin" / "scontrol"
    real = sc.read_text()
    assert [hook.run(dict(ENV, SLURM_JOB_ID=j)) for j in ("42", "43")] == [0, 0]
    sc.write_text("#!/bin/sh\necho 'slurm_update error: Unable to contact slurm controller' >&2\nexit 1\n")
    assert hook.run(dict(ENV, SLURM_JOB_ID="44")) == 1
    cfg = node["config"]()
    entries, _ = durable.read(durable.state_dirs(cfg), drainq.FILE)
    assert entries["n1"]["reason"] == DRAIN_REASON
    sc.write_text(real)
    hook.run(dict(ENV, SLURM_JOB_ID="45"))  # the next run retries the pending drain first
    assert ["scontrol", "update", "nodename=n1", "state=drain", f"reason={DRAIN_REASON}"] in node["calls"]()


def test_an_escalated_drain_is_recorded_as_the_drain_it_was(node):
    """The third job's run drained the node (no job was failed): health_runs, its findings
    and node_actions say drain with the escalation reason, not the live check's fail-job,
    so `node show`, the history and the metrics tell what was done."""
    from gpuguard.store import open_store

    assert [hook.run(dict(ENV, SLURM_JOB_ID=j)) for j in ("42", "43", "44")] == [0, 0, 1]
    st = open_store(str(node["tmp"] / "node.db"))
    assert st.query("select job_id, decision, reason from health_runs order by id") == [
        {"job_id": "42", "decision": "fail-job", "reason": FAIL_REASON},
        {"job_id": "43", "decision": "fail-job", "reason": FAIL_REASON},
        {"job_id": "44", "decision": "drain", "reason": DRAIN_REASON}]
    assert st.query("select job_id, code, action from findings where code = 'config.persistence_off' "
                    "order by id") == [
        {"job_id": "42", "code": "config.persistence_off", "action": "fail-job"},
        {"job_id": "43", "code": "config.persistence_off", "action": "fail-job"},
        {"job_id": "44", "code": "config.persistence_off", "action": "drain"}]
    [act] = st.query("select action, by, outcome, reason, evidence from node_actions")
    assert (act["action"], act["by"], act["outcome"], act["reason"]) == ("drain", "prolog", "done", DRAIN_REASON)
    assert [e["code"] for e in json.loads(act["evidence"])] == ["config.persistence_off"]



def test_a_fail_job_slurm_refuses_is_recorded_with_the_run(node):
    """The run that decided fail-job but could not cancel the job says so in its record
    (the actuator's log line alone leaves `node show` and the metrics saying it was done)."""
    from gpuguard.store import open_store

    sc = node["tmp"] / "bin" / "scancel"
    sc.write_text("#!/bin/sh\necho 'scancel: error: Kill job error on job id 42: Unable to contact slurm "
                  "controller' >&2\nexit 1\n")
    assert hook.run(ENV) == 0
    [run] = open_store(str(node["tmp"] / "node.db")).query("select decision, tool_errors from health_runs")
    assert run["decision"] == "fail-job"
    [err] = json.loads(run["tool_errors"])
    assert err.startswith("fail-job of job 42 not done: ") and "Unable to contact slurm controller" in err, err
