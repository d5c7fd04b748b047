"""The pieces that keep faults from being lost or repeated: durable state files, the
pending-drain list, the per-job epilog lock, the hook watchdog, the collector supervisor
and the job directory's size cap."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import node_snapshot

from gpuguard import durable
from gpuguard.collector import launch
from gpuguard.collector.jobdir_cap import enforce_cap
from gpuguard.collector.scan import find_collector_pids
from gpuguard.actuator import Actuator
from gpuguard.drainq import PendingDrains
from gpuguard.hookrun import announce, run_watched

# -- durable state files ------------------------------------------------------------------


def test_durable_newest_copy_wins_and_survives_a_readonly_dir(tmp_path):
    disk, run = str(tmp_path / "disk"), str(tmp_path / "run")
    dirs = [disk, run]
    assert durable.write(dirs, "x.json", "a") == [disk, run]
    assert durable.read(dirs, "x.json") == ("a", 1)
    os.makedirs(disk, exist_ok=True)
    # the disk copy can no longer be replaced (read-only / full): only /run takes it
    os.rename(os.path.join(disk, "x.json"), os.path.join(disk, "keep"))
    os.mkdir(os.path.join(disk, "x.json"))  # a directory in the way: rename onto it fails
    assert durable.write(dirs, "x.json", "b") == [run]
    assert durable.read(dirs, "x.json") == ("b", 2)


def test_durable_copies_of_another_owner_are_ignored(tmp_path):
    run = str(tmp_path / "run")
    durable.write([str(tmp_path / "other"), run], "x.json", "theirs")
    assert durable.read([str(tmp_path / "mine"), run], "x.json") == (None, 0)


def test_durable_nothing_writable_raises(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(OSError):
        durable.write([str(tmp_path / "f" / "sub")], "x.json", 1)


# -- pending drains -----------------------------------------------------------------------


class FakeSlurm:
    def __init__(self, fail_drains=0, hang=False):
        self.reasons: dict[str, str] = {}
        self.fail_drains = fail_drains
        self.calls: list[tuple] = []
        self.hang = hang

    def node_reason(self, node, timeout_s=None):
        self.calls.append(("show", node, timeout_s))
        return self.reasons.get(node)

    def drain_node(self, node, reason, timeout_s=None):
        self.calls.append(("drain", node, timeout_s))
        if self.fail_drains:
            self.fail_drains -= 1
            from gpuguard.slurm import SlurmError
            raise SlurmError("slurmctld down")
        self.reasons[node] = reason + " [root@x]"


@pytest.fixture
def cfg(make_config):
    return make_config()[1]


def test_failed_drain_stays_pending_and_the_next_run_confirms_it(cfg):
    slurm = FakeSlurm(fail_drains=1)
    out = PendingDrains(cfg, Actuator(slurm)).drain("n1", "gpuguard: xid.79 x")
    assert (out.status, out.why) == ("pending", "drain failed: slurmctld down")
    assert PendingDrains(cfg, Actuator(slurm)).entries()["n1"]["attempts"] == 1
    [again] = PendingDrains(cfg, Actuator(slurm)).retry()
    assert again.status == "confirmed"
    assert PendingDrains(cfg, Actuator(slurm)).entries() == {}
    assert [c[0] for c in slurm.calls if c[0] == "drain"] == ["drain", "drain"]
    assert slurm.calls[-1][0] == "show"  # confirmed by reading the node back


class SlowSlurm(FakeSlurm):
    """Both hooks read the node before either drain lands: the race of hooks that start together."""

    def node_reason(self, node, timeout_s=None):
        time.sleep(0.1)
        return super().node_reason(node, timeout_s)

    def drain_node(self, node, reason, timeout_s=None):
        time.sleep(0.2)
        super().drain_node(node, reason, timeout_s)


def test_two_hooks_settling_one_pending_drain_drain_once(cfg):
    import threading

    slurm = SlowSlurm()
    assert PendingDrains(cfg, None).add("n1", "gpuguard: xid.79 x", "reset")
    outs: list = []
    threads = [threading.Thread(target=lambda: outs.append(PendingDrains(cfg, Actuator(slurm)).settle(
        "n1", "gpuguard: xid.79 x"))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(o.status for o in outs) == ["confirmed", "confirmed"]
    assert [c[0] for c in slurm.calls].count("drain") == 1  # the second read the first's reason back
    assert PendingDrains(cfg, None).entries() == {}


def test_already_drained_by_us_is_confirmed_without_a_second_drain(cfg):
    slurm = FakeSlurm()
    slurm.reasons["n1"] = "gpuguard: xid.48 earlier [root@x]"
    assert PendingDrains(cfg, Actuator(slurm)).drain("n1", "gpuguard: xid.79 x").status == "confirmed"
    assert [c[0] for c in slurm.calls] == ["show"]


def test_admin_reason_is_left_alone_and_the_drain_stays_pending(cfg):
    slurm = FakeSlurm()
    slurm.reasons["n1"] = "memory test by alice"
    out = PendingDrains(cfg, Actuator(slurm)).drain("n1", "gpuguard: xid.79 x")
    assert out.status == "refused"
    assert "n1" in PendingDrains(cfg, Actuator(slurm)).entries()
    assert "drain" not in [c[0] for c in slurm.calls]


def test_admin_hold_drops_an_auto_drain_so_it_never_fires_on_stale_evidence(cfg):
    """An auto fault (a state every run re-reads) refused by an admin's reason is not kept
    to fire after the resume: the next run re-checks it."""
    slurm = FakeSlurm()
    slurm.reasons["n1"] = "memory test by alice"
    out = PendingDrains(cfg, Actuator(slurm)).drain("n1", "gpuguard: pcie.width_degraded x16 -> x8", "auto")
    assert (out.status, out.why) == ("refused", "it already carries someone else's reason 'memory test by alice'")
    assert PendingDrains(cfg, None).entries() == {}
    slurm.reasons.clear()  # the administrator resumes the node; the link has recovered
    assert PendingDrains(cfg, Actuator(slurm)).retry() == []
    assert "drain" not in [c[0] for c in slurm.calls] and "n1" not in slurm.reasons


def test_admin_hold_keeps_an_event_drain_and_fires_it_after_the_resume(cfg, monkeypatch):
    from gpuguard import drainq

    monkeypatch.setattr(drainq, "boot_time", lambda: time.time() - 86400.0)  # booted before the XID
    slurm = FakeSlurm()
    slurm.reasons["n1"] = "memory test by alice"
    assert PendingDrains(cfg, Actuator(slurm)).drain("n1", "gpuguard: xid.79 x", "reboot").status == "refused"
    assert PendingDrains(cfg, None).entries()["n1"]["recovery"] == "reboot"
    slurm.reasons.clear()
    [again] = PendingDrains(cfg, Actuator(slurm)).retry()
    assert again.status == "confirmed"
    assert slurm.reasons["n1"] == "gpuguard: xid.79 x [root@x]"


def test_reboot_after_the_evidence_drops_a_reset_or_reboot_drain(cfg, monkeypatch):
    from gpuguard import drainq

    slurm = FakeSlurm()
    slurm.reasons["n1"] = "memory test by alice"
    PendingDrains(cfg, Actuator(slurm)).drain("n1", "gpuguard: xid.48 x", "reset")
    slurm.reasons.clear()
    monkeypatch.setattr(drainq, "boot_id", lambda: "another-boot")  # the admin rebooted it after the XID
    [out] = PendingDrains(cfg, Actuator(slurm)).retry()
    assert (out.status, out.why) == (
        "dropped", "the node has booted since its evidence was seen (recovery kind reset: a reboot resets the GPUs)")
    assert "drain" not in [c[0] for c in slurm.calls]
    assert PendingDrains(cfg, None).entries() == {}


def test_rma_drain_survives_a_reboot_and_fires_after_the_resume(cfg, monkeypatch):
    from gpuguard import drainq

    slurm = FakeSlurm()
    slurm.reasons["n1"] = "memory test by alice"
    PendingDrains(cfg, Actuator(slurm)).drain("n1", "gpuguard: ecc.row_remap_failure x", "rma")
    slurm.reasons.clear()
    monkeypatch.setattr(drainq, "boot_id", lambda: "another-boot")
    [out] = PendingDrains(cfg, Actuator(slurm)).retry()
    assert out.status == "confirmed" and slurm.reasons["n1"].startswith("gpuguard: ecc.row_remap_failure")


def test_auto_drain_not_seen_again_within_the_stale_limit_is_dropped(cfg, monkeypatch):
    from gpuguard import drainq

    slurm = FakeSlurm(fail_drains=1)  # slurmctld down: the drain stays pending
    assert PendingDrains(cfg, Actuator(slurm)).drain("n1", "gpuguard: ib.port_down mlx5_0/1", "auto").status == "pending"
    real, before = drainq.boot_clock, len(slurm.calls)
    monkeypatch.setattr(drainq, "boot_clock", lambda: real() + drainq.AUTO_STALE_S + 60)
    [out] = PendingDrains(cfg, Actuator(slurm)).retry()
    assert out.status == "dropped" and out.why.startswith("its evidence (recovery kind auto) was last seen 66")
    assert len(slurm.calls) == before  # no Slurm call at all for a stale entry
    assert PendingDrains(cfg, None).entries() == {}


def test_auto_drain_seen_again_is_refreshed_and_fires(cfg):
    slurm = FakeSlurm(fail_drains=1)
    pend = PendingDrains(cfg, Actuator(slurm))
    pend.drain("n1", "gpuguard: ib.port_down mlx5_0/1", "auto")
    e0 = pend.entries()["n1"]
    assert pend.add("n1", "gpuguard: ib.port_down mlx5_0/1 (again)", "auto")
    e1 = pend.entries()["n1"]
    assert (e1["reason"], e1["repeats"], e1["since"]) == ("gpuguard: ib.port_down mlx5_0/1 (again)", 1, e0["since"])
    assert e1["seen"] >= e0["seen"]
    # a worse kind replaces an auto entry's kind and reason; an auto repeat never weakens it
    assert pend.add("n1", "gpuguard: xid.79 x", "reboot") and pend.add("n1", "gpuguard: ib.port_down y", "auto")
    assert (pend.entries()["n1"]["reason"], pend.entries()["n1"]["recovery"]) == ("gpuguard: xid.79 x", "reboot")
    [out] = pend.retry()
    assert out.status == "confirmed" and slurm.reasons["n1"] == "gpuguard: xid.79 x [root@x]"


def test_decision_recovery_is_the_worst_kind_of_the_drain_findings():
    from gpuguard.drainq import decision_recovery
    from gpuguard.model import Finding
    from gpuguard.policy import decide

    # nothing drains (pcie.width_degraded alerts by default): a drain nobody can explain is manual
    assert decision_recovery(decide([Finding("pcie.width_degraded", "critical", "x8")], {}, {})) == "manual"
    d = decide([Finding("ib.port_down", "critical", "down"), Finding("xid.79", "critical", "off the bus")],
               {"ib.port_down": "drain", "xid.79": "drain"}, {})
    assert (d.outcome, decision_recovery(d)) == ("drain", "reboot")
    d = decide([Finding("ib.port_down", "critical", "down")], {"ib.port_down": "drain"}, {})
    assert (d.outcome, decision_recovery(d)) == ("drain", "auto")


def test_accepted_but_unconfirmed_drain_is_not_repeated_after_a_resume(cfg):
    from gpuguard.slurm import SlurmError

    class SlowShow(FakeSlurm):
        blind = False

        def node_reason(self, node, timeout_s=None):
            if self.blind:
                self.calls.append(("show", node, timeout_s))
                raise SlurmError("scontrol show node timed out")
            return super().node_reason(node, timeout_s)

        def drain_node(self, node, reason, timeout_s=None):
            super().drain_node(node, reason, timeout_s)
            self.blind = True  # slurmctld accepted the drain, then stopped answering

    slurm = SlowShow()
    out = PendingDrains(cfg, Actuator(slurm)).drain("n1", "gpuguard: xid.79 x")
    assert out.status == "applied"
    assert PendingDrains(cfg, None).entries()["n1"]["applied_at"] > 0
    slurm.blind = False
    slurm.reasons.clear()  # an administrator resumed the node
    [again] = PendingDrains(cfg, Actuator(slurm)).retry()
    assert (again.status, again.why) == ("confirmed", "applied earlier; the node has been resumed since")
    assert [c[0] for c in slurm.calls].count("drain") == 1
    assert PendingDrains(cfg, None).entries() == {}


def test_node_drained_by_slurm_for_our_prolog_exit_counts_as_drained(cfg):
    slurm = FakeSlurm()
    slurm.reasons["n1"] = "Prolog error"
    out = PendingDrains(cfg, Actuator(slurm)).drain("n1", "gpuguard: xid.79 x")
    assert (out.status, out.why) == ("confirmed", "drained by Slurm as 'Prolog error'")
    assert PendingDrains(cfg, Actuator(slurm)).entries() == {}


def test_retry_takes_only_its_share_of_the_budget(cfg):
    from gpuguard import drainq

    slurm = FakeSlurm()
    PendingDrains(cfg, Actuator(slurm)).add("n1", "gpuguard: x")
    deadline = time.monotonic() + 10.0
    act = Actuator(slurm, deadline=deadline)
    PendingDrains(cfg, act).retry()
    assert max(c[2] for c in slurm.calls) <= 10.0 * drainq.RETRY_SHARE + 0.01
    assert act.deadline == deadline  # restored for the run's own drain


def test_every_call_timeout_is_capped_by_the_deadline(cfg):
    slurm = FakeSlurm()
    PendingDrains(cfg, Actuator(slurm, deadline=time.monotonic() + 2.0)).drain("n1", "gpuguard: x")
    assert all(c[2] <= 2.0 for c in slurm.calls)
    slurm2 = FakeSlurm()
    out = PendingDrains(cfg, Actuator(slurm2, deadline=time.monotonic() - 1)).drain("n2", "gpuguard: x")
    assert (out.status, slurm2.calls) == ("pending", [])  # no time left: no call, kept


# -- the hook watchdog -------------------------------------------------------------------


def test_watchdog_ends_a_blocked_hook_at_its_budget(tmp_path):
    fifo = tmp_path / "hung"
    os.mkfifo(fifo)

    def blocked():
        with open(fifo, "rb") as fh:  # blocks in open(2) until a writer comes: never
            fh.read()
        return 1

    t = time.monotonic()
    assert run_watched(blocked, 0.5, "prolog", log_file=str(tmp_path / "g.log")) == 0
    assert time.monotonic() - t < 2.0
    assert "prolog exceeded its time budget of 0.5 s" in (tmp_path / "g.log").read_text()


def test_watchdog_exits_with_the_announced_verdict(tmp_path):
    def drain_then_hang():
        announce(1)
        time.sleep(30)
        return 0

    assert run_watched(drain_then_hang, 0.5, "prolog", log_file=str(tmp_path / "g.log")) == 1
    assert "exiting 1 as announced" in (tmp_path / "g.log").read_text()


def test_watchdog_passes_rc_and_output():
    r = subprocess.run([sys.executable, "-c",
                        "from gpuguard.hookrun import run_watched\n"
                        "import sys\n"
                        "rc = run_watched(lambda: print('hello') or 3, 5, 'epilog')\n"
                        "sys.exit(rc)\n"], capture_output=True, text=True, timeout=30)
    assert (r.returncode, r.stdout) == (3, "hello\n")


def test_watchdog_relays_output_written_just_before_the_child_exits():
    # the parent's first select sees nothing and sleeps long enough for the child to write
    # and exit: its output is in the pipe when waitpid reports the exit, and must be relayed
    r = subprocess.run([sys.executable, "-c",
                        "import select, sys, time\n"
                        "from gpuguard.hookrun import run_watched\n"
                        "real, calls = select.select, []\n"
                        "def late(*a):\n"
                        "    calls.append(1)\n"
                        "    if len(calls) == 1:\n"
                        "        time.sleep(1.0)\n"
                        "        return [], [], []\n"
                        "    return real(*a)\n"
                        "select.select = late\n"
                        "rc = run_watched(lambda: print('x' * 5000) or print('bye', file=sys.stderr) or 3, 5, 'epilog')\n"
                        "sys.exit(rc)\n"], capture_output=True, text=True, timeout=30)
    assert (r.returncode, r.stdout, r.stderr) == (3, "x" * 5000 + "\n", "bye\n")


# -- job directory cap ---------------------------------------------------------------------


def test_job_dir_cap_cuts_files_in_name_order(tmp_path):
    d = tmp_path / "42"
    d.mkdir()
    (d / "train.rank0.jsonl").write_bytes(b"a" * 600)
    (d / "train.rank1.jsonl").write_bytes(b"b" * 600)
    (d / "link").symlink_to("/etc/passwd")
    assert enforce_cap(str(d), 1000) == (1200, ["train.rank1.jsonl"])
    assert (os.path.getsize(d / "train.rank0.jsonl"), os.path.getsize(d / "train.rank1.jsonl")) == (600, 400)
    assert enforce_cap(str(d), 1000) == (1000, [])
    assert enforce_cap(str(tmp_path / "missing"), 10) == (0, [])


# -- collector supervisor ----------------------------------------------------------------


def _wait(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_killed_collector_is_restarted_and_the_downtime_reported(tmp_path, make_config, write_replay):
    _, cfg = make_config("[collector]\ninterval_s = 0.5\nflush_s = 1\n", replay=write_replay(node_snapshot(2)))
    cg = tmp_path / "cg"
    cg.mkdir()
    (cg / "cpuacct.usage").write_text("1\n")
    env = {"SLURM_JOB_ID": "77", "PATH": os.environ["PATH"]}
    sup = launch.start_collector(cfg, "77", gpus="0", uid=1001, env=env,
                                 extra_args=["--job-cgroup", str(cg), "--no-scontrol"])
    try:
        def children():
            return [p for p in find_collector_pids("77", config=cfg.path) if p != sup]
        assert _wait(lambda: len(children()) == 1)
        first = children()[0]
        os.kill(first, signal.SIGKILL)
        t = time.monotonic()
        assert _wait(lambda: any(p != first for p in children()), timeout=5.0)
        assert time.monotonic() - t < 2 * 0.5 + 1.0  # within two intervals (+ start-up slack)
        doc = json.loads((tmp_path / "state" / "collector.77.restarts.json").read_text())
        assert doc["restarts"] == 1 and doc["last_death"] == "killed by SIGKILL" and 0 < doc["down_s"] < 1.0
        res = launch.stop_collector(cfg, "77", timeout_s=10)
        assert res.was_running and res.exited
        assert _wait(lambda: find_collector_pids("77", config=cfg.path) == [], timeout=10)
    finally:
        for p in find_collector_pids("77", config=cfg.path):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(sup, 0)


# -- collector spill ---------------------------------------------------------------------


def test_rows_a_locked_store_refused_at_exit_reach_the_store_through_the_spill(tmp_path):
    import threading as _t

    from gpuguard.collector.run import Collector, RowBuffer
    from gpuguard.collector.spill import load_spill
    from gpuguard.store import open_store

    db = str(tmp_path / "node.db")
    open_store(db).close()

    class Live:
        def check(self):
            return True, ""

    class Host:
        def sample(self, *a, **k):
            return None

    spill = str(tmp_path / "collector.9.spill.jsonl")
    coll = Collector(job_id="9", node="n1", source=None, gpus="", host=Host(), liveness=Live(),
                     open_store=lambda: open_store(db), interval_s=10, flush_s=10, spill_path=spill)
    coll.buffer = RowBuffer()
    coll.buffer.add("samples", [{"job_id": "9", "node": "n1", "at": 1000.0 + i, "gpu_index": 0} for i in range(5)])
    coll._store = open_store(db)
    import sqlite3
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    coll.stop_event.set()
    t = time.monotonic()
    coll.run()
    assert time.monotonic() - t < 4.0
    holder.execute("ROLLBACK")
    holder.close()
    assert len(open(spill).read().splitlines()) == 5
    s = open_store(db)
    assert load_spill(s, spill) == 5
    assert s.query("select count(*) as n from samples where job_id = '9'") == [{"n": 5}]
    assert not os.path.exists(spill)
    _ = _t


@pytest.mark.parametrize("reason,kind", [("gpuguard: ib.port_down mlx5_0/1 port DOWN", "auto"),
                                         ("gpuguard: xid.79 XID 79 GPU has fallen off the bus", "reboot"),
                                         ("gpuguard: ecc.row_remap_failure gpu0", "rma"),
                                         ("gpuguard: ib.port_down mlx5_0/1 port DOWN (+1 more)", "manual"),
                                         ("gpuguard: manual: fan noisy (by alice)", "manual")])
def test_a_drain_without_a_kind_takes_the_kind_of_the_code_its_reason_names(cfg, reason, kind):
    slurm = FakeSlurm()
    slurm.reasons["n1"] = "memory test by alice"
    out = PendingDrains(cfg, Actuator(slurm)).drain("n1", reason)
    assert out.status == "refused"
    entries = PendingDrains(cfg, None).entries()
    assert (entries == {}) if kind == "auto" else (entries["n1"]["recovery"] == kind)
