import os

import pytest
from click.testing import CliRunner

from gpuguard import config as config_mod
from gpuguard.cli import main


def write(tmp_path, text):
    p = tmp_path / "g.toml"
    p.write_text(text)
    return str(p)


def test_defaults_without_file(monkeypatch, tmp_path):
    monkeypatch.delenv("GPUGUARD_CONFIG", raising=False)
    monkeypatch.delenv("SLURM_CONF", raising=False)
    monkeypatch.setattr(config_mod, "DEFAULT_PATH", str(tmp_path / "absent.toml"))
    cfg = config_mod.load()
    assert cfg.path is None
    assert cfg.get("paths", "store") == "/var/lib/gpuguard/node.db"
    assert cfg.get("prolog", "time_budget_s") == 20.0
    assert cfg.origin[("gpu", "source")] == "default"


def test_values_and_origin(tmp_path):
    p = write(tmp_path, '[gpu]\ncall_timeout_s = 2\n[node]\nname = "n7"\ngpu_count = 8\n')
    cfg = config_mod.load(p)
    assert cfg.get("gpu", "call_timeout_s") == 2.0
    assert isinstance(cfg.get("gpu", "call_timeout_s"), float)
    assert cfg.node_name == "n7"
    assert cfg.origin[("node", "gpu_count")] == p
    assert cfg.origin[("paths", "store")] == "default"


def test_node_placeholder(tmp_path, monkeypatch):
    p = write(tmp_path, '[paths]\nstore = "/x/{node}/node.db"\n')
    monkeypatch.setenv("SLURMD_NODENAME", "n2")
    assert config_mod.load(p).store_path == "/x/n2/node.db"


def test_unknown_key_names_file_and_key(tmp_path):
    p = write(tmp_path, "[gpu]\nsorce = 'nvml'\n")
    with pytest.raises(config_mod.ConfigError) as e:
        config_mod.load(p)
    assert str(e.value) == f"{p}: unknown key gpu.sorce; known: source, replay_path, call_timeout_s"


def test_unknown_section(tmp_path):
    p = write(tmp_path, "[gpus]\nx = 1\n")
    with pytest.raises(config_mod.ConfigError, match=r"unknown section \[gpus\]"):
        config_mod.load(p)


def test_wrong_type(tmp_path):
    p = write(tmp_path, '[prolog]\ntime_budget_s = "20"\n')
    with pytest.raises(config_mod.ConfigError) as e:
        config_mod.load(p)
    assert str(e.value) == f"{p}: prolog.time_budget_s must be int or float, got str '20'"


def test_bool_is_not_a_number(tmp_path):
    p = write(tmp_path, "[node]\ngpu_count = true\n")
    with pytest.raises(config_mod.ConfigError, match="node.gpu_count must be int, got bool True"):
        config_mod.load(p)


def test_bad_toml(tmp_path):
    p = write(tmp_path, "[gpu\n")
    with pytest.raises(config_mod.ConfigError, match=f"^{p}: invalid TOML"):
        config_mod.load(p)


def test_missing_explicit_file(tmp_path):
    with pytest.raises(config_mod.ConfigError) as e:
        config_mod.load(str(tmp_path / "nope.toml"))
    assert str(e.value) == f"{tmp_path}/nope.toml: config file not found"


def test_replay_needs_path(tmp_path):
    p = write(tmp_path, '[gpu]\nsource = "replay"\n')
    with pytest.raises(config_mod.ConfigError, match="gpu.replay_path is required"):
        config_mod.load(p)


def test_policy_overrides_and_validation(tmp_path):
    p = write(tmp_path, '[policy]\n"pcie.width_degraded" = "drain"\n[policy.xid]\n63 = "drain"\n92 = "record"\n')
    cfg = config_mod.load(p)
    assert cfg.policy == {"pcie.width_degraded": "drain"}
    assert cfg.xid_policy == {63: "drain", 92: "record"}
    bad = write(tmp_path, '[policy]\n"ecc.row_remap_pending" = "reboot"\n')
    with pytest.raises(config_mod.ConfigError) as e:
        config_mod.load(bad)
    assert "policy.ecc.row_remap_pending must be one of record, alert, drain, fail-job, got 'reboot'" in str(e.value)


def test_search_order_env_then_slurm_conf(tmp_path, monkeypatch):
    slurm_dir = tmp_path / "etc"
    slurm_dir.mkdir()
    (slurm_dir / "gpuguard.toml").write_text('[node]\nname = "beside-slurm"\n')
    monkeypatch.delenv("GPUGUARD_CONFIG", raising=False)
    monkeypatch.setenv("SLURM_CONF", str(slurm_dir / "slurm.conf"))
    assert config_mod.load().node_name == "beside-slurm"
    env_file = write(tmp_path, '[node]\nname = "from-env"\n')
    monkeypatch.setenv("GPUGUARD_CONFIG", env_file)
    assert config_mod.load().node_name == "from-env"


def test_cli_config_show_and_error_exit(tmp_path):
    p = write(tmp_path, '[node]\nname = "n9"\n')
    r = CliRunner().invoke(main, ["--config", p, "config", "show"])
    assert r.exit_code == 0
    line = next(ln for ln in r.output.splitlines() if ln.startswith("node.name"))
    assert line.split() == ["node.name", '"n9"', p]
    bad = write(tmp_path, "[nope]\n")
    r = CliRunner().invoke(main, ["--config", bad, "config", "show"])
    assert r.exit_code == 2
    assert r.output.strip().splitlines()[-1].startswith(f"Error: {bad}: unknown section [nope]")


def test_every_schema_key_documented():
    for section, keys in config_mod.SCHEMA.items():
        for key, (default, typ, doc, *_bound) in keys.items():
            assert doc, f"{section}.{key} has no doc"
            assert config_mod._check_type(default, typ), f"{section}.{key} default has the wrong type"
    assert os.path.basename(config_mod.DEFAULT_PATH) == "gpuguard.toml"


def test_shipped_example_and_readme_match_the_schema():
    """slurm-conf-examples/gpuguard.toml and the README reference are generated from
    SCHEMA (`gpuguard config example`, `config.reference_markdown()`): regenerate them
    when a key changes."""
    import pathlib
    import re
    import tomllib

    root = pathlib.Path(__file__).parent.parent
    example = (root / "slurm-conf-examples" / "gpuguard.toml").read_text()
    assert example == config_mod.example_toml()
    uncommented = re.sub(r"^# (\w+ = )", r"\1", example, flags=re.M)
    cfg = config_mod.from_dict(tomllib.loads(uncommented))
    assert cfg.values == config_mod.from_dict({}).values
    assert config_mod.reference_markdown() in (root / "README.md").read_text()


def test_invalid_utf8_and_unknown_disabled_check(tmp_path):
    p = tmp_path / "g.toml"
    p.write_bytes(b'[node]\nname = "\xff"\n')
    with pytest.raises(config_mod.ConfigError) as e:
        config_mod.load(str(p))
    assert str(e.value) == f"{p}: not UTF-8 text (byte 15)"
    p2 = write(tmp_path, '[checks]\ndisabled = ["nope", "ecc"]\n')
    with pytest.raises(config_mod.ConfigError, match=r"checks.disabled: unknown check\(s\) nope; known: "):
        config_mod.load(p2)


@pytest.mark.parametrize("value,used", [("gpu-a01", True), ("n1.cluster", True), ("../../etc", False),
                                        ("n1,n2", False), ("n[1-2]", False), ("n1 n2", False), ("-rf", False),
                                        ("n1/x", False), ("", False)])
def test_slurmd_nodename_is_used_only_when_it_is_one_node_name(monkeypatch, value, used):
    """The node name goes into paths ({node}) and scontrol's nodename=: a path escape, a
    node list or an option-like value from the environment is never used."""
    import socket

    from gpuguard import config as config_mod

    monkeypatch.setenv("SLURMD_NODENAME", value)
    cfg = config_mod.from_dict({"paths": {"store": "/var/lib/gg/{node}.db"}})
    host = socket.gethostname().split(".")[0]
    assert cfg.node_name == (value if used else host)
    assert cfg.store_path == f"/var/lib/gg/{value if used else host}.db"


@pytest.mark.parametrize("text,line", [
    ("[node]\ngpu_count = -3\n", "node.gpu_count must be a finite number >= 0, got -3"),
    ("[prolog]\ntime_budget_s = inf\n", "prolog.time_budget_s must be a finite number >= 0, got inf"),
    ("[verdict]\nz_threshold = nan\n", "verdict.z_threshold must be a finite number >= 0, got nan"),
    ("[alerts]\nretry_base_s = -1.5\n", "alerts.retry_base_s must be a finite number >= 0, got -1.5"),
])
def test_a_negative_or_non_finite_number_is_a_config_error(tmp_path, text, line):
    """TOML has nan and inf; no gpuguard number is negative: one line naming the key."""
    from gpuguard import config as config_mod

    p = tmp_path / "g.toml"
    p.write_text(text)
    with pytest.raises(config_mod.ConfigError) as e:
        config_mod.load(str(p))
    assert str(e.value) == f"{p}: {line}"
