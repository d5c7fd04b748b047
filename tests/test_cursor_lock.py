"""The kernel-log cursor lock (gpuguard.cursorlock): one reader of the kernel log at a
time across processes, a bounded wait, and a lock failure that never drains."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from conftest import node_snapshot

from gpuguard import cursorlock
from gpuguard.health import read_cursor_file
from gpuguard.prolog import hook

XID79 = "[6781741.548779] NVRM: Xid (PCI:0000:3a:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"
ENV = {"SLURM_JOB_ID": "42", "SLURM_JOB_GPUS": "0,1", "SLURMD_NODENAME": "n1"}
DRAIN_79 = "gpuguard: xid.79 XID 79 GPU has fallen off the bus on gpu2 (0000:3a:00)"

HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0)
os.pwrite(fd, f"{os.getpid()} {float(sys.argv[2]):.3f}\\n".encode(), 0)
print("held", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def node(tmp_path, make_config, write_replay, fake_slurm_bin):
    kl = tmp_path / "kern.log"
    kl.write_text(XID79)
    _path, cfg = make_config('[prolog]\nstart_collector = false\n', replay=write_replay(node_snapshot(4)),
                             kernel_log=str(kl))
    return {"kl": kl, "cfg": cfg, "calls": fake_slurm_bin, "tmp": tmp_path}


class Holder:
    """Another process (a concurrent hook) holding the cursor lock, as if since ``since``."""

    def __init__(self, path: str, since: float):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.p = subprocess.Popen([sys.executable, "-c", HOLDER, path, str(since)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert self.p.stdout.readline() == "held\n"

    def release(self) -> None:
        self.p.stdin.close()
        self.p.wait(10)


def _lock_path(cfg) -> str:
    return os.path.join(cfg.get("paths", "state_dir"), cursorlock.LOCK_FILE)


def test_second_taker_waits_bounded_then_gets_a_one_line_refusal(node):
    cfg = node["cfg"]
    holder = Holder(_lock_path(cfg), time.monotonic())
    t0 = time.monotonic()
    with pytest.raises(cursorlock.LockNotTaken) as e:
        cursorlock.acquire(cfg, wait_s=0.3)
    waited = time.monotonic() - t0
    assert 0.3 <= waited < 2.0
    assert str(e.value).startswith(f"cursor lock {_lock_path(cfg)} held by pid {holder.p.pid} for ")
    holder.release()
    lock = cursorlock.acquire(cfg, wait_s=0.3)
    assert lock.fd is not None
    with open(_lock_path(cfg)) as fh:
        assert fh.read().split()[0] == str(os.getpid())
    lock.release()
    lock.release()  # idempotent


def test_prolog_while_another_reader_holds_the_lock_never_drains_and_keeps_the_events(node):
    cfg = node["cfg"]
    holder = Holder(_lock_path(cfg), time.monotonic())
    try:
        t0 = time.monotonic()
        assert hook.run(ENV) == 0
        assert time.monotonic() - t0 < float(cfg.get("prolog", "time_budget_s"))
    finally:
        holder.release()
    assert node["calls"]() == []
    assert read_cursor_file(cfg) is None  # the events were not consumed
    log = (node["tmp"] / "gpuguard.log").read_text()
    assert (f"tool error: kernel log: not read this run: cursor lock {_lock_path(cfg)} held by pid {holder.p.pid} "
            "for ") in log
    # the lock is free again: the next hook reads the XID and drains exactly once
    assert hook.run(dict(ENV, SLURM_JOB_ID="43")) == 1
    assert node["calls"]() == [["scontrol", "update", "nodename=n1", "state=drain", f"reason={DRAIN_79}"]]
    assert hook.run(dict(ENV, SLURM_JOB_ID="44")) == 0
    assert len(node["calls"]()) == 1


def test_a_stuck_holder_is_not_waited_for_forever(node):
    cfg = node["cfg"]
    holder = Holder(_lock_path(cfg), time.monotonic() - cursorlock.STALE_S - 30)
    try:
        assert hook.run(ENV) == 1  # read without the lock: the XID still drains
    finally:
        holder.release()
    assert node["calls"]() == [["scontrol", "update", "nodename=n1", "state=drain", f"reason={DRAIN_79}"]]
    log = (node["tmp"] / "gpuguard.log").read_text()
    assert f"tool error: kernel log: cursor lock {_lock_path(cfg)} held longer than 120 s by a stuck process; " \
           "read without it" in log


def test_lock_released_after_the_cursor_moved_before_scontrol(node, monkeypatch):
    """The next reader is not held by a slow slurmctld: the lock is free when the drain
    is attempted."""
    from gpuguard import actuator

    seen = []
    real = actuator.Actuator.drain

    def drain(self, node_name, reason):
        try:
            cursorlock.acquire(node["cfg"], wait_s=0.0).release()
            seen.append("free")
        except cursorlock.LockNotTaken:
            seen.append("held")
        return real(self, node_name, reason)

    monkeypatch.setattr(actuator.Actuator, "drain", drain)
    assert hook.run(ENV) == 1
    assert seen == ["free"]
    assert read_cursor_file(node["cfg"]) is not None


def test_no_directory_for_the_lock_reads_without_it_and_the_fault_still_drains(node):
    """No state directory can hold the lock file: the lock cannot coordinate anything
    (nor can the cursor be stored), so the kernel log is read without it: the XID is
    never lost; the lock problem is one tool error."""
    cfg = node["cfg"]
    for d in (cfg.get("paths", "state_dir"), cfg.get("paths", "run_dir")):
        os.makedirs(d, exist_ok=True)
        os.symlink("/nonexistent/target", os.path.join(d, cursorlock.LOCK_FILE))  # O_NOFOLLOW refuses it
    assert hook.run(ENV) == 1
    assert node["calls"]() == [["scontrol", "update", "nodename=n1", "state=drain", f"reason={DRAIN_79}"]]
    log = (node["tmp"] / "gpuguard.log").read_text()
    assert f"tool error: kernel log: cursor lock: cannot open {cursorlock.LOCK_FILE} in " in log
    assert "; read without it" in log


def test_a_wall_clock_step_never_makes_a_live_holder_look_stuck(node, monkeypatch):
    cfg = node["cfg"]
    holder = Holder(_lock_path(cfg), time.monotonic())
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600.0)  # the clock jumps an hour ahead
    try:
        with pytest.raises(cursorlock.LockNotTaken, match=f"held by pid {holder.p.pid} for "):
            cursorlock.acquire(cfg, wait_s=0.1)
    finally:
        holder.release()
