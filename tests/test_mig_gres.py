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


def _with(snap, **kw):
    return dataclasses.replace(snap, gpus=[dataclasses.replace(g, **kw) for g in snap.gpus])


def test_a_busy_mig_gpu_with_unknown_utilisation_is_not_judged_idle():
    """NVML gives no utilisation for a MIG-enabled GPU (the dump: `N/A`); its other
    instances may be running other jobs at full power, so a HW slowdown or the SW thermal
    slowdown seen then is no idle reading."""
    snap = _with(load_nvidia_smi(DUMP), clock_event_reasons=["hw_slowdown", "sw_thermal_slowdown"])
    assert [g.gpu_util_pct for g in snap.gpus] == [None]
    findings = _run(snap, None)
    assert [(f.code, f.severity, f.message) for f in findings if f.code.startswith("throttle.")] == [
        ("throttle.idle_not_judged", "info", "gpu0 (0000:00:04.0) hw_slowdown+sw_thermal_slowdown active, "
         "utilisation unknown (MIG mode: NVML reports none): idle throttle not judged")]
    assert decide(findings).outcome == "proceed"
    # without MIG an unknown utilisation is unknown too (never 0 %): not judged, no drain
    plain = _with(snap, mig_mode=False)
    findings = _run(plain, None)
    assert [(f.code, f.severity) for f in findings if f.code.startswith("throttle.")] == [
        ("throttle.idle_not_judged", "info")]
    assert decide(findings).outcome == "proceed"


def test_a_mig_gpu_of_unknown_utilisation_adds_no_idle_reading(tmp_path):
    from gpuguard.checks.idle import idle_findings
    from gpuguard.config import from_dict
    from gpuguard.store import open_store

    snap = load_nvidia_smi(DUMP)
    store = open_store(str(tmp_path / "node.db"))
    try:
        values = from_dict({}).values
        assert idle_findings(store, "n1", snap, values, now=1767225600.0) == ([], [])
        # unknown utilisation without MIG is no idle reading either; a known 0 % is one
        assert idle_findings(store, "n1", _with(snap, mig_mode=False), values, now=1767225600.0) == ([], [])
        findings, rows = idle_findings(store, "n1", _with(snap, mig_mode=False, gpu_util_pct=0.0), values,
                                       now=1767225600.0)
        assert (findings, [(r["node"], r["gpu_index"], r["flagged"]) for r in rows]) == ([], [("n1", 0, 0)])
    finally:
        store.close()


def test_the_collector_says_why_a_mig_job_has_no_gpu_metrics(caplog):
    """CUDA_VISIBLE_DEVICES holds MIG UUIDs and the source cannot map them to their GPU:
    nothing is sampled, one warning says so (never a silent job without GPU metrics);
    tests/test_collector_mig.py has the mapped cases."""
    import logging

    from gpuguard.collector.host import HostSampler
    from gpuguard.collector.run import Collector

    spec = "MIG-5c89852c-d268-c3f3-1b07-005d5ae1dc3f"
    with caplog.at_level(logging.WARNING, logger="t"):
        c = Collector(job_id="1", node="n1", source=None, gpus=spec, host=HostSampler("1", "n1"),
                      liveness=None, open_store=lambda: None, interval_s=1, flush_s=1, log=logging.getLogger("t"))
        assert c.gpu_rows() is None
    assert (c.indices, c.uuids, c.migs) == ([], [], [spec])
    assert [r.getMessage() for r in caplog.records] == [
        f"MIG device(s) {spec}: this GPU source cannot map MIG devices to their GPU: not sampled"]


def test_an_unreadable_mig_mode_does_not_drain_for_a_gres_index_nvml_lacks():
    """A GPU whose MIG mode read failed may be in MIG mode, where the job's gres index 1
    is its second MIG device: no count mismatch (that drained a healthy node); the failed
    read is its own finding, and a GPU index check without MIG still drains."""
    snap = load_nvidia_smi(DUMP)
    snap = _with(snap, mig_mode=None, read_errors={"mig_mode": "Unknown"})
    findings = _run(snap, [1])
    assert [f.code for f in findings if f.code.startswith("gpu.")] == ["gpu.read_error"]
    assert decide(findings).outcome == "proceed"
    plain = _with(snap, mig_mode=None, read_errors={})
    assert [f.code for f in _run(plain, [1]) if f.code == "gpu.count_mismatch"] == ["gpu.count_mismatch"]
