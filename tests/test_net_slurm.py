"""The NCCL probe in ``gpuguard health`` on the real testbed (slurmd runs it as the
HealthCheckProgram every 5 s): a node whose probe reads 40 % below its own baseline three
probes in a row is drained with a ``gpuguard: nccl.busbw_low`` reason; a node with a
single low probe is not. A fake ``all_reduce_perf`` replays corpus output per node."""

from __future__ import annotations

import importlib.util
import time

import pytest
from conftest import node_snapshot
from nccl_fake import healthy_text, scaled

from gpuguard.gpu.replay import dump_snapshot
from gpuguard.store import open_store

pytestmark = pytest.mark.slurm


needs_health = pytest.mark.skipif(importlib.util.find_spec("gpuguard.ops") is None,
                                  reason="gpuguard health (HealthCheckProgram) is not on this branch")

REASON = "gpuguard: nccl.busbw_low NCCL all-reduce busbw at 60% of node baseline, 3 probes in a row"

FAKE = """#!/bin/sh
# fake all_reduce_perf: the next queued output of this node, else the node's default
q="{root}/nccl/$SLURMD_NODENAME"
f=$(ls "$q" 2>/dev/null | sort | head -n 1)
if [ -z "$f" ]; then exec cat "{root}/nccl/default-$SLURMD_NODENAME.txt"; fi
cat "$q/$f"
rm -f "$q/$f"
"""


def _queue(root, node, texts, default):
    d = root / "nccl" / node
    d.mkdir(parents=True, exist_ok=True)
    for i, t in enumerate(texts):
        (d / f"{i:03d}").write_text(t)
    (root / "nccl" / f"default-{node}.txt").write_text(default)


def _states(root, node):
    st = open_store(str(root / node / "node.db"), create=False)
    try:
        return [r["state"] for r in st.query("select state from nccl_probes where node = ? order by id", [node])]
    finally:
        st.close()


def wait_for(pred, what, timeout=120, root=None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.5)
    log = (root / "gpuguard.log").read_text()[-4000:] if root and (root / "gpuguard.log").exists() else ""
    raise AssertionError(f"timed out waiting for {what}\n{log}")


@pytest.fixture
def nccl_hc(slurm):
    tb = slurm
    root = tb.root / "ggnet"
    tb.install_gpuguard(root, dump_snapshot(node_snapshot(4), t0=time.time()), extra=f"""
[nccl]
binary = "{root}/all_reduce_perf"
interval_s = 0.0
timeout_s = 20.0
""")
    fake = root / "all_reduce_perf"
    fake.write_text(FAKE.format(root=root))
    fake.chmod(0o755)
    flag = tb.root / "etc" / "healthcheck.on"
    yield tb, root, flag
    flag.unlink(missing_ok=True)
    time.sleep(1)


@needs_health
def test_three_low_probes_in_a_row_drain_one_does_not(nccl_hc):
    tb, root, flag = nccl_hc
    ok, low = healthy_text(), scaled(healthy_text(), 0.6)
    # n1: a baseline of 3 healthy probes, then 3 probes reading 60 % (each re-measured)
    _queue(root, "n1", [ok] * 3 + [low] * 6, default=low)
    # n2: the same baseline, then one low probe (re-measured low), then healthy again
    _queue(root, "n2", [ok] * 3 + [low] * 2, default=ok)
    flag.touch()
    reason = wait_for(lambda: tb.drain_reason("n1"), "n1 drained", root=root)
    assert reason == REASON
    assert _states(root, "n1")[:6] == ["ok", "ok", "ok", "low", "low", "low"]
    wait_for(lambda: len(_states(root, "n2")) >= 6, "n2's sixth probe", root=root)
    assert _states(root, "n2")[:6] == ["ok", "ok", "ok", "low", "ok", "ok"]
    assert tb.drain_reason("n2") is None


# --- the Prolog's probe on a multi-node job (no ops dependency) -----------------------

PROLOG_REASON = "gpuguard: nccl.errors NCCL probe: #wrong 475896"


@pytest.fixture
def nccl_prolog(slurm):
    tb = slurm
    root = tb.root / "ggnetp"
    tb.install_gpuguard(root, dump_snapshot(node_snapshot(4), t0=time.time()), extra=f"""
[nccl]
binary = "{root}/all_reduce_perf"
prolog = "multi-node"
timeout_s = 20.0
""")
    fake = root / "all_reduce_perf"
    fake.write_text(FAKE.format(root=root))
    fake.chmod(0o755)
    return tb, root


def test_prolog_probe_of_a_two_node_job_drains_the_corrupting_node(nccl_prolog):
    from nccl_fake import DATA

    tb, root = nccl_prolog
    _queue(root, "n1", [], default=(DATA / "nccl-allreduce-2.18.3-dgxh100-wrong-nonzero.txt").read_text())
    _queue(root, "n2", [], default=healthy_text())
    jid = tb.submit(wrap="true", gres="gpu:2", nodes=2)
    reason = wait_for(lambda: tb.drain_reason("n1"), "n1 drained by the Prolog", timeout=90, root=root)
    assert reason == PROLOG_REASON
    assert tb.drain_reason("n2") is None
    st = open_store(str(root / "n2" / "node.db"), create=False)
    try:
        assert [r["state"] for r in st.query("select state from nccl_probes")] == ["ok"]
    finally:
        st.close()
    tb.run(["scancel", str(jid)], check=False)


def test_prolog_single_node_job_is_not_probed(nccl_prolog):
    tb, root = nccl_prolog
    _queue(root, "n1", [], default="not nccl output\n")
    jid = tb.submit(wrap="true", gres="gpu:1", nodelist="n1")
    assert tb.wait_job(jid, timeout=60)["State"] == "COMPLETED"
    st = open_store(str(root / "n1" / "node.db"), create=False)
    try:
        assert st.query("select count(*) n from nccl_probes")[0]["n"] == 0
    finally:
        st.close()


def test_prolog_probe_never_drains_a_node_in_maintenance(slurm):
    """The same corrupting probe on a node inside a maintenance window: no drain (not even
    Slurm's 'Prolog error'), the job runs, the suppression is on the node's record."""
    from nccl_fake import DATA

    tb = slurm
    root = tb.root / "ggnetm"
    tb.install_gpuguard(root, dump_snapshot(node_snapshot(4), t0=time.time()), extra=f"""
[nccl]
binary = "{root}/all_reduce_perf"
prolog = "multi-node"
timeout_s = 20.0
[maintenance]
slurm_reservations = false
windows = [{{nodes = "n1", start = "2020-01-01T00:00:00Z", end = "2099-01-01T00:00:00Z", reason = "NIC swap"}}]
""")
    fake = root / "all_reduce_perf"
    fake.write_text(FAKE.format(root=root))
    fake.chmod(0o755)
    _queue(root, "n1", [], default=(DATA / "nccl-allreduce-2.18.3-dgxh100-wrong-nonzero.txt").read_text())
    _queue(root, "n2", [], default=healthy_text())
    jid = tb.submit(wrap="true", gres="gpu:2", nodes=2)
    assert tb.wait_job(jid, timeout=90)["State"] == "COMPLETED"
    assert tb.drain_reason("n1") is None and tb.drain_reason("n2") is None
    st = open_store(str(root / "n1" / "node.db"), create=False)
    try:
        assert st.query("select action, by, outcome, why, reason from node_actions") == [
            {"action": "suppressed", "by": "prolog", "outcome": "refused",
             "why": "would drain: in maintenance (window: NIC swap) until 2099-01-01T00:00:00Z",
             "reason": PROLOG_REASON}]
    finally:
        st.close()
