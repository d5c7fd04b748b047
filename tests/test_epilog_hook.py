"""The epilog end to end without Slurm: replay GPUs, a kernel-log file, a fake scontrol
that records its argv; the collector stopped through a stub or the real module."""

import importlib.util
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from conftest import node_snapshot

from gpuguard.epilog import hook
from gpuguard.gpu.replay import dump_snapshot
from gpuguard.prolog import hook as prolog_hook
from gpuguard.store import open_store

#: The collector's API (launch.stop_collector/remove_job_dir, ingest.read_job_records) is
#: written alongside; the tests that run it for real wait until it is in the checkout.
REAL_COLLECTOR = (importlib.util.find_spec("gpuguard.collector.ingest") is not None
                  and hasattr(importlib.import_module("gpuguard.collector.launch"), "remove_job_dir"))
needs_collector = pytest.mark.skipif(not REAL_COLLECTOR, reason="collector API not in this checkout yet")

UID = str(os.getuid())
ENV = {"SLURM_JOB_ID": "42", "SLURM_JOB_GPUS": "0,1", "SLURMD_NODENAME": "n1", "SLURM_JOB_UID": UID,
       "SLURM_JOB_GID": str(os.getgid())}
EPILOG_ENV = dict(ENV, SLURM_JOB_EXIT_CODE="768")
DRAIN_ECC = ("gpuguard: ecc.uncorrectable_volatile gpu1 (0000:29:00.0) 2 uncorrectable ECC error(s) "
             "since driver load (2 new)")
XID79 = "[6781741.548779] NVRM: Xid (PCI:0000:3a:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"
DRAIN_79 = "gpuguard: xid.79 XID 79 GPU has fallen off the bus on gpu2 (0000:3a:00)"


def stopped(pid=4242, was_running=True, exited=True, signal_sent="SIGTERM"):
    return SimpleNamespace(pid=pid, was_running=was_running, exited=exited, signal_sent=signal_sent)


def step(rank, n, st, **kw):
    r = {"v": 1, "kind": "step", "rank": rank, "t": 1e9 + n, "step": n, "step_time_s": st, "samples": 8,
         "tokens": None, "loss": 1.0, "loss_nonfinite": False, "grad_norm": None,
         "phases": {"data_wait_s": st / 4, "fwd_bwd_s": st / 2, "comm_s": st / 8, "optim_s": st / 8}}
    r.update(kw)
    return r


@pytest.fixture
def node(tmp_path, make_config, write_replay, fake_slurm_bin, monkeypatch):
    kl = tmp_path / "kern.log"
    kl.write_text("")
    replay = write_replay(node_snapshot(4))
    _path, cfg = make_config("[prolog]\nstart_collector = false\n", replay=replay, kernel_log=str(kl))
    monkeypatch.setattr(hook, "stop_collector", lambda cfg, job_id, timeout_s: stopped())
    return {"kl": kl, "cfg": cfg, "calls": fake_slurm_bin, "db": str(tmp_path / "node.db"), "tmp": tmp_path,
            "replay": replay, "jobs": tmp_path / "jobs", "log": tmp_path / "gpuguard.log"}


def summary(db, job="42"):
    rows = open_store(db).query("select summary from job_summaries where job_id = ?", [job])
    return json.loads(rows[0]["summary"]) if rows else None


def test_ecc_rise_since_prolog_drains_with_reason(node):
    assert prolog_hook.run(ENV) == 0
    # during the job GPU 1 logs two uncorrectable ECC errors (the replay file is what NVML says)
    with open(node["replay"], "w") as fh:
        fh.write(dump_snapshot(node_snapshot(4, gpu1={"ecc_volatile_uncorrected": 2})))
    assert hook.run(EPILOG_ENV) == 0
    assert node["calls"]() == [["scontrol", "update", "nodename=n1", "state=drain", f"reason={DRAIN_ECC}"]]
    s = summary(node["db"])
    assert s["post_job"]["outcome"] == "drain"
    assert s["post_job"]["reason"] == DRAIN_ECC
    assert s["post_job"]["findings"] == [{"code": "ecc.uncorrectable_volatile", "severity": "critical",
                                          "action": "drain", "gpu_index": 1}]
    assert (s["exit_code"], s["exit_text"], s["collector_status"]) == (3, "exit 3", "ok")
    assert f"drained n1: {DRAIN_ECC}" in node["log"].read_text()


def test_xid_during_job_drains_and_is_in_the_summary(node):
    assert prolog_hook.run(ENV) == 0
    node["kl"].write_text(XID79)
    assert hook.run(EPILOG_ENV) == 0
    assert node["calls"]() == [["scontrol", "update", "nodename=n1", "state=drain", f"reason={DRAIN_79}"]]
    s = summary(node["db"])
    assert s["xid_event_count"] == 1
    assert [(e["kind"], e["code"], e["gpu_index"], e["action"]) for e in s["xid_events"]] == [("xid", 79, 2, "drain")]


@needs_collector
def test_healthy_no_scontrol_summary_records_and_dir_removed(node, monkeypatch):
    assert prolog_hook.run(ENV) == 0  # creates jobs/42 owned by the job user
    job_dir = node["jobs"] / "42"
    assert job_dir.is_dir()
    lines = [step(0, 1, 0.5), step(0, 2, 1.5),
             {"v": 1, "kind": "checkpoint", "rank": 0, "t": 1e9 + 3, "step": 2, "duration_s": 4.0}]
    (job_dir / "train.rank0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    seen = []
    real = hook.ingest_records
    monkeypatch.setattr(hook, "ingest_records", lambda st, d, j, n, uid: seen.append((d, j, n, uid)) or real(
        st, d, j, n, uid))
    assert hook.run(dict(EPILOG_ENV, SLURM_JOB_EXIT_CODE="0")) == 0
    assert node["calls"]() == []
    assert seen == [(str(job_dir), "42", "n1", int(UID))]
    st = open_store(node["db"])
    assert st.query("select rank, step, step_time_s, samples, loss_nonfinite, data_wait_s, comm_s from steps") == [
        {"rank": 0, "step": 1, "step_time_s": 0.5, "samples": 8, "loss_nonfinite": 0, "data_wait_s": 0.125,
         "comm_s": 0.0625},
        {"rank": 0, "step": 2, "step_time_s": 1.5, "samples": 8, "loss_nonfinite": 0, "data_wait_s": 0.375,
         "comm_s": 0.1875}]
    assert st.query("select rank, step, duration_s from checkpoints") == [{"rank": 0, "step": 2, "duration_s": 4.0}]
    # the step sub-windows the ingest's trigger kept served the part and are dropped (upkeep)
    assert st.query("select count(*) n from step_windows")[0]["n"] == 0
    s = summary(node["db"])
    assert (s["exit_text"], s["collector_status"], s["step_records"], s["step_time_p50_s"],
            s["data_wait_share_pct"], s["checkpoint_total_s"]) == ("exit 0", "ok", 2, 0.5, 25.0, 4.0)
    assert s["post_job"] == {"outcome": "proceed", "reason": "", "findings": []}
    assert not job_dir.exists()
    # an epilog rerun (slurmd retried it) leaves one copy of everything
    assert hook.run(dict(EPILOG_ENV, SLURM_JOB_EXIT_CODE="0")) == 0
    assert st.query("select count(*) n from steps")[0]["n"] == 2
    assert st.query("select count(*) n from job_summaries")[0]["n"] == 1


def test_store_unwritable_exit_0_nothing_drained(node, monkeypatch):
    p = node["tmp"] / "broken-store.toml"
    p.write_text(f"""[node]\nname = "n1"\n[paths]\nstore = "/proc/nope/node.db"\nlog_file = "{node['log']}"\nrun_dir = "{node['tmp']}/run"
job_dir_root = "{node['jobs']}"\nstate_dir = "{node['tmp']}/state"
[gpu]\nsource = "replay"\nreplay_path = "{node['replay']}"\n[xid]\nkernel_log = "{node['kl']}"\nkernel_log_kernel_only = true
[slurm]\nbin_dir = "{node['calls'].bindir}"\n""")
    monkeypatch.setenv("GPUGUARD_CONFIG", str(p))
    monkeypatch.setattr(hook, "ingest_records", lambda *a: pytest.fail("no store: records stay on disk"))
    assert hook.run(EPILOG_ENV) == 0
    assert node["calls"]() == []
    log = node["log"].read_text()
    assert "tool error: store /proc/nope/node.db: cannot create" in log
    assert "epilog done without a summary (no store)" in log


def test_collector_died_is_recorded(node, monkeypatch):
    monkeypatch.setattr(hook, "stop_collector", lambda cfg, job_id, timeout_s: stopped(4321, False, True, None))
    assert hook.run(EPILOG_ENV) == 0
    ev = open_store(node["db"]).query("select node, kind, pid, job_id, source from events")
    assert ev == [{"node": "n1", "kind": "collector_died", "pid": 4321, "job_id": "42", "source": "epilog"}]
    assert summary(node["db"])["collector_status"] == "died"
    assert node["calls"]() == []


@pytest.mark.parametrize("result, status", [
    (stopped(None, False, True, None), "never_started"),
    (stopped(7, True, False, "SIGKILL"), "did_not_exit"),
    (None, "unknown"),
])
def test_collector_status_mapping(result, status):
    assert hook.collector_status(result) == status


def test_collector_stop_crash_is_a_tool_error(node, monkeypatch):
    def boom(cfg, job_id, timeout_s):
        raise RuntimeError("pidfd trouble")
    monkeypatch.setattr(hook, "stop_collector", boom)
    assert hook.run(EPILOG_ENV) == 0
    assert summary(node["db"])["collector_status"] == "unknown"
    assert "tool error: collector stop: RuntimeError: pidfd trouble" in node["log"].read_text()


@needs_collector
def test_real_collector_module_died_and_real_ingest(node, monkeypatch):
    """The collector's real stop_collector/read_job_records/remove_job_dir: a pid file
    naming a process that is gone = died; records of the job user are ingested; the job
    dir is removed."""
    monkeypatch.undo()  # drop the stop_collector stub (GPUGUARD_CONFIG is set again below)
    monkeypatch.setenv("GPUGUARD_CONFIG", str(node["tmp"] / "gpuguard.toml"))
    from gpuguard.collector import launch

    assert prolog_hook.run(ENV) == 0
    dead = subprocess.Popen(["true"])
    dead.wait()
    os.makedirs(os.path.dirname(launch.pid_file_path(node["cfg"], "42")), exist_ok=True)
    with open(launch.pid_file_path(node["cfg"], "42"), "w") as fh:
        fh.write(f"{dead.pid}\n")
    lines = [step(0, 1, 0.5), step(0, 2, 0.7), {"v": 1, "kind": "checkpoint", "rank": 0, "t": 1e9, "duration_s": 2.0}]
    (node["jobs"] / "42" / "train.rank0.jsonl").write_text(
        "".join(json.dumps(x) + "\n" for x in lines) + "not json\n")
    assert hook.run(EPILOG_ENV) == 0
    s = summary(node["db"])
    assert (s["collector_status"], s["step_records"], s["malformed_records"], s["checkpoint_total_s"]) == (
        "died", 2, 1, 2.0)
    kinds = open_store(node["db"]).query("select kind, pid from events")
    assert kinds == [{"kind": "collector_died", "pid": dead.pid}]
    assert not (node["jobs"] / "42").exists()
    assert not os.path.exists(launch.pid_file_path(node["cfg"], "42"))


@needs_collector
def test_rejected_files_do_not_keep_the_job_dir(node, monkeypatch):
    """Files the user planted (symlink, FIFO, hard link to another user's file) are
    rejected, logged, in the summary, and the job dir goes anyway: targets untouched."""
    monkeypatch.undo()
    monkeypatch.setenv("GPUGUARD_CONFIG", str(node["tmp"] / "gpuguard.toml"))
    assert prolog_hook.run(ENV) == 0
    jd = node["jobs"] / "42"
    secret = node["tmp"] / "secret"
    secret.write_text('{"v":1}\n')
    other = node["tmp"] / "other"
    other.write_text("not yours\n")
    os.chown(other, 4242, 4242)
    os.symlink(secret, jd / "train.rank0.jsonl")
    os.mkfifo(jd / "train.rank1.jsonl")
    os.link(other, jd / "train.rank2.jsonl")
    (jd / "train.rank3.jsonl").write_text(json.dumps(step(3, 1, 0.5)) + "\n")
    assert hook.run(EPILOG_ENV) == 0
    s = summary(node["db"])
    assert s["rejected_files"] == [[str(jd / "train.rank0.jsonl"), "symlink"],
                                   [str(jd / "train.rank1.jsonl"), "not a regular file"],
                                   [str(jd / "train.rank2.jsonl"), f"owned by uid 4242, expected {UID}"]]
    assert (s["step_records"], s["collector_status"]) == (1, "never_started")
    assert not jd.exists()
    assert secret.read_text() == '{"v":1}\n'
    assert (other.read_text(), os.stat(other).st_nlink, os.stat(other).st_uid) == ("not yours\n", 1, 4242)
    log = node["log"].read_text()
    assert "job directory kept" not in log
    assert log.count("training records: ") == 3 and "rejected: symlink" in log


@needs_collector
def test_store_write_failure_keeps_the_job_dir(node, monkeypatch):
    from gpuguard.store import StoreError

    monkeypatch.undo()
    monkeypatch.setenv("GPUGUARD_CONFIG", str(node["tmp"] / "gpuguard.toml"))
    assert prolog_hook.run(ENV) == 0
    jd = node["jobs"] / "42"
    (jd / "train.rank0.jsonl").write_text(json.dumps(step(0, 1, 0.5)) + "\n")

    def fail(store, job_dir, job_id, node_name, uid):
        raise StoreError("store x: training records write failed: disk I/O error")
    monkeypatch.setattr(hook, "ingest_records", fail)
    assert hook.run(EPILOG_ENV) == 0
    assert (jd / "train.rank0.jsonl").read_text() == json.dumps(step(0, 1, 0.5)) + "\n"
    log = node["log"].read_text()
    assert "tool error: training records: StoreError: store x: training records write failed" in log
    assert f"job directory kept: {jd}" in log


@needs_collector
def test_out_of_range_record_drops_only_its_line(node, monkeypatch):
    monkeypatch.undo()
    monkeypatch.setenv("GPUGUARD_CONFIG", str(node["tmp"] / "gpuguard.toml"))
    assert prolog_hook.run(ENV) == 0
    jd = node["jobs"] / "42"
    lines = [step(0, 1, 0.5), step(0, 2**63, 0.5), step(0, 3, 0.5, samples=10**30), step(0, 4, 0.5, t=1.0),
             step(0, 5, 0.5, t=1e12), step(0, 6, 0.5, t=1e300), step(0, 7, 0.5, t=-1e300), step(0, 8, 0.5)]
    (jd / "train.rank0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert hook.run(EPILOG_ENV) == 0
    assert open_store(node["db"]).query("select step from steps order by step") == [{"step": 1}, {"step": 8}]
    s = summary(node["db"])
    assert (s["step_records"], s["malformed_records"], s["records_truncated"]) == (2, 6, False)
    assert not jd.exists()
    assert "tool error" not in node["log"].read_text()


@needs_collector
def test_truncated_ingest_is_in_the_summary_and_the_log(node, monkeypatch):
    from gpuguard.collector import ingest_tail

    monkeypatch.setattr(hook, "ingest_records", lambda st, d, j, n, uid: ingest_tail.ingest_new_records(
        st, d, j, n, uid, final=True, max_records=2))
    assert prolog_hook.run(ENV) == 0
    jd = node["jobs"] / "42"
    (jd / "train.rank0.jsonl").write_text("".join(json.dumps(step(0, n, 0.5)) + "\n" for n in range(5)))
    assert hook.run(EPILOG_ENV) == 0
    s = summary(node["db"])
    assert (s["step_records"], s["records_truncated"]) == (2, True)
    assert ("training records: truncated at the ingest caps; the summary covers the first 2 step and "
            "0 checkpoint record(s)") in node["log"].read_text()


@pytest.mark.parametrize("raw, stored, text", [
    ("99999999999999999999999", None, "unknown"),
    ("4294967296", None, "unknown"),
    ("-1", None, "unknown"),
    ("٧٦٨", None, "unknown"),
    (" 768", None, "unknown"),
    ("", None, "unknown"),
    ("4294967295", 4294967295, "signal 127 (?) core dumped"),
    ("768", 768, "exit 3"),
])
def test_exit_code_out_of_range_is_unknown(node, raw, stored, text):
    assert hook.run(dict(EPILOG_ENV, SLURM_JOB_EXIT_CODE=raw)) == 0
    s = summary(node["db"])
    assert (s["exit_status_raw"], s["exit_text"]) == (stored, text)
    assert "tool error" not in node["log"].read_text()


@pytest.mark.parametrize("job_id", ["١٢٣", "42\n", "²", "1" * 21, "-42", "+42"])
def test_non_ascii_or_odd_job_id_checks_only(node, job_id):
    assert hook.run(dict(EPILOG_ENV, SLURM_JOB_ID=job_id)) == 0
    st = open_store(node["db"])
    assert st.query("select hook, job_id from health_runs") == [{"hook": "epilog", "job_id": None}]
    assert st.query("select count(*) n from job_summaries")[0]["n"] == 0
    assert f"tool error: SLURM_JOB_ID {job_id!r} is not a job id" in node["log"].read_text()


def test_scontrol_failure_still_exit_0(node):
    node["kl"].write_text(XID79)
    (node["tmp"] / "bin" / "scontrol").write_text("#!/bin/sh\necho 'slurm_update error: Access denied' >&2\nexit 1\n")
    assert hook.run(EPILOG_ENV) == 0
    assert "tool error: drain n1 failed: scontrol update nodename=n1 state=drain: exit 1: slurm_update error: " \
           "Access denied" in node["log"].read_text()
    # the fault is not lost: the drain stays pending for the next hook run
    from gpuguard.drainq import PendingDrains
    assert list(PendingDrains(node["cfg"], None).entries()) == ["n1"]


def test_dry_run(node):
    node["kl"].write_text(XID79)
    cfg_path = node["tmp"] / "gpuguard.toml"
    cfg_path.write_text(cfg_path.read_text().replace("[slurm]\n", "[slurm]\ndrain = false\n"))
    assert hook.run(EPILOG_ENV) == 0
    assert node["calls"]() == []
    assert f"dry run: would drain n1: {DRAIN_79}" in node["log"].read_text()


def test_bad_config_exit_0(tmp_path, monkeypatch):
    p = tmp_path / "bad.toml"
    p.write_text("[epilog]\ntime_budget_s = -1\n")
    monkeypatch.setenv("GPUGUARD_CONFIG", str(p))
    assert hook.run(EPILOG_ENV) == 0


def test_bad_job_id_checks_only(node):
    assert hook.run(dict(EPILOG_ENV, SLURM_JOB_ID="../../etc")) == 0
    assert open_store(node["db"]).query("select hook, job_id from health_runs") == [{"hook": "epilog", "job_id": None}]
    assert "is not a job id" in node["log"].read_text()


def test_budget_exceeded_exit_0(monkeypatch):
    monkeypatch.setattr(hook, "run", lambda env=None: time.sleep(5) or 1)
    t = time.monotonic()
    assert hook.run_with_budget(0.2) == 0
    assert time.monotonic() - t < 4


def test_crash_exit_0(monkeypatch):
    def boom(env=None):
        raise KeyError("bug")
    monkeypatch.setattr(hook, "run", boom)
    assert hook.run_with_budget(5) == 0


@needs_collector
def test_console_script_exits_0_with_an_empty_environment(node):
    """The real process as slurmd starts it: no PATH, no HOME (SLURM-FACTS §3)."""
    exe = os.path.join(os.path.dirname(sys.executable), "gpuguard-epilog")
    env = dict(EPILOG_ENV, GPUGUARD_CONFIG=str(node["tmp"] / "gpuguard.toml"), SLURM_JOB_EXIT_CODE="9")
    p = subprocess.run([exe], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    s = summary(node["db"])
    assert (s["exit_signal"], s["exit_text"], s["collector_status"]) == (9, "signal 9 (SIGKILL)", "never_started")


def test_fail_job_finding_after_the_job_is_recorded_as_the_alert_it_was(node, make_config, write_replay):
    """The job has ended: the Epilog cancels nothing; its run, findings, summary and node
    history say alert/proceed with the reason naming why, never fail-job."""
    from gpuguard.ops.nodes import history

    _path, _ = make_config('[prolog]\nstart_collector = false\n[policy]\n"config.persistence_off" = "fail-job"\n',
                           replay=write_replay(node_snapshot(4, gpu2={"persistence_mode": False})),
                           kernel_log=str(node["kl"]))
    assert hook.run(EPILOG_ENV) == 0
    assert node["calls"]() == []
    reason = ("gpuguard: config.persistence_off gpu2 (0000:3a:00.0) persistence mode off"
              " (fail-job after the job ended: alerted only)")
    st = open_store(node["db"])
    assert st.query("select hook, job_id, decision, policy_decision, reason from health_runs") == [
        {"hook": "epilog", "job_id": "42", "decision": "proceed", "policy_decision": "fail-job", "reason": reason}]
    assert st.query("select code, action from findings where code = 'config.persistence_off'") == [
        {"code": "config.persistence_off", "action": "alert"}]
    s = summary(node["db"])
    assert (s["post_job"]["outcome"], s["post_job"]["reason"]) == ("proceed", reason)
    assert [f["action"] for f in s["post_job"]["findings"] if f["code"] == "config.persistence_off"] == ["alert"]
    assert [r["what"] for r in history(st, "n1") if r["kind"] == "finding"] == [
        "config.persistence_off gpu2 warning -> alert"]
    from gpuguard.config import load
    from gpuguard.ops import metrics

    reg, errors = metrics.build_registry(load(_path), st)
    assert errors == []
    assert reg.get_sample_value("gpuguard_health_findings", {
        "node": "n1", "code": "config.persistence_off", "severity": "warning", "action": "alert", "gpu": "2"}) == 1
    assert reg.get_sample_value("gpuguard_health_findings", {
        "node": "n1", "code": "config.persistence_off", "severity": "warning", "action": "fail-job", "gpu": "2"}) is None
    assert "post-job finding with action fail-job, alerted (the job has ended; nothing to fail)" in \
        node["log"].read_text()


def test_fail_job_after_the_job_is_told_by_the_decisions_flag_not_its_reason_text(node, make_config, write_replay,
                                                                                   monkeypatch):
    """The Epilog tells a fail-job alerted after the job by Decision.fail_job_alerted: a
    reworded note (or none) changes neither the log nor what is recorded."""
    from gpuguard import policy

    real = policy.after_job

    def reworded(decision):
        d = real(decision)
        d.reason = d.reason.replace(policy.AFTER_JOB_NOTE, " [alerted: the job had ended]")
        return d

    monkeypatch.setattr(policy, "after_job", reworded)
    make_config('[prolog]\nstart_collector = false\n[policy]\n"config.persistence_off" = "fail-job"\n',
                replay=write_replay(node_snapshot(4, gpu2={"persistence_mode": False})), kernel_log=str(node["kl"]))
    assert hook.run(EPILOG_ENV) == 0
    assert node["calls"]() == []
    reason = "gpuguard: config.persistence_off gpu2 (0000:3a:00.0) persistence mode off [alerted: the job had ended]"
    st = open_store(node["db"])
    assert st.query("select decision, reason from health_runs") == [{"decision": "proceed", "reason": reason}]
    assert st.query("select action from findings where code = 'config.persistence_off'") == [{"action": "alert"}]
    assert "post-job finding with action fail-job, alerted (the job has ended; nothing to fail): " + reason in \
        node["log"].read_text()


def test_mig_node_part_gives_the_controller_the_node_side_template(node, make_config, write_replay, tmp_path):
    """A MIG node samples no GPU: the controller's template counted 0 sampled GPUs and
    had no GPU name ('gpu._.x_.n1.train') where the node side derives from SLURM_JOB_GPUS
    and its inventory ('gpu.h100-80gb-hbm3.x2.n1.train'). The part carries both facts."""
    from gpuguard.epilog import part as part_mod
    from gpuguard.epilog.judge import _template, judge_parts, meta_from_env
    from gpuguard.epilog.template import job_template

    sp = tmp_path / "spool"
    sp.mkdir()
    mig = {f"gpu{i}": {"mig_mode": True} for i in range(4)}
    path, _cfg = make_config("[prolog]\nstart_collector = false\n", replay=write_replay(node_snapshot(4, **mig)),
                             kernel_log=str(node["kl"]))
    with open(path) as fh:
        text = fh.read()
    with open(path, "w") as fh:
        fh.write(text.replace("[paths]\n", f'[paths]\nspool_dir = "{sp}"\n', 1))
    env = dict(ENV, SLURM_JOB_PARTITION="gpu", SLURM_JOB_NUM_NODES="1")
    assert prolog_hook.run(env) == 0
    assert hook.run(dict(env, SLURM_JOB_EXIT_CODE="0")) == 0
    parts = part_mod.read_parts(str(sp), "42", None)
    assert list(parts) == ["n1"] and parts["n1"]["gpus"] == []
    assert (parts["n1"]["job"]["gpus"], parts["n1"]["job"]["gpu_name"]) == (2, "NVIDIA H100 80GB HBM3")
    meta = meta_from_env(dict(env, SLURM_JOB_NAME="train", SLURM_JOB_NODELIST="n1", SLURM_JOB_EXIT_CODE="0"), ["n1"])
    node_side = job_template(env, job_info={"JobName": "train"}, gpu_name="NVIDIA H100 80GB HBM3").name
    assert node_side == _template(meta, parts).name == "gpu.h100-80gb-hbm3.x2.n1.train"
    cluster = open_store(str(tmp_path / "cluster.db"))
    from gpuguard.config import load

    res = judge_parts(cluster, "42", parts, cfg=load(path), meta=meta, slurm=None, log=hook_log(),
                      set_comment=False)
    assert res.verdict["template"] == "gpu.h100-80gb-hbm3.x2.n1.train"
    assert cluster.query("select gpus from cluster_jobs") == [{"gpus": 2}]  # sacct AllocTRES gres/gpu=2
    cluster.close()


def hook_log():
    import logging

    return logging.getLogger("test")
