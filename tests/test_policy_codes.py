"""A ``[policy]`` key that names no finding code gpuguard raises is a config error: a
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
    ('"nonexistent.code"', "c.toml: policy.nonexistent.code: unknown finding code; families: baseline, config, "
                           "ecc, gpu, ib, inventory, nccl, nvlink, pcie, thermal, throttle, verdict, xid.N, sxid.N"),
    ('"xid.79x"', "c.toml: policy.xid.79x: unknown finding code; families: baseline, config, "
                  "ecc, gpu, ib, inventory, nccl, nvlink, pcie, thermal, throttle, verdict, xid.N, sxid.N"),
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
