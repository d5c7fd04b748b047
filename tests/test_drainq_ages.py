"""Pending drains age on the boot clock (gpuguard.drainq, "Ages"): a wall-clock step
(NTP after boot with a bad RTC, a VM restored) neither drops a real drain nor keeps one
forever; entries written without the boot fields are still read."""

from __future__ import annotations

import logging
import time

import pytest
from test_reliability import FakeSlurm

from gpuguard import drainq, durable
from gpuguard.actuator import Actuator
from gpuguard.drainq import Outcome, PendingDrains

DAY = 86400.0
R79 = "gpuguard: xid.79 x"


@pytest.fixture
def cfg(make_config):
    return make_config()[1]


def _pending(cfg, reason=R79, recovery="reboot"):
    """A drain slurmctld did not take: left pending. Returns the fake Slurm."""
    slurm = FakeSlurm(fail_drains=1)
    assert PendingDrains(cfg, Actuator(slurm)).drain("n1", reason, recovery).status == "pending"
    return slurm


def _step_wall(monkeypatch, by_s):
    real = time.time
    monkeypatch.setattr(drainq.time, "time", lambda: real() + by_s)


def _step_boot_clock(monkeypatch, by_s):
    real = drainq.boot_clock
    monkeypatch.setattr(drainq, "boot_clock", lambda: real() + by_s)


def _drops(caplog):
    return [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]


def test_an_entry_keeps_its_boot_and_boot_clock(cfg):
    _pending(cfg)
    e = PendingDrains(cfg, None).entries()["n1"]
    assert (e["boot_id"], e["booted"]) == (drainq.boot_id(), False)
    assert e["since_boot_s"] == e["seen_boot_s"]
    assert 0 <= drainq.boot_clock() - e["since_boot_s"] < 60


def test_wall_clock_stepped_8_days_forward_fires_the_drain(cfg, monkeypatch, caplog):
    slurm = _pending(cfg)
    _step_wall(monkeypatch, 8 * DAY)
    with caplog.at_level(logging.INFO, "gpuguard.drainq"):
        [out] = PendingDrains(cfg, Actuator(slurm)).retry()
    assert (out.status, slurm.reasons["n1"]) == ("confirmed", R79 + " [root@x]")
    assert _drops(caplog) == []


def test_wall_clock_stepped_back_still_drops_after_7_days_on_the_boot_clock(cfg, monkeypatch, caplog):
    slurm = _pending(cfg)
    _step_wall(monkeypatch, -30 * DAY)
    _step_boot_clock(monkeypatch, 8 * DAY)
    before = len(slurm.calls)
    with caplog.at_level(logging.INFO, "gpuguard.drainq"):
        out = PendingDrains(cfg, Actuator(slurm)).retry()
    assert out == [Outcome("n1", R79, "dropped", "unconfirmed for 8.0 days (limit 7)")]
    assert _drops(caplog) == [f"tool error: pending drain of n1 dropped, unconfirmed for 8.0 days (limit 7): {R79}"]
    assert (len(slurm.calls), PendingDrains(cfg, None).entries()) == (before, {})


def test_auto_evidence_is_not_stale_after_a_wall_step_of_an_hour(cfg, monkeypatch):
    slurm = _pending(cfg, "gpuguard: ib.port_down mlx5_0/1", "auto")
    _step_wall(monkeypatch, 3600)
    [out] = PendingDrains(cfg, Actuator(slurm)).retry()
    assert (out.status, slurm.reasons["n1"]) == ("confirmed", "gpuguard: ib.port_down mlx5_0/1 [root@x]")


def _old_entry(cfg, since, recovery="reboot", **more):
    """An entry as the version without boot fields wrote it."""
    e = {"reason": R79, "since": since, "seen": since, "recovery": recovery, "attempts": 0, "repeats": 0,
         "last_error": "", **more}
    durable.write(durable.state_dirs(cfg), drainq.FILE, {"n1": e})


def test_an_old_entry_with_since_in_the_future_is_not_old_and_is_anchored(cfg, monkeypatch):
    _old_entry(cfg, time.time() + 5 * DAY)  # written before the clock stepped back
    slurm = FakeSlurm(fail_drains=1)
    [out] = PendingDrains(cfg, Actuator(slurm)).retry()
    assert (out.status, out.why) == ("pending", "drain failed: slurmctld down")
    e = PendingDrains(cfg, None).entries()["n1"]
    assert (e["boot_id"], e["booted"], e["attempts"]) == (drainq.boot_id(), False, 1)
    assert 0 <= drainq.boot_clock() - e["since_boot_s"] < 60  # age 0 from its first read
    _step_boot_clock(monkeypatch, 8 * DAY)
    assert PendingDrains(cfg, Actuator(slurm)).retry() == [
        Outcome("n1", R79, "dropped", "unconfirmed for 8.0 days (limit 7)")]


def test_an_old_entry_8_days_old_on_the_wall_clock_is_dropped(cfg):
    _old_entry(cfg, time.time() - 8 * DAY, recovery="rma")
    slurm = FakeSlurm()
    assert PendingDrains(cfg, Actuator(slurm)).retry() == [
        Outcome("n1", R79, "dropped", "unconfirmed for 8.0 days (limit 7)")]
    assert slurm.calls == []


def test_a_reset_drain_from_an_earlier_boot_is_dropped_whatever_the_wall_clock_says(cfg):
    """btime and seen are both wall-clock: after a step back the reboot would go unseen."""
    _old_entry(cfg, time.time() + DAY, recovery="reset", boot_id="an-earlier-boot", since_boot_s=50.0,
               seen_boot_s=50.0, booted=False)
    slurm = FakeSlurm()
    [out] = PendingDrains(cfg, Actuator(slurm)).retry()
    assert (out.status, out.why) == (
        "dropped", "the node has booted since its evidence was seen (recovery kind reset: a reboot resets the GPUs)")
    assert slurm.calls == []


def test_fresh_evidence_after_the_reboot_clears_booted_and_fires(cfg):
    _old_entry(cfg, time.time() - 60, recovery="reset", boot_id="an-earlier-boot", since_boot_s=50.0,
               seen_boot_s=50.0, booted=False)
    assert PendingDrains(cfg, None).add("n1", R79, "reset")  # the XID again in this boot
    e = PendingDrains(cfg, None).entries()["n1"]
    assert (e["boot_id"], e["booted"], e["repeats"]) == (drainq.boot_id(), False, 1)
    slurm = FakeSlurm()
    [out] = PendingDrains(cfg, Actuator(slurm)).retry()
    assert (out.status, slurm.reasons["n1"]) == ("confirmed", R79 + " [root@x]")
