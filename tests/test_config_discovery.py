"""Config discovery without SLURM_CONF (EpilogSlurmctld): slurmctld's -f, the standard
slurm.conf places, and a missing or dangling config as one error."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from gpuguard import config as config_mod
from gpuguard import hookrun

REAL_DAEMON_CONF = config_mod._daemon_slurm_conf


@pytest.fixture
def clean_env(monkeypatch):
    for k in ("SLURM_CONF", "GPUGUARD_CONFIG"):
        monkeypatch.setenv(k, "")  # recorded, so whatever a test exports is undone
        monkeypatch.delenv(k)


def _fake_daemon(name: str, *args: str) -> subprocess.Popen:
    """A process whose argv[0] is ``name`` (like slurmscriptd, a fork of slurmctld)."""
    code = "import time; time.sleep(30)"
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    p = subprocess.Popen(["bash", "-c", f'exec -a {name} {sys.executable} -c "{code}" "$@"', "x", *args], env=env)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with open(f"/proc/{p.pid}/cmdline", "rb") as fh:
            if fh.read().split(b"\0")[0] == name.encode():
                return p
        time.sleep(0.01)
    raise AssertionError("fake daemon did not start")


def test_slurmctld_dash_f_names_the_config_dir(tmp_path, clean_env, monkeypatch):
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "slurm.conf").write_text("ClusterName=x\n")
    (etc / "gpuguard.toml").write_text('[node]\nname = "ctl"\n')
    d = _fake_daemon("/usr/sbin/slurmctld", "-f", str(etc / "slurm.conf"))
    try:
        assert REAL_DAEMON_CONF(d.pid) == str(etc / "slurm.conf")
        monkeypatch.setattr(config_mod, "_daemon_slurm_conf", lambda *a, **k: REAL_DAEMON_CONF(d.pid))
        assert config_mod.find_config_path() == (str(etc / "gpuguard.toml"), True)
        assert config_mod.load().values["node"]["name"] == "ctl"
        assert config_mod.export_slurm_conf() == str(etc / "slurm.conf")
        assert os.environ["SLURM_CONF"] == str(etc / "slurm.conf")  # for scontrol/sacctmgr
    finally:
        d.kill()
        d.wait()


def test_not_a_slurm_daemon_and_no_dash_f(tmp_path, clean_env):
    d = _fake_daemon("bash-not-slurm", "-f", "/etc/x.conf")
    e = _fake_daemon("slurmctld", "-D")
    try:
        assert REAL_DAEMON_CONF(d.pid) is None
        assert REAL_DAEMON_CONF(e.pid) is None
    finally:
        for p in (d, e):
            p.kill()
            p.wait()


def test_search_order_and_standard_locations(tmp_path, clean_env, monkeypatch):
    etc_slurm = tmp_path / "etc-slurm"
    etc_slurm.mkdir()
    (etc_slurm / "slurm.conf").write_text("")
    monkeypatch.setattr(config_mod, "SLURM_CONF_LOCATIONS", (str(etc_slurm / "slurm.conf"),))
    assert config_mod.config_candidates()[-1] == str(etc_slurm / "gpuguard.toml")
    assert config_mod.find_config_path() == (None, False)
    (etc_slurm / "gpuguard.toml").write_text("")
    assert config_mod.find_config_path() == (str(etc_slurm / "gpuguard.toml"), True)
    # /etc/gpuguard/gpuguard.toml comes before the standard slurm.conf places
    default = tmp_path / "default.toml"
    default.write_text("")
    monkeypatch.setattr(config_mod, "DEFAULT_PATH", str(default))
    assert config_mod.find_config_path() == (str(default), True)
    # and $SLURM_CONF's directory before both
    own = tmp_path / "own"
    own.mkdir()
    (own / "gpuguard.toml").write_text("")
    monkeypatch.setenv("SLURM_CONF", str(own / "slurm.conf"))
    assert config_mod.find_config_path() == (str(own / "gpuguard.toml"), True)


def test_dangling_symlink_is_an_error_not_defaults(tmp_path, clean_env, monkeypatch):
    link = tmp_path / "gpuguard.toml"
    link.symlink_to(tmp_path / "gone" / "gpuguard.toml")
    monkeypatch.setattr(config_mod, "DEFAULT_PATH", str(link))
    with pytest.raises(config_mod.ConfigError, match=f"{link}: dangling symlink to {tmp_path}/gone/gpuguard.toml"):
        config_mod.load()
    cfg, err = hookrun.load_config()
    assert err == f"{link}: dangling symlink to {tmp_path}/gone/gpuguard.toml"
    assert cfg.path is None  # the defaults, with the error beside them


def test_missing_config_is_one_error_for_hooks_only(clean_env):
    assert config_mod.load().path is None  # the CLI runs on the defaults
    _cfg, err = hookrun.load_config()
    assert err.startswith("no gpuguard config found; looked at $GPUGUARD_CONFIG and ")
    assert config_mod.DEFAULT_PATH in err


@pytest.mark.timeout(30)
def test_a_config_on_a_fifo_or_device_is_one_error_never_a_hang(tmp_path, clean_env, monkeypatch):
    """`GPUGUARD_CONFIG` naming a FIFO (no writer: a blocking open waits forever) or
    /dev/zero (a read never ends): the hook gets its shipped defaults and one error naming
    the file, at once; /dev/null still reads as an empty config."""
    fifo = tmp_path / "gpuguard.toml"
    os.mkfifo(fifo)
    for path, what in ((str(fifo), "a FIFO"), ("/dev/zero", "a device")):
        monkeypatch.setenv("GPUGUARD_CONFIG", path)
        cfg, err = hookrun.load_config()
        assert (cfg.path, err) == (None, f"{path}: not a regular file ({what}), expected a TOML file")
    monkeypatch.setenv("GPUGUARD_CONFIG", "/dev/null")
    cfg, err = hookrun.load_config()
    assert (cfg.path, err) == ("/dev/null", None)


@pytest.mark.timeout(30)
def test_a_stalled_config_read_gives_the_defaults_within_the_timeout(tmp_path, clean_env, monkeypatch):
    """A config whose read never returns (a hung NFS mount holding it: D state, which no
    signal interrupts; simulated by a read that sleeps): the hook gets the shipped
    defaults and a one-line error after timeout_s, not a hang past its budget."""
    conf = tmp_path / "gpuguard.toml"
    conf.write_text('[node]\nname = "n1"\n')
    monkeypatch.setenv("GPUGUARD_CONFIG", str(conf))
    for name in ("load", "read"):  # whichever the hook's loader calls
        monkeypatch.setattr(config_mod, name, lambda *a, **k: time.sleep(60), raising=False)
    monkeypatch.setattr(hookrun, "CONFIG_READ_TIMEOUT_S", 0.5, raising=False)
    t0 = time.monotonic()
    cfg, err = hookrun.load_config()
    assert time.monotonic() - t0 < 5
    assert cfg.path is None and cfg.get("prolog", "time_budget_s") == 20.0
    assert err.startswith("config not read within 0.5 s (a hung filesystem?); looked at $GPUGUARD_CONFIG and ")
