"""gpuguard.collector.launch: job directory safety, detached start, pid file, stop."""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
import time

import pytest
from conftest import node_snapshot

from gpuguard.collector import launch
from gpuguard.collector.launch import (
    CollectorRunning,
    JobDirError,
    PrepareError,
    StopResult,
    ensure_job_dir,
    prepare_job,
    start_collector,
    stop_collector,
)
from gpuguard.store import open_store

UID, GID = 1001, 1001


def wait_exit(pid: int, timeout: float = 10.0) -> int | None:
    """Reap our child ``pid``; its exit status, or None if still running at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return None  # already reaped
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    return None


# -- job directory -----------------------------------------------------------------------


def test_job_dir_created_owned_by_the_job_user(tmp_path):
    root = tmp_path / "jobs"
    path = ensure_job_dir(str(root), "42", UID, GID)
    assert path == str(root / "42")
    st = os.lstat(path)
    assert stat.S_ISDIR(st.st_mode) and (st.st_uid, st.st_gid) == (UID, GID)
    assert stat.S_IMODE(st.st_mode) == 0o700
    rst = os.lstat(root)
    assert rst.st_uid == 0 and stat.S_IMODE(rst.st_mode) & 0o022 == 0


def test_symlink_at_the_path_is_replaced_never_followed(tmp_path):
    root = tmp_path / "jobs"
    root.mkdir(mode=0o755)
    victim = tmp_path / "etc"
    victim.mkdir(mode=0o755)
    (victim / "shadow").write_text("secret")
    (root / "42").symlink_to(victim)
    path = ensure_job_dir(str(root), "42", UID, GID)
    vst = os.lstat(victim)
    assert (vst.st_uid, vst.st_gid, stat.S_IMODE(vst.st_mode)) == (0, 0, 0o755)
    assert os.lstat(victim / "shadow").st_uid == 0 and (victim / "shadow").read_text() == "secret"
    st = os.lstat(path)
    assert stat.S_ISDIR(st.st_mode) and not stat.S_ISLNK(st.st_mode) and st.st_uid == UID


def test_symlink_to_a_file_and_plain_file_are_replaced(tmp_path):
    root = tmp_path / "jobs"
    root.mkdir(mode=0o755)
    target = tmp_path / "passwd"
    target.write_text("x")
    (root / "1").symlink_to(target)
    (root / "2").write_text("junk")
    for j in ("1", "2"):
        st = os.lstat(ensure_job_dir(str(root), j, UID, GID))
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == UID
    assert os.lstat(target).st_uid == 0 and target.read_text() == "x"


def test_existing_dir_of_another_user_is_replaced_own_dir_is_kept(tmp_path):
    root = tmp_path / "jobs"
    root.mkdir(mode=0o755)
    stale = root / "7"
    stale.mkdir()
    (stale / "train.rank0.jsonl").write_text("old")
    (stale / "link").symlink_to(tmp_path)  # rmtree must not descend through it
    os.chown(stale, 2002, 2002)
    ensure_job_dir(str(root), "7", UID, GID)
    assert os.listdir(stale) == [] and os.lstat(stale).st_uid == UID
    assert tmp_path.exists()
    (stale / "train.rank0.jsonl").write_text("mine")
    os.chmod(stale, 0o755)
    ensure_job_dir(str(root), "7", UID, GID)  # a requeued job keeps its records
    assert (stale / "train.rank0.jsonl").read_text() == "mine"
    assert stat.S_IMODE(os.lstat(stale).st_mode) == 0o700


def test_unsafe_root_is_refused(tmp_path):
    root = tmp_path / "jobs"
    root.mkdir()
    root.chmod(0o777)
    with pytest.raises(JobDirError, match="not group/other-writable"):
        ensure_job_dir(str(root), "1", UID, GID)
    assert not (root / "1").exists()
    real = tmp_path / "real"
    real.mkdir(mode=0o755)
    link = tmp_path / "linkroot"
    link.symlink_to(real)
    with pytest.raises(JobDirError):
        ensure_job_dir(str(link), "1", UID, GID)
    assert os.listdir(real) == []
    with pytest.raises(PrepareError, match="not a Slurm job id"):
        ensure_job_dir(str(real), "../etc", UID, GID)


def test_prepare_job_without_collector(tmp_path, make_config):
    _, cfg = make_config("[prolog]\nstart_collector = false\n")
    log = launch.logging.getLogger("test")
    res = prepare_job(cfg, {"SLURM_JOB_ID": "42", "SLURM_JOB_UID": str(UID), "SLURM_JOB_GID": str(GID)}, log)
    assert res == launch.PrepareResult(str(tmp_path / "jobs" / "42"), None)
    assert os.lstat(res.job_dir).st_uid == UID
    with pytest.raises(PrepareError, match="SLURM_JOB_UID"):
        prepare_job(cfg, {"SLURM_JOB_ID": "43"}, log)
    assert not (tmp_path / "jobs" / "43").exists()


# -- collector start / stop --------------------------------------------------------------


@pytest.fixture
def node(tmp_path, make_config, write_replay):
    replay = write_replay(node_snapshot(4))
    _, cfg = make_config("[collector]\ninterval_s = 0.2\nflush_s = 10\n", replay=replay)
    cg = tmp_path / "cg"
    cg.mkdir()
    (cg / "cpuacct.usage").write_text("1000000000\n")
    return {"cfg": cfg, "tmp": tmp_path, "cg": str(cg)}


def test_prepare_job_starts_a_detached_collector_and_stop_flushes(node):
    cfg, tmp = node["cfg"], node["tmp"]
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_UID": str(UID), "SLURM_JOB_GID": str(GID),
           "SLURM_JOB_GPUS": "0,2", "SLURMD_NODENAME": "n1", "PATH": os.environ["PATH"]}
    launch_args = ["--job-cgroup", node["cg"], "--no-scontrol"]
    pid = start_collector(cfg, "42", gpus="0,2", uid=UID, env=env, extra_args=launch_args)
    try:
        assert open(tmp / "state" / "collector.42.pid").read() == f"{pid}\n"
        assert os.getsid(pid) == pid and os.getpgid(pid) == pid != os.getpgid(0)
        assert launch.is_collector(pid, "42") and not launch.is_collector(pid, "43")
        with pytest.raises(CollectorRunning) as ei:
            start_collector(cfg, "42", gpus="0,2", uid=UID, env=env, extra_args=launch_args)
        assert ei.value.pid == pid
        deadline = time.monotonic() + 30
        while "collector running" not in (tmp / "gpuguard.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # several samples, no timed flush yet (flush_s = 10)
        assert not (tmp / "node.db").exists()
        res = stop_collector(cfg, "42", timeout_s=10)
        assert res == StopResult(pid, True, True, "SIGTERM")
        assert wait_exit(pid, 5) == 0
        assert not (tmp / "state" / "collector.42.pid").exists()
        rows = open_store(str(tmp / "node.db")).query("select distinct gpu_index from samples where job_id='42'")
        assert sorted(r["gpu_index"] for r in rows) == [0, 2]
        assert "collector exiting (stopped by SIGTERM)" in (tmp / "gpuguard.log").read_text()
    finally:  # our unreaped child: its pid cannot have been reused
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
        wait_exit(pid, 5)


def test_prepare_job_start_via_prolog_env(node, monkeypatch):
    """prepare_job itself: job dir plus collector; a second call keeps the running one."""
    cfg, tmp = node["cfg"], node["tmp"]
    env = {"SLURM_JOB_ID": "44", "SLURM_JOB_UID": str(UID), "SLURM_JOB_GID": str(GID),
           "CUDA_VISIBLE_DEVICES": "GPU-00000000-0000-0000-0000-000000000003"}
    real = launch.collector_argv
    monkeypatch.setattr(launch, "collector_argv",
                        lambda *a, **k: [*real(*a, **k), "--job-cgroup", node["cg"], "--no-scontrol"])
    res = prepare_job(cfg, env, launch.logging.getLogger("test"))
    pid = res.collector_pid
    try:
        assert res.job_dir == str(tmp / "jobs" / "44")
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        assert argv[argv.index(b"--gpus") + 1] == b"GPU-00000000-0000-0000-0000-000000000003"
        assert argv[argv.index(b"--uid") + 1] == b"1001"
        assert prepare_job(cfg, env, launch.logging.getLogger("test")).collector_pid == pid
    finally:
        assert stop_collector(cfg, "44", timeout_s=10).exited
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
        wait_exit(pid, 5)


def test_stop_collector_on_dead_or_foreign_pid(node):
    cfg, tmp = node["cfg"], node["tmp"]
    pidfile = tmp / "state" / "collector.50.pid"
    assert stop_collector(cfg, "50", 1) == StopResult(None, False, True, None)
    (tmp / "state").mkdir(exist_ok=True)
    p = subprocess.Popen(["true"])
    p.wait()
    pidfile.write_text(f"{p.pid}\n")
    assert stop_collector(cfg, "50", 1) == StopResult(p.pid, False, True, None)
    assert not pidfile.exists()
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        pidfile.write_text(f"{sleeper.pid}\n")
        assert stop_collector(cfg, "50", 1) == StopResult(sleeper.pid, False, True, None)
        assert sleeper.poll() is None  # not ours: never signalled
    finally:
        sleeper.kill()
        sleeper.wait()
    pidfile.write_text("garbage")
    assert stop_collector(cfg, "50", 1) == StopResult(None, False, True, None)


@pytest.mark.parametrize("text", ["2147483648", "4294967297", "99999999999999999999", "4194305", "0",
                                  "-1", "\u0661\u0662\u0663", "12 34", "1" * 60, ""])
def test_stop_collector_pid_out_of_range_is_garbage(node, text):
    """pidfd_open(2**31) raised OverflowError before; out of 1..PID_MAX is no pid."""
    cfg, tmp = node["cfg"], node["tmp"]
    pidfile = tmp / "state" / "collector.51.pid"
    (tmp / "state").mkdir(exist_ok=True)
    pidfile.write_text(text + "\n")
    assert launch.read_pid_file(str(pidfile)) is None
    assert stop_collector(cfg, "51", 0.1) == StopResult(None, False, True, None)
    assert not pidfile.exists()


def test_read_pid_file_range_edges(tmp_path):
    p = tmp_path / "x.pid"
    for text, want in [("1\n", 1), ("4194304\n", 4194304), ("4194305\n", None), ("0004242\n", 4242),
                       ("00004242\n", 4242), (" 77 \n", 77), ("4_2\n", None)]:
        p.write_text(text)
        assert (text, launch.read_pid_file(str(p))) == (text, want)
    assert launch.PID_MAX == 4194304


@pytest.mark.parametrize("job_id", ["\u0661\u0662\u0663", "\u00b2", "4\u0662", "1" * 21, "", "-1"])
def test_job_id_must_be_ascii_digits(tmp_path, make_config, job_id):
    _, cfg = make_config("[prolog]\nstart_collector = false\n")
    with pytest.raises(PrepareError, match="not a Slurm job id"):
        launch.pid_file_path(cfg, job_id)
    with pytest.raises(PrepareError, match="not a Slurm job id"):
        ensure_job_dir(str(tmp_path / "jobs"), job_id, UID, GID)
    with pytest.raises(PrepareError, match="not a Slurm job id"):
        launch.remove_job_dir(str(tmp_path / "jobs"), job_id)
    assert launch.pid_file_path(cfg, "7") == str(tmp_path / "state" / "collector.7.pid")


@pytest.mark.parametrize("env_uid, env_gid", [("-1", "1001"), ("\u0661", "1001"), ("99999999999", "1001"),
                                              (" 1001", "1001")])
def test_prepare_job_refuses_odd_uid(tmp_path, make_config, env_uid, env_gid):
    _, cfg = make_config("[prolog]\nstart_collector = false\n")
    log = launch.logging.getLogger("test")
    with pytest.raises(PrepareError, match="job user unknown"):
        prepare_job(cfg, {"SLURM_JOB_ID": "44", "SLURM_JOB_UID": env_uid, "SLURM_JOB_GID": env_gid}, log)
    assert not (tmp_path / "jobs" / "44").exists()


def test_stop_collector_escalates_to_sigkill(node):
    cfg, tmp = node["cfg"], node["tmp"]
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    p = subprocess.Popen([sys.executable, "-c", code, "-m", launch.RUN_MODULE, "--job-id", "51"],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "up\n"
        (tmp / "state").mkdir(exist_ok=True)
        (tmp / "state" / "collector.51.pid").write_text(f"{p.pid}\n")
        t0 = time.monotonic()
        res = stop_collector(cfg, "51", timeout_s=0.3)
        assert res == StopResult(p.pid, True, True, "SIGKILL")
        assert time.monotonic() - t0 < 3
        assert p.wait(5) == -9
    finally:
        p.kill()
        p.wait()


def test_collector_survives_slurms_killpg_and_does_not_hold_the_hook_stdout(node):
    """SLURM-FACTS §6e: slurmd reads the hook's stdout to EOF, then killpg(SIGKILL)s the
    hook's process group. Play slurmd: the hook is a process-group leader whose stdout is
    a pipe we read to EOF."""
    cfg = node["cfg"]
    hook = (
        "import sys; from gpuguard import config; from gpuguard.collector.launch import start_collector; "
        f"pid = start_collector(config.load({cfg.path!r}), '60', gpus='1', uid=None, "
        f"extra_args=['--job-cgroup', {node['cg']!r}, '--no-scontrol']); print(pid)"
    )
    p = subprocess.Popen([sys.executable, "-c", hook], stdout=subprocess.PIPE, text=True, start_new_session=True)
    out, _ = p.communicate(timeout=20)  # EOF: nothing else holds the pipe
    assert p.returncode == 0
    pid = int(out)
    with pytest.raises(ProcessLookupError):  # the group is empty: the collector left it
        os.killpg(p.pid, 9)
    try:
        time.sleep(0.3)
        assert launch.is_collector(pid, "60")
        assert os.getsid(pid) == pid
    finally:
        res = stop_collector(cfg, "60", timeout_s=10)
        if not res.exited:
            os.kill(pid, 9)  # not our child; stop_collector just verified it is this collector
        assert res == StopResult(pid, True, True, "SIGTERM")


def test_prolog_hook_prepares_the_job(node, monkeypatch):
    """The prolog's proceed path calls prepare_job: job dir for the user, collector running."""
    from gpuguard.prolog import hook

    cfg, tmp = node["cfg"], node["tmp"]
    real = launch.collector_argv
    monkeypatch.setattr(launch, "collector_argv",
                        lambda *a, **k: [*real(*a, **k), "--job-cgroup", node["cg"], "--no-scontrol"])
    env = {"SLURM_JOB_ID": "61", "SLURM_JOB_UID": str(UID), "SLURM_JOB_GID": str(GID), "SLURM_JOB_GPUS": "1",
           "SLURMD_NODENAME": "n1"}
    assert hook.run(env) == 0
    pid = launch.read_pid_file(launch.pid_file_path(cfg, "61"))
    try:
        assert pid is not None and launch.is_collector(pid, "61")
        assert os.lstat(tmp / "jobs" / "61").st_uid == UID
        assert "tool error" not in (tmp / "gpuguard.log").read_text()
    finally:
        assert stop_collector(cfg, "61", timeout_s=10).exited
        wait_exit(pid, 5)
