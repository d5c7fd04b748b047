"""``gpuguard job show``: text and JSON from a store filled by hand."""

import json

import pytest
from click.testing import CliRunner
from test_epilog_summary import fill

from gpuguard.cli import main
from gpuguard.epilog.cli import job
from gpuguard.epilog.summary import METRICS, save_summary, summarize_job
from gpuguard.store import open_store

if "job" not in main.commands:  # until gpuguard.cli registers it
    main.add_command(job)


@pytest.fixture
def db(tmp_path):
    path = str(tmp_path / "node.db")
    s = open_store(path)
    fill(s)
    rid = s.insert("health_runs", {"node": "n1", "hook": "epilog", "job_id": "7", "started_at": 1400.0,
                                   "finished_at": 1401.0, "decision": "drain",
                                   "reason": "gpuguard: ecc.uncorrectable_volatile gpu1 2 errors"})
    s.insert("findings", {"run_id": rid, "node": "n1", "at": 1401.0, "job_id": "7", "code": "ecc.uncorrectable_volatile",
                          "severity": "critical", "action": "drain", "gpu_index": 1, "message": "gpu1 2 errors",
                          "evidence": "{}"})
    save_summary(s, summarize_job(s, "7", "n1", exit_status_raw=768, collector_status="ok", ended_at=1500.0))
    s.close()
    return path


def invoke(*args):
    return CliRunner().invoke(main, list(args))


def test_json_fields(db, tmp_path, monkeypatch):
    cfg = tmp_path / "noslurm.toml"
    cfg.write_text(f'[slurm]\nbin_dir = "{tmp_path}/no-slurm-here"\n')  # the host's sacct is not asked
    monkeypatch.setenv("GPUGUARD_CONFIG", str(cfg))
    r = invoke("job", "show", "7", "--json", "--store", db)
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert set(d) == {"job_id", "job", "nodes", "verdict", "gpus", "summaries", "health_runs", "findings", "events",
                      "source", "sacct_error"}
    # no Slurm to ask here: the header from the store, which is the source
    assert (d["source"], d["job"]["source"]) == (f"store {db}", "gpuguard summaries")
    assert d["sacct_error"] == f"{tmp_path}/no-slurm-here/sacct: not found (set [slurm] bin_dir)"
    assert d["verdict"] is None  # no verdict stored for this hand-made job
    assert (d["job_id"], d["nodes"]) == ("7", ["n1", "n2"])
    assert d["gpus"] == [{"node": "n1", "gpu_index": 0, "gpu_uuid": "GPU-0"},
                         {"node": "n1", "gpu_index": 1, "gpu_uuid": "GPU-1"},
                         {"node": "n2", "gpu_index": 0, "gpu_uuid": "GPU-0"}]
    assert d["health_runs"] == [
        {"node": "n1", "hook": "prolog", "decision": "proceed", "reason": "", "started_at": "1970-01-01T00:16:35+00:00"},
        {"node": "n1", "hook": "epilog", "decision": "drain", "reason": "gpuguard: ecc.uncorrectable_volatile gpu1 2 errors",
         "started_at": "1970-01-01T00:23:20+00:00"}]
    assert d["findings"] == [{"node": "n1", "hook": "epilog", "at": "1970-01-01T00:23:21+00:00",
                              "code": "ecc.uncorrectable_volatile", "severity": "critical", "action": "drain",
                              "gpu_index": 1, "message": "gpu1 2 errors"}]
    # tagged with the job (the prolog's XID 13, the collector's death) + XIDs inside the window (48)
    assert [(e["kind"], e["code"], e["at"]) for e in d["events"]] == [
        ("xid", 13, "1970-01-01T00:16:39+00:00"), ("xid", 48, "1970-01-01T00:16:45+00:00"),
        ("collector_died", None, "1970-01-01T00:16:46+00:00")]
    (s,) = d["summaries"]
    assert (s["node"], s["exit_code"], s["exit_text"], s["collector_status"], s["step_time_p95_s"],
            s["first_sample_at"], s["ended_at"]) == ("n1", 3, "exit 3", "ok", 1.9, "1970-01-01T00:16:40+00:00",
                                                     "1970-01-01T00:25:00+00:00")
    assert set(METRICS) <= set(s)
    assert s["post_job"]["outcome"] == "drain"
    assert s["gpus"][0]["clock_event_s"] == {"sw_power_cap": 6.0, "hw_thermal_slowdown": 2.0}


def test_text(db):
    r = invoke("job", "show", "7", "--full", "--store", db)
    assert r.exit_code == 0, r.output
    out = r.output.splitlines()
    out = out[out.index("job 7 on n1, n2"):]  # --full: every table after the one-screen page
    assert out[:2] == ["job 7 on n1, n2", "  n1: exit 3, collector ok, 2 GPU(s), post-job check: drain "
                       "(gpuguard: ecc.uncorrectable_volatile gpu1 2 errors)"]
    # the sample of job 7 on n2 puts n2 in the node and GPU lists (it has no summary of its own)
    assert [x.split() for x in out[out.index("GPUs") + 3:out.index("GPUs") + 6]] == [
        ["n1", "0", "GPU-0"], ["n1", "1", "GPU-1"], ["n2", "0", "GPU-0"]]
    table = {x.split("  ")[0]: x.split("  ")[0:1] + x.split()[-2:] for x in out if x and not x.startswith(" ")}
    for metric, value, unit in [
        ("exit status", "768", "raw"), ("step_time_p95_s", "1.9", "s"), ("gpu_util_p95_pct", "80", "%"),
        ("power_mean_w", "152.2", "W"), ("clock event sw_power_cap", "6", "GPU-s"),
        ("throughput_samples_per_s", "40", "samples/s"), ("data_wait_share_pct", "25", "%"),
        ("NaN/inf loss", "3", "steps"),
    ]:
        got = table[metric][1:]
        assert got == ([unit, value] if metric == "exit status" else [value, unit]), metric
    assert [x.split() for x in out if x.startswith("first sample")] == [["first", "sample",
                                                                         "1970-01-01T00:16:40+00:00"]]
    i = out.index("Per GPU (n1)")
    # the per-GPU columns are the metric table's per-GPU statistics, in table order
    assert out[i + 1].split() == ["GPU", "SAMPLES", "UTIL_MEAN_%", "MEMUTIL_MEAN_%", "MEM_PEAK_MIB", "POWER_MEAN_W",
                                  "TEMP_MAX_C", "SM_MEAN_MHZ", "ECC_UNC_NEW", "PCIE_REPLAY_NEW", "ENERGY_NEW_J", "CLOCK_EVENTS"]
    # mem_util 5*i over i = 0..9 -> 22.5; PCIe replays i // 3 -> 0..3: 3 new
    assert out[i + 3].split() == ["0", "10", "45", "22.5", "1009", "104.5", "59", "1000", "2", "3", "-",
                                  "hw_thermal_slowdown", "2s,", "sw_power_cap", "6s"]
    i = out.index("Findings")
    assert out[i + 3].split()[:6] == ["n1", "epilog", "critical", "drain", "ecc.uncorrectable_volatile", "1"]
    i = out.index("Events")
    assert [x.split()[2:4] for x in out[i + 3:]] == [["xid", "13"], ["xid", "48"], ["collector_died", "-"]]


def test_config_store_path(db, tmp_path):
    cfg = tmp_path / "g.toml"
    cfg.write_text(f'[paths]\nstore = "{db}"\n')
    r = invoke("--config", str(cfg), "job", "show", "7", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["nodes"] == ["n1", "n2"]


def test_unknown_job_exit_2(db):
    r = invoke("job", "show", "999", "--store", db)
    assert r.exit_code == 2
    assert r.output.strip() == f"Error: job 999: not found in store {db}"


def test_missing_store_exit_2(tmp_path):
    r = invoke("job", "show", "7", "--store", str(tmp_path / "none.db"))
    assert r.exit_code == 2
    assert r.output.strip() == f"Error: store {tmp_path / 'none.db'}: does not exist"
