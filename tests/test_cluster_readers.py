"""Reading a job from anywhere: `job show` through sacct (AdminComment) or a read-only
cluster store, and `report sync` turning AdminComments into job summaries."""

from __future__ import annotations

import hashlib
import json
import os
from zoneinfo import ZoneInfo

from click.testing import CliRunner
from reports_helpers import cache_store

from gpuguard.cli import main
from gpuguard.epilog import admincomment
from gpuguard.reports.queries import efficiency_report
from gpuguard.reports.sync import import_text

UTC = ZoneInfo("UTC")


def _comment() -> str:
    v = {"cause": "straggler-node", "state": "judged", "template": "llm", "baseline_runs": 5,
         "summary": "node n2 compute time per step 40% above the other nodes", "evidence": {"node": "n2"},
         "comparisons": [{"metric": "sm_clock_mhz", "value": 990.0, "median": 1980.0, "rel_change": -0.5,
                          "flagged": True}]}
    nodes = {"n1": {"gpu_util_mean_pct": 70.0, "gpus": [{"gpu_util_mean_pct": 80.0}, {"gpu_util_mean_pct": 60.0}]},
             "n2": {"gpu_util_mean_pct": 70.0, "gpus": [{"gpu_util_mean_pct": 100.0}, {"gpu_util_mean_pct": 40.0}]}}
    return admincomment.encode(admincomment.build("42", v, nodes, []))


def _fake_sacct(tmp_path, line: str | None) -> str:
    b = tmp_path / "bin"
    b.mkdir(exist_ok=True)
    out = tmp_path / "sacct.out"
    out.write_text(line + "\n" if line else "")
    (b / "sacct").write_text(f"#!/bin/sh\ncat {out}\n")
    (b / "sacct").chmod(0o755)
    return str(b)


def _line(ac: str) -> str:
    f = ["42", "train", "alice", "acct_a", "gpu", "COMPLETED", "00:10:00", "01:00:00", "2", "n[1-2]",
         "billing=4,cpu=4,gres/gpu=4,node=2", "2026-01-01T00:00:00", "2026-01-01T00:10:00", "0:0",
         "gpuguard:template=llm", ac]
    return "\x1f".join(f)


def test_job_show_from_sacct_with_no_store(tmp_path):
    cfg = tmp_path / "g.toml"
    cfg.write_text(f'[paths]\nstore = "{tmp_path}/none/node.db"\ncluster_store = "{tmp_path}/none/cluster.db"\n'
                   f'[slurm]\nbin_dir = "{_fake_sacct(tmp_path, _line(_comment()))}"\n')
    r = CliRunner().invoke(main, ["--config", str(cfg), "job", "show", "42", "--timezone", "UTC"])
    assert r.exit_code == 0, r.output
    out = r.output.splitlines()
    assert out[:2] == ['Job 42 "train"   user alice  account acct_a  partition gpu',
                       "State COMPLETED   exit 0:0   elapsed 10m00s of 1h00m limit (17 %)"]
    assert out[3] == "Nodes 2 (n1, n2)   GPUs 4"
    assert out[5] == "Verdict: straggler-node — node n2 compute time per step 40% above the other nodes"
    assert out[7] == "  sm_clock_mhz: 990 vs baseline 1980 (-50%)"
    assert [x.split()[:3] for x in out[10:14]] == [["n1", "gpu0", "[█████████████···]"], ["n1", "gpu1",
                                                   "[██████████······]"], ["n2", "gpu0", "[████████████████]"],
                                                  ["n2", "gpu1", "[██████··········]"]]
    assert not os.path.exists(tmp_path / "none")  # reading never creates a store
    j = json.loads(CliRunner().invoke(main, ["--config", str(cfg), "job", "show", "42", "--json"]).output)
    assert (j["source"], j["verdict"]["cause"], j["verdict"]["evidence"]["node"], j["nodes"]) == (
        "AdminComment (sacct)", "straggler-node", "n2", ["n1", "n2"])
    assert (j["job"]["user"], j["job"]["elapsed_s"], j["job"]["time_limit_s"], j["job"]["gpus"]) == (
        "alice", 600.0, 3600.0, 4)
    assert [(g["gpu_index"], g["gpu_util_mean_pct"]) for g in j["summaries"][1]["gpus"]] == [(0, 100), (1, 40)]
    assert (j["summaries"][1]["node"], j["summaries"][1]["source"]) == ("n2", "admin_comment")


def test_job_hidden_by_slurm_is_refused(tmp_path):
    cfg = tmp_path / "g.toml"
    cfg.write_text(f'[paths]\nstore = "{tmp_path}/none/node.db"\n[slurm]\nbin_dir = "{_fake_sacct(tmp_path, None)}"\n')
    r = CliRunner().invoke(main, ["--config", str(cfg), "job", "show", "42"])
    assert r.exit_code == 2
    assert r.output.strip() == (f"Error: job 42: store {tmp_path}/none/node.db: does not exist; "
                                "sacct shows no such job for this user (Slurm's PrivateData decides)")


def test_cluster_store_is_read_only_and_never_written(tmp_path):
    from gpuguard.store import open_store

    db = tmp_path / "ro" / "cluster.db"
    store = open_store(str(db))
    store.insert("cluster_jobs", {"job_id": "42", "user": "alice", "nodes": '["n1"]', "parts": '["n1"]',
                                  "missing": "[]", "gpus": 2, "state": "complete"})
    store.db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.close()
    for extra in ("-wal", "-shm"):
        if os.path.exists(str(db) + extra):
            os.unlink(str(db) + extra)
    db.chmod(0o444)
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    cfg = tmp_path / "g.toml"
    cfg.write_text(f'[paths]\ncluster_store = "{db}"\n[slurm]\nbin_dir = "{_fake_sacct(tmp_path, None)}"\n')
    r = CliRunner().invoke(main, ["--config", str(cfg), "job", "show", "42", "--json"])
    assert r.exit_code == 0, r.output
    j = json.loads(r.output)
    assert (j["source"], j["cluster"]["user"], j["cluster"]["nodes"]) == (f"cluster store {db}", "alice", ["n1"])
    assert j["job"]["source"] == "gpuguard summaries"  # no sacct answer: the store's own header
    assert (j["job"]["gpus"], j["cluster"]["gpus"]) == (2, 2)  # allocated, not the (no) sampled GPUs
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before
    assert sorted(os.listdir(db.parent)) == ["cluster.db"]


def test_report_sync_decodes_admin_comment_into_summaries(tmp_path):
    for store in cache_store(tmp_path):
        head = "JobIDRaw|JobID|Account|State|Submit|Eligible|Start|End|ElapsedRaw|ExitCode|AllocTRES|Comment|AdminComment\n"
        text = head + (f"42|42|acct_a|COMPLETED|2025-03-01T00:00:00|2025-03-01T00:00:00|2025-03-01T00:00:00|"
                       f"2025-03-01T01:00:00|3600|0:0|cpu=4,gres/gpu=4,node=2||{_comment()}\n"
                       "43|43|acct_a|COMPLETED|2025-03-01T00:00:00|2025-03-01T00:00:00|2025-03-01T00:00:00|"
                       "2025-03-01T01:00:00|3600|0:0|cpu=1,gres/gpu=1,node=1||not ours\n")
        import_text(store, text, tz=UTC)
        import_text(store, text, tz=UTC)  # twice: still one summary per node
        rows = store.query("select job_id, node, summary from job_summaries order by node")
        assert [(r["job_id"], r["node"]) for r in rows] == [("42", "n1"), ("42", "n2")]
        assert json.loads(rows[1]["summary"])["gpus"] == [{"gpu_index": 0, "gpu_util_mean_pct": 100},
                                                          {"gpu_index": 1, "gpu_util_mean_pct": 40}]
        t = efficiency_report(store, since=1740787200.0, until=1740801600.0, by="account").tables[0]
        row = next(r for r in t.rows if r["group"] == "acct_a")
        # job 42: 4 GPU-h at (80+60+100+40)/4 = 70 %; job 43: 1 GPU-h, no summary
        assert (row["jobs_with_summary"], row["jobs_no_summary"], row["measured_gpu_hours"],
                row["util_weighted_gpu_hours"]) == (1, 1, 4.0, 2.8)


def _fake_sacct_by_query(tmp_path, full: str, record: str, doc: dict | None) -> str:
    """A sacct answering the full header query (``--format`` with JobName), the record
    query (without the free-text fields) and ``--json`` with their own outputs."""
    b = tmp_path / "bin"
    b.mkdir(exist_ok=True)
    (tmp_path / "full.out").write_text(full)
    (tmp_path / "record.out").write_text(record)
    (tmp_path / "json.out").write_text(json.dumps(doc) if doc is not None else "")
    json_part = f"cat {tmp_path}/json.out" if doc is not None else "echo 'sacct: error: json not supported' >&2; exit 1"
    (b / "sacct").write_text(f"#!/bin/sh\necho \"$*\" >> {tmp_path}/calls\ncase \"$*\" in\n"
                             f"  *--json*) {json_part} ;;\n  *JobName*) cat {tmp_path}/full.out ;;\n"
                             f"  *) cat {tmp_path}/record.out ;;\nesac\n")
    (b / "sacct").chmod(0o755)
    return str(b)


def _forged_comment() -> str:
    v = {"cause": "job", "state": "judged", "template": "llm", "baseline_runs": 5,
         "summary": "FORGED: the job was slow because of its own code", "evidence": {}, "comparisons": []}
    return admincomment.encode(admincomment.build("42", v, {"n1": {"gpu_util_mean_pct": 99.0, "gpus": []}}, []))


def test_job_show_never_takes_a_header_forged_in_the_job_name(tmp_path):
    # Slurm keeps a newline and the unit separator in `sbatch -J`, and sacct -P prints them raw:
    # the name below ends the real line after two fields and adds a whole line for job 42
    # (another user, another account, a forged AdminComment verdict).
    real = _line(_comment()).split("\x1f")
    forged = ["42", "x", "mallory", "acct_m", "gpu", "COMPLETED", "00:01:00", "01:00:00", "1", "n9",
              "billing=1,cpu=1,gres/gpu=1,node=1", "2026-01-01T00:00:00", "2026-01-01T00:01:00", "0:0",
              "", _forged_comment()]
    name = "train\n" + "\x1f".join(forged) + "\nz"
    full = "\x1f".join([real[0], name, *real[2:]]) + "\n"
    record = "\x1f".join([real[0], *real[2:14]]) + "\n"
    doc = {"jobs": [{"job_id": 42, "name": name, "state": {"current": "COMPLETED"}, "account": "acct_a",
                     "comment": {"job": "gpuguard:template=llm", "administrator": _comment(), "system": ""}}]}
    cfg = tmp_path / "g.toml"
    cfg.write_text(f'[paths]\nstore = "{tmp_path}/none/node.db"\ncluster_store = "{tmp_path}/none/cluster.db"\n'
                   f'[slurm]\nbin_dir = "{_fake_sacct_by_query(tmp_path, full, record, doc)}"\n')
    r = CliRunner().invoke(main, ["--config", str(cfg), "job", "show", "42", "--json"])
    assert r.exit_code == 0, r.output
    j = json.loads(r.output)
    assert (j["source"], j["verdict"]["cause"], j["verdict"]["evidence"]["node"], j["nodes"]) == (
        "AdminComment (sacct)", "straggler-node", "n2", ["n1", "n2"])
    assert (j["job"]["name"], j["job"]["user"], j["job"]["account"], j["job"]["gpus"], j["job"]["elapsed_s"]) == (
        name, "alice", "acct_a", 4, 600.0)
    calls = (tmp_path / "calls").read_text().splitlines()
    assert [("--json" in c, "JobName" in c) for c in calls] == [(False, True), (False, False), (True, False)]


def test_job_show_with_a_forged_name_and_no_sacct_json_shows_no_admin_comment(tmp_path):
    real = _line(_forged_comment()).split("\x1f")
    full = "\x1f".join([real[0], "a\x1fb", *real[2:]]) + "\n"  # the delimiter in a name: 17 fields
    record = "\x1f".join([real[0], *real[2:14]]) + "\n"
    cfg = tmp_path / "g.toml"
    cfg.write_text(f'[paths]\nstore = "{tmp_path}/none/node.db"\ncluster_store = "{tmp_path}/none/cluster.db"\n'
                   f'[slurm]\nbin_dir = "{_fake_sacct_by_query(tmp_path, full, record, None)}"\n')
    r = CliRunner().invoke(main, ["--config", str(cfg), "job", "show", "42", "--json"])
    assert r.exit_code == 0, r.output
    j = json.loads(r.output)
    assert (j["source"], j["verdict"], j["note"]) == ("sacct", None, "no gpuguard record for this job")
    assert (j["job"]["name"], j["job"]["user"], j["job"]["gpus"]) == (None, "alice", 4)
