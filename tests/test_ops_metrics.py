"""Prometheus output (parsed back with prometheus_client's own parsers) and the
dcgm-exporter / jobstats job-mapping files."""

from __future__ import annotations

import logging
import os
import time

import pytest
from prometheus_client import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from gpuguard.ops import jobmap, metrics
from gpuguard.store import open_store
from conftest import node_snapshot

LOG = logging.getLogger("test")
#: the Prolog's snapshot of a node without MIG: Slurm's GPU index is NVML's
SNAP = node_snapshot(4)
ENV = {"SLURM_JOB_ID": "42", "SLURM_JOB_GPUS": "1,3", "SLURM_JOB_USER": "gg_alice", "SLURM_JOB_UID": "1001",
       "SLURM_JOB_ACCOUNT": "acct_a", "SLURM_JOB_PARTITION": "gpu"}


@pytest.fixture
def cfg(tmp_path, make_config):
    _, c = make_config(f'[metrics]\ntextfile_dir = "{tmp_path}/textfile"\ndcgm_job_map_dir = "{tmp_path}/dcgm"\n'
                       f'gpustat_dir = "{tmp_path}/gpustat"\n')
    return c


def test_job_mapping_files_follow_the_jobs(cfg, tmp_path):
    jobmap.job_started(cfg, ENV, LOG, snapshot=SNAP)
    jobmap.job_started(cfg, dict(ENV, SLURM_JOB_ID="43", SLURM_JOB_GPUS="3", SLURM_JOB_UID="1002"), LOG,
                       snapshot=SNAP)
    dcgm, gpustat = tmp_path / "dcgm", tmp_path / "gpustat"
    assert sorted(os.listdir(dcgm)) == ["1", "3"]
    assert ((dcgm / "1").read_text(), (dcgm / "3").read_text()) == ("42\n", "42\n43\n")
    assert (gpustat / "1").read_text() == "42 1001\n"
    assert (gpustat / "3").read_text() == "43 1002\n"  # jobstats keeps one owner per GPU: the newest
    assert [j["job_id"] for j in jobmap.running_jobs(cfg)] == ["42", "43"]
    jobmap.job_ended(cfg, ENV, LOG)
    assert sorted(os.listdir(dcgm)) == ["3"]
    assert (dcgm / "3").read_text() == "43\n"
    assert sorted(os.listdir(gpustat)) == ["3"]  # 43's file is not 42's to remove
    assert [j["job_id"] for j in jobmap.running_jobs(cfg)] == ["43"]


#: A node whose GPU 0 is in MIG mode with two instances (Slurm AutoDetect=nvml: gres
#: devices 0 and 1 are its MIG devices, 2 and 3 are NVML GPUs 1 and 2), GPUs 1-3 whole.
MIG_A = "MIG-5c89852c-d268-c3f3-1b07-005d5ae1dc3f"
MIG_B = "MIG-7e1a3b2c-0f4d-5e6a-8b9c-0d1e2f3a4b5c"
MIG_SNAP = node_snapshot(4, gpu0={"mig_mode": True})


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_mig_job_never_labels_another_tenants_gpu(cfg, tmp_path, caplog):
    """Job 42 holds MIG device B (Slurm gres index 1): file '1' would say it owns NVML GPU
    1, which job 43 holds whole. jobstats gets the MIG UUID's file, dcgm-exporter nothing
    (its HPC map names whole GPUs); each gap is one warning."""
    dcgm, gpustat = tmp_path / "dcgm", tmp_path / "gpustat"
    with caplog.at_level(logging.WARNING):
        jobmap.job_started(cfg, dict(ENV, SLURM_JOB_GPUS="1", CUDA_VISIBLE_DEVICES=MIG_B), LOG, snapshot=MIG_SNAP)
    assert not dcgm.exists() or os.listdir(dcgm) == []
    assert sorted(os.listdir(gpustat)) == [MIG_B]
    assert (gpustat / MIG_B).read_text() == "42 1001\n"
    assert _warnings(caplog) == [
        f"job mapping files: MIG device(s) {MIG_B}: dcgm-exporter's HPC job mapping names whole GPUs only "
        "(every MIG instance of a GPU carries its index): no dcgm job mapping file written",
        "job mapping files: job GPU index(es) 1: GPU(s) 0 of this node are in MIG mode (or their MIG mode is "
        "unreadable), where Slurm's GPU index counts MIG devices, not NVML's GPUs: no GPU-index job mapping "
        "file written"]
    [rec] = jobmap.running_jobs(cfg)
    assert (rec["gpus"], rec["mig_devices"]) == ([], [MIG_B])
    # a whole GPU named by its UUID on the same node is still mapped to its NVML index
    uuid2 = MIG_SNAP.gpus[2].uuid
    jobmap.job_started(cfg, dict(ENV, SLURM_JOB_ID="43", SLURM_JOB_GPUS="3", SLURM_JOB_UID="1002",
                                 CUDA_VISIBLE_DEVICES=uuid2), LOG, snapshot=MIG_SNAP)
    assert sorted(os.listdir(dcgm)) == ["2"] and (dcgm / "2").read_text() == "43\n"
    assert sorted(os.listdir(gpustat)) == ["2", MIG_B]
    jobmap.job_ended(cfg, dict(ENV, SLURM_JOB_GPUS="1", CUDA_VISIBLE_DEVICES=MIG_B), LOG)
    assert sorted(os.listdir(gpustat)) == ["2"]
    assert sorted(os.listdir(dcgm)) == ["2"]
    jobmap.job_ended(cfg, dict(ENV, SLURM_JOB_ID="43", SLURM_JOB_GPUS="3", CUDA_VISIBLE_DEVICES=uuid2), LOG)
    assert os.listdir(gpustat) == [] and os.listdir(dcgm) == []


@pytest.mark.parametrize("gpu0", [{"mig_mode": None, "read_errors": {"mig_mode": "Unknown"}},
                                  {"mig_mode": None, "read_errors": {"handle": "NoPermission"}}])
def test_unreadable_mig_mode_counts_as_mig(cfg, tmp_path, gpu0):
    """A GPU whose MIG mode (or handle) could not be read may be in MIG mode: no index is
    trusted on that node (the collector's rule)."""
    jobmap.job_started(cfg, ENV, LOG, snapshot=node_snapshot(4, gpu0=gpu0))
    assert not (tmp_path / "dcgm").exists() and not (tmp_path / "gpustat").exists()
    assert [j["gpus"] for j in jobmap.running_jobs(cfg)] == [[]]


def test_no_snapshot_writes_no_index_file(cfg, tmp_path, caplog):
    """Without the Prolog's snapshot nobody knows whether Slurm's index is NVML's: nothing
    is written by index (one warning); a MIG UUID still names its own device."""
    with caplog.at_level(logging.WARNING):
        jobmap.job_started(cfg, dict(ENV, CUDA_VISIBLE_DEVICES=f"{MIG_A},MIG-GPU-{MIG_SNAP.gpus[0].uuid[4:]}/1/0"),
                           LOG, snapshot=None)
    assert not (tmp_path / "dcgm").exists()
    assert os.listdir(tmp_path / "gpustat") == [MIG_A]
    w = _warnings(caplog)
    assert w[0] == (f"job mapping files: MIG device(s) MIG-GPU-{MIG_SNAP.gpus[0].uuid[4:]}/1/0: a pre-R470 MIG "
                    "id names no file: no job mapping file written")
    assert w[2] == ("job mapping files: job GPU(s) 1,3: no GPU snapshot, so whether Slurm's GPU index is NVML's "
                    "(no GPU in MIG mode) is unknown: no GPU-index job mapping file written")
    assert len(w) == 3


def test_job_mapping_fails_open(cfg, tmp_path, caplog):
    (tmp_path / "dcgm").write_text("not a directory")
    with caplog.at_level(logging.ERROR):
        jobmap.job_started(cfg, ENV, LOG, snapshot=SNAP)
    assert "tool error: job mapping files: " in caplog.text
    jobmap.job_started(cfg, dict(ENV, SLURM_JOB_ID="../../etc"), LOG, snapshot=SNAP)  # not a job id: ignored
    assert [j["job_id"] for j in jobmap.running_jobs(cfg)] == ["42"]


def _samples(st, t):
    st.insert_many("samples", [
        {"job_id": "42", "node": "n1", "at": t - 20, "gpu_index": 1, "gpu_uuid": "GPU-1", "gpu_util_pct": 10.0,
         "mem_used_mib": 100.0, "power_w": 100.0, "temp_c": 40.0, "sm_clock_mhz": 1000.0},
        {"job_id": "42", "node": "n1", "at": t - 15, "gpu_index": 1, "gpu_uuid": "GPU-1", "energy_j": 7000.0},
        {"job_id": "42", "node": "n1", "at": t - 10, "gpu_index": 1, "gpu_uuid": "GPU-1", "gpu_util_pct": 87.0,
         "mem_util_pct": 41.0, "mem_used_mib": 2048.0, "power_w": 312.5, "temp_c": 61.0, "sm_clock_mhz": 1980.0},
        {"job_id": "42", "node": "n1", "at": t - 10, "gpu_index": 3, "gpu_uuid": "GPU-3", "gpu_util_pct": 0.0,
         "mem_used_mib": 0.0, "power_w": 70.0, "temp_c": 31.0, "sm_clock_mhz": 345.0},
    ])


def _samples_by(text, name):
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                out[(s.labels.get("job_id"), s.labels.get("gpu"))] = (s.labels, s.value)
    return out


def test_job_metrics_carry_job_labels_and_parse(cfg):
    now = time.time()
    jobmap.job_started(cfg, ENV, LOG, snapshot=SNAP)
    st = open_store(cfg.store_path)
    _samples(st, now)
    reg, errors = metrics.build_registry(cfg, st, now=now)
    assert errors == []
    text = generate_latest(reg).decode()
    info = _samples_by(text, "gpuguard_job_gpu_info")
    assert info[("42", "1")] == ({"node": "n1", "job_id": "42", "user": "gg_alice", "account": "acct_a", "gpu": "1",
                                  "uuid": "GPU-1"}, 1.0)
    assert set(info) == {("42", "1"), ("42", "3")}
    util = _samples_by(text, "gpuguard_job_gpu_utilization_ratio")
    assert util[("42", "1")][1] == pytest.approx(0.87)
    assert _samples_by(text, "gpuguard_job_gpu_memory_used_bytes")[("42", "1")][1] == 2048 * 1024 * 1024
    assert _samples_by(text, "gpuguard_job_gpu_sm_clock_hertz")[("42", "3")][1] == 345e6
    assert _samples_by(text, "gpuguard_job_gpu_power_watts")[("42", "1")][1] == 312.5
    # every metric-table row with a Prometheus export, from the newest sample / slow reading
    assert _samples_by(text, "gpuguard_job_gpu_memory_utilization_ratio")[("42", "1")][1] == pytest.approx(0.41)
    assert _samples_by(text, "gpuguard_job_gpu_temperature_celsius")[("42", "3")][1] == 31.0
    assert _samples_by(text, "gpuguard_job_gpu_energy_joules")[("42", "1")][1] == 7000.0
    assert ("42", "3") not in _samples_by(text, "gpuguard_job_gpu_energy_joules")
    assert _samples_by(text, "gpuguard_job_gpu_sample_timestamp_seconds")[("42", "1")][1] == pytest.approx(now - 10,
                                                                                                         abs=0.01)
    fams = {f.name for f in parse_openmetrics(generate_openmetrics(reg).decode())}
    assert {"gpuguard_job_gpu_info", "gpuguard_node_drained", "gpuguard_xid_events"} <= fams


def test_stale_job_drops_out(cfg):
    now = time.time()
    jobmap.job_started(cfg, ENV, LOG, snapshot=SNAP)
    st = open_store(cfg.store_path)
    _samples(st, now - 3600)
    reg, _ = metrics.build_registry(cfg, st, now=now)
    assert _samples_by(generate_latest(reg).decode(), "gpuguard_job_gpu_info") == {}


def test_node_metrics_after_a_drain(cfg):
    from gpuguard.ops.nodes import record_action

    st = open_store(cfg.store_path)
    run = st.insert("health_runs", {"node": "n1", "hook": "health", "started_at": 1.0, "finished_at": 2.0,
                                    "decision": "drain", "reason": "gpuguard: xid.79 x", "tool_errors": "[]"})
    st.insert("findings", {"run_id": run, "node": "n1", "at": 2.0, "code": "xid.79", "severity": "critical",
                           "action": "drain", "gpu_index": 0, "message": "x", "evidence": "{}"})
    st.insert_many("events", [{"node": "n1", "at": 2.0, "kind": "xid", "code": 79, "gpu_index": 0}] * 3)
    # a user's `logger -t kernel` line read from syslog: kept, but not an XID of the GPU
    st.insert("events", {"node": "n1", "at": 2.0, "kind": "xid", "code": 79, "gpu_index": 0, "action": "record",
                         "source": "kernel_log_untrusted"})
    record_action(st, node="n1", action="drain", by="health", outcome="done", reason="gpuguard: xid.79 x")
    reg, errors = metrics.build_registry(cfg, st)
    assert errors == []
    text = generate_latest(reg).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert [(s.labels, s.value) for s in fams["gpuguard_node_drained"].samples] == [({"node": "n1"}, 1.0)]
    assert [(s.labels, s.value) for s in fams["gpuguard_health_findings"].samples] == [
        ({"node": "n1", "code": "xid.79", "severity": "critical", "action": "drain", "gpu": "0"}, 1.0)]
    xid = [s for s in fams["gpuguard_xid_events"].samples if s.name == "gpuguard_xid_events_total"]
    assert [(s.labels, s.value) for s in xid] == [({"node": "n1", "gpu": "0", "xid": "79"}, 3.0)]


def test_textfile_is_written_atomically(cfg, tmp_path):
    st = open_store(cfg.store_path)
    assert metrics.write_textfile(cfg, st) == []
    d = tmp_path / "textfile"
    assert os.listdir(d) == ["gpuguard_n1.prom"]
    names = {f.name for f in text_string_to_metric_families((d / "gpuguard_n1.prom").read_text())}
    assert "gpuguard_node_maintenance" in names


def test_grafana_dashboard_queries_only_metrics_gpuguard_writes(cfg):
    import json
    import pathlib
    import re

    now = time.time()
    jobmap.job_started(cfg, ENV, LOG, snapshot=SNAP)
    st = open_store(cfg.store_path)
    _samples(st, now)
    st.insert_many("events", [{"node": "n1", "at": 2.0, "kind": "xid", "code": 79, "gpu_index": 0}])
    run = st.insert("health_runs", {"node": "n1", "hook": "health", "started_at": 1.0, "finished_at": 2.0,
                                    "decision": "proceed", "reason": "", "tool_errors": "[]"})
    st.insert("findings", {"run_id": run, "node": "n1", "at": 2.0, "code": "pcie.width_degraded",
                           "severity": "warning", "action": "alert", "gpu_index": 1, "message": "x8", "evidence": "{}"})
    reg, _ = metrics.build_registry(cfg, st, now=now)
    written = {s.name for f in text_string_to_metric_families(generate_latest(reg).decode()) for s in f.samples}
    dash = json.loads((pathlib.Path(__file__).parents[1] / "slurm-conf-examples" / "grafana-gpuguard.json").read_text())
    used = {m for p in dash["panels"] for t in p["targets"] for m in re.findall(r"gpuguard_[a-z_]+", t["expr"])}
    used |= {m for v in dash["templating"]["list"] for m in re.findall(r"gpuguard_[a-z_]+", str(v.get("query", "")))}
    assert len(used) >= 12
    assert used - written == set()
