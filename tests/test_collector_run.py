"""The collector as a real process: replay GPUs with timed steps, a fake job cgroup, a
temporary store, sub-second intervals."""

from __future__ import annotations

import itertools
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
from conftest import node_snapshot

from gpuguard.model import encode_clock_event_reasons

MIB = 1024 * 1024
STEP_S = 3.0  # the replay step; the collector starts well before it, even on a loaded box


@pytest.fixture
def env(tmp_path, make_config, write_replay):
    """4 replay GPUs; after STEP_S GPU 1 gets busy and throttles, GPU 3 gets busy."""
    steps = [{"after_s": STEP_S, "gpus": {
        "1": {"gpu_util_pct": 97.0, "sm_clock_mhz": 1410.0, "power_w": 650.0,
              "clock_event_reasons": ["sw_power_cap", "hw_thermal_slowdown"]},
        "3": {"gpu_util_pct": 88.0, "mem_used_mib": 40000.0},
        "0": {"gpu_util_pct": 55.0}}}]
    t0 = time.time()
    replay = write_replay(node_snapshot(4), steps=steps, t0=t0)
    _, cfg = make_config("[collector]\ninterval_s = 0.2\nflush_s = 0.5\n", replay=replay)
    cg = tmp_path / "cgroup" / "job_42"
    cg.mkdir(parents=True)
    (cg / "cpuacct.usage").write_text("5000000000\n")
    (cg / "memory.stat").write_text("cache 1\nrss 2\ntotal_cache 4096\ntotal_rss 536870912\n")
    (cg / "blkio.throttle.io_service_bytes_recursive").write_text(
        "8:0 Read 1048576\n8:0 Write 3145728\n8:16 Read 1048576\n8:16 Write 0\nTotal 5242880\n")
    return {"tmp": tmp_path, "cfg": cfg, "cg": cg, "db": str(tmp_path / "node.db"), "t0": t0}


def start(env, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gpuguard.collector.run", "--job-id", "42", "--no-scontrol",
                             "--liveness-s", "0.2", *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def q(env, sql):
    """Query the collector's store with plain sqlite3: ``open_store`` would run migrations
    and race the collector's own first open."""
    if not os.path.exists(env["db"]):
        return []
    conn = sqlite3.connect(env["db"], timeout=10)
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute(sql)]
    except sqlite3.OperationalError as e:
        if "no such table" in str(e):
            return []
        raise
    finally:
        conn.close()


def log_text(env) -> str:
    p = env["tmp"] / "gpuguard.log"
    return p.read_text() if p.exists() else ""


def wait_for(pred, timeout: float = 30.0, what: str = "condition"):
    """Poll ``pred`` until it returns something truthy (start-up is slow on a loaded CI box:
    the tests wait for data, never for a fixed time)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def wait_running(env) -> None:
    wait_for(lambda: "collector running" in log_text(env), what="collector start")


def test_samples_only_job_gpus_values_change_and_exits_when_cgroup_goes(env):
    p = start(env, "--gpus", "1,3", "--job-cgroup", str(env["cg"]))
    try:
        wait_for(lambda: q(env, "select 1 from samples where gpu_index = 1 and gpu_util_pct = 97"),
                 what="a sample after the replay step")
        (env["cg"] / "cpuacct.usage").write_text("7000000000\n")
        wait_for(lambda: q(env, "select 1 from host_samples where cpu_pct > 100"), what="the CPU jump")
        for f in env["cg"].iterdir():
            f.unlink()
        env["cg"].rmdir()  # the job ended: slurmstepd removed its cgroup
        assert p.wait(10) == 0, p.stdout.read()
    finally:
        p.kill()
        p.wait()
    rows = q(env, "select * from samples where job_id = '42' order by at, gpu_index")
    assert {r["gpu_index"] for r in rows} == {1, 3}
    assert {(r["gpu_index"], r["gpu_uuid"]) for r in rows} == {
        (1, "GPU-00000000-0000-0000-0000-000000000001"), (3, "GPU-00000000-0000-0000-0000-000000000003")}
    assert all(r["node"] == "n1" for r in rows)
    g1 = [r for r in rows if r["gpu_index"] == 1]
    step_at = env["t0"] + STEP_S
    assert len(g1) >= 6
    assert {r["gpu_util_pct"] for r in g1 if r["at"] < step_at} == {0.0}
    assert {r["gpu_util_pct"] for r in g1 if r["at"] >= step_at} == {97.0}
    before, after = g1[0], g1[-1]
    assert (before["gpu_util_pct"], before["sm_clock_mhz"], before["power_w"]) == (0.0, 345.0, 70.0)
    assert before["clock_event_mask"] == encode_clock_event_reasons(["gpu_idle"]) == 1
    assert (after["gpu_util_pct"], after["sm_clock_mhz"], after["power_w"]) == (97.0, 1410.0, 650.0)
    assert after["clock_event_mask"] == 0x4 | 0x40
    assert after["temp_c"] == 31.0
    # cumulative counters come with the first sample, then once a minute (SLOW_EVERY_S)
    assert (before["ecc_volatile_uncorrected"], before["pcie_replay_count"]) == (0, 0)
    assert (after["ecc_volatile_uncorrected"], after["pcie_replay_count"]) == (None, None)
    g3 = [r for r in rows if r["gpu_index"] == 3]
    assert (g3[0]["mem_used_mib"], g3[-1]["mem_used_mib"]) == (0.0, 40000.0)
    gaps = [b["at"] - a["at"] for a, b in itertools.pairwise(g1)]
    assert 0.15 < sorted(gaps)[len(gaps) // 2] < 0.3  # 0.2 s interval
    host = q(env, "select * from host_samples where job_id = '42' order by at")
    assert host[0]["cpu_pct"] is None  # no previous reading
    assert host[1]["cpu_pct"] == 0.0
    assert max(h["cpu_pct"] for h in host if h["cpu_pct"] is not None) > 100  # 2 s of CPU in ~0.2 s
    assert (host[0]["rss_mib"], host[0]["io_read_mib"], host[0]["io_write_mib"]) == (512.0, 2.0, 3.0)
    assert "job gone: job cgroup removed" in log_text(env)


def test_uuid_selection(env):
    p = start(env, "--gpus", "GPU-00000000-0000-0000-0000-000000000002", "--job-cgroup", str(env["cg"]),
              "--max-runtime-s", "0.7")
    try:
        assert p.wait(20) == 0
    finally:
        p.kill()
        p.wait()
    rows = q(env, "select distinct gpu_index, gpu_uuid from samples")
    assert rows == [{"gpu_index": 2, "gpu_uuid": "GPU-00000000-0000-0000-0000-000000000002"}]
    assert "hard cap of 1 s reached" in log_text(env)


def test_sigterm_flushes_before_the_flush_interval(env):
    p = start(env, "--gpus", "0", "--flush-s", "10", "--job-cgroup", str(env["cg"]))
    try:
        wait_running(env)
        time.sleep(1.0)  # about 5 samples at 0.2 s
        assert not os.path.exists(env["db"])  # the store is opened by the first flush
        p.send_signal(signal.SIGTERM)
        assert p.wait(5) == 0
    finally:
        p.kill()
        p.wait()
    n = q(env, "select count(*) n from samples where gpu_index = 0")[0]["n"]
    assert n >= 2
    assert q(env, "select count(*) n from samples where gpu_index != 0")[0]["n"] == 0
    assert "stopped by SIGTERM" in log_text(env)


def test_exits_when_no_process_of_the_job_user_remains(env):
    # uid 54321 owns no process: after the startup grace the job counts as gone
    p = start(env, "--gpus", "0", "--uid", "54321", "--startup-grace-s", "0.3", "--cgroup-root",
              str(env["tmp"] / "no-cgroups"))
    try:
        wait_running(env)
        t0 = time.monotonic()
        assert p.wait(15) == 0
        assert time.monotonic() - t0 < 5  # grace 0.3 s + two empty checks 0.2 s apart
    finally:
        p.kill()
        p.wait()
    assert "job gone: no process of uid 54321 left" in log_text(env)
    host = q(env, "select * from host_samples")
    assert host and all(h["rss_mib"] == 0.0 for h in host)


def test_discovers_the_v1_job_cgroup_and_exits_when_it_goes(env):
    root = env["tmp"] / "sys-fs-cgroup"
    dirs = {}
    for ctrl, files in {"cpuacct": {"cpuacct.usage": "100\n"},
                        "memory": {"memory.stat": "total_rss 1048576\n"},
                        "blkio": {"blkio.throttle.io_service_bytes_recursive": "8:0 Read 0\n8:0 Write 2097152\n"}}.items():
        d = root / ctrl / "slurm_n1" / "uid_1001" / "job_42"
        d.mkdir(parents=True)
        for name, text in files.items():
            (d / name).write_text(text)
        dirs[ctrl] = d
    (root / "memory" / "slurm_n2" / "uid_1001" / "job_42").mkdir(parents=True)  # the other slurmd's
    p = start(env, "--uid", "1001", "--cgroup-root", str(root))
    try:
        wait_for(lambda: q(env, "select 1 from host_samples where rss_mib = 1.0"), what="a cgroup sample")
        for d in dirs.values():
            for f in d.iterdir():
                f.unlink()
            d.rmdir()
        assert p.wait(10) == 0
    finally:
        p.kill()
        p.wait()
    host = q(env, "select rss_mib, io_read_mib, io_write_mib from host_samples")
    assert host[0] == {"rss_mib": 1.0, "io_read_mib": 0.0, "io_write_mib": 2.0}
    assert q(env, "select count(*) n from samples")[0]["n"] == 0  # no --gpus: the job has no GPUs
    assert "job gone: job cgroup removed" in log_text(env)


def test_bad_config_exits_2(tmp_path, monkeypatch):
    bad = tmp_path / "bad.toml"
    bad.write_text("[nope]\n")
    r = subprocess.run([sys.executable, "-m", "gpuguard.collector.run", "--job-id", "1", "--config", str(bad)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown section [nope]" in r.stderr


def test_non_ascii_job_id_exits_2():
    r = subprocess.run([sys.executable, "-m", "gpuguard.collector.run", "--job-id", "\u0664\u0662"],
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stderr) == (2, "gpuguard collector: bad --job-id '\u0664\u0662'\n")
