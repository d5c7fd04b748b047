"""gpuguard-taskprolog: exact stdout (Slurm's TaskProlog protocol), always exit 0."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest

SCRIPT = str(pathlib.Path(sys.executable).parent / "gpuguard-taskprolog")
JOB_USER = 1001


def run_tp(config: str, job_id: str = "42", user: int | None = None, **extra: str):
    env = {"PATH": "/usr/bin:/bin", "GPUGUARD_CONFIG": config, "SLURM_JOB_ID": job_id, **extra}
    return subprocess.run([SCRIPT], env=env, capture_output=True, text=True, timeout=60, user=user)


@pytest.fixture
def world():
    """A world-readable tree (the job user must read the config), removed afterwards."""
    d = pathlib.Path(tempfile.mkdtemp(prefix="gg-tp-"))
    d.chmod(0o755)
    (d / "jobs").mkdir(mode=0o755)
    cfg = d / "gpuguard.toml"
    cfg.write_text(f'[paths]\njob_dir_root = "{d}/jobs"\nlog_file = ""\n')
    cfg.chmod(0o644)
    yield d, str(cfg)
    shutil.rmtree(d)


def test_prints_export_for_own_directory(world):
    d, cfg = world
    (d / "jobs" / "42").mkdir(mode=0o700)  # owned by root = the current uid
    r = run_tp(cfg)
    assert (r.returncode, r.stdout, r.stderr) == (0, f"export GPUGUARD_JOB_DIR={d}/jobs/42\n", "")


def test_as_the_job_user(world):
    d, cfg = world
    jd = d / "jobs" / "42"
    jd.mkdir(mode=0o700)
    os.chown(jd, JOB_USER, JOB_USER)
    r = run_tp(cfg, user=JOB_USER)
    assert (r.returncode, r.stdout) == (0, f"export GPUGUARD_JOB_DIR={jd}\n")
    r = run_tp(cfg)  # root does not own it: nothing
    assert (r.returncode, r.stdout) == (0, "")


@pytest.mark.parametrize("case", ["missing", "other_owner", "symlink", "file", "bad_config", "no_job_id"])
def test_prints_nothing_and_exits_0(world, case):
    d, cfg = world
    jd = d / "jobs" / "42"
    job_id = "42"
    if case == "other_owner":
        jd.mkdir()
        os.chown(jd, JOB_USER, JOB_USER)
    elif case == "symlink":
        (d / "elsewhere").mkdir()
        jd.symlink_to(d / "elsewhere")
    elif case == "file":
        jd.write_text("")
    elif case == "bad_config":
        jd.mkdir()
        pathlib.Path(cfg).write_text("[paths\n")
    elif case == "no_job_id":
        jd.mkdir()
        job_id = ""
    r = run_tp(cfg, job_id=job_id)
    assert (r.returncode, r.stdout) == (0, "")


def test_import_stays_minimal():
    code = ("import sys, gpuguard.collector.taskprolog; "
            "print([m for m in ('click', 'sqlite3', 'sqlite_utils', 'jinja2') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("job_id", ["\u0664\u0662", "\u00b2"])
def test_non_ascii_digit_job_id_prints_nothing(world, job_id):
    d, cfg = world
    (d / "jobs" / job_id).mkdir(mode=0o700)  # owned by the current uid: only the id is wrong
    r = run_tp(cfg, job_id=job_id)
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hung", ["job_dir_root", "config"])
def test_hung_filesystem_prints_nothing_and_exits_0_within_its_timeout(tmp_path, hung):
    """A job directory root or a config on a mount that never answers (a FUSE mount:
    every access blocks, as on a dead NFS server): the task is not held, the job runs
    without the export, and one line on stderr says why."""
    from fault_matrix import can_fuse, hung_fs

    if not can_fuse():
        pytest.skip("needs root and /dev/fuse")
    with hung_fs(tmp_path / "hung") as mnt:
        cfg = tmp_path / "gpuguard.toml"
        root = mnt / "jobs" if hung == "job_dir_root" else tmp_path
        cfg.write_text(f'[paths]\njob_dir_root = "{root}"\nlog_file = ""\n')
        r = run_tp(str(mnt / "gpuguard.toml") if hung == "config" else str(cfg))  # subprocess timeout: 60 s
    assert (r.returncode, r.stdout, r.stderr) == (
        0, "", "gpuguard-taskprolog: tool error: config and job directory not read within 5 s "
               "(a hung filesystem?); GPUGUARD_JOB_DIR not set\n")
