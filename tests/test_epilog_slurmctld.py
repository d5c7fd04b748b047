"""EpilogSlurmctld: spool merge into AdminComment through sacctmgr (fake Slurm tools)."""

import json

import pytest

from gpuguard.epilog import slurmctld, spool


@pytest.fixture
def ctld(tmp_path, make_config, fake_slurm_bin, write_replay):
    from conftest import node_snapshot

    sp = tmp_path / "spool"
    make_config('[epilog]\nslurmctld_wait_s = 0.3\n', replay=write_replay(node_snapshot(1)))
    cfg = tmp_path / "gpuguard.toml"
    cfg.write_text(cfg.read_text().replace("[paths]\n", f'[paths]\nspool_dir = "{sp}"\n'))
    # scontrol show hostnames n[1-2] -> n1 n2
    (tmp_path / "bin" / "scontrol").write_text("#!/bin/sh\necho n1; echo n2\n")
    return {"spool": str(sp), "calls": fake_slurm_bin, "tmp": tmp_path}


def test_merges_all_nodes_into_admin_comment(ctld):
    spool.write_node_summary(ctld["spool"], "77", "n1", {"gpu_util_mean_pct": 91.5})
    spool.write_node_summary(ctld["spool"], "77", "n2", {"gpu_util_mean_pct": 88.0})
    assert slurmctld.run({"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n[1-2]"}, retry_sleep_s=0) == 0
    [call] = ctld["calls"]()
    assert call[:6] == ["sacctmgr", "-i", "modify", "job", "where", "jobid=77"]
    assert call[6] == "set"
    text = call[7][len("AdminComment="):]
    assert text.startswith("gpuguard:v1z:") and '"' not in text
    assert spool.decode_admin_comment(text) == {
        "job": "77", "missing_nodes": [],
        "nodes": {"n1": {"gpu_util_mean_pct": 91.5}, "n2": {"gpu_util_mean_pct": 88.0}}}


def test_missing_node_is_named_after_the_wait(ctld):
    spool.write_node_summary(ctld["spool"], "78", "n1", {"x": 1})
    slurmctld.run({"SLURM_JOB_ID": "78", "SLURM_JOB_NODELIST": "n[1-2]"}, retry_sleep_s=0)
    text = ctld["calls"]()[0][7][len("AdminComment="):]
    assert spool.decode_admin_comment(text)["missing_nodes"] == ["n2"]
    assert "no summary from node(s) n2 after 0 s" in (ctld["tmp"] / "gpuguard.log").read_text()


def test_no_spool_no_call(ctld):
    assert slurmctld.run({"SLURM_JOB_ID": "79", "SLURM_JOB_NODELIST": "n[1-2]"}, retry_sleep_s=0) == 0
    assert ctld["calls"]() == []


def test_sacctmgr_failure_retries_then_exits_0(ctld):
    (ctld["tmp"] / "bin" / "sacctmgr").write_text("#!/bin/sh\necho 'Job not found' >&2\nexit 1\n")
    spool.write_node_summary(ctld["spool"], "80", "n1", {"x": 1})
    spool.write_node_summary(ctld["spool"], "80", "n2", {"x": 2})
    assert slurmctld.run({"SLURM_JOB_ID": "80", "SLURM_JOB_NODELIST": "n[1-2]"}, retries=2, retry_sleep_s=0) == 0
    log = (ctld["tmp"] / "gpuguard.log").read_text()
    assert log.count("AdminComment attempt") == 2
    assert "tool error: AdminComment not set for job 80" in log


def test_large_summaries_are_compressed_under_the_slurmdbd_limit():
    nodes = {f"n{i}": {"per_gpu": [{"gpu": g, "note": "x" * 400} for g in range(8)], "util": i} for i in range(64)}
    text = spool.encode_admin_comment("9", nodes, [])
    assert len(text.encode()) <= spool.ADMIN_COMMENT_MAX
    assert text.startswith("gpuguard:v1z:")
    assert spool.decode_admin_comment(text)["nodes"]["n63"]["util"] == 63


def test_unsafe_names_refused(tmp_path):
    with pytest.raises(spool.SpoolError, match=r"unsafe node name for a spool path: '../etc'"):
        spool.write_node_summary(str(tmp_path), "1", "../etc", {})
    with pytest.raises(spool.SpoolError, match="unsafe job id"):
        spool.read_job(str(tmp_path), "1/../../x")


def test_symlinked_summary_is_not_followed(tmp_path):
    d = tmp_path / "5"
    d.mkdir()
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"secret": True}))
    (d / "n1.json").symlink_to(secret)
    spool.write_node_summary(str(tmp_path), "5", "n2", {"ok": 1})
    assert spool.read_job(str(tmp_path), "5") == {"n2": {"ok": 1}}


def test_hostile_job_id_and_fifo_in_the_spool(ctld):
    import os

    assert slurmctld.run({"SLURM_JOB_ID": "../x", "SLURM_JOB_NODELIST": "n[1-2]"}, retry_sleep_s=0) == 0
    assert "SLURM_JOB_ID '../x' is not a job id" in (ctld["tmp"] / "gpuguard.log").read_text()
    d = os.path.join(ctld["spool"], "81")
    os.makedirs(d)
    os.mkfifo(os.path.join(d, "n1.json"))
    spool.write_node_summary(ctld["spool"], "81", "n2", {"x": 2})
    assert spool.read_job(ctld["spool"], "81") == {"n2": {"x": 2}}  # returns at once, FIFO skipped
