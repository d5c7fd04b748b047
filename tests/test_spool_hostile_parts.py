"""Hostile spool parts: fields of other types than build_part writes, a summary or a
finding about another job or node, parts of nodes the job did not run on, and a job whose
judgment raises. None may crash the worker or `cluster ingest`, stop the jobs after it, or
write another job's data."""

from __future__ import annotations

import gzip
import json
import logging
import os
import time

import pytest

from gpuguard.epilog import cluster, part
from gpuguard.epilog.judge import meta_from_env
from gpuguard.slurm import SlurmCli
from gpuguard.store import open_store
from test_epilog_slurmctld import _env, _spool_job, ctld  # noqa: F401  (ctld: the fixture)


def _rewrite(ctld, job_id: str, node: str, change) -> None:  # noqa: F811
    """Re-encode ``node``'s part of ``job_id`` in the spool after ``change(doc)``."""
    [doc] = [p for n, p in part.read_parts(ctld["spool"], job_id).items() if n == node]
    change(doc)
    blob, _ = part.encode_part(lambda ws: doc, 60.0)
    part.write_part(ctld["spool"], job_id, node, blob)


def _set(path, value):
    def change(doc):
        tgt = doc
        for k in path[:-1]:
            tgt = tgt[k]
        tgt[path[-1]] = value
    return change


@pytest.mark.parametrize(("path", "value", "why"), [
    (("summary",), "x", "summary is str, not a dict"),
    (("summary", "gpus"), 1, "summary.gpus is int 1, not list[GpuSummary]"),
    (("summary", "gpus"), [1], "summary.gpus[0] is int, not a dict"),
    (("summary", "gpu_util_mean_pct"), "97", "summary.gpu_util_mean_pct is str '97', not float | None"),
    (("summary", "sample_count"), True, "summary.sample_count is bool True, not int"),
    (("summary", "job_id"), "999", "summary names job '999' node 'n1'"),
    (("summary", "node"), None, "summary names job '90' node None"),
    (("hw_events",), 1, "hw_events is int, not a list"),
    (("hw_findings",), [{"node": "n1", "code": ["x"]}], "hw_findings[0] is not a flat record"),
    (("hw_findings",), [{"node": "n7", "code": "xid.79", "action": "drain"}],
     "hw_findings[0] is about node 'n7', not 'n1'"),
    (("checkpoints_s",), 5, "checkpoints_s is not a list of seconds"),
    (("job",), ["x"], "job is not a flat record"),
    (("window_s",), 0, "window_s is 0, not a positive number of seconds"),
    (("gpus", 0, "name"), 7, "gpus[0].name is int, not str | None"),
])
def test_a_part_with_fields_of_other_types_is_skipped_with_one_line(ctld, caplog, path, value, why):  # noqa: F811
    _spool_job(ctld, "90")
    _rewrite(ctld, "90", "n1", _set(path, value))
    with caplog.at_level(logging.WARNING):
        got = part.read_parts(ctld["spool"], "90", logging.getLogger("t"))
    assert sorted(got) == ["n2"]
    [msg] = [r.getMessage() for r in caplog.records]
    assert msg == f"spool: {os.path.join(ctld['spool'], '90', 'n1' + part.SUFFIX)} skipped: {why}"


def test_a_malformed_version_1_part_is_a_spool_error_not_a_crash():
    doc = {"format": "gpuguard-part", "v": 1, "job_id": "1", "node": "n1", "window_s": 60.0, "ranks": 1}
    with pytest.raises(part.SpoolError, match=r"^malformed part: TypeError: 'int' object is not iterable$"):
        part.decode_part(gzip.compress(json.dumps(doc).encode()))


def test_a_foreign_summary_never_overwrites_another_jobs_summary(ctld):  # noqa: F811
    _spool_job(ctld, "91")
    _rewrite(ctld, "91", "n2", lambda d: d["summary"].update(job_id="5"))
    assert slurmctld_run(ctld, "91") == 0
    store = open_store(str(ctld["tmp"] / "cluster.db"))
    try:
        assert store.query("select job_id, node from job_summaries order by job_id, node") == [
            {"job_id": "91", "node": "n1"}]
        row = store.query("select parts, missing, state from cluster_jobs where job_id = '91'")[0]
        assert (json.loads(row["parts"]), json.loads(row["missing"]), row["state"]) == (["n1"], ["n2"], "partial")
    finally:
        store.close()


def slurmctld_run(ctld, job_id):  # noqa: F811
    from gpuguard.epilog import slurmctld

    return slurmctld.run(_env(job_id), retry_sleep_s=0)


def test_parts_of_nodes_the_job_did_not_run_on_are_left_out(ctld, caplog):  # noqa: F811
    """A part of n2 left in job 92's directory (an earlier attempt of the requeued job ran
    there) while the manifest says the job ran on n1 only: judged on n1's part alone."""
    _spool_job(ctld, "92")
    meta = meta_from_env(dict(_env("92"), SLURM_JOB_NUM_NODES="1"), ["n1"])
    cluster.write_manifest(ctld["spool"], "92", meta)
    store = open_store(str(ctld["tmp"] / "cluster.db"))
    try:
        with caplog.at_level(logging.WARNING):
            res = cluster.judge_from_spool(ctld["cfg"], store, "92", log=logging.getLogger("t"),
                                           slurm=SlurmCli(ctld["calls"].bindir), retry_sleep_s=0)
        assert (res.nodes, res.missing) == (["n1"], [])
        assert sorted(json.loads(store.query("select nodes from verdicts")[0]["nodes"])) == ["n1"]
    finally:
        store.close()
    assert "job 92: part(s) of n2 left out: not among the job's nodes n1" in caplog.text


def test_ingest_goes_on_after_a_job_whose_judgment_raises(ctld, monkeypatch):  # noqa: F811
    _spool_job(ctld, "93")
    _spool_job(ctld, "94")
    real = cluster.judge_from_spool

    def judge(cfg, store, job_id, **kw):
        if job_id == "93":
            raise TypeError("'int' object is not iterable")
        return real(cfg, store, job_id, **kw)

    monkeypatch.setattr(cluster, "judge_from_spool", judge)
    time.sleep(0.35)
    store = open_store(str(ctld["tmp"] / "cluster.db"))
    try:
        res = cluster.ingest(ctld["cfg"], store, log=logging.getLogger("t"), slurm=SlurmCli(ctld["calls"].bindir),
                             retry_sleep_s=0)
        assert (res.judged, res.errors) == (1, ["job 93: TypeError: 'int' object is not iterable"])
        assert store.query("select job_id from verdicts") == [{"job_id": "94"}]
    finally:
        store.close()


def test_a_symlinked_or_foreign_job_directory_is_never_written_or_read(ctld, tmp_path):  # noqa: F811
    """A job directory planted in the spool as a symlink (or owned by a user) before the
    job's Epilog runs: root's part never lands where it points, the reader refuses it."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, os.path.join(ctld["spool"], "96"))
    with pytest.raises(part.SpoolError, match=r"spool directory .*/96 is not a directory \(a symlink or a "
                                              r"file\): not used$"):
        part.write_part(ctld["spool"], "96", "n1", b"x")
    with pytest.raises(part.SpoolError, match="is not a directory"):
        part.read_parts(ctld["spool"], "96")
    assert os.listdir(elsewhere) == []
    d = os.path.join(ctld["spool"], "97")
    os.mkdir(d)
    os.chown(d, 4242, 4242)
    os.chmod(ctld["spool"], 0o755)  # only its owner writes the spool: any owner is trusted
    assert part.read_parts(ctld["spool"], "97") == {}
    os.chmod(ctld["spool"], 0o1777)  # anyone may make entries: only root's, ours or the owner's count
    with pytest.raises(part.SpoolError, match=r"spool directory .*/97 belongs to uid 4242, not root or the "
                                              r"spool's owner: not used$"):
        part.write_part(ctld["spool"], "97", "n1", b"x")
    assert os.listdir(d) == []


def test_a_symlinked_nccl_probe_directory_is_never_written(tmp_path):
    """``{spool}/nccl`` planted as a symlink: root's probe file never lands where it points."""
    from gpuguard import config as config_mod
    from gpuguard.net.nccl_spool import SUBDIR, spool_probe

    spool, elsewhere = tmp_path / "spool", tmp_path / "elsewhere"
    spool.mkdir()
    elsewhere.mkdir()
    os.symlink(elsewhere, spool / SUBDIR)
    cfg = config_mod.from_dict({"paths": {"store": str(tmp_path / "n1" / "node.db"),
                                          "cluster_store": str(tmp_path / "cluster.db"), "spool_dir": str(spool)}})
    row = {"node": "n1", "config_key": "k", "at": 1767225600.0}
    with pytest.raises(OSError, match=r"spool directory .*/nccl is not a directory \(a symlink or a file\)"):
        spool_probe(cfg, row, {1048576: 100.0}, {})
    assert os.listdir(elsewhere) == []



def test_two_cluster_ingests_at_once_judge_nothing_twice(ctld):  # noqa: F811
    """A pass run by hand while the timer's pass runs: the second does nothing."""
    import fcntl

    from click.testing import CliRunner

    from gpuguard.cli import main as cli

    _spool_job(ctld, "98")
    time.sleep(0.35)
    fd = os.open(str(ctld["tmp"] / "cluster.db.ingest.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        r = CliRunner().invoke(cli, ["cluster", "ingest", "--json"])
        assert r.exit_code == 0
        assert f"another cluster ingest holds {ctld['tmp']}/cluster.db.ingest.lock: nothing done" in r.output
        assert ctld["calls"]() == []
    finally:
        os.close(fd)
    r = CliRunner().invoke(cli, ["cluster", "ingest", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["judged"] == 1
    assert len(ctld["calls"]()) == 1


def test_a_job_another_judge_holds_is_left_to_it(ctld):  # noqa: F811
    """The worker slowed past its wait (sacctmgr retries against a silent slurmdbd) still
    holds the job when cluster ingest comes: ingest leaves it alone."""
    import fcntl

    _spool_job(ctld, "99")
    time.sleep(0.35)
    fd = os.open(os.path.join(ctld["spool"], "99", cluster.JUDGE_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    store = open_store(str(ctld["tmp"] / "cluster.db"))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        res = cluster.ingest(ctld["cfg"], store, log=logging.getLogger("t"), slurm=SlurmCli(ctld["calls"].bindir),
                             retry_sleep_s=0, now=time.time() + 3600)  # past the worker's wait
        assert (res.judged, res.unchanged, res.errors) == (0, 1, [])
        assert ctld["calls"]() == [] and store.query("select job_id from verdicts") == []
        os.close(fd)
        fd = -1
        res = cluster.ingest(ctld["cfg"], store, log=logging.getLogger("t"), slurm=SlurmCli(ctld["calls"].bindir),
                             retry_sleep_s=0, now=time.time() + 3600)
        assert (res.judged, res.errors) == (1, [])
        assert store.query("select job_id from verdicts") == [{"job_id": "99"}]
    finally:
        if fd >= 0:
            os.close(fd)
        store.close()
    assert not os.path.exists(os.path.join(ctld["spool"], "99"))  # judged complete: removed, lock and all
