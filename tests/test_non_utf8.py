"""Bytes that are not UTF-8 in what users name (job names, comments, accounts): in the
hook environment (Python decodes it with surrogateescape) and in Slurm's tool output.
One such job must neither go unjudged nor fail a whole sacct/scontrol call, crash the
collector or lose a mail."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from gpuguard.collector.liveness import scontrol_job_state
from gpuguard.hookenv import clean_env, read_hook_env
from gpuguard.slurm import SlurmCli
from gpuguard.store import open_store
from test_epilog_slurmctld import _env, _spool_job, ctld  # noqa: F401  (ctld: the fixture)

LATIN1 = b"caf\xe9".decode("utf-8", "surrogateescape")  # what os.environ holds for a Latin-1 name


def test_clean_env_replaces_undecodable_bytes_and_keeps_the_rest():
    env = {"SLURM_JOB_NAME": LATIN1, "SLURM_JOB_COMMENT": "gpuguard:template=ü-run", "SLURM_JOB_ID": "7",
           "X": "\ud800"}
    assert clean_env(env) == {"SLURM_JOB_NAME": "caf\ufffd", "SLURM_JOB_COMMENT": "gpuguard:template=ü-run",
                              "SLURM_JOB_ID": "7", "X": "?"}
    assert read_hook_env({"SLURM_JOB_COMMENT": LATIN1}).job_comment == "caf\ufffd"


def _tool(tmp_path, name, out: bytes):
    exe = tmp_path / name
    exe.write_bytes(b"#!/bin/sh\ncat <<'EOF'\n" + out + b"\nEOF\n")
    exe.chmod(0o755)
    return str(exe)


def test_slurm_output_that_is_not_utf8_is_read_with_replacement_characters(tmp_path):
    _tool(tmp_path, "scontrol", b"JobId=7 JobName=caf\xe9 JobState=RUNNING")
    _tool(tmp_path, "squeue", b"gpu|1|N/A|caf\xe9")
    assert SlurmCli(str(tmp_path)).show_job("7") == {"Partition": "gpu", "NumNodes": "1", "Comment": "caf\ufffd",
                                                     "JobName": "gpu|1|N/A|caf\ufffd"}
    _tool(tmp_path, "squeue", b"RUNNING")
    assert scontrol_job_state(str(tmp_path / "scontrol"), "7") == "RUNNING"


def test_a_job_named_in_latin1_is_judged(ctld):  # noqa: F811
    from gpuguard.epilog import slurmctld

    _spool_job(ctld, "95")
    env = dict(_env("95"), SLURM_JOB_NAME=LATIN1, SLURM_JOB_ACCOUNT=LATIN1)
    assert slurmctld.run(env, retry_sleep_s=0) == 0
    store = open_store(str(ctld["tmp"] / "cluster.db"))
    try:
        row = store.query("select job_name, account, state, parts from cluster_jobs where job_id = '95'")[0]
    finally:
        store.close()
    assert (row["job_name"], row["account"], row["state"], json.loads(row["parts"])) == (
        "caf\ufffd", "caf\ufffd", "complete", ["n1", "n2"])


def test_mailprog_passes_a_body_that_is_not_utf8_unchanged(tmp_path):
    log = tmp_path / "mail.log"
    exe = tmp_path / "mail"
    exe.write_text(f"#!/bin/sh\ncat > {log}.body\n")
    exe.chmod(0o755)
    cfg = tmp_path / "g.toml"
    cfg.write_text(f'[mail]\nmailer = "{exe}"\n')
    gm = os.path.join(os.path.dirname(sys.executable), "gpuguard-mail")
    cp = subprocess.run([gm, "-s", "Slurm Job_id=9 Name=x Began", "bob"], input=b"caf\xe9 body\n",
                        env={**os.environ, "GPUGUARD_CONFIG": str(cfg), "LC_ALL": "C.UTF-8"}, capture_output=True)
    assert cp.returncode == 0, cp.stderr
    assert (tmp_path / "mail.log.body").read_bytes() == b"caf\xe9 body\n"
