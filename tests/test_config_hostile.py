"""Hostile or broken configs: a ``[policy]`` key that names no finding code gpuguard raises,
numbers outside their meaning, cross-key rules only the Epilog reads. A ``[policy]``
typo would otherwise leave the shipped action in force without a word (a degraded node
kept in service, or a drain the operator meant to switch off still made)."""

from __future__ import annotations

import tomllib

import pytest

from gpuguard.config import ConfigError, from_dict


def load_text(text: str, path: str):
    return from_dict(tomllib.loads(text), path)


@pytest.mark.parametrize(("key", "msg"), [
    ('"pcie.width_degrade"', "c.toml: policy.pcie.width_degrade: unknown finding code; known in pcie: "
                             "pcie.gen_degraded, pcie.replay_growth, pcie.width_degraded"),
    ('"nonexistent.code"', "c.toml: policy.nonexistent.code: unknown finding code; families: baseline, config, dcgm, "
                           "ecc, fabric, gpu, ib, inventory, nccl, nvlink, pcie, thermal, throttle, verdict, xid.N, sxid.N"),
    ('"xid.79x"', "c.toml: policy.xid.79x: unknown finding code; families: baseline, config, dcgm, "
                  "ecc, fabric, gpu, ib, inventory, nccl, nvlink, pcie, thermal, throttle, verdict, xid.N, sxid.N"),
])
def test_unknown_policy_code_is_one_line_config_error(key, msg):
    with pytest.raises(ConfigError) as e:
        load_text(f'[policy]\n{key} = "drain"\n', "c.toml")
    assert str(e.value) == msg


@pytest.mark.parametrize("code", ["pcie.width_degraded", "xid.79", "sxid.20034", "verdict.straggler_node",
                                  "nccl.warn", "gpu.recovery_action.gpu_reset", "config.persistence_off"])
def test_every_code_gpuguard_raises_may_be_overridden(code):
    cfg = load_text(f'[policy]\n"{code}" = "record"\n', "c.toml")
    assert cfg.policy == {code: "record"}


@pytest.mark.parametrize(("text", "msg"), [
    ("[checks]\nidle_util_pct = 150", "c.toml: checks.idle_util_pct is a percentage: 0 to 100, got 150.0"),
    ("[job_page]\nidle_gpu_pct = 101", "c.toml: job_page.idle_gpu_pct is a percentage: 0 to 100, got 101.0"),
    ("[verdict]\nthrottle_active_share = 0", "c.toml: verdict.throttle_active_share is a share: above 0, at most 1, "
                                             "got 0.0"),
    ("[collector]\ninterval_s = 0", "c.toml: collector.interval_s must be > 0"),
    ("[verdict]\nshort_window_s = 0", "c.toml: verdict.short_window_s must be > 0"),
    ("[health]\ntime_budget_s = 0", "c.toml: health.time_budget_s must be > 0"),
    ("[gpu]\ncall_timeout_s = 0", "c.toml: gpu.call_timeout_s must be > 0"),
    # past TOML's 64-bit integers: the verdict's baseline query (LIMIT runs) overflowed
    ("[baseline]\nruns = 99999999999999999999999",
     "c.toml: baseline.runs is above the TOML integer range (2**63 - 1), got 99999999999999999999999"),
    ("[baseline]\nmin_runs = 9223372036854775808",
     "c.toml: baseline.min_runs is above the TOML integer range (2**63 - 1), got 9223372036854775808"),
])
def test_numbers_outside_their_meaning_are_config_errors(text, msg):
    """A percentage over 100 made every loaded GPU 'idle' for the throttle checks; a zero
    share made every job gpu-throttling; a zero interval spun the collector on every node."""
    with pytest.raises(ConfigError) as e:
        load_text(text + "\n", "c.toml")
    assert str(e.value) == msg


def test_an_interval_whose_zero_has_a_meaning_is_accepted():
    """[nccl] interval_s is how seldom at most an idle node is probed: 0 = every health run
    (the real-Slurm NCCL tests run so). Refusing it left the health check on the defaults,
    so the probe's drains never came."""
    cfg = load_text("[nccl]\ninterval_s = 0.0\n", "c.toml")
    assert cfg.get("nccl", "interval_s") == 0.0
    with pytest.raises(ConfigError, match=r"^c.toml: collector.interval_s must be > 0$"):
        load_text("[collector]\ninterval_s = 0\n", "c.toml")


#: Every number key whose 0 is > 0 today, with the exact message: the lower bound is
#: declared per key in SCHEMA, so this is the whole list (a key added without a
#: declaration is caught by the next test).
_ABOVE_ZERO = [("gpu", "call_timeout_s"), ("prolog", "time_budget_s"), ("prolog", "fail_job_escalate_window_s"),
               ("collector", "interval_s"),
               ("epilog", "time_budget_s"), ("verdict", "long_window_s"), ("verdict", "short_window_s"),
               ("nccl", "timeout_s"), ("reports", "sacct_timeout_s"), ("health", "time_budget_s"),
               ("alerts", "webhook_timeout_s")]


def test_zero_is_refused_exactly_where_the_schema_declares_above_zero():
    from gpuguard import config as config_mod

    refused = []
    for sec, keys in config_mod.SCHEMA.items():
        for key, spec in keys.items():
            if not isinstance(spec[0], (int, float)) or isinstance(spec[0], bool) or key.endswith("_share"):
                continue
            try:
                load_text(f"[{sec}]\n{key} = 0\n", "c.toml")
            except ConfigError as e:
                if str(e) == f"c.toml: {sec}.{key} must be > 0":
                    refused.append((sec, key))
    assert refused == _ABOVE_ZERO


def test_every_time_key_declares_its_lower_bound():
    """An interval, timeout or budget added without a bound would accept 0 (a busy loop, a
    budget that never lets work run): each must say ABOVE_ZERO or, when 0 means something,
    AT_LEAST_ZERO with that meaning in its doc."""
    from gpuguard import config as config_mod

    undeclared = [f"{s}.{k}" for s, keys in config_mod.SCHEMA.items() for k, spec in keys.items()
                  if k.endswith(("interval_s", "timeout_s", "time_budget_s", "window_s")) and len(spec) < 4]
    assert undeclared == []
    assert config_mod.lower_bound("nccl", "interval_s") == config_mod.AT_LEAST_ZERO
    assert config_mod.lower_bound("collector", "interval_s") == config_mod.ABOVE_ZERO
    assert config_mod.lower_bound("node", "gpu_count") == config_mod.AT_LEAST_ZERO


def test_a_bound_declared_on_any_key_is_enforced(monkeypatch):
    """The bound is the key's, not its name's: a key with no time suffix declared
    ABOVE_ZERO refuses 0 with the same message."""
    from gpuguard import config as config_mod

    spec = config_mod.SCHEMA["node"]["gpu_count"]
    monkeypatch.setitem(config_mod.SCHEMA["node"], "gpu_count", (*spec[:3], config_mod.ABOVE_ZERO))
    with pytest.raises(ConfigError) as e:
        load_text("[node]\ngpu_count = 0\n", "c.toml")
    assert str(e.value) == "c.toml: node.gpu_count must be > 0"
    assert load_text("[node]\ngpu_count = 2\n", "c.toml").get("node", "gpu_count") == 2


def test_config_show_names_what_only_the_epilog_would_refuse(tmp_path):
    from click.testing import CliRunner

    from gpuguard.cli import main

    p = tmp_path / "c.toml"
    p.write_text("[baseline]\nmin_runs = 0\n")
    r = CliRunner().invoke(main, ["--config", str(p), "config", "show"])
    assert r.exit_code == 2
    assert r.output == f"Error: {p}: baseline.runs must be >= baseline.min_runs >= 1\n"


def test_every_module_declaring_finding_codes_is_known_to_the_policy_check():
    import pathlib
    import re

    from gpuguard.policy import CODE_MODULES

    root = pathlib.Path(__file__).resolve().parent.parent
    pkg = {"gpuguard": "gpuguard", "epilog": "gpuguard.epilog", "prolog": "gpuguard.prolog",
           "collector": "gpuguard.collector", "reports": "gpuguard.reports"}
    declaring = set()
    for top, name in pkg.items():
        for f in (root / top).rglob("*.py"):
            if re.search(r"^CODES = declare_codes\(", f.read_text(), re.M):
                declaring.add(".".join([name, *f.relative_to(root / top).with_suffix("").parts]))
    checks = {m for m in declaring if m.startswith("gpuguard.checks.")}
    assert declaring - checks == set(CODE_MODULES)
    assert load_text('[policy]\n"dcgm.diag_unreadable" = "record"\n', "c.toml").policy == {
        "dcgm.diag_unreadable": "record"}


@pytest.mark.parametrize("name", ["../../etc", "-n1", ".hidden", "gpu/01", "n[1-2]", "a b"])
def test_a_node_name_that_is_not_one_host_name_is_a_config_error(name):
    """{node} goes into the paths root writes (run_dir = /run/gpuguard/{node}): a name of
    '../../etc' put the pending-drain list and the cursor copy into /etc."""
    with pytest.raises(ConfigError) as e:
        load_text(f'[node]\nname = "{name}"\n', "c.toml")
    assert str(e.value) == ("c.toml: node.name must be one host name (letters, digits, _ . -, not starting with "
                            f". or -), got {name!r}")


def test_a_host_name_with_dots_is_a_node_name():
    assert load_text('[node]\nname = "gpu-01.cluster_a"\n', "c.toml").node_name == "gpu-01.cluster_a"
