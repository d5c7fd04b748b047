"""End-to-end on a real Slurm 22.05 (tests/testbed): real sbatch, real hooks, sinfo/sacct.

Each node (n1, n2: two slurmd on this host, 4 fake GPUs each) gets its own replay GPU
snapshot, kernel-log file and store under ``$TESTBED/gg/{node}``, configured through
``gpuguard.toml`` beside slurm.conf, which is where the hooks find it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import node_snapshot

from gpuguard.gpu.replay import dump_snapshot
from gpuguard.store import open_store

pytestmark = pytest.mark.slurm

XID79_N1_GPU0 = "[  912.345678] NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"


@dataclass
class GG:
    root: Path
    tb: object

    def node_dir(self, node: str) -> Path:
        return self.root / node

    def store(self, node: str):
        return open_store(str(self.node_dir(node) / "node.db"), create=False)

    def cluster(self):
        """The cluster store, read-only: opened by root it must not gain root-owned
        -wal/-shm files that would lock the SlurmUser worker out."""
        from gpuguard.epilog.jobview import open_readonly

        return open_readonly(str(self.root / "cluster" / "cluster.db"))

    def wait_verdict(self, jid: int, timeout: float = 60.0) -> dict:
        """The verdict row the controller's worker wrote for ``jid`` (it runs after the job
        has left squeue, so poll)."""
        deadline = time.monotonic() + timeout
        while True:
            if (self.root / "cluster" / "cluster.db").exists():
                try:  # the worker may be mid-write: read again on the next poll
                    c = self.cluster()
                    try:
                        rows = c.query("select * from verdicts where job_id = ?", [str(jid)])
                    finally:
                        c.close()
                except Exception:
                    rows = []
                if rows:
                    return rows[0]
            assert time.monotonic() < deadline, f"no verdict for job {jid}\n{self.log()[-3000:]}"
            time.sleep(0.3)

    def log(self) -> str:
        p = self.root / "gpuguard.log"
        return p.read_text() if p.exists() else ""

    def write_gpus(self, node: str, snap, steps=None) -> None:
        (self.node_dir(node) / "gpus.json").write_text(dump_snapshot(snap, steps, t0=time.time()))

    def toml(self, extra: str = "", store: str | None = None) -> None:
        self.tb.write_toml(self.tb.gpuguard_config_text(self.root, store=store, extra=extra))


@pytest.fixture
def gg(slurm):
    root = slurm.root / "gg"
    slurm.install_gpuguard(root, dump_snapshot(node_snapshot(4), t0=time.time()))
    g = GG(root, slurm)
    return g


def test_xid79_before_the_job_drains_and_requeues(gg):
    tb = gg.tb
    (gg.node_dir("n1") / "kern.log").write_text(XID79_N1_GPU0)
    jid = tb.submit(wrap="true", gres="gpu:1", nodelist="n1")
    deadline = time.monotonic() + 60
    while not ((st := tb.squeue_state_reason(jid) or ("", ""))[0] == "PENDING" and "held" in st[1].lower()):
        assert time.monotonic() < deadline, tb.show_job_text(jid) + gg.log()
        time.sleep(0.2)
    reason = tb.drain_reason("n1")
    # gpuguard writes its reason first; Slurm 22.05 then leaves it in place (the node was
    # already drained) and requeues the batch job held.
    assert reason == "gpuguard: xid.79 XID 79 GPU has fallen off the bus on gpu0 (0000:18:00)"
    state, why = tb.squeue_state_reason(jid)
    assert state == "PENDING"
    assert "held" in why.lower()
    assert tb.drain_reason("n2") is None
    runs = gg.store("n1").query("select hook, job_id, decision, reason from health_runs")
    # Slurm runs the Epilog for the failed attempt too; the XID was already acted on.
    assert runs == [{"hook": "prolog", "job_id": str(jid), "decision": "drain", "reason": reason},
                    {"hook": "epilog", "job_id": str(jid), "decision": "proceed", "reason": ""}]


def test_unwritable_store_jobs_run_node_stays_up(gg):
    tb = gg.tb
    gg.toml(store="/proc/gpuguard-cannot-write/{node}.db")
    jid = tb.submit(wrap="true", gres="gpu:2", nodelist="n1")
    rec = tb.wait_job(jid, timeout=60)
    assert (rec["State"], rec["ExitCode"]) == ("COMPLETED", "0:0")
    assert tb.drains() == []
    assert "tool error: store /proc/gpuguard-cannot-write/n1.db: cannot create" in gg.log()


REPO = Path(__file__).resolve().parent.parent
PY = REPO / ".venv" / "bin" / "python"
TRAIN = REPO / "scripts" / "train_demo.py"


def train_script(steps: int = 40, extra: str = "") -> str:
    return f"#!/bin/bash\nexec {PY} {TRAIN} --steps {steps} {extra}\n"


def samples_by_gpu(gg, node: str, jid: int) -> dict[int, int]:
    if not (gg.node_dir(node) / "node.db").exists():
        return {}  # the prolog records (and creates the store) after it started the collector
    rows = gg.store(node).query("select gpu_index, count(*) n from samples where job_id = ? group by gpu_index",
                                [str(jid)])
    return {r["gpu_index"]: r["n"] for r in rows}


def summary(gg, node: str, jid: int) -> dict:
    import json

    rows = gg.store(node).query("select summary from job_summaries where job_id = ? and node = ?", [str(jid), node])
    assert rows, f"no summary for job {jid} on {node}\n{gg.log()}"
    return json.loads(rows[0]["summary"])


def test_healthy_training_job_samples_its_gpus_and_summarises(gg):
    tb = gg.tb
    jid = tb.submit(train_script(40), gres="gpu:2", nodelist="n1", comment="gpuguard:template=demo")
    rec = tb.wait_job(jid, timeout=120)
    assert (rec["State"], rec["ExitCode"]) == ("COMPLETED", "0:0"), tb.job_output(jid)
    assert tb.job_output(jid).strip().startswith("done: 40 steps")
    by_gpu = samples_by_gpu(gg, "n1", jid)
    assert set(by_gpu) == {0, 1}, by_gpu
    assert min(by_gpu.values()) >= 2
    s = summary(gg, "n1", jid)
    assert (s["steps"], s["exit_code"], s["collector_status"]) == (40, 0, "ok")
    assert 0.1 <= s["step_time_p50_s"] <= s["step_time_p95_s"] <= s["step_time_p99_s"]
    assert s["checkpoint_count"] == 1
    assert [g["gpu_index"] for g in s["gpus"]] == [0, 1]
    assert tb.drains() == []
    assert tb.node_state("n1") == "idle"
    # the job directory was ingested and removed
    assert not (gg.node_dir("n1") / "jobs" / str(jid)).exists()


def test_ecc_rising_during_the_job_drains_after_it(gg):
    tb = gg.tb
    gg.write_gpus("n1", node_snapshot(4), steps=[{"after_s": 2, "gpus": {"1": {"ecc_volatile_uncorrected": 2}}}])
    jid = tb.submit(wrap="sleep 4", gres="gpu:2", nodelist="n1")
    rec = tb.wait_job(jid, timeout=60)
    assert rec["State"] == "COMPLETED"  # the job itself is not failed afterwards
    assert tb.drain_reason("n1") == (
        "gpuguard: ecc.uncorrectable_volatile gpu1 (0000:29:00.0) 2 uncorrectable ECC error(s) since driver load (2 new)")
    runs = gg.store("n1").query("select hook, decision from health_runs where job_id = ? order by id", [str(jid)])
    assert runs == [{"hook": "prolog", "decision": "proceed"}, {"hook": "epilog", "decision": "drain"}]


def test_collector_killed_mid_job_epilog_still_summarises(gg):
    import os
    import signal

    tb = gg.tb
    jid = tb.submit(wrap="sleep 8", gres="gpu:1", nodelist="n1")
    pidfile = gg.node_dir("n1") / "state" / f"collector.{jid}.pid"
    deadline = time.monotonic() + 30
    while not (pidfile.exists() and samples_by_gpu(gg, "n1", jid)):
        assert time.monotonic() < deadline, gg.log()
        time.sleep(0.3)
    os.kill(int(pidfile.read_text().split()[0]), signal.SIGKILL)
    rec = tb.wait_job(jid, timeout=60)
    assert rec["State"] == "COMPLETED"
    s = summary(gg, "n1", jid)
    assert s["collector_status"] == "died"
    assert s["sample_count"] >= 1
    ev = gg.store("n1").query("select kind from events where job_id = ?", [str(jid)])
    assert {"kind": "collector_died"} in ev
    assert tb.drains() == []


def test_four_concurrent_single_gpu_jobs_each_sample_their_own_gpu(gg):
    tb = gg.tb
    jids = [tb.submit(wrap="sleep 5", gres="gpu:1", nodelist="n1") for _ in range(4)]
    deadline = time.monotonic() + 30
    while sum(tb.squeue_state(j) == "RUNNING" for j in jids) < 4:
        assert time.monotonic() < deadline, [tb.squeue_state_reason(j) for j in jids]
        time.sleep(0.2)
    allocated = {j: int(tb.show_job(j)["JOB_GRES"].split("IDX:")[1].rstrip(")"))
                 if "IDX:" in tb.show_job(j).get("JOB_GRES", "") else None for j in jids}
    for j in jids:
        assert tb.wait_job(j, timeout=90)["State"] == "COMPLETED"
    owned = {}
    for j in jids:
        by_gpu = samples_by_gpu(gg, "n1", j)
        assert len(by_gpu) == 1, (j, by_gpu)
        owned[j] = next(iter(by_gpu))
    assert sorted(owned.values()) == [0, 1, 2, 3]
    if all(v is not None for v in allocated.values()):
        assert owned == allocated


def test_two_node_job_each_node_samples_and_summarises_its_part(gg):
    from gpuguard.epilog.admincomment import decode

    tb = gg.tb
    jid = tb.submit(wrap="sleep 4", gres="gpu:2", nodes=2)
    rec = tb.wait_job(jid, timeout=90)
    assert rec["State"] == "COMPLETED"
    for node in ("n1", "n2"):
        assert set(samples_by_gpu(gg, node, jid)) == {0, 1}
        assert summary(gg, node, jid)["exit_code"] == 0
    # EpilogSlurmctld merged both nodes' summaries into the AdminComment (sacct shows it)
    deadline = time.monotonic() + 30
    while True:
        ac = tb.run(["sacct", "-n", "-X", "-P", "-j", str(jid), "-o", "AdminComment"]).stdout.strip()
        if ac or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    doc = decode(ac)
    assert doc is not None, (ac, gg.log())
    assert sorted(doc["n"]) == ["n1", "n2"] and "x" not in doc


def test_template_runs_judged_healthy_data_pipeline_throttling_healthy(gg):
    """Issue 4 on real Slurm: one template run 4 times with a real training loop, then a
    slow data loader, then a GPU that throttles (thermal slowdown, SM clock halved, the
    step slower), then healthy again. Judged by the controller's worker into the cluster
    store (node stores per node, a spool between them)."""
    tb = gg.tb
    gg.toml("[verdict]\nwarmup_s = 0.0\nlong_window_s = 2.0\nshort_window_s = 1.0\n")
    busy = {"gpu_util_pct": 97.0, "power_w": 610.0, "sm_clock_mhz": 1980.0, "temp_c": 62.0,
            "clock_event_reasons": [], "mem_used_mib": 40000.0}
    hot = dict(busy, sm_clock_mhz=990.0, power_w=380.0, temp_c=88.0, clock_event_reasons=["hw_thermal_slowdown"])

    def run(extra: str = "", gpu_state: dict | None = None) -> dict:
        gg.write_gpus("n1", node_snapshot(4), steps=[{"after_s": 1.0, "gpus": {"0": gpu_state or busy,
                                                                                "1": gpu_state or busy}}])
        jid = tb.submit(train_script(40, extra), gres="gpu:2", nodelist="n1",
                        comment="gpuguard:template=e2e-demo retry=no")
        rec = tb.wait_job(jid, timeout=120)
        assert rec["State"] == "COMPLETED", tb.job_output(jid)
        v = gg.wait_verdict(jid)
        return {k: v[k] for k in ("template", "state", "cause")}

    # below [baseline] min_runs = 3 the template is learning and nothing is judged
    for _ in range(3):
        assert run() == {"template": "e2e-demo", "state": "learning", "cause": "learning"}
    assert run()["cause"] == "healthy"
    assert run("--data-sleep-s 0.1")["cause"] == "data-pipeline"
    assert run("--compute-s 0.2", hot)["cause"] == "gpu-throttling"
    assert run()["cause"] == "healthy"
    assert tb.drains() == []
    import subprocess

    out = subprocess.run([str(REPO / ".venv/bin/gpuguard"), "--config", str(tb.gpuguard_toml), "template", "list"],
                         env={"SLURMD_NODENAME": "n1", "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                         check=True).stdout
    assert "e2e-demo" in out
