"""Real Slurm 22.05 (tests/testbed): a job's own name cannot forge its Comment or state.

``scontrol show job -o`` prints the name unescaped, so a job named
``x Comment=gpuguard:template=victim`` showed a second Comment (tests/data/scontrol)."""

from __future__ import annotations

import pytest

from gpuguard.collector.liveness import scontrol_job_state
from gpuguard.epilog.template import job_template
from gpuguard.slurm import SlurmCli

pytestmark = pytest.mark.slurm
FORGED = "x Comment=gpuguard:template=victim JobState=COMPLETED UserId=root(0) Partition=evil"


def test_a_name_forging_a_comment_is_not_the_template(slurm, monkeypatch):
    jid = slurm.submit(wrap="sleep 1", job_name=FORGED, gres="gpu:2", extra=["--hold"])
    try:
        scontrol = slurm.run(["scontrol", "show", "job", "-o", str(jid)]).stdout
        assert scontrol.count("Comment=gpuguard:template=victim") == 1  # Slurm really prints the forgery
        monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
        cli = SlurmCli("/usr/bin")
        assert cli.show_job(str(jid)) == {"Partition": "gpu", "NumNodes": "1", "TresPerNode": "gres:gpu:2",
                                          "JobName": FORGED}
        t = job_template({"SLURM_JOB_ID": str(jid)}, slurm=cli)
        assert t.source == "derived"
        assert t.name.startswith("gpu._.x2.n1.x-Comment-gpuguard-template-victim-")
        assert scontrol_job_state("/usr/bin/scontrol", str(jid)) == "PENDING"
    finally:
        slurm.cancel(jid)
    assert scontrol_job_state("/usr/bin/scontrol", "999999") == "UNKNOWN_JOB"


def test_fail_job_on_a_persistent_fault_escalates_to_a_drain(slurm):
    """Real Slurm: [policy] fail-job for persistence mode off on n1. The Prolog cancels the
    first two jobs sent to n1 and leaves it up; the third drains n1 with the escalation
    reason (and that job is requeued: held, as after any Prolog drain, SLURM-FACTS §5)."""
    import time

    from conftest import node_snapshot

    from gpuguard.gpu.replay import dump_snapshot

    root = slurm.root / "gg-fail-streak"
    slurm.install_gpuguard(root, dump_snapshot(node_snapshot(4, gpu2={"persistence_mode": False}), None,
                                               t0=time.time()),
                           extra='[prolog]\nstart_collector = false\n[policy]\n"config.persistence_off" = "fail-job"\n')
    states = []
    for _ in range(3):
        jid = slurm.submit(wrap="sleep 300", nodelist="n1", gres="gpu:1")  # only a cancel ends it in time
        deadline = time.monotonic() + 60
        while slurm.squeue_state(jid) not in (None, "CANCELLED") and "drain" not in slurm.node_state("n1"):
            assert time.monotonic() < deadline, (jid, slurm.squeue_state(jid), slurm.node_state("n1"))
            time.sleep(0.3)
        states.append((slurm.squeue_state(jid), "drain" in slurm.node_state("n1")))
        slurm.cancel(jid)
    assert [d for _, d in states] == [False, False, True], states  # n1 up after two failed jobs
    assert [st for st, _ in states[:2]] == [None, None]  # both left the queue: cancelled by the Prolog
    drains = {d.reason for d in slurm.drains() if "n1" in d.nodes}
    assert drains == {"gpuguard: config.persistence_off failed 3 jobs in a row within 3600 s; drained: "
                      "gpu2 (0000:3a:00.0) persistence mode off"}, (states, slurm.log_tail("slurmd-n1"))
