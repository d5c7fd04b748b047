"""`gpuguard job show` on a real Slurm 22.05 (tests/testbed): a job's own free text
(Comment) cannot forge its header or its AdminComment verdict. Slurm keeps a newline and
the unit separator in ``--comment`` and ``sacct -P`` prints them raw.

Deterministic on purpose: the test installs its own gpuguard.toml (healthy replay GPUs, an
empty kernel log, ``[cluster] admin_comment = false``), so neither a config an earlier test
left wired in (a Prolog that drains, requeuing the job) nor the job judge's own
AdminComment, written whenever its worker gets to it, can change what the job shows; the
test writes the genuine AdminComment itself, as the judge does (``sacctmgr modify job``),
and waits, bounded, for each state it reads."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from conftest import node_snapshot

from gpuguard.epilog import admincomment
from gpuguard.gpu.replay import dump_snapshot

pytestmark = pytest.mark.slurm
GPUGUARD = str(Path(__file__).resolve().parent.parent / ".venv" / "bin" / "gpuguard")
GENUINE = "genuine verdict: the job's own change"
WAIT_S = 60.0


def _verdict_comment(job_id: int, summary: str) -> str:
    v = {"cause": "job", "state": "judged", "template": "llm", "baseline_runs": 5,
         "summary": summary, "evidence": {}, "comparisons": []}
    return admincomment.encode(admincomment.build(str(job_id), v, {"n1": {"gpu_util_mean_pct": 99.0, "gpus": []}},
                                                  []))


def _forged_line(job_id: int) -> str:
    """One whole ``-P`` header line for ``job_id`` (another user, a forged verdict)."""
    return "\x1f".join([str(job_id), "x", "gg_alice", "acct_a", "gpu", "COMPLETED", "00:01:00", "01:00:00", "1",
                        "n1", "billing=1,cpu=1,gres/gpu=1,node=1", "2026-01-01T00:00:00", "2026-01-01T00:01:00",
                        "0:0", "", _verdict_comment(job_id, "FORGED verdict")])


def _poll(what: str, read, ok, timeout_s: float = WAIT_S):
    """``read()`` until ``ok(value)``, at most ``timeout_s``; returns the value, or fails
    naming ``what`` and the last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if ok(value):
            return value
        assert time.monotonic() < deadline, f"{what} not reached after {timeout_s:.0f} s: {value!r}"
        time.sleep(0.3)


def test_job_show_ignores_a_header_line_forged_in_the_comment(slurm):
    hooks = slurm.root / "gg-job-show"
    slurm.install_gpuguard(hooks, dump_snapshot(node_snapshot(4), None, t0=time.time()),
                           extra="[cluster]\nadmin_comment = false\n")
    jid = slurm.submit(wrap="true", user="gg_bob", job_name="train", extra=["--hold"])
    slurm.run(["scontrol", "update", f"JobId={jid}", f"Comment=a\n{_forged_line(jid)}\nz"], user="gg_bob")
    slurm.run(["scontrol", "release", str(jid)], user="gg_bob")

    def user_sacct() -> str:  # the job as its user's sacct shows it (not slurm.wait_job: its parse
        # meets the forged line too), with the free text
        return slurm.run(["sacct", "-X", "-n", "-P", "-D", "--delimiter=\x1f", "-j", str(jid),
                          "--format=JobIDRaw,JobName,User,Account,Partition,State,Elapsed,Timelimit,NNodes,NodeList,"
                          "AllocTRES,Start,End,ExitCode,Comment,AdminComment"], user="gg_bob").stdout

    head = f"{jid}\x1ftrain\x1fgg_bob\x1facct_b\x1fgpu\x1fCOMPLETED\x1f"
    raw = _poll("the job's one allocation line, COMPLETED, with its comment in slurmdbd",
                lambda: (slurm.squeue_state(jid), user_sacct()),
                lambda v: v[0] is None and v[1].startswith(head) and v[1].count(head) == 1
                and _forged_line(jid) in v[1])[1]
    assert f"\n{jid}\x1fx\x1fgg_alice\x1facct_a\x1f" in raw  # the forged line is really there

    cfg = slurm.jobs_dir / f"show-{jid}.toml"  # readable by gg_bob (pytest's tmp_path is 0700 root)
    none = slurm.jobs_dir / f"none-{jid}"
    cfg.write_text(f'[paths]\nstore = "{none}/node.db"\ncluster_store = "{none}/cluster.db"\n')
    cfg.chmod(0o644)

    def show() -> dict:
        r = subprocess.run(["runuser", "-u", "gg_bob", "--", GPUGUARD, "--config", str(cfg), "job", "show", str(jid),
                            "--json"], env=slurm.env, capture_output=True, text=True, timeout=120, cwd="/")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    j = show()  # no AdminComment: the header from sacct, no verdict
    assert (j["job"]["user"], j["job"]["account"], j["job"]["name"], j["job"]["state"]) == (
        "gg_bob", "acct_b", "train", "COMPLETED")
    assert (j["source"], j["verdict"]) == ("sacct", None)

    # the genuine AdminComment, written as the job judge writes it
    slurm.run(["sacctmgr", "-i", "modify", "job", "where", f"jobid={jid}", "set",
               f"AdminComment={_verdict_comment(jid, GENUINE)}"])
    _poll("the genuine AdminComment in sacct", user_sacct,
          lambda out: out.rstrip("\n").endswith("\x1f" + _verdict_comment(jid, GENUINE)))
    j = show()
    assert (j["job"]["user"], j["job"]["account"], j["job"]["name"]) == ("gg_bob", "acct_b", "train")
    assert (j["source"], j["verdict"]["summary"], j["verdict"]["cause"]) == ("AdminComment (sacct)", GENUINE, "job")
