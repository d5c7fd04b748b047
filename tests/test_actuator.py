"""The actuator (drain / fail-job / resume once, ours only, within the budget) and the hook
environment reader, against a fake Slurm backend that records calls."""

import logging
import time

import pytest

from gpuguard.actuator import ActionResult, Actuator
from gpuguard.hookenv import read_hook_env
from gpuguard.slurm import SlurmCli, SlurmError


class FakeSlurm:
    timeout_s = 15.0

    def __init__(self, reason=None, fail=None):
        self.reason = reason
        self.fail = fail or set()
        self.calls = []

    def _do(self, name, *args, timeout_s):
        self.calls.append((name, *args, round(timeout_s, 1)))
        if name in self.fail:
            raise SlurmError(f"{name}: exit 1: boom")

    def node_reason(self, node, *, timeout_s=None):
        self._do("node_reason", node, timeout_s=timeout_s)
        return self.reason

    def drain_node(self, node, reason, *, timeout_s=None):
        self._do("drain_node", node, reason, timeout_s=timeout_s)

    def resume_node(self, node, *, timeout_s=None):
        self._do("resume_node", node, timeout_s=timeout_s)

    def fail_job(self, job_id, reason, *, timeout_s=None):
        self._do("fail_job", job_id, reason, timeout_s=timeout_s)


R = "gpuguard: xid.79 XID 79 GPU has fallen off the bus on gpu2"


def test_drain_once_per_run():
    s = FakeSlurm()
    act = Actuator(s)
    assert act.drain("n1", R) == ActionResult("drain", "n1", "done", "", R)
    second = act.drain("n1", "gpuguard: perf.straggler slow")
    assert (second.status, second.why) == ("refused", "already done by this run")
    assert [c[0] for c in s.calls] == ["node_reason", "drain_node"]


def test_drain_leaves_an_admins_reason_alone():
    s = FakeSlurm(reason="PSU swap ticket 4711")
    res = Actuator(s).drain("n1", R)
    assert (res.status, res.why) == ("refused", "it already carries someone else's reason 'PSU swap ticket 4711'")
    assert [c[0] for c in s.calls] == ["node_reason"]


def test_drain_over_our_own_reason_and_when_reason_unreadable():
    s = FakeSlurm(reason="gpuguard: ecc.dbe old")
    assert Actuator(s).drain("n1", R).done
    s = FakeSlurm(fail={"node_reason"})
    assert Actuator(s).drain("n1", R).done


def test_drain_reason_without_prefix_fails_without_a_call():
    s = FakeSlurm()
    res = Actuator(s).drain("n1", "xid 79")
    assert (res.status, res.why) == ("failed", "reason must start with 'gpuguard:'")
    assert s.calls == []


def test_resume_only_our_drains():
    assert Actuator(FakeSlurm(reason="gpuguard: xid.79 ...")).resume("n1").done
    admin = FakeSlurm(reason="maintenance")
    res = Actuator(admin).resume("n1")
    assert (res.status, res.why) == ("refused", "its reason 'maintenance' is not gpuguard's")
    assert [c[0] for c in admin.calls] == ["node_reason"]
    res = Actuator(FakeSlurm(reason=None)).resume("n1")
    assert (res.status, res.why) == ("refused", "it has no drain/down reason")
    res = Actuator(FakeSlurm(fail={"node_reason"})).resume("n1")
    assert (res.status, res.why) == ("failed", "node_reason: exit 1: boom")


def test_dry_run_calls_nothing(caplog):
    s = FakeSlurm()
    log = logging.getLogger("t-act")
    with caplog.at_level(logging.WARNING, "t-act"):
        res = Actuator(s, dry_run=True, log=log).fail_job("42", R)
    assert (res.status, res.why) == ("refused", "dry run")
    assert s.calls == []
    assert caplog.messages == [f"dry run: would fail job 42: {R}"]


def test_failure_is_a_value_and_logged_as_tool_error(caplog):
    log = logging.getLogger("t-act2")
    with caplog.at_level(logging.WARNING, "t-act2"):
        res = Actuator(FakeSlurm(fail={"fail_job"}), log=log).fail_job("42", R)
    assert (res.status, res.why) == ("failed", "fail_job: exit 1: boom")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("ERROR", "tool error: fail job 42 failed: fail_job: exit 1: boom")]


def test_timeouts_capped_by_the_deadline():
    s = FakeSlurm()
    Actuator(s, deadline=time.monotonic() + 3.0).drain("n1", R)
    assert all(c[-1] <= 3.0 for c in s.calls) and s.calls[0][-1] >= 2.5
    late = FakeSlurm()
    res = Actuator(late, deadline=time.monotonic() + 0.05).resume("n1")
    assert (res.status, res.why) == ("failed", "no time left in the budget")
    assert late.calls == []


def test_slurmcli_backend_argv(fake_slurm_bin):
    act = Actuator(SlurmCli(fake_slurm_bin.bindir))
    assert act.drain("n1", R).done
    assert act.fail_job("42", R).done
    assert fake_slurm_bin(include_reads=True) == [
        ["scontrol", "show", "node", "n1", "-o"],
        ["scontrol", "update", "nodename=n1", "state=drain", f"reason={R}"],
        ["scontrol", "update", "job=42", f"AdminComment={R}"], ["scancel", "42"]]


@pytest.mark.parametrize("env, field, value, problem", [
    ({"SLURM_JOB_ID": "١٢٣"}, "job_id", None, "SLURM_JOB_ID '١٢٣' is not a job id"),
    ({"SLURM_JOB_ID": "42"}, "job_id", "42", None),
    ({"SLURM_JOB_UID": "4294967295"}, "job_uid", None, "SLURM_JOB_UID '4294967295' is not a uid"),
    ({"SLURM_JOB_UID": "1001"}, "job_uid", 1001, None),
    ({"SLURM_JOB_EXIT_CODE": "4294967295"}, "exit_status_raw", 4294967295, None),
    ({"SLURM_JOB_EXIT_CODE": " 768"}, "exit_status_raw", None,
     "SLURM_JOB_EXIT_CODE ' 768' is not an exit status (0..2**32-1)"),
    ({"SLURM_JOB_USER": "a b"}, "job_user", None, "SLURM_JOB_USER 'a b' is not a user name"),
    ({"SLURMD_NODENAME": "gpu-n1"}, "node_name", "gpu-n1", None),
    ({"SLURM_JOB_GPUS": "0,2,GPU-ab"}, "job_gpus", [0, 2], None),
    ({"SLURM_JOB_NUM_NODES": "2"}, "job_num_nodes", 2, None),
    ({"SLURM_JOB_NUM_NODES": "2-4"}, "job_num_nodes", None, "SLURM_JOB_NUM_NODES '2-4' is not a node count"),
])

def test_hook_env_checks(env, field, value, problem):
    h = read_hook_env(env)
    assert getattr(h, field) == value
    assert h.problems == ((problem,) if problem else ())


def test_hook_env_gpus_spec():
    assert read_hook_env({"CUDA_VISIBLE_DEVICES": "GPU-1"}).gpus_spec == "GPU-1"
    assert read_hook_env({"SLURM_JOB_GPUS": "1", "CUDA_VISIBLE_DEVICES": "0"}).gpus_spec == "1"


def test_slurmcli_deadline_caps_and_refuses(fake_slurm_bin):
    late = SlurmCli(fake_slurm_bin.bindir, deadline=time.monotonic() + 0.05)
    with pytest.raises(SlurmError, match="scontrol show node n1: not run: no time left in the budget"):
        late.node_reason("n1")
    assert fake_slurm_bin(include_reads=True) == []
    SlurmCli(fake_slurm_bin.bindir, deadline=time.monotonic() + 5).node_reason("n1")
    assert fake_slurm_bin(include_reads=True) == [["scontrol", "show", "node", "n1", "-o"]]


def test_template_reads_the_checked_environment():
    """A bad SLURM_JOB_ID never reaches scontrol; the node count comes from the env."""
    from gpuguard.epilog.template import job_template

    class NoSlurm:
        def show_job(self, job_id):
            raise AssertionError(f"scontrol called for {job_id!r}")

    t = job_template({"SLURM_JOB_ID": "١٢٣", "SLURM_JOB_PARTITION": "gpu", "SLURM_JOB_GPUS": "0,1",
                      "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NAME": "train"}, slurm=NoSlurm(), gpu_name="NVIDIA H100")
    assert (t.source, t.name.split(".")[0], ".x2.n2." in t.name) == ("derived", "gpu", True)
