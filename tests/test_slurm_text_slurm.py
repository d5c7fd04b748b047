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
