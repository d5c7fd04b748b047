"""`gpuguard job show` on a real Slurm 22.05 (tests/testbed): a job's own free text
(Comment) cannot forge its header or its AdminComment verdict. Slurm keeps a newline and
the unit separator in ``--comment`` and ``sacct -P`` prints them raw."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from gpuguard.epilog import admincomment

pytestmark = pytest.mark.slurm
GPUGUARD = str(Path(__file__).resolve().parent.parent / ".venv" / "bin" / "gpuguard")


def _forged_line(job_id: int) -> str:
    """One whole ``-P`` header line for ``job_id`` (another user, a forged verdict)."""
    v = {"cause": "job", "state": "judged", "template": "llm", "baseline_runs": 5,
         "summary": "FORGED verdict", "evidence": {}, "comparisons": []}
    ac = admincomment.encode(admincomment.build(str(job_id), v, {"n1": {"gpu_util_mean_pct": 99.0, "gpus": []}}, []))
    return "\x1f".join([str(job_id), "x", "gg_alice", "acct_a", "gpu", "COMPLETED", "00:01:00", "01:00:00", "1",
                        "n1", "billing=1,cpu=1,gres/gpu=1,node=1", "2026-01-01T00:00:00", "2026-01-01T00:01:00",
                        "0:0", "", ac])


def test_job_show_ignores_a_header_line_forged_in_the_comment(slurm):
    jid = slurm.submit(wrap="true", user="gg_bob", job_name="train", extra=["--hold"])
    slurm.run(["scontrol", "update", f"JobId={jid}", f"Comment=a\n{_forged_line(jid)}\nz"], user="gg_bob")
    slurm.run(["scontrol", "release", str(jid)], user="gg_bob")
    deadline = time.monotonic() + 60  # not slurm.wait_job: its sacct parse meets the forged line too
    while slurm.squeue_state(jid) is not None or slurm.run(
            ["sacct", "-X", "-n", "-P", "-j", str(jid), "-o", "State"]).stdout.strip() != "COMPLETED":
        assert time.monotonic() < deadline, slurm.show_job_text(jid)
        time.sleep(0.3)
    raw = slurm.run(["sacct", "-X", "-n", "-P", "--delimiter=\x1f", "-j", str(jid),
                     "--format=JobIDRaw,JobName,User,Account,Partition,State,Elapsed,Timelimit,NNodes,NodeList,"
                     "AllocTRES,Start,End,ExitCode,Comment,AdminComment"], user="gg_bob").stdout
    assert f"\n{jid}\x1fx\x1fgg_alice\x1facct_a\x1f" in raw  # the forged line is really there
    cfg = slurm.jobs_dir / f"show-{jid}.toml"  # readable by gg_bob (pytest's tmp_path is 0700 root)
    none = slurm.jobs_dir / f"none-{jid}"
    cfg.write_text(f'[paths]\nstore = "{none}/node.db"\ncluster_store = "{none}/cluster.db"\n')
    cfg.chmod(0o644)
    # the job's genuine AdminComment (sacct --json escapes it): none, or the verdict of the
    # hooks an earlier test left wired in, which EpilogSlurmctld's worker may write while we
    # read: show the job between two equal reads of it
    def admin() -> str:
        doc = json.loads(slurm.run(["sacct", "-X", "-j", str(jid), "--json"]).stdout)
        return doc["jobs"][0]["comment"].get("administrator") or ""

    for _ in range(20):
        before = admin()
        r = subprocess.run(["runuser", "-u", "gg_bob", "--", GPUGUARD, "--config", str(cfg), "job", "show", str(jid),
                            "--json"], env=slurm.env, capture_output=True, text=True, timeout=120, cwd="/")
        real = admin()
        if real == before:
            break
        time.sleep(1.0)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert (j["job"]["user"], j["job"]["account"], j["job"]["name"]) == ("gg_bob", "acct_b", "train")
    if real:
        doc = admincomment.decode(real)
        want = (doc.get("m") or "") if doc.get("c") else None
        assert (j["source"], (j["verdict"] or {}).get("summary")) == ("AdminComment (sacct)", want)
        assert want != "FORGED verdict"
    else:
        assert (j["source"], j["verdict"]) == ("sacct", None)
