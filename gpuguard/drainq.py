"""Pending drains: a drain decision is kept until Slurm confirms it.

A drain can fail: slurmctld is down, slow, or the hook's budget runs out while
``scontrol`` hangs. The kernel-log events that caused it are already past the cursor, so
without a record the fault would be lost for good. The rule:

1. a drain decision is first written to the pending list (:data:`FILE`, kept in
   ``state_dir`` and ``run_dir`` by :mod:`gpuguard.durable`); only then may the caller
   move the kernel-log cursor past its events (:meth:`PendingDrains.add` returns False
   when no copy could be written: the caller then keeps the cursor, and the events are
   read again next time);
2. the drain is attempted, then *confirmed*: the node's reason (``scontrol show node``)
   must start with ``gpuguard:``; only then is the entry removed;
3. every later hook run (Prolog or Epilog, any job) retries what is still pending
   (:meth:`PendingDrains.retry`) before anything else talks to Slurm.

One entry per node (a second decision for a node already pending keeps the first
reason and counts the repeats). Entries older than :data:`MAX_AGE_S` are dropped with an
error: by then a human has looked at the node.

Ages. Each entry keeps the boot it was last written in (:data:`BOOT_ID_FILE`) and the
boot clock (``CLOCK_BOOTTIME``: counts from boot, suspend included, and never steps) at
its ``since`` and ``seen``; within that boot every age is measured on the boot clock, so
an NTP step after boot on a node with a bad RTC, or a VM restored from a snapshot, neither
drops a real drain as "a week old" nor keeps one forever. Read first in a later boot (or
written by a version without these fields), an entry's ages are taken once from the wall
clock (a time in the future counts as age 0, never as old), and the entry is re-anchored on
this boot's clock; "booted since the evidence was seen" is then known from the boot id, not
from comparing wall-clock times.

Stale evidence. Each entry keeps the recovery kind of its findings
(:mod:`gpuguard.recovery`) and when its evidence was last seen; an entry fires only on
evidence that still stands:

* ``auto`` (a *state* every run re-reads: a degraded PCIe link, a port down, a low NCCL
  probe): refused by someone else's reason on the node (an administrator's drain), the
  entry is dropped, not kept to fire after the resume; retried, it fires only when its
  evidence was seen within :data:`AUTO_STALE_S`, else it is dropped. Nothing is lost:
  the next run reads that state again and drains on fresh evidence if it still holds.
* ``reset`` / ``reboot`` (an *event*, read once from the kernel log): kept through an
  administrator's drain and fired after the resume, unless the node has booted since
  the evidence was seen (a reboot resets every GPU, which is the recovery those faults
  ask for; a fault that survives it is read again by the checks).
* ``rma`` / ``manual``: kept through an administrator's drain and fired after the
  resume (a human must look at the part; an unrelated resume does not clear it).

This module wraps the one drain implementation, :class:`gpuguard.actuator.Actuator`
(ownership rules, dry run, budget-capped ``scontrol`` calls); it adds only the durable
list and the confirmation, read through the actuator's backend (``node_reason``). Every
call's timeout is capped by what is left before the actuator's ``deadline`` (a
:func:`time.monotonic` value: the hook's budget).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gpuguard import durable

FILE = "pending_drains.json"
#: Longest confirmation query (s), before the budget cap (our choice: scontrol answers
#: in 10-100 ms on a healthy slurmctld; 15 s is the backend's own default).
CALL_TIMEOUT_S = 15.0
#: Below this much time left no call is started (s); the actuator's own floor.
MIN_CALL_S = 0.2
#: A pending drain older than this (s) is dropped (our choice: a week).
MAX_AGE_S = 7 * 86400.0
#: An ``auto`` entry whose evidence was last seen longer ago than this (s) is dropped
#: instead of fired (our choice: two of Slurm's usual HealthCheckInterval of 300 s; the
#: state is re-read by the next run anyway, so dropping it loses nothing).
AUTO_STALE_S = 600.0
#: Recovery kinds a reboot satisfies (:mod:`gpuguard.recovery`: NVIDIA's RESET_GPU and
#: RESTART_BM actions).
CLEARED_BY_REBOOT = ("reset", "reboot")
#: At most this many nodes pending (one per slurmd on this host; more is not ours).
MAX_ENTRIES = 64
#: Share of the time left that retrying earlier drains may take, so a slurmctld that
#: hangs cannot eat the budget the run's own checks need (our choice).
RETRY_SHARE = 0.5
#: Reasons Slurm itself sets when a hook exits non-zero (SLURM-FACTS.md §5): the node is
#: drained because of our own Prolog/Epilog exit, so a pending drain counts as done.
SLURM_HOOK_REASONS = ("Prolog error", "Epilog error")

#: This boot's id: a random UUID the kernel makes at every boot (random(4), proc(5)).
BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"

#: Lock file beside :data:`FILE`: hooks that start together settle one drain at a time,
#: so the second reads the first's reason back and confirms instead of draining again.
LOCK_FILE = "pending_drains.lock"
#: Longest wait for that lock (s; our choice: a drain + read-back takes well under 1 s on a
#: healthy slurmctld; past it we drain without the lock: a repeated drain beats a lost one).
SETTLE_LOCK_WAIT_S = 2.0


@dataclass
class Outcome:
    """What happened to one node's drain: ``status`` ``confirmed`` (the node shows a
    gpuguard reason, or was drained by Slurm for our hook's exit, or was resumed after a
    drain of ours that Slurm had accepted), ``applied`` (``scontrol`` accepted it but the
    node could not be read back yet: kept, never re-drained after a resume), ``pending``
    (kept for the next run, ``why`` says why), ``refused`` (someone else's reason is on
    the node; kept, except for ``auto`` evidence), ``dropped`` (its evidence no longer
    stands, ``why`` says why: module docstring, "Stale evidence") or ``dry-run``."""

    node: str
    reason: str
    status: str
    why: str = ""


class PendingDrains:
    """The pending-drain list of one node's state directories (``cfg``), acting through
    ``actuator`` (a :class:`gpuguard.actuator.Actuator`; None: the list only)."""

    def __init__(self, cfg: Any, actuator: Any, log: logging.Logger | None = None):
        self.dirs = durable.state_dirs(cfg)
        self.actuator = actuator
        self.slurm = getattr(actuator, "slurm", None)
        self.deadline = getattr(actuator, "deadline", None)
        self.dry_run = bool(getattr(actuator, "dry_run", False))
        self.log = log or logging.getLogger(__name__)

    # -- the list ---------------------------------------------------------------------
    def entries(self) -> dict[str, dict[str, Any]]:
        """``node -> {"reason", "since", "seen", "recovery", "attempts", "repeats",
        "last_error"}`` (``since``/``seen``: UTC epoch s), plus the boot fields of the
        module docstring, "Ages": ``boot_id``, ``since_boot_s``, ``seen_boot_s``,
        ``booted`` (absent in entries written before they were kept)."""
        value, _ = durable.read(self.dirs, FILE)
        return value if isinstance(value, dict) else {}

    def _save(self, entries: dict[str, dict[str, Any]]) -> bool:
        try:
            durable.write(self.dirs, FILE, entries)
            return True
        except OSError as e:
            self.log.error("tool error: pending drains: cannot write %s in %s: %s", FILE, self.dirs, e)
            return False

    def add(self, node: str, reason: str, recovery: str | None = None) -> bool:
        """Record a drain decision whose findings need ``recovery`` (a kind of
        :data:`gpuguard.recovery.RECOVERY_KINDS`; :func:`decision_recovery`; None: the
        kind of the finding code the reason names, :func:`reason_recovery`). Returns False
        when no copy could be written. A repeat refreshes when the evidence was seen and
        keeps the most demanding kind (with its reason)."""
        from gpuguard.recovery import RECOVERY_KINDS, worst

        recovery = recovery if recovery in RECOVERY_KINDS else reason_recovery(reason)
        entries = self.entries()
        clk = Clock.read()
        now = clk.wall
        if node in entries:
            e = entries[node]
            anchor(e, clk)
            e["repeats"] = int(e.get("repeats", 0)) + 1
            e.update(seen=now, seen_boot_s=clk.boot_s, booted=False)
            old = _kind(e)
            if worst([old, recovery]) != old or old == "auto":  # fresh evidence replaces stale
                e["reason"], e["recovery"] = reason, worst([old, recovery])
        else:
            if len(entries) >= MAX_ENTRIES:
                oldest = max(entries, key=lambda n: age_s(entries[n], "since", clk))
                entries.pop(oldest)
            entries[node] = {"reason": reason, "since": now, "seen": now, "recovery": recovery, "attempts": 0,
                             "repeats": 0, "last_error": "", "boot_id": clk.boot_id, "since_boot_s": clk.boot_s,
                             "seen_boot_s": clk.boot_s, "booted": False}
        return self._save(entries)

    # -- acting ---------------------------------------------------------------------------
    def _timeout(self) -> float | None:
        if self.deadline is None:
            return CALL_TIMEOUT_S
        left = self.deadline - time.monotonic()
        return None if left < MIN_CALL_S else min(CALL_TIMEOUT_S, left)

    def _current_reason(self, node: str) -> tuple[str | None, str]:
        """(reason on the node or None, error text or "")."""
        t = self._timeout()
        if t is None:
            return None, "no time left in the budget"
        try:
            return self.slurm.node_reason(node, timeout_s=t), ""
        except Exception as e:  # SlurmError, a timeout: the drain stays pending
            return None, str(e)

    def _drain_one(self, node: str, reason: str, applied: bool = False) -> Outcome:
        """One attempt. ``applied``: an earlier run's ``scontrol update`` returned 0 but
        could not be confirmed (time ran out); a node that now shows no reason was then
        resumed by someone after our drain, and is not drained again."""
        from gpuguard.slurm import REASON_PREFIX

        if self.dry_run:
            return Outcome(node, reason, "dry-run", "dry run ([slurm] drain = false)")
        current, err = self._current_reason(node)
        if current and current.startswith(REASON_PREFIX):
            return Outcome(node, reason, "confirmed")  # an earlier attempt went through
        if current and current.startswith(SLURM_HOOK_REASONS):
            # our Prolog exited 1 before its drain went through: Slurm drained the node
            return Outcome(node, reason, "confirmed", f"drained by Slurm as {current!r}")
        if applied and not current and not err:
            return Outcome(node, reason, "confirmed", "applied earlier; the node has been resumed since")
        res = self.actuator.drain(node, reason)
        if res.status == "refused" and "someone else's reason" in res.why:
            return Outcome(node, reason, "refused", res.why)
        if res.status == "failed":
            return Outcome(node, reason, "pending", f"drain failed: {res.why}")
        current, err = self._current_reason(node)
        if current and current.startswith(REASON_PREFIX):
            return Outcome(node, reason, "confirmed")
        # scontrol accepted it (exit 0) but the node could not be read back yet
        return Outcome(node, reason, "applied", f"not confirmed: {err or f'node reason is {current!r}'}")

    def drain(self, node: str, reason: str, recovery: str | None = None) -> Outcome:
        """Record the decision (if not already pending; ``recovery`` as for :meth:`add`),
        drain, confirm, and remove the entry when confirmed. Never raises; logs the
        outcome."""
        if self.dry_run:
            self.log.warning("dry run: would drain %s: %s", node, reason)
            return Outcome(node, reason, "dry-run")
        if not self.add(node, reason, recovery):
            self.log.error("tool error: drain of %s not recorded as pending; trying it anyway", node)
        return self._settle(node, self.entries().get(node, {"reason": reason}))

    def settle(self, node: str, reason: str) -> Outcome:
        """Drain and confirm the pending entry of ``node`` (added by :meth:`add`; when
        the list could not be written, ``reason`` is drained all the same)."""
        return self._settle(node, self.entries().get(node) or {"reason": reason})

    def retry(self) -> list[Outcome]:
        """Retry every pending drain (oldest first) within :data:`RETRY_SHARE` of the time
        left; returns their outcomes."""
        entries = self.entries()
        if not entries:
            return []
        saved = self.deadline
        if saved is not None:
            self.deadline = time.monotonic() + max(0.0, saved - time.monotonic()) * RETRY_SHARE
            if self.actuator is not None:
                self.actuator.deadline = self.deadline
        try:
            return self._retry(entries)
        finally:
            self.deadline = saved
            if self.actuator is not None:
                self.actuator.deadline = saved

    def _retry(self, entries: dict[str, dict[str, Any]]) -> list[Outcome]:
        out = []
        clk = Clock.read()
        if [anchor(e, clk) for e in entries.values() if isinstance(e, dict)].count(True):
            self._save(entries)  # ages on this boot's clock from now on
        entries = {n: e for n, e in entries.items() if isinstance(e, dict)}
        for node in sorted(entries, key=lambda n: -age_s(entries[n], "since", clk)):
            e = entries[node]
            age = age_s(e, "since", clk)
            if age > MAX_AGE_S:
                why = f"unconfirmed for {age / 86400:.1f} days (limit {MAX_AGE_S / 86400:.0f})"
                self.log.error("tool error: pending drain of %s dropped, %s: %s", node, why, e.get("reason"))
                self._forget(node)
                out.append(Outcome(node, str(e.get("reason", "")), "dropped", why))
                continue
            stale = _stale(e, clk)
            if stale:
                self.log.warning("pending drain of %s dropped, not fired: %s: %s", node, stale, e.get("reason"))
                self._forget(node)
                out.append(Outcome(node, str(e.get("reason", "")), "dropped", stale))
                continue
            out.append(self._settle(node, e))
        return out

    @contextlib.contextmanager
    def _settle_lock(self) -> Iterator[bool]:
        """Hold :data:`LOCK_FILE` (first state directory that can hold it) for one settle;
        waits at most :data:`SETTLE_LOCK_WAIT_S` and never past the deadline. Yields
        whether it is held; without it the caller goes on (a repeated drain of the same
        node is harmless, a skipped one is not)."""
        fd = None
        for d in self.dirs:
            try:
                fd = os.open(os.path.join(d, LOCK_FILE),
                             os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                break
            except OSError:
                continue
        held = False
        try:
            if fd is not None:
                end = time.monotonic() + SETTLE_LOCK_WAIT_S
                if self.deadline is not None:
                    end = min(end, self.deadline - MIN_CALL_S)
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        held = True
                        break
                    except OSError:
                        if time.monotonic() >= end:
                            break
                        time.sleep(0.02)
            yield held
        finally:
            if fd is not None:
                os.close(fd)  # releases the flock

    def _settle(self, node: str, entry: dict[str, Any]) -> Outcome:
        with self._settle_lock():
            return self._settle_locked(node, entry)

    def _settle_locked(self, node: str, entry: dict[str, Any]) -> Outcome:
        reason = str(entry.get("reason", ""))
        res = self._drain_one(node, reason, applied=bool(entry.get("applied_at")))
        if res.status == "confirmed":
            self.log.info("drain of %s confirmed: %s", node, res.why or "the node shows a gpuguard reason")
            self._forget(node)
        elif res.status == "refused" and _kind(entry) == "auto":
            self.log.warning("drain of %s not kept: %s; its evidence is a state every run re-reads, so it is "
                             "drained on fresh evidence after the resume if the fault still holds: %s",
                             node, res.why, reason)
            self._forget(node)
        else:
            self.log.error("tool error: drain of %s %s (%s); it stays pending for the next hook run",
                           node, res.status, res.why)
            entries = self.entries()
            if node in entries:
                entries[node]["attempts"] = int(entries[node].get("attempts", 0)) + 1
                entries[node]["last_error"] = res.why[:300]
                if res.status == "applied":
                    entries[node]["applied_at"] = time.time()
                self._save(entries)
        return res

    def _forget(self, node: str) -> None:
        entries = self.entries()
        if entries.pop(node, None) is not None:
            self._save(entries)


def _kind(entry: dict[str, Any]) -> str:
    """An entry's recovery kind; ``manual`` for entries written before kinds were kept."""
    return str(entry.get("recovery") or "manual")


def boot_time() -> float | None:
    """When this host booted (UTC epoch seconds: ``btime`` of ``/proc/stat``, proc(5)),
    or None when it cannot be read."""
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def boot_id() -> str | None:
    """This boot's id (:data:`BOOT_ID_FILE`), or None when it cannot be read."""
    try:
        with open(BOOT_ID_FILE, encoding="ascii") as fh:
            return fh.read(100).strip() or None
    except (OSError, ValueError):
        return None


def boot_clock() -> float:
    """Seconds since boot on ``CLOCK_BOOTTIME`` (clock_gettime(2): includes suspend, is
    never stepped by ``settimeofday`` or NTP)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


@dataclass(frozen=True)
class Clock:
    """One reading of the clocks: ``wall`` (UTC epoch s), ``boot_id`` (None: unknown)
    and ``boot_s`` (:func:`boot_clock`)."""

    wall: float
    boot_id: str | None
    boot_s: float

    @classmethod
    def read(cls) -> Clock:
        return cls(time.time(), boot_id(), boot_clock())


def _num(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if f == f and abs(f) != float("inf") else None


def age_s(entry: dict[str, Any], key: str, clk: Clock) -> float:
    """Seconds since ``entry[key]`` (``since`` or ``seen``; ``seen`` falls back to
    ``since``): on the boot clock when the entry is anchored to this boot, else on the
    wall clock, where a time in the future is age 0 (module docstring, "Ages")."""
    bt = _num(entry.get(f"{key}_boot_s"))
    if clk.boot_id and entry.get("boot_id") == clk.boot_id and bt is not None:
        return max(0.0, clk.boot_s - bt)
    wall = _num(entry.get(key)) if entry.get(key) is not None else _num(entry.get("since"))
    return max(0.0, clk.wall - (wall or 0.0))


def anchor(entry: dict[str, Any], clk: Clock) -> bool:
    """Tie ``entry``'s ages to this boot's clock when it was written in another boot or
    without the boot fields: ages taken from the wall clock once, ``booted`` set when
    the node has booted since the evidence was seen (a different boot id; for an entry
    without one, ``btime`` of ``/proc/stat`` after ``seen``, the only evidence there is).
    Returns whether ``entry`` changed (nothing changes when the boot id is unknown)."""
    if not clk.boot_id or entry.get("boot_id") == clk.boot_id:
        return False
    since, seen = age_s(entry, "since", clk), age_s(entry, "seen", clk)
    booted = bool(entry.get("boot_id")) or bool(entry.get("booted")) or _booted_by_wall(entry)
    entry.update(boot_id=clk.boot_id, since_boot_s=clk.boot_s - since, seen_boot_s=clk.boot_s - seen,
                 booted=booted)
    return True


def _booted_by_wall(entry: dict[str, Any]) -> bool:
    """Booted after ``entry``'s evidence was seen, by the wall clock (``btime`` against
    ``seen``): for an entry without a boot id, the only evidence there is."""
    btime, seen = boot_time(), _num(entry.get("seen")) or _num(entry.get("since")) or 0.0
    return btime is not None and btime > seen


def _stale(entry: dict[str, Any], clk: Clock | None = None) -> str:
    """Why ``entry``'s evidence no longer stands (module docstring, "Stale evidence"), or
    "" when it may fire. Ages as :func:`age_s`."""
    clk = clk or Clock.read()
    kind = _kind(entry)
    seen = age_s(entry, "seen", clk)
    if kind == "auto" and seen > AUTO_STALE_S:
        return (f"its evidence (recovery kind auto) was last seen {seen:.0f} s ago; the checks read that "
                "state again")
    if kind in CLEARED_BY_REBOOT and not entry.get("applied_at"):
        if clk.boot_id and entry.get("boot_id") == clk.boot_id:
            booted = bool(entry.get("booted"))
        else:
            booted = _booted_by_wall(entry)
        if booted:
            return f"the node has booted since its evidence was seen (recovery kind {kind}: a reboot resets the GPUs)"
    return ""


def reason_recovery(reason: str) -> str:
    """The recovery kind of the finding code a drain reason names first
    (``gpuguard: ib.port_down mlx5_0/1 ...`` -> ``auto``); ``manual`` when the reason
    names more than one finding (``(+N more)``: the others' kinds are unknown) or no
    code."""
    from gpuguard.recovery import recovery_of
    from gpuguard.slurm import REASON_PREFIX

    words = reason[len(REASON_PREFIX):].split() if reason.startswith(REASON_PREFIX) else []
    if not words or "." not in words[0] or "(+" in reason:
        return "manual"
    return recovery_of(words[0])[0]


def decision_recovery(decision: Any) -> str:
    """The recovery kind of a :class:`gpuguard.policy.Decision` to drain: the most
    demanding kind among its findings whose action is ``drain``
    (:func:`gpuguard.recovery.recovery_of_findings`)."""
    from gpuguard.recovery import recovery_of_findings

    return recovery_of_findings([{"code": f.code, "action": a} for f, a in getattr(decision, "actions", [])])
