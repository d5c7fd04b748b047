"""MIG: each MIG instance is a gres device of its own (Slurm gres.conf(5), MIG with
``AutoDetect=nvml``), so ``SLURM_JOB_GPUS`` names gres indices NVML does not have as GPU
indices. The Prolog must not drain a healthy MIG node for its job's second instance."""

from __future__ import annotations

import dataclasses

from gpuguard.checks import CheckContext, run_checks
from gpuguard.gpu.nvsmi import load_nvidia_smi
from gpuguard.policy import decide

DUMP = "tests/data/nvsmi-qx-a100-mig-510.47.03.xml"  # A100 in MIG mode, two instances


def _run(snap, job_gpus):
    findings, errors = run_checks(CheckContext(snapshot=snap, job_gpu_indices=job_gpus, hook="prolog",
                                               gpu_nodes_expected=True))
    assert errors == []
    return findings


def test_a_job_on_the_second_mig_instance_does_not_drain_the_node():
    snap = load_nvidia_smi(DUMP)
    assert [(g.index, g.mig_mode) for g in snap.gpus] == [(0, True)]
    findings = _run(snap, [1])
    assert [(f.code, f.severity) for f in findings if f.severity != "info"] == [("config.persistence_off", "warning")]
    assert decide(findings).outcome == "proceed"


def test_without_mig_a_missing_job_gpu_still_drains():
    snap = load_nvidia_smi(DUMP)
    snap = dataclasses.replace(snap, gpus=[dataclasses.replace(g, mig_mode=False) for g in snap.gpus])
    [f] = [f for f in _run(snap, [1]) if f.code == "gpu.count_mismatch"]
    assert (f.severity, f.message) == ("critical", "job's GPU(s) 1 not visible (1 GPUs visible)")
    assert decide([f]).outcome == "drain"
