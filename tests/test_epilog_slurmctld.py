"""EpilogSlurmctld worker and `gpuguard cluster ingest`: spool parts -> the job judge ->
cluster store + AdminComment (fake Slurm tools)."""

from __future__ import annotations

import json
import os
import time

import pytest
from click.testing import CliRunner

import scenarios as S
from cluster_helpers import close_all, parts_of, write_per_node
from gpuguard.cli import main as cli
from gpuguard.epilog import admincomment, cluster, part, slurmctld
from gpuguard.store import open_store


@pytest.fixture
def ctld(tmp_path, make_config, fake_slurm_bin, write_replay):
    from conftest import node_snapshot

    sp = tmp_path / "spool"
    sp.mkdir()
    make_config('[epilog]\nslurmctld_wait_s = 0.3\n[cluster]\ningest_grace_s = 0\n',
                             replay=write_replay(node_snapshot(1)))
    p = tmp_path / "gpuguard.toml"
    p.write_text(p.read_text().replace("[paths]\n", f'[paths]\nspool_dir = "{sp}"\n'
                                       f'cluster_store = "{tmp_path}/cluster.db"\n'))
    # scontrol show hostnames n[1-2] -> n1 n2
    (tmp_path / "bin" / "scontrol").write_text("#!/bin/sh\necho n1; echo n2\n")
    from gpuguard.config import load

    return {"spool": str(sp), "calls": fake_slurm_bin, "tmp": tmp_path, "cfg": load(str(p))}


def _spool_job(ctld, job_id: str, nodes=("n1", "n2"), family="healthy"):
    """Write the parts of a 2-node scenario job into the spool, as the node Epilogs do."""
    p = S.Profile(name="ctl", nodes=2, gpus_per_node=2, duration_s=900.0)
    rows = S.generate(p, family, seed=3, job_id=job_id, start=S.T0)
    stores = write_per_node(str(ctld["tmp"] / "nodes" / job_id), rows, p, dict(zip(p.node_names, ("n1", "n2"), strict=True)))
    try:
        parts = parts_of(stores, job_id, ctld["cfg"], {"comment": "gpuguard:template=ctl"})
    finally:
        close_all(stores)
    for n in nodes:
        blob, _ = part.encode_part(lambda ws, n=n: parts[n], 60.0)
        part.write_part(ctld["spool"], job_id, n, blob)
    return parts


def _env(job_id):
    return {"SLURM_JOB_ID": job_id, "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_USER": "alice",
            "SLURM_JOB_UID": "1001", "SLURM_JOB_ACCOUNT": "acct_a", "SLURM_JOB_PARTITION": "gpu",
            "SLURM_JOB_COMMENT": "gpuguard:template=ctl", "SLURM_JOB_EXIT_CODE": "0", "SLURM_JOB_NUM_NODES": "2"}


def test_worker_judges_once_with_both_parts(ctld):
    _spool_job(ctld, "77")
    assert slurmctld.run(_env("77"), retry_sleep_s=0) == 0
    [call] = ctld["calls"]()
    assert call[:7] == ["sacctmgr", "-i", "modify", "job", "where", "jobid=77", "set"]
    text = call[7][len("AdminComment="):]
    assert text.startswith("gpuguard:v2z:") and '"' not in text and text == text.lower()
    doc = admincomment.decode(text)
    assert (doc["v"], doc["j"], doc["c"], doc["t"], sorted(doc["n"])) == (2, "77", "learning", "ctl", ["n1", "n2"])
    assert "x" not in doc
    store = open_store(str(ctld["tmp"] / "cluster.db"))
    row = store.query("select user, uid, account, partition, state, parts, admin_comment from cluster_jobs")[0]
    assert (row["user"], row["uid"], row["account"], row["partition"], row["state"]) == (
        "alice", 1001, "acct_a", "gpu", "complete")
    assert json.loads(row["parts"]) == ["n1", "n2"] and row["admin_comment"] == text
    assert store.query("select count(*) as n from verdicts")[0]["n"] == 1
    assert store.query("select node from job_summaries order by node") == [{"node": "n1"}, {"node": "n2"}]
    store.close()
    assert not os.path.exists(os.path.join(ctld["spool"], "77"))  # judged complete: spool cleaned


def test_missing_node_is_named_and_the_late_part_is_judged_by_ingest(ctld):
    parts = _spool_job(ctld, "78", nodes=("n1",))
    slurmctld.run(_env("78"), retry_sleep_s=0)
    log = (ctld["tmp"] / "gpuguard.log").read_text()
    assert "job 78 judged without node(s) n2: no part in" in log
    first = admincomment.decode(ctld["calls"]()[0][7][len("AdminComment="):])
    assert first["x"] == ["n2"] and sorted(first["n"]) == ["n1"]
    assert os.path.exists(os.path.join(ctld["spool"], "78", "job.json"))  # kept for a late part
    blob, _ = part.encode_part(lambda ws: parts["n2"], 60.0)
    part.write_part(ctld["spool"], "78", "n2", blob)
    time.sleep(0.35)  # ingest leaves a job alone while a worker could still be waiting (0.3 s here)
    r = CliRunner().invoke(cli, ["cluster", "ingest", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output) == {"judged": 1, "unchanged": 0, "waiting": 0, "removed": 0,
                                    "nccl_probes_carried": 0, "errors": []}
    second = admincomment.decode(ctld["calls"]()[1][7][len("AdminComment="):])
    assert "x" not in second and sorted(second["n"]) == ["n1", "n2"]
    assert len(ctld["calls"]()) == 2


def _spool_nameless_job(ctld, job_id: str, comment):
    """A 2-node job with a derived template (no ``gpuguard:template=`` in ``comment``) in the
    spool, with no manifest (EpilogSlurmctld never ran for it)."""
    p = S.Profile(name="ctl", nodes=2, gpus_per_node=2, duration_s=900.0)
    rows = S.generate(p, "healthy", seed=3, job_id=job_id, start=S.T0)
    stores = write_per_node(str(ctld["tmp"] / "nodes" / job_id), rows, p, dict(zip(p.node_names, ("n1", "n2"), strict=True)))
    job = {"comment": comment, "partition": "gpu", "num_nodes": 2, "gpus": 2, "gpu_name": "NVIDIA H100 80GB HBM3"}
    try:
        parts = parts_of(stores, job_id, ctld["cfg"], job)
    finally:
        close_all(stores)
    for n in ("n1", "n2"):
        blob, _ = part.encode_part(lambda ws, n=n: parts[n], 60.0)
        part.write_part(ctld["spool"], job_id, n, blob)


@pytest.mark.parametrize(("sacct_out", "comment", "template"), [
    ("95|llama pretrain|v2\n", "nightly run", "gpu.h100-80gb-hbm3.x2.n2.llama-pretrain-v2"),
    ("95|two\nlines\n96|two\nlines\n", None, "gpu.h100-80gb-hbm3.x2.n2.two-lines"),
    ("", None, "gpu.h100-80gb-hbm3.x2.n2._"),
    ("95|ignored\n", "xgpuguard:template=forged", "gpu.h100-80gb-hbm3.x2.n2.ignored"),
])
def test_ingest_without_a_manifest_reads_the_job_name_from_slurmdbd(ctld, sacct_out, comment, template):
    """Without the manifest the derived template had ``_`` for the job name, so the same
    job got another template than with its manifest; the name now comes from sacct (a
    name with ``|`` or a newline kept whole, a het job's second component not read)."""
    _spool_nameless_job(ctld, "95", comment)
    log = ctld["tmp"] / "sacct.out"
    log.write_text(sacct_out)
    (ctld["tmp"] / "bin" / "sacct").write_text(f"#!/bin/sh\ncat {log}\n")
    time.sleep(0.35)
    store = open_store(str(ctld["tmp"] / "cluster.db"))
    try:
        from gpuguard.slurm import SlurmCli

        res = cluster.ingest(ctld["cfg"], store, log=__import__("logging").getLogger("t"),
                             slurm=SlurmCli(ctld["calls"].bindir), retry_sleep_s=0)
        assert (res.judged, res.errors) == (1, [])
        assert store.query("select template from verdicts") == [{"template": template}]
    finally:
        store.close()


def test_ingest_without_a_manifest_asks_sacct_only_for_a_derived_template(ctld):
    _spool_nameless_job(ctld, "96", "gpuguard:template=mine")
    time.sleep(0.35)
    store = open_store(str(ctld["tmp"] / "cluster.db"))
    try:
        from gpuguard.slurm import SlurmCli

        cluster.ingest(ctld["cfg"], store, log=__import__("logging").getLogger("t"),
                       slurm=SlurmCli(ctld["calls"].bindir), retry_sleep_s=0)
        assert store.query("select template from verdicts") == [{"template": "mine"}]
    finally:
        store.close()
    assert [c for c in ctld["calls"](include_reads=True) if c[0] == "sacct"] == []


def test_worker_killed_mid_judge_then_ingest_twice(ctld):
    """What a SIGKILLed worker leaves (manifest and parts, no cluster_jobs row) is judged
    by ingest; a second ingest changes nothing and calls sacctmgr no more."""
    from gpuguard.epilog.judge import meta_from_env

    _spool_job(ctld, "79")
    cluster.write_manifest(ctld["spool"], "79", meta_from_env(_env("79"), ["n1", "n2"]))
    runner = CliRunner()
    time.sleep(0.35)
    r1 = runner.invoke(cli, ["cluster", "ingest"])
    assert r1.exit_code == 0 and r1.output.startswith("1 judged, 0 unchanged"), r1.output
    store = open_store(str(ctld["tmp"] / "cluster.db"))
    snap = (store.query("select * from verdicts"), store.query("select code, node, job_id from findings"),
            store.query("select job_id, user, state from cluster_jobs"))
    r2 = runner.invoke(cli, ["cluster", "ingest"])
    assert r2.exit_code == 0 and r2.output.startswith("0 judged, 0 unchanged"), r2.output
    assert (store.query("select * from verdicts"), store.query("select code, node, job_id from findings"),
            store.query("select job_id, user, state from cluster_jobs")) == snap
    assert snap[2] == [{"job_id": "79", "user": "alice", "state": "complete"}]
    store.close()
    assert len(ctld["calls"]()) == 1


def test_ingest_waits_for_a_running_worker(ctld, monkeypatch):
    _spool_job(ctld, "80")
    cfg = ctld["cfg"]
    cfg.values["cluster"]["ingest_grace_s"] = 3600.0
    store = open_store(str(ctld["tmp"] / "cluster.db"))
    import logging

    res = cluster.ingest(cfg, store, log=logging.getLogger("t"), slurm=None)
    store.close()
    assert (res.judged, res.waiting) == (0, 1)


def test_ingest_refuses_to_run_as_another_user_than_the_store_owner(ctld, monkeypatch):
    (ctld["tmp"] / "cluster.db").write_bytes(b"")
    monkeypatch.setattr(os, "geteuid", lambda: 4242)
    r = CliRunner().invoke(cli, ["cluster", "ingest"])
    assert r.exit_code == 2
    assert "belongs to root: run cluster ingest as that user" in r.output


def test_sacctmgr_failure_retries_then_ingest_retries(ctld):
    (ctld["tmp"] / "bin" / "sacctmgr").write_text("#!/bin/sh\necho 'Job not found' >&2\nexit 1\n")
    _spool_job(ctld, "81")
    assert slurmctld.run(_env("81"), retries=2, retry_sleep_s=0) == 0
    log = (ctld["tmp"] / "gpuguard.log").read_text()
    assert log.count("AdminComment attempt") == 2
    assert "tool error: AdminComment not set for job 81" in log
    assert os.path.exists(os.path.join(ctld["spool"], "81"))  # kept: ingest sets the comment later


def test_hostile_job_id_fifo_symlink_and_foreign_files_in_the_spool(ctld):
    assert slurmctld.run({"SLURM_JOB_ID": "../x", "SLURM_JOB_NODELIST": "n[1-2]"}, retry_sleep_s=0) == 0
    assert "SLURM_JOB_ID '../x' is not a job id" in (ctld["tmp"] / "gpuguard.log").read_text()
    d = os.path.join(ctld["spool"], "82")
    os.makedirs(d)
    os.mkfifo(os.path.join(d, "n1" + part.SUFFIX))
    secret = ctld["tmp"] / "secret.gz"
    secret.write_bytes(b"x")
    os.symlink(secret, os.path.join(d, "n3" + part.SUFFIX))
    with open(os.path.join(d, "n4" + part.SUFFIX), "wb") as fh:
        fh.write(b"not gzip")
    parts = _spool_job(ctld, "82", nodes=("n2",))
    assert list(part.read_parts(ctld["spool"], "82")) == ["n2"]  # returns at once: FIFO skipped
    blob, _ = part.encode_part(lambda ws: dict(parts["n1"], node="n9"), 60.0)
    with open(os.path.join(d, "n5" + part.SUFFIX), "wb") as fh:
        fh.write(blob)  # a part naming another node than its file
    assert list(part.read_parts(ctld["spool"], "82")) == ["n2"]


def test_part_format_bounds_and_versions(ctld):
    parts = _spool_job(ctld, "83", nodes=())
    p = parts["n1"]
    assert (p["format"], p["v"], p["job_id"], p["node"], p["window_s"]) == ("gpuguard-part", 2, "83", "n1", 60.0)
    assert [g["index"] for g in p["gpus"]] == [0, 1]
    assert len(p["gpus"][0]["t"]) == 15  # 900 s at 60 s windows
    assert p["summary"]["node"] == "n1" and p["job"]["comment"] == "gpuguard:template=ctl"
    limit = len(part.encode_part(lambda w: p, 60.0)[0]) + 1000
    blob, ws = part.encode_part(lambda w: dict(p, window_s=w, pad=[i * 1.2345678 for i in range(int(72000 / w))]),
                                60.0, max_bytes=limit)
    assert ws > 60.0 and len(blob) <= limit  # the window doubled until the part fitted
    assert part.decode_part(blob)["window_s"] == ws
    import gzip

    with pytest.raises(part.SpoolError, match="part version 2 in gzip JSON is not 1"):
        part.decode_part(gzip.compress(json.dumps({"format": "gpuguard-part", "v": 2}).encode()))
    with pytest.raises(part.SpoolError, match="not a gpuguard part"):
        part.decode_part(gzip.compress(b'{"a": 1}'))


def test_unsafe_names_refused(tmp_path):
    with pytest.raises(part.SpoolError, match=r"unsafe node name for a spool path: '../etc'"):
        part.write_part(str(tmp_path), "1", "../etc", b"")
    with pytest.raises(part.SpoolError, match="unsafe job id"):
        part.read_parts(str(tmp_path), "1/../../x")


def test_admin_comment_sizes_and_one_liner():
    """v2 stays under 1 kB for 1 and 8 nodes of 8 GPUs, and the documented one-liner
    decodes it."""
    import subprocess
    import sys

    def summ(n):
        return {"gpu_util_mean_pct": 93.25, "power_mean_w": 612.4, "sm_clock_mean_mhz": 1755.2, "temp_max_c": 71.0,
                "mem_used_peak_mib": 61234.0, "step_time_p50_s": 1.2345,
                "gpus": [{"gpu_util_mean_pct": 90.0 + g} for g in range(8)]}
    v = {"cause": "straggler-node", "state": "judged", "template": "llama-70b-pretrain", "baseline_runs": 20,
         "summary": "node n7 compute time per step 41% above the median of the other nodes",
         "evidence": {"node": "n7"}, "comparisons": [
             {"metric": "step_time_p50_s", "value": 1.61, "median": 1.2, "rel_change": 0.34, "flagged": True}]}
    sizes = {}
    for n in (1, 8, 64):
        text = admincomment.encode(admincomment.build("123456", v, {f"node{i:03d}": summ(i) for i in range(n)}, []))
        sizes[n] = len(text)
        assert admincomment.decode(text)["n"]["node000"][1] == 93.2
    assert sizes[1] <= 1000 and sizes[8] <= 1000 and sizes[64] <= 10000, sizes
    one_liner = ('import sys,base64,zlib;s=sys.stdin.read().strip().split(":",2)[2].upper();'
                 'print(zlib.decompress(base64.b32decode(s+"="*(-len(s)%8))).decode())')
    out = subprocess.run([sys.executable, "-c", one_liner], input=text, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["c"] == "straggler-node"
    # the v1z texts of earlier versions still decode
    import base64
    import zlib

    old = "gpuguard:v1z:" + base64.b32encode(zlib.compress(b'{"job":"9","nodes":{"n1":{"x":1}}}')).decode().rstrip(
        "=").lower()
    assert admincomment.node_summaries(admincomment.decode(old)) == {"n1": {"x": 1}}


@pytest.mark.timeout(90)
def test_hook_with_its_config_on_a_hung_mount_exits_0_after_the_config_timeout(tmp_path):
    """The EpilogSlurmctld hook itself (not the worker) reads the config to hand it on;
    on a mount that never answers (FUSE: every access blocks, as on a dead NFS server) it
    used to wait for ever, holding the job COMPLETING. It now gives up after the config
    timeout (10 s) with one line and starts no worker."""
    import pathlib
    import subprocess
    import sys

    from fault_matrix import can_fuse, hung_fs

    if not can_fuse():
        pytest.skip("needs root and /dev/fuse")
    script = str(pathlib.Path(sys.executable).parent / "gpuguard-epilog-slurmctld")
    with hung_fs(tmp_path / "hung") as mnt:
        r = subprocess.run([script], env={"GPUGUARD_CONFIG": str(mnt / "gpuguard.toml"), "SLURM_JOB_ID": "7"},
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    head = ("gpuguard-epilog-slurmctld: tool error: config: config not read within 10 s (a hung filesystem?); "
            "looked at $GPUGUARD_CONFIG and ")
    assert (r.returncode, r.stdout, r.stderr.startswith(head), r.stderr.count("\n")) == (0, "", True, 1)
