"""The main job on the embedded default: gpuguard around real Slurm jobs, in cluster mode.

Brings up the single-host Slurm testbed (tests/testbed: slurmctld, two slurmd with four
fake GPUs each, slurmdbd, MariaDB, munge) with gpuguard's hooks and the replay GPU
source, laid out as a real cluster is: one store per node (``{root}/n1/node.db``,
``{root}/n2/node.db``), a separate cluster store written only by EpilogSlurmctld's worker
as SlurmUser (``{root}/cluster/cluster.db``) and a spool between them. Then:

1. one job template run four times, alternating n1 and n2, with a real training loop on
   busy GPUs (a replay scenario that follows the job: 97 % utilisation, full clocks):
   runs 1-3 are ``learning``; run 4, on n2, is judged against runs that were mostly on n1;
2. a 2-node job whose n2 GPUs run at half clock: judged once, with both nodes' data
   (``straggler-node`` naming n2), and a healthy 2-node control;
3. a job sent to a node whose kernel log holds XID 79: the Prolog drains the node with a
   ``gpuguard:`` reason and Slurm requeues the job, held;
4. ``gpuguard job show`` run as the job's user, who can read no store: the header from
   sacct, the verdict from the AdminComment; ``sinfo -R``.

The testbed stays up for a look around; ``tests/testbed/testbed.sh down`` stops it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from conftest import node_snapshot  # noqa: E402
from testbed.slurmtb import JobHeld, Testbed  # noqa: E402

from gpuguard.gpu.replay import dump_snapshot  # noqa: E402

PY = REPO / ".venv" / "bin" / "python"
GG = REPO / ".venv" / "bin" / "gpuguard"
#: What a training job's GPUs read while it runs (the replay follows the job from 0.5 s on).
BUSY = {"gpu_util_pct": 97.0, "power_w": 610.0, "sm_clock_mhz": 1980.0, "temp_c": 62.0,
        "clock_event_reasons": [], "mem_used_mib": 40000.0}
HALF_CLOCK = dict(BUSY, sm_clock_mhz=990.0, power_w=400.0)


def banner(text: str) -> None:
    print(f"\n=== {text}", flush=True)


def gpus(root: Path, node: str, state: dict) -> None:
    (root / node / "gpus.json").write_text(dump_snapshot(
        node_snapshot(4), [{"after_s": 0.5, "gpus": {str(i): state for i in range(4)}}], t0=time.time()))


def verdict(root: Path, jid: int, timeout: float = 60.0) -> dict:
    """The controller worker's verdict, read from the cluster store read-only."""
    from gpuguard.epilog.jobview import open_readonly

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            s = open_readonly(str(root / "cluster" / "cluster.db"))
            try:
                rows = s.query("select cause, state, nodes, summary from verdicts where job_id = ?", [str(jid)])
            finally:
                s.close()
            if rows:
                return rows[0]
        except Exception:
            pass  # not written yet
        time.sleep(0.3)
    return {"cause": "?", "state": "?", "nodes": "[]", "summary": "no verdict yet"}


def show(tb: Testbed, jid: int, user: str) -> None:
    banner(f"gpuguard job show {jid}   (as {user}, who can read no store)")
    env = dict(tb.env, TZ="UTC")
    subprocess.run(["runuser", "-u", user, "--", str(GG), "job", "show", str(jid)], env=env, cwd="/")


def main() -> int:
    tb = Testbed()
    banner("bringing up Slurm (tests/testbed/testbed.sh up)")
    cp = tb.testbed_sh("up", timeout=900)
    if cp.returncode != 0:
        print(cp.stdout, cp.stderr, file=sys.stderr)
        return 1
    tb.reset()
    root = tb.root / "demo"
    tb.install_gpuguard(root, dump_snapshot(node_snapshot(4), t0=time.time()),
                        extra="[verdict]\nwarmup_s = 0.0\nlong_window_s = 2.0\nshort_window_s = 1.0\n")
    for n in ("n1", "n2"):
        gpus(root, n, BUSY)
    print(f"stores: {root}/n1/node.db, {root}/n2/node.db (one per node); cluster store "
          f"{root}/cluster/cluster.db (SlurmUser); spool {root}/spool")
    train = f"#!/bin/bash\nexec {PY} {REPO}/scripts/train_demo.py --steps 40 {{}}\n"

    banner("1. template 'demo' four times, alternating n1/n2, busy GPUs")
    runs = []
    for k, node in enumerate(("n1", "n2", "n1", "n2")):
        j = tb.submit(train.format(""), gres="gpu:2", nodelist=node, comment="gpuguard:template=demo")
        rec = tb.wait_job(j, timeout=180)
        v = verdict(root, j)
        print(f"  run {k + 1}: job {j} on {node}: {rec['State']}; verdict {v['state']}/{v['cause']}: {v['summary']}")
        runs.append(j)

    banner("2. a 2-node job whose n2 GPUs run at half clock, then a healthy 2-node control")
    for k in range(3):
        j = tb.submit("#!/bin/bash\nsleep 6\n", gres="gpu:2", nodes=2, comment="gpuguard:template=two-node")
        tb.wait_job(j, timeout=120)
        print(f"  baseline run {k + 1}: job {j}: {verdict(root, j)['cause']}")
    gpus(root, "n2", HALF_CLOCK)
    strag = tb.submit("#!/bin/bash\nsleep 6\n", gres="gpu:2", nodes=2, comment="gpuguard:template=two-node")
    tb.wait_job(strag, timeout=120)
    v = verdict(root, strag)
    print(f"  job {strag} on {', '.join(json.loads(v['nodes']))}: judged once: {v['cause']}: {v['summary']}")
    gpus(root, "n2", BUSY)
    ctl = tb.submit("#!/bin/bash\nsleep 6\n", gres="gpu:2", nodes=2, comment="gpuguard:template=two-node")
    tb.wait_job(ctl, timeout=120)
    print(f"  control job {ctl}: {verdict(root, ctl)['cause']}")

    banner("3. a job sent to n2, whose kernel log holds XID 79 on GPU 0")
    (root / "n2" / "kern.log").write_text(
        "[ 912.345678] NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n")
    j = tb.submit("#!/bin/bash\ntrue\n", gres="gpu:1", nodelist="n2")
    try:
        tb.wait_job(j, timeout=60)
    except JobHeld as e:
        print(f"job {j} requeued and held by Slurm after the Prolog drained n2:", str(e).splitlines()[0])

    show(tb, runs[-1], "gg_alice")
    show(tb, strag, "gg_alice")
    banner(f"gpuguard job show {strag} as gg_bob (not his job: Slurm's PrivateData=jobs refuses)")
    subprocess.run(["runuser", "-u", "gg_bob", "--", str(GG), "job", "show", str(strag)], env=tb.env, cwd="/")
    banner("sinfo -R -o '%E|%U|%H|%N'   (full drain reasons)")
    print(tb.run(["sinfo", "-R", "-o", "%E|%U|%H|%N"]).stdout)
    print("testbed left up: eval \"$(tests/testbed/testbed.sh env)\" to use sinfo/sbatch; "
          "tests/testbed/testbed.sh down to stop it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
