"""User and admin free text in Slurm's one-line output cannot set another field.

``scontrol show job -o`` prints JobName, Comment, WorkDir, StdOut... unescaped between
``Key=value`` pairs; a job named ``x Comment=gpuguard:template=victim`` carried a second
Comment that the last-wins split took. Inputs are real testbed output
(tests/data/scontrol/README.md says how each was made)."""

from __future__ import annotations

import pathlib

import pytest

from gpuguard.ops.nodes import parse_node
from gpuguard.slurm import SlurmCli, node_line

DATA = pathlib.Path(__file__).parent / "data" / "scontrol"
HOSTILE_NAME = "x Comment=gpuguard:template=victim UserId=root(0) NodeList=n9 Reason=gpuguard: fake"
HOSTILE_COMMENT = "c UserId=root(0) JobName=evil Comment=gpuguard:template=victim2 TresPerNode=gres:gpu:8"


def _bin(tmp_path: pathlib.Path) -> str:
    """A bin dir whose scontrol and squeue print the captured output of job 1 / node n2."""
    script = f"""#!/usr/bin/env python3
import sys, os
tool, args = os.path.basename(sys.argv[0]), sys.argv[1:]
d = {str(DATA)!r}
files = {{("scontrol", "job"): "show_job_hostile_name_comment.txt", ("scontrol", "node"): "show_node_hostile_reason.txt",
         ("squeue", "%P|%D|%b|%k"): "squeue_job_fields_hostile.txt", ("squeue", "%j"): "squeue_job_name_hostile.txt"}}
key = (tool, args[1] if tool == "scontrol" else args[-1])
sys.stdout.write(open(os.path.join(d, files[key])).read())
"""
    for tool in ("scontrol", "squeue"):
        p = tmp_path / tool
        p.write_text(script)
        p.chmod(0o755)
    return str(tmp_path)


def test_show_job_reads_each_user_field_whole(tmp_path):
    assert SlurmCli(_bin(tmp_path)).show_job("1") == {
        "Partition": "gpu", "NumNodes": "1", "TresPerNode": "gres:gpu:2",
        "Comment": HOSTILE_COMMENT, "JobName": HOSTILE_NAME}


def test_a_forged_comment_in_the_job_name_is_not_the_template(tmp_path):
    from gpuguard.epilog.template import job_template

    t = job_template({"SLURM_JOB_ID": "1"}, slurm=SlurmCli(_bin(tmp_path)))
    assert (t.name, t.source) == ("gpu._.x2.n1.x-Comment-gpuguard-template-victim-UserId-r-5c367e05", "derived")


@pytest.mark.parametrize(("out", "want"), [
    ("gpu|1|N/A|(null)\n", {"Partition": "gpu", "NumNodes": "1"}),
    ("gpu|2|gres:gpu:h100:8|a|b|gpuguard:template=t\n",
     {"Partition": "gpu", "NumNodes": "2", "TresPerNode": "gres:gpu:h100:8", "Comment": "a|b|gpuguard:template=t"}),
    ("gpu|1|N/A|two\nlines\n", {"Partition": "gpu", "NumNodes": "1", "Comment": "two\nlines"}),
])
def test_show_job_comment_is_the_rest_of_its_line(tmp_path, out, want):
    p = tmp_path / "squeue"
    p.write_text(f"#!/bin/sh\nif [ \"$5\" = '%j' ]; then printf 'a\\nb|c\\n'; else printf '%s' '{out}'; fi\n")
    p.chmod(0o755)
    assert SlurmCli(str(tmp_path)).show_job("7") == {**want, "JobName": "a\nb|c"}


def test_node_reason_holding_field_names_and_a_comment_and_extra():
    n = parse_node((DATA / "show_node_hostile_reason.txt").read_text())
    assert (n.name, n.state, n.reason, n.stamp) == (
        "n2", "IDLE+DRAIN", "gpuguard: xid.79 pid=7 State=IDLE Reason=gpuguard: other", "root@2026-12-01T10:29:34")
    assert n.full_reason == "gpuguard: xid.79 pid=7 State=IDLE Reason=gpuguard: other [root@2026-12-01T10:29:34]"


def test_node_comment_forging_a_reason_and_state():
    n = parse_node((DATA / "show_node_comment_no_reason.txt").read_text())
    assert (n.name, n.state, n.reason, n.stamp) == ("n1", "IDLE+NOT_RESPONDING", None, None)


def test_node_reason_through_slurmcli_is_whole(tmp_path):
    assert SlurmCli(_bin(tmp_path)).node_reason("n2") == ("gpuguard: xid.79 pid=7 State=IDLE Reason=gpuguard: other "
                                                          "[root@2026-12-01T10:29:34]")


@pytest.mark.parametrize(("tail", "reason", "stamp"), [
    # a reason forging a stamp and a Comment: the last stamp before the real end is Slurm's
    (" Reason=gpuguard: x [root@2026-01-01T00:00:00] Comment=y [slurm@2026-12-01T10:29:34]",
     "gpuguard: x [root@2026-01-01T00:00:00] Comment=y", "slurm@2026-12-01T10:29:34"),
    (" Reason=gpuguard: x name=a=b [root@2026-12-01T10:29:34] Comment=c State=UP Extra=Reason=z",
     "gpuguard: x name=a=b", "root@2026-12-01T10:29:34"),
    (" Reason=no stamp here Extra=e", "no stamp here", None),
    (" Comment=c Reason=r [root@2026-12-01T10:29:34]", None, None),
    ("", None, None),
])
def test_node_line_reason_ends_at_slurms_stamp(tail, reason, stamp):
    line = node_line("NodeName=n1 Arch=x86_64 OS=Linux 6.1 #1 SMP  State=DOWN+DRAIN Partitions=gpu" + tail)
    assert (line.fields["NodeName"], line.fields["State"], line.reason, line.stamp) == ("n1", "DOWN+DRAIN", reason, stamp)
