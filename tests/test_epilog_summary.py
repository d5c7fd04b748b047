"""The job summary on synthetic samples, steps, checkpoints and events inserted by hand:
every number is worked out in the comments."""

import json
import math
from types import SimpleNamespace

import pytest

from gpuguard.epilog.summary import (
    METRICS,
    JobSummary,
    decode_exit_status,
    load_summaries,
    percentile,
    save_summary,
    summarize_job,
)
from gpuguard.model import encode_clock_event_reasons
from gpuguard.store import open_store

CAP = encode_clock_event_reasons(["sw_power_cap"])
CAP_HOT = encode_clock_event_reasons(["sw_power_cap", "hw_thermal_slowdown"])
IDLE = encode_clock_event_reasons(["gpu_idle"])


@pytest.fixture
def store(tmp_path):
    s = open_store(str(tmp_path / "node.db"))
    yield s
    s.close()


def sample(job="7", node="n1", **kw):
    row = {"job_id": job, "node": node, "gpu_uuid": f"GPU-{kw['gpu_index']}", "mem_util_pct": 0.0,
           "mem_clock_mhz": 2619.0, "pcie_replay_count": 0}
    row.update(kw)
    return row


def fill(store):
    """Two GPUs, ten samples each at t = 1000..1009 (1 s), plus rows that must be left out."""
    # a sample stamped before the prolog ended (an earlier attempt), stored before this attempt's
    rows = [sample(gpu_index=0, at=990.0, gpu_util_pct=100.0, temp_c=99.0)]
    for i in range(10):
        # GPU 0: util 0,10..90; mem 1000+i; power 100+i; temp 50+i; SM 1000; ECC 0 -> 2 at i=5;
        # power cap for samples 0-5, thermal slowdown too for samples 4-5, nothing after.
        mask = CAP if i < 4 else CAP_HOT if i < 6 else 0
        rows.append(sample(gpu_index=0, at=1000.0 + i, gpu_util_pct=10.0 * i, mem_used_mib=1000.0 + i,
                           power_w=100.0 + i, temp_c=50.0 + i, sm_clock_mhz=1000.0, clock_event_mask=mask,
                           mem_util_pct=5.0 * i, pcie_replay_count=i // 3,
                           ecc_volatile_uncorrected=0 if i < 5 else 2))
        # GPU 0: memory-controller util 0..45 step 5; PCIe replays 0,0,0,1,1,1,2,2,2,3 -> +3.
        # GPU 1: util 50..59; mem 2000; power 200; temp 60; SM 1500; idle reason; ECC unsupported.
        rows.append(sample(gpu_index=1, at=1000.0 + i, gpu_util_pct=50.0 + i, mem_used_mib=2000.0, power_w=200.0,
                           temp_c=60.0, sm_clock_mhz=1500.0, clock_event_mask=IDLE, ecc_volatile_uncorrected=None))
    rows.append(sample(job="8", gpu_index=0, at=1001.0, gpu_util_pct=100.0, temp_c=99.0))  # another job
    rows.append(sample(node="n2", gpu_index=0, at=1001.0, gpu_util_pct=100.0, temp_c=99.0))  # another node
    store.insert_many("samples", rows)
    store.insert_many("host_samples", [
        {"job_id": "7", "node": "n1", "at": 1000.0, "cpu_pct": 50.0, "rss_mib": 100.0},
        {"job_id": "7", "node": "n1", "at": 1005.0, "cpu_pct": 70.0, "rss_mib": 300.0},
    ])
    steps = []
    for rank in (0, 1):
        for k in range(1, 21):
            # step time k/10 s (sum 21 s per rank); 21 samples and 2100 tokens per step
            # -> 420/21 = 20 samples/s and 2000 tokens/s per rank.
            steps.append({"job_id": "7", "node": "n1", "rank": rank, "step": k, "t": 1000.0 + k,
                          "step_time_s": k / 10, "samples": 21, "tokens": 2100,
                          "loss_nonfinite": 1 if (rank, k) in ((0, 3), (1, 3), (1, 4)) else 0,
                          # data wait on rank 0 only: k/40 = a quarter of its step time -> 25 %
                          "data_wait_s": k / 40 if rank == 0 else None,
                          # communication on rank 1 only: half its step time -> 50 %
                          "comm_s": k / 20 if rank == 1 else None})
    store.insert_many("steps", steps)
    store.insert_many("checkpoints", [
        {"job_id": "7", "node": "n1", "rank": 0, "step": 10, "t": 1010.0, "duration_s": 2.5},
        {"job_id": "7", "node": "n1", "rank": 0, "step": 20, "t": 1020.0, "duration_s": 3.5},
        {"job_id": "7", "node": "n1", "rank": 1, "step": 10, "t": 1010.0, "duration_s": 1.0},
    ])
    run = store.insert("health_runs", {"node": "n1", "hook": "prolog", "job_id": "7", "started_at": 995.0,
                                       "finished_at": 999.5, "decision": "proceed", "reason": ""})
    assert run
    ev = {"node": "n1", "kind": "xid", "gpu_index": 0, "pci_bus_id": "0000:18:00", "action": "record",
          "source": "kernel_log"}
    store.insert_many("events", [
        dict(ev, at=999.0, code=13, job_id="7", message="found by the prolog: before the job"),
        dict(ev, at=1005.0, code=48, job_id=None, action="drain", message="DBE during the job"),
        dict(ev, at=1006.0, kind="collector_died", code=None, job_id="7", message="not an XID"),
        dict(ev, at=1005.0, code=79, node="n2", message="another node"),
        dict(ev, at=2000.0, code=31, message="after the epilog"),
    ])


def test_percentile_nearest_rank():
    assert percentile(list(range(1, 21)), 95) == 19
    assert percentile([1, 2, 3, 4], 50) == 2
    assert percentile([1, 2, 3, 4], 0) == 1
    assert percentile([1, 2, 3, 4], 100) == 4
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="within 0..100"):
        percentile([1], 101)


@pytest.mark.parametrize("raw, code, sig, text", [
    (0, 0, None, "exit 0"),
    (768, 3, None, "exit 3"),
    (9, None, 9, "signal 9 (SIGKILL)"),
    (139, None, 11, "signal 11 (SIGSEGV) core dumped"),
    (None, None, None, "unknown"),
])
def test_exit_status_decoding(raw, code, sig, text):
    ex = decode_exit_status(raw)
    assert (ex.raw, ex.code, ex.signal, ex.text) == (raw, code, sig, text)


def test_summary_exact_values(store):
    fill(store)
    s = summarize_job(store, "7", "n1", exit_status_raw=768, collector_status="ok", ended_at=1500.0)
    assert (s.started_at, s.ended_at) == (999.5, 1500.0)  # the prolog run's end .. the epilog
    assert (s.exit_code, s.exit_signal, s.exit_text, s.collector_status) == (3, None, "exit 3", "ok")
    assert (s.sample_count, s.first_sample_at, s.last_sample_at, s.sample_interval_s) == (20, 1000.0, 1009.0, 1.0)
    # pooled util: 0..90 step 10 and 50..59 -> mean (450 + 545) / 20; sorted 20 values, p95 = 19th = 80
    assert (s.gpu_util_mean_pct, s.gpu_util_p95_pct) == (49.75, 80.0)
    assert (s.mem_used_peak_mib, s.power_mean_w, s.temp_max_c, s.sm_clock_mean_mhz) == (2000.0, 152.25, 60.0, 1250.0)
    # memory-controller util: 0..45 on GPU 0, 0 on GPU 1 -> mean 225 / 20
    assert (s.mem_util_mean_pct, s.pcie_replay_count_increase) == (11.25, 3)
    # left-point rule, 9 intervals of 1 s per GPU: cap on samples 0-5, thermal on 4-5, idle on 0-8
    assert s.clock_event_gpu_s == {"gpu_idle": 9.0, "sw_power_cap": 6.0, "hw_thermal_slowdown": 2.0}
    assert s.ecc_volatile_uncorrected_increase == 2
    assert s.xid_event_count == 1
    assert [(e["code"], e["action"], e["at"]) for e in s.xid_events] == [(48, "drain", 1005.0)]
    assert (s.host_sample_count, s.host_cpu_mean_pct, s.host_rss_peak_mib) == (2, 60.0, 300.0)
    g0, g1 = s.gpus
    assert g0.to_dict() == {
        "gpu_index": 0, "gpu_uuid": "GPU-0", "sample_count": 10, "gpu_util_mean_pct": 45.0,
        "sm_clock_mean_mhz": 1000.0, "power_mean_w": 104.5, "temp_max_c": 59.0, "mem_used_peak_mib": 1009.0,
        "mem_util_mean_pct": 22.5, "pcie_replay_count_increase": 3,
        "ecc_volatile_uncorrected_increase": 2, "energy_increase_j": None,
        "clock_event_s": {"sw_power_cap": 6.0, "hw_thermal_slowdown": 2.0}}
    assert (g1.gpu_util_mean_pct, g1.sm_clock_mean_mhz, g1.power_mean_w, g1.temp_max_c,
            g1.ecc_volatile_uncorrected_increase, g1.clock_event_s) == (54.5, 1500.0, 200.0, 60.0, None,
                                                                        {"gpu_idle": 9.0})
    # steps: 40 records of 20 steps on 2 ranks; each step time k/10 twice, sorted:
    # p50 = 20th of 40 = 1.0, p95 = 38th = 1.9, p99 = 40th = 2.0
    assert (s.step_records, s.steps, s.ranks) == (40, 20, 2)
    assert (s.step_time_p50_s, s.step_time_p95_s, s.step_time_p99_s) == (1.0, 1.9, 2.0)
    assert (s.throughput_samples_per_s, s.throughput_tokens_per_s) == (40.0, 4000.0)
    assert (s.data_wait_share_pct, s.comm_share_pct) == (25.0, 50.0)
    # rank 0 checkpointed 2.5 + 3.5 s, rank 1 1.0 s: the busiest rank counts
    assert (s.checkpoint_total_s, s.checkpoint_count) == (6.0, 2)
    assert s.nonfinite_loss_count == 3
    assert s.post_job is None


def test_clock_event_gap_is_capped(store):
    # samples at 0, 1, 2, 12 s: median interval 1 s, so the 10 s gap counts as 3 s
    store.insert_many("samples", [sample(gpu_index=0, at=t, clock_event_mask=CAP) for t in (0.0, 1.0, 2.0, 12.0)])
    s = summarize_job(store, "7", "n1", exit_status_raw=0, ended_at=100.0)
    assert s.clock_event_gpu_s == {"sw_power_cap": 5.0}
    assert s.started_at is None  # no prolog run: no lower bound


def test_empty_job_has_none_not_zero(store):
    s = summarize_job(store, "9", "n1", exit_status_raw=None, collector_status="never_started")
    assert (s.sample_count, s.step_records, s.gpus, s.exit_text) == (0, 0, [], "unknown")
    for name in METRICS:
        if name != "xid_event_count":
            assert getattr(s, name) is None, name
    assert s.xid_event_count == 0


def test_ingest_counts_and_post_job(store):
    fill(store)
    rid = store.insert("health_runs", {"node": "n1", "hook": "epilog", "job_id": "7", "started_at": 1400.0,
                                       "finished_at": 1401.0, "decision": "drain", "reason": "gpuguard: x"})
    store.insert("findings", {"run_id": rid, "node": "n1", "at": 1401.0, "job_id": "7", "code": "ecc.uncorrectable_volatile",
                              "severity": "critical", "action": "drain", "gpu_index": 1, "message": "m", "evidence": "{}"})

    ingest = SimpleNamespace(malformed=4, rejected_files=[("/jobs/7/train.rank1.jsonl", "symlink")], truncated=True)
    s = summarize_job(store, "7", "n1", exit_status_raw=9, collector_status="died", ingest=ingest, ended_at=1500.0)
    assert (s.malformed_records, s.rejected_files, s.records_truncated) == (
        4, [["/jobs/7/train.rank1.jsonl", "symlink"]], True)
    assert s.post_job == {"outcome": "drain", "reason": "gpuguard: x", "findings": [
        {"code": "ecc.uncorrectable_volatile", "severity": "critical", "action": "drain", "gpu_index": 1}]}
    assert s.exit_text == "signal 9 (SIGKILL)"


def test_bad_collector_status(store):
    with pytest.raises(ValueError, match="collector_status must be one of"):
        summarize_job(store, "7", "n1", exit_status_raw=0, collector_status="fine")


def test_save_roundtrip_and_upsert(store):
    fill(store)
    s = summarize_job(store, "7", "n1", exit_status_raw=0, collector_status="ok", ended_at=1500.0)
    save_summary(store, s)
    save_summary(store, s)  # a rerun replaces
    rows = store.query("select job_id, node, exit_code, collector_status, sample_count, step_records, "
                       "summary_version from job_summaries")
    assert rows == [{"job_id": "7", "node": "n1", "exit_code": 0, "collector_status": "ok", "sample_count": 20,
                     "step_records": 40, "summary_version": 1}]
    (back,) = load_summaries(store, "7")
    assert back == s
    assert json.loads(json.dumps(s.to_dict())) == s.to_dict()
    assert JobSummary.from_dict(dict(s.to_dict(), field_from_the_future=1)) == s
    assert s.metrics()["step_time_p50_s"] == 1.0


def test_migration_2_tables(store):
    names = set(store.db.table_names())
    assert {"steps", "checkpoints", "job_summaries"} <= names
    assert store.db["job_summaries"].pks == ["job_id", "node"]
    assert {"job_id", "node", "rank", "step", "t", "step_time_s", "samples", "tokens", "loss", "loss_nonfinite",
            "grad_norm", "data_wait_s", "fwd_bwd_s", "comm_s", "optim_s"} == set(store.db["steps"].columns_dict)


def test_nan_free_output(store):
    fill(store)
    d = summarize_job(store, "7", "n1", exit_status_raw=0, ended_at=1500.0).to_dict()
    for k, v in d.items():
        assert not (isinstance(v, float) and math.isnan(v)), k


def test_backward_clock_step_keeps_every_sample_of_the_attempt(store):
    # 48 samples at 10 s; after the 12th the clock steps back one hour
    rows = [sample(gpu_index=0, at=(1000.0 + 10 * i) - (3600.0 if i >= 12 else 0.0), gpu_util_pct=50.0)
            for i in range(48)]
    store.insert_many("samples", rows)
    store.insert("health_runs", {"node": "n1", "hook": "prolog", "job_id": "7", "started_at": 990.0,
                                 "finished_at": 999.0, "decision": "proceed", "reason": ""})
    s = summarize_job(store, "7", "n1", exit_status_raw=0, collector_status="ok", ended_at=1480.0 - 3600.0 + 10)
    assert s.sample_count == 48
    assert s.gpus[0].sample_count == 48
    assert s.sample_interval_s == 10.0


def test_whole_attempt_after_a_backward_step_still_counts(store):
    store.insert("health_runs", {"node": "n1", "hook": "prolog", "job_id": "7", "started_at": 990.0,
                                 "finished_at": 999.0, "decision": "proceed", "reason": ""})
    store.insert_many("samples", [sample(gpu_index=0, at=100.0 + 10 * i, gpu_util_pct=50.0) for i in range(5)])
    s = summarize_job(store, "7", "n1", exit_status_raw=0, collector_status="ok", ended_at=200.0)
    assert s.sample_count == 5


def test_windows_in_the_declared_shape(store):
    fill(store)
    s = summarize_job(store, "7", "n1", exit_status_raw=0, collector_status="ok", ended_at=1500.0, window_s=5.0)
    w = s.windows
    # samples 1000..1009 -> windows [1000, 1005) and [1005, 1010)
    assert (w["window_s"], w["start"], w["count"]) == (5.0, 1000.0, 2)
    g0 = w["gpus"]["0"]
    # GPU 0 util 0,10,..,40 then 50..90; memory peak 1004 then 1009
    assert (g0["n"], g0["gpu_util_pct"], g0["mem_used_mib"]) == ([5, 5], [20.0, 70.0], [1004.0, 1009.0])
    assert w["gpus"]["1"]["power_w"] == [200.0, 200.0]
    # steps at t = 1001..1020: rank 0 in window 0 has steps 1-4 (0.1+0.2+0.3+0.4 s); 1005-1009 in window 1
    r0 = w["ranks"]["n1/0"]
    assert (r0["n"], r0["step_time_s_sum"]) == ([4, 5], [pytest.approx(1.0), pytest.approx(3.5)])
    save_summary(store, s)
    assert "windows" not in json.loads(store.query("select summary from job_summaries")[0]["summary"])
