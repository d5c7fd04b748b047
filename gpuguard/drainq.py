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
reason and counts the repeats). A node that carries someone else's drain reason (an
administrator's) is left alone and the entry stays, so the fault is acted on once the
node is resumed. Entries older than :data:`MAX_AGE_S` are dropped with an error: by
then a human has looked at the node.

This module wraps the one drain implementation, :class:`gpuguard.actuator.Actuator`
(ownership rules, dry run, budget-capped ``scontrol`` calls); it adds only the durable
list and the confirmation, read through the actuator's backend (``node_reason``). Every
call's timeout is capped by what is left before the actuator's ``deadline`` (a
:func:`time.monotonic` value: the hook's budget).
"""

from __future__ import annotations

import logging
import time
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
#: At most this many nodes pending (one per slurmd on this host; more is not ours).
MAX_ENTRIES = 64
#: Share of the time left that retrying earlier drains may take, so a slurmctld that
#: hangs cannot eat the budget the run's own checks need (our choice).
RETRY_SHARE = 0.5
#: Reasons Slurm itself sets when a hook exits non-zero (SLURM-FACTS.md §5): the node is
#: drained because of our own Prolog/Epilog exit, so a pending drain counts as done.
SLURM_HOOK_REASONS = ("Prolog error", "Epilog error")


@dataclass
class Outcome:
    """What happened to one node's drain: ``status`` ``confirmed`` (the node shows a
    gpuguard reason, or was drained by Slurm for our hook's exit, or was resumed after a
    drain of ours that Slurm had accepted), ``applied`` (``scontrol`` accepted it but the
    node could not be read back yet: kept, never re-drained after a resume), ``pending``
    (kept for the next run, ``why`` says why), ``refused`` (someone else's reason is on
    the node; kept) or ``dry-run``."""

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
        """``node -> {"reason", "since", "attempts", "repeats", "last_error"}``."""
        value, _ = durable.read(self.dirs, FILE)
        return value if isinstance(value, dict) else {}

    def _save(self, entries: dict[str, dict[str, Any]]) -> bool:
        try:
            durable.write(self.dirs, FILE, entries)
            return True
        except OSError as e:
            self.log.error("tool error: pending drains: cannot write %s in %s: %s", FILE, self.dirs, e)
            return False

    def add(self, node: str, reason: str) -> bool:
        """Record a drain decision. Returns False when no copy could be written."""
        entries = self.entries()
        if node in entries:
            entries[node]["repeats"] = int(entries[node].get("repeats", 0)) + 1
        else:
            if len(entries) >= MAX_ENTRIES:
                oldest = min(entries, key=lambda n: entries[n].get("since", 0))
                entries.pop(oldest)
            entries[node] = {"reason": reason, "since": time.time(), "attempts": 0, "repeats": 0,
                             "last_error": ""}
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

    def drain(self, node: str, reason: str) -> Outcome:
        """Record the decision (if not already pending), drain, confirm, and remove the
        entry when confirmed. Never raises; logs the outcome."""
        if self.dry_run:
            self.log.warning("dry run: would drain %s: %s", node, reason)
            return Outcome(node, reason, "dry-run")
        if not self.add(node, reason):
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
        for node in sorted(entries, key=lambda n: entries[n].get("since", 0)):
            e = entries[node]
            if time.time() - float(e.get("since", 0)) > MAX_AGE_S:
                self.log.error("tool error: pending drain of %s dropped after %.0f days unconfirmed: %s",
                               node, MAX_AGE_S / 86400, e.get("reason"))
                self._forget(node)
                continue
            out.append(self._settle(node, e))
        return out

    def _settle(self, node: str, entry: dict[str, Any]) -> Outcome:
        reason = str(entry.get("reason", ""))
        res = self._drain_one(node, reason, applied=bool(entry.get("applied_at")))
        if res.status == "confirmed":
            self.log.info("drain of %s confirmed: %s", node, res.why or "the node shows a gpuguard reason")
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
