"""The prolog's decision path end to end without Slurm: replay GPUs, a kernel-log file,
a fake scontrol that records its argv."""

import json
import os
import time

import pytest
from conftest import node_snapshot

from gpuguard.prolog import hook
from gpuguard.store import open_store

XID79 = "[6781741.548779] NVRM: Xid (PCI:0000:3a:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"
ENV = {"SLURM_JOB_ID": "42", "SLURM_JOB_GPUS": "0,1", "SLURMD_NODENAME": "n1"}
DRAIN_79 = "gpuguard: xid.79 XID 79 GPU has fallen off the bus on gpu2 (0000:3a:00)"


@pytest.fixture
def node(tmp_path, make_config, write_replay, fake_slurm_bin):
    kl = tmp_path / "kern.log"
    kl.write_text("")
    replay = write_replay(node_snapshot(4))
    _path, cfg = make_config('[prolog]\nstart_collector = false\n', replay=replay, kernel_log=str(kl))
    return {"kl": kl, "cfg": cfg, "calls": fake_slurm_bin, "db": str(tmp_path / "node.db"), "tmp": tmp_path}


def runs(db):
    return open_store(db).query("select hook, job_id, decision, reason from health_runs order by id")


def test_healthy_proceeds_and_records(node):
    assert hook.run(ENV) == 0
    assert node["calls"]() == []
    assert runs(node["db"]) == [{"hook": "prolog", "job_id": "42", "decision": "proceed", "reason": ""}]
    inv = open_store(node["db"]).query("select gpu_index, uuid from inventory order by gpu_index")
    assert [r["gpu_index"] for r in inv] == [0, 1, 2, 3]


def test_xid79_drains_with_reason_once(node):
    node["kl"].write_text("[6781700.0] unrelated kernel line\n" + XID79)
    assert hook.run(ENV) == 1
    assert node["calls"]() == [["scontrol", "update", "nodename=n1", "state=drain", f"reason={DRAIN_79}"]]
    ev = open_store(node["db"]).query("select kind, code, gpu_index, pci_bus_id, action, job_id from events")
    assert ev == [{"kind": "xid", "code": 79, "gpu_index": 2, "pci_bus_id": "0000:3a:00", "action": "drain",
                   "job_id": "42"}]
    # the cursor moved: the same XID is not reported again by the next job's prolog
    assert hook.run(dict(ENV, SLURM_JOB_ID="43")) == 0
    assert len(node["calls"]()) == 1
    # a new XID line appended later is seen
    with open(node["kl"], "a") as fh:
        fh.write(XID79)
    assert hook.run(dict(ENV, SLURM_JOB_ID="44")) == 1


def test_application_xid_is_recorded_not_drained(node):
    node["kl"].write_text("NVRM: Xid (PCI:0000:29:00): 13, pid=1234, name=python, Graphics Exception: ESR 0x0\n")
    assert hook.run(ENV) == 0
    assert node["calls"]() == []
    f = open_store(node["db"]).query("select code, action, gpu_index from findings")
    assert f == [{"code": "xid.13", "action": "record", "gpu_index": 1}]


def test_xid_policy_override(node, tmp_path, make_config, write_replay):
    node["kl"].write_text("NVRM: Xid (PCI:0000:29:00): 13, pid=1234, name=python, Graphics Exception: ESR 0x0\n")
    make_config('[prolog]\nstart_collector = false\n[policy.xid]\n13 = "drain"\n',
                replay=write_replay(node_snapshot(4)), kernel_log=str(node["kl"]))
    assert hook.run(ENV) == 1


def test_store_unwritable_still_decides_from_live_checks(node, write_replay, monkeypatch):
    replay = write_replay(node_snapshot(4, gpu1={"read_errors": {"temp_c": "GpuIsLost"}}))
    p = node["tmp"] / "broken-store.toml"
    p.write_text(f"""[node]\nname = "n1"\n[paths]\nstore = "/proc/nope/node.db"\nlog_file = "{node['tmp']}/g.log"\nstate_dir = "{node['tmp']}/state"\nrun_dir = "{node['tmp']}/run"
[gpu]\nsource = "replay"\nreplay_path = "{replay}"\n[xid]\nkernel_log = "{node['kl']}"\nkernel_log_kernel_only = true
[slurm]\nbin_dir = "{node['calls'].bindir}"\n[prolog]\nstart_collector = false\n""")
    monkeypatch.setenv("GPUGUARD_CONFIG", str(p))
    assert hook.run(ENV) == 1
    assert node["calls"]()[0][4].startswith("reason=gpuguard: gpu.lost gpu1 (0000:29:00.0) lost or hung")
    log = (node["tmp"] / "g.log").read_text()
    assert "tool error: store /proc/nope/node.db: cannot create" in log


def test_store_locked_never_drains_a_healthy_node(node):
    s = open_store(node["db"])
    s.db.conn.execute("BEGIN EXCLUSIVE")  # hold the write lock past the busy timeout
    import gpuguard.store as store_mod
    old = store_mod.BUSY_TIMEOUT_MS
    store_mod.BUSY_TIMEOUT_MS = 100
    try:
        assert hook.run(ENV) == 0
    finally:
        store_mod.BUSY_TIMEOUT_MS = old
        s.db.conn.execute("ROLLBACK")
    assert node["calls"]() == []
    assert "tool error: store" in (node["tmp"] / "gpuguard.log").read_text()


def test_bad_config_is_our_fault_exit_0_but_checks_still_run(tmp_path, monkeypatch, capsys):
    p = tmp_path / "bad.toml"
    p.write_text("[gpu]\nsource = 'cuda'\n")
    monkeypatch.setenv("GPUGUARD_CONFIG", str(p))
    import gpuguard.config as config_mod
    paths = config_mod.SCHEMA["paths"]
    for key, val in (("log_file", "fallback.log"), ("store", "node.db"), ("state_dir", "state"), ("run_dir", "run")):
        monkeypatch.setitem(paths, key, (str(tmp_path / val), *paths[key][1:]))
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)  # no NVML here
    assert hook.run(dict(ENV, SLURM_JOB_GPUS="0,1")) == 0
    log = (tmp_path / "fallback.log").read_text()
    assert f"tool error: config: {p}: gpu.source must be 'nvml' or 'replay', got 'cuda' " \
           "(checking with defaults; no drain, job proceeds)" in log
    assert "tool error: GPU source: pynvml not importable" in log
    assert "collector" not in log  # nothing is started on a broken config


def test_dry_run_does_not_call_scontrol(node):
    node["kl"].write_text(XID79)
    cfg_path = node["tmp"] / "gpuguard.toml"
    cfg_path.write_text(cfg_path.read_text().replace("[slurm]\n", "[slurm]\ndrain = false\n"))
    assert hook.run(ENV) == 0  # a non-zero exit would make Slurm drain the node ("Prolog error")
    assert node["calls"]() == []
    log = (node["tmp"] / "gpuguard.log").read_text()
    assert f"dry run: would drain n1: {DRAIN_79}" in log
    assert "dry run: the prolog exits 0 and the job runs (with [slurm] drain = true it would exit 1 " \
           "and Slurm would requeue the job)" in log


def test_scontrol_failure_is_logged_and_still_fails_the_job(node, tmp_path, fake_slurm_bin):
    node["kl"].write_text(XID79)
    sc = tmp_path / "bin" / "scontrol"
    good = sc.read_text()
    sc.write_text("#!/bin/sh\necho 'slurm_update error: Invalid node name specified' >&2\nexit 1\n")
    assert hook.run(ENV) == 1
    log = (tmp_path / "gpuguard.log").read_text()
    assert "ERROR tool error: drain n1 failed: scontrol update nodename=n1 state=drain: exit 1: " \
           "slurm_update error: Invalid node name specified\n" in log
    assert "ERROR tool error: drain not confirmed (drain failed: scontrol update nodename=n1 state=drain: exit 1: " \
           "slurm_update error: Invalid node name specified); Slurm will drain with 'Prolog error' when this " \
           "prolog exits 1, and the drain stays pending\n" in log
    # the drain stays pending and the next hook run (slurmctld back) drains and confirms it
    from gpuguard.drainq import PendingDrains
    pend = PendingDrains(node["cfg"], None)
    assert list(pend.entries()) == ["n1"] and pend.entries()["n1"]["reason"] == DRAIN_79
    sc.write_text(good)
    assert hook.run(dict(ENV, SLURM_JOB_ID="43")) == 0  # the XID itself was consumed once
    assert node["calls"]() == [["scontrol", "update", "nodename=n1", "state=drain", f"reason={DRAIN_79}"]]
    assert pend.entries() == {}


def test_budget_exceeded_proceeds(monkeypatch):
    monkeypatch.setattr(hook, "run", lambda env=None: time.sleep(5) or 1)
    t = time.monotonic()
    assert hook.run_with_budget(0.2) == 0
    assert time.monotonic() - t < 4


def test_crash_proceeds(monkeypatch):
    def boom(env=None):
        raise KeyError("bug")
    monkeypatch.setattr(hook, "run", boom)
    assert hook.run_with_budget(5) == 0


def test_fail_job_cancels_the_job_and_leaves_the_node_up(node, make_config, write_replay):
    make_config('[prolog]\nstart_collector = false\n[policy]\n"config.persistence_off" = "fail-job"\n',
                replay=write_replay(node_snapshot(4, gpu2={"persistence_mode": False})),
                kernel_log=str(node["kl"]))
    assert hook.run(ENV) == 0
    reason = "gpuguard: config.persistence_off gpu2 (0000:3a:00.0) persistence mode off"
    assert node["calls"]() == [["scontrol", "update", "job=42", f"AdminComment={reason}"], ["scancel", "42"]]


def test_decision_json_roundtrip(node):
    node["kl"].write_text(XID79)
    hook.run(ENV)
    f = open_store(node["db"]).query("select evidence from findings where code = 'xid.79'")
    ev = json.loads(f[0]["evidence"])
    assert (ev["count"], ev["catalog_action"], ev["pci_bus_id"]) == (1, "drain", "0000:3a:00")


def test_corrupt_store_healthy_node_proceeds(node):
    with open(node["db"], "wb") as fh:
        fh.write(b"garbage" * 1000)
    assert hook.run(ENV) == 0
    assert node["calls"]() == []
    assert "cannot open: file is not a database" in (node["tmp"] / "gpuguard.log").read_text()
    assert open(node["db"], "rb").read(7) == b"garbage"  # nothing overwritten


def test_readonly_store_still_drains_on_hardware(node):
    hook.run(ENV)  # create it
    import os
    os.chmod(node["db"], 0o444)
    node["kl"].write_text(XID79)
    # root ignores file modes: make the connection itself read-only instead
    import gpuguard.store as store_mod
    real = store_mod.sqlite3.connect

    def ro_connect(path, *a, **kw):
        return real(f"file:{path}?mode=ro", *a, uri=True, **kw)
    store_mod.sqlite3.connect = ro_connect
    try:
        assert hook.run(dict(ENV, SLURM_JOB_ID="50")) == 1
    finally:
        store_mod.sqlite3.connect = real
    assert node["calls"]() == [["scontrol", "update", "nodename=n1", "state=drain", f"reason={DRAIN_79}"]]
    assert "attempt to write a readonly database" in (node["tmp"] / "gpuguard.log").read_text()
    # the XID was acted on (drained) though not recorded: the cursor file moved on, so the
    # next job's prolog does not drain again for the same line
    assert hook.run(dict(ENV, SLURM_JOB_ID="51")) == 0


def test_full_disk_on_write_is_a_tool_error(node, monkeypatch):
    from gpuguard.store import Store, StoreError

    def full(self, table, row):
        raise StoreError(f"store {self.path}: insert into {table} failed: database or disk is full")
    monkeypatch.setattr(Store, "insert", full)
    assert hook.run(ENV) == 0
    assert "database or disk is full" in (node["tmp"] / "gpuguard.log").read_text()


# --- the nvml source under the prolog (fake pynvml raising the real NVMLError classes) ---

@pytest.fixture
def nvml_node(node, monkeypatch):
    import pynvml as real

    import fake_pynvml as fp

    cfg_path = node["tmp"] / "gpuguard.toml"
    text = cfg_path.read_text()
    text = text[: text.index("[gpu]")] + '[gpu]\nsource = "nvml"\ncall_timeout_s = 0.3\n[prolog]\nstart_collector = false\n'
    cfg_path.write_text(text)
    fake = fp.FakeNvml(fp.h100_node())
    monkeypatch.setitem(__import__("sys").modules, "pynvml", fake.module)
    node["fake"], node["real"] = fake, real
    return node


def test_broken_pynvml_install_is_our_fault(node, monkeypatch):
    cfg_path = node["tmp"] / "gpuguard.toml"
    text = cfg_path.read_text()
    cfg_path.write_text(text[: text.index("[gpu]")] + '[gpu]\nsource = "nvml"\n[prolog]\nstart_collector = false\n')
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)  # import raises ImportError
    assert hook.run(ENV) == 0
    assert node["calls"]() == []
    assert "tool error: GPU source: pynvml not importable" in (node["tmp"] / "gpuguard.log").read_text()


def test_nvml_library_missing_on_gpu_node_drains(nvml_node):
    nvml_node["fake"].init_error = nvml_node["real"].NVML_ERROR_LIBRARY_NOT_FOUND
    assert hook.run(ENV) == 1
    [call] = nvml_node["calls"]()
    assert call[4].startswith("reason=gpuguard: gpu.driver_unusable GPU driver/NVML unusable: NVML unavailable: ")


def test_nvml_gpu_lost_drains_that_gpu(nvml_node):
    nvml_node["fake"].fail("nvmlDeviceGetPowerUsage", nvml_node["real"].NVML_ERROR_GPU_IS_LOST, gpu=3)
    assert hook.run(ENV) == 1
    [call] = nvml_node["calls"]()
    # the fake H100 node's GPU 5 also has a pending row remap (a second draining finding)
    assert call[4] == "reason=gpuguard: gpu.lost gpu3 (0000:5d:00.0) lost or hung: power_w=GpuIsLost (+1 more)"


def test_nvml_hung_call_becomes_a_finding_not_a_hung_prolog(nvml_node):
    nvml_node["fake"].hang("nvmlDeviceGetPowerUsage", gpu=1, max_s=5)
    t = time.monotonic()
    assert hook.run(ENV) == 1
    assert time.monotonic() - t < 4
    nvml_node["fake"].release()
    [call] = nvml_node["calls"]()
    assert call[4] == "reason=gpuguard: gpu.lost gpu1 (0000:2a:00.0) lost or hung: power_w=Timeout (+1 more)"


def test_broken_store_does_not_redrain_on_an_old_xid(node):
    """A corrupt store must not make every prolog re-read the kernel log from the start."""
    node["kl"].write_text(XID79)
    assert hook.run(ENV) == 1
    with open(node["db"], "wb") as fh:
        fh.write(b"garbage" * 1000)
    node["calls"]()  # one drain so far
    assert hook.run(dict(ENV, SLURM_JOB_ID="43")) == 0
    assert hook.run(dict(ENV, SLURM_JOB_ID="44")) == 0
    assert len(node["calls"]()) == 1


def test_odd_job_gpu_values_are_ignored_not_fatal():
    from gpuguard.health import parse_job_gpus

    assert parse_job_gpus("0,1,foo,../../x,²,3") == [0, 1, 3]
    assert parse_job_gpus("") is None
    assert parse_job_gpus("GPU-aaaa") is None


def test_prolog_keeps_idle_baselines_and_flags_a_gpu_idling_hotter(node, make_config, write_replay):
    """The registered idle_baseline check through the real prolog: five normal idle
    readings, then GPU 1 idles 14 C hotter than its own median."""
    for i in range(5):
        assert hook.run(dict(ENV, SLURM_JOB_ID=str(100 + i))) == 0
    make_config('[prolog]\nstart_collector = false\n',
                replay=write_replay(node_snapshot(4, gpu1={"temp_c": 45.0})), kernel_log=str(node["kl"]))
    assert hook.run(dict(ENV, SLURM_JOB_ID="200")) == 0  # an alert, not a drain
    rows = open_store(node["db"]).query(
        "select code, severity, action, gpu_index from findings where job_id = '200'")
    assert rows == [{"code": "baseline.idle_temp_up", "severity": "warning", "action": "alert", "gpu_index": 1}]
    # every run stored its 4 readings through ctx.records; only the hot one is flagged
    idle = open_store(node["db"]).query("select gpu_index, flagged from node_idle where job_id = '200'")
    assert sorted((r["gpu_index"], r["flagged"]) for r in idle) == [(0, 0), (1, 1), (2, 0), (3, 0)]
    assert open_store(node["db"]).query("select count(*) as n from node_idle")[0]["n"] == 24


@pytest.mark.parametrize("job_id", ["\u0664\u0662", "\u00b2", "42/../1", "1" * 21])
def test_non_ascii_job_id_is_node_checks_only(node, make_config, write_replay, job_id):
    """str.isdigit() accepts '٤٢': the prolog takes ASCII digits only; a bad id fails no
    job and sets up no job directory, the node checks still run."""
    make_config('[prolog]\nstart_collector = false\n[policy]\n"config.persistence_off" = "fail-job"\n',
                replay=write_replay(node_snapshot(4, gpu2={"persistence_mode": False})),
                kernel_log=str(node["kl"]))
    assert hook.run(dict(ENV, SLURM_JOB_ID=job_id, SLURM_JOB_UID="1001", SLURM_JOB_GID="1001")) == 0
    assert node["calls"]() == []
    assert [(r["job_id"], r["decision"]) for r in runs(node["db"])] == [(None, "fail-job")]
    assert not (node["tmp"] / "jobs").exists() or os.listdir(node["tmp"] / "jobs") == []
    log = (node["tmp"] / "gpuguard.log").read_text()
    assert f"tool error: SLURM_JOB_ID {job_id!r} is not a job id; node checks only" in log


def test_impossible_gpu_index_in_env_is_a_tool_problem_not_a_drain(node):
    """SLURM_JOB_GPUS naming a GPU index no node can have is rejected as a bad hook
    variable (logged), never judged as 'the job's GPU is not visible' (a drain)."""
    assert hook.run(dict(ENV, SLURM_JOB_GPUS="99999999999999999999")) == 0
    assert node["calls"]() == []
    log = (node["tmp"] / "gpuguard.log").read_text()
    assert "SLURM_JOB_GPUS '99999999999999999999' is not a list of GPU indices (GPU index above 1023)" in log


def test_parse_job_gpus_refuses_impossible_indices():
    from gpuguard.hookenv import parse_job_gpus

    assert parse_job_gpus("0,1023") == [0, 1023]
    with pytest.raises(ValueError):
        parse_job_gpus("0,1024")


@pytest.mark.parametrize("gpus", ["1024", "0,1,99999999999999999999", "9" * 5000, "0," * 200000 + "4096"])
def test_impossible_gpu_indices_are_one_tool_error_in_both_hooks(node, gpus):
    """The class of the case above: any index no node can have (too large, too long to
    convert, hidden at the end of a huge list) is one logged tool error, never a drain,
    in the Prolog and the Epilog, and no exporter file is written for it."""
    from gpuguard.epilog import hook as epilog_hook
    from gpuguard.ops.jobmap import job_gpus

    assert hook.run(dict(ENV, SLURM_JOB_GPUS=gpus)) == 0
    assert epilog_hook.run(dict(ENV, SLURM_JOB_GPUS=gpus)) == 0
    assert node["calls"]() == []
    log = (node["tmp"] / "gpuguard.log").read_text()
    line = f"tool error: SLURM_JOB_GPUS {gpus[:80]!r} is not a list of GPU indices (GPU index above 1023); " \
           "the job's GPUs are not checked by index"
    assert log.count(line) == 2, log[-2000:]
    assert job_gpus({"SLURM_JOB_GPUS": gpus}) == []
    assert job_gpus({"SLURM_JOB_GPUS": gpus, "CUDA_VISIBLE_DEVICES": "1,1,0"}) == [1, 0]


@pytest.mark.parametrize("job_id", ["%(x)s", "1\n2026-01-01 prolog[1] job=9 ERROR forged", "%" * 5000])
def test_rejected_job_id_cannot_break_or_forge_log_lines(node, job_id):
    """A SLURM_JOB_ID the reader rejects still labels the log, as one escaped token: a '%'
    cannot break the log format and a newline cannot start a forged line."""
    assert hook.run(dict(ENV, SLURM_JOB_ID=job_id)) == 0
    lines = (node["tmp"] / "gpuguard.log").read_text().splitlines()
    label = ascii(job_id[:24]) if "\n" in job_id or len(job_id) > 24 else job_id
    assert lines and all(f" job={label} " in ln for ln in lines)
    assert not any("forged" in ln and "ERROR" in ln.split(" job=")[0] for ln in lines)
    assert any(f"tool error: SLURM_JOB_ID {job_id[:80]!r} is not a job id; node checks only" in ln for ln in lines)


@pytest.mark.parametrize("mig0, files", [(False, ["1"]), (True, [])])
def test_prolog_names_exporter_files_through_its_snapshot(tmp_path, make_config, write_replay, fake_slurm_bin,
                                                          mig0, files):
    """The Prolog hands its live snapshot to the job map: on a node whose GPU 0 is in MIG
    mode, Slurm's gres index 1 (a MIG device) gets no dcgm-exporter file, which would
    label NVML GPU 1; without MIG the same index is NVML's GPU 1."""
    kl = tmp_path / "kern.log"
    kl.write_text("")
    replay = write_replay(node_snapshot(4, gpu0={"mig_mode": mig0}))
    make_config(f'[prolog]\nstart_collector = false\n[metrics]\ndcgm_job_map_dir = "{tmp_path}/dcgm"\n',
                replay=replay, kernel_log=str(kl))
    assert hook.run(dict(ENV, SLURM_JOB_GPUS="1")) == 0
    got = sorted(os.listdir(tmp_path / "dcgm")) if (tmp_path / "dcgm").exists() else []
    assert got == files


def test_a_drain_only_the_history_shows_is_made_when_the_pending_list_cannot_be_written(node, monkeypatch):
    """The Prolog exits 1 for a drain the checks with history decide; it must drain with
    gpuguard's reason then even when the pending-drain list cannot be written (Slurm's own
    drain would read 'Prolog error', which gpuguard never resumes)."""
    from gpuguard import drainq, nodecheck
    from gpuguard.policy import Decision

    real = nodecheck.judge
    why = "gpuguard: idle.hot gpu1 hot at idle in 3 runs"

    def judge(cfg, col, **kw):
        res = real(cfg, col, **kw)
        if kw.get("store") is not None:  # the second judgement, with history
            res.decision = Decision("drain", why, res.decision.actions)
        return res

    monkeypatch.setattr(nodecheck, "judge", judge)
    monkeypatch.setattr(drainq.PendingDrains, "add", lambda self, *a, **k: False)
    assert hook.run(ENV) == 1
    assert node["calls"]() == [["scontrol", "update", "nodename=n1", "state=drain", f"reason={why}"]]
