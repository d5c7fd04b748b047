"""The one place gpuguard acts on Slurm: drain a node, fail a job, resume a node.

Every hook and command that changes Slurm state goes through :class:`Actuator`; the Slurm
commands themselves stay behind :mod:`gpuguard.slurm` (argument lists, never a shell), so
another backend only has to provide ``drain_node`` / ``node_reason`` / ``resume_node`` /
``fail_job``, each taking a ``timeout_s`` keyword.

Rules the actuator enforces, whoever calls it:

* **Ours only.** A drain reason always starts with :data:`gpuguard.slurm.REASON_PREFIX`
  (``gpuguard:``), and :meth:`Actuator.resume` resumes only a node whose *current* reason
  carries it: an administrator's drain is never lifted (the LBNL NHC convention; NHC issue
  #134 is the bug this prevents). :meth:`Actuator.drain` does not overwrite a drain or
  down reason someone else set either: the finding stays in the store, the admin's reason
  stays on the node.
* **Once.** One actuator acts at most once per (action, target) in its lifetime: the
  Epilog's health checks and its verdict may both ask to drain; the second ask is
  ``refused`` ("already drained by this run") instead of a second ``scontrol``.
* **Bounded.** Each Slurm command's timeout is the smaller of the backend's own timeout
  and what is left until ``deadline`` (a :func:`time.monotonic` value, the hook's
  budget); with less than :data:`MIN_CALL_S` left the action fails without a call.
* **No exceptions.** Every outcome is an :class:`ActionResult` (``done`` / ``refused`` /
  ``failed`` with the reason why); a hook never sees a Slurm error as an exception.
* **Dry run.** ``dry_run=True`` (``[slurm] drain = false``) refuses every action with
  ``why = "dry run"`` and calls nothing.

Each result is also logged once, in one wording, when a logger is given.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Literal

from gpuguard.slurm import REASON_PREFIX, SlurmCli, SlurmError

#: Smallest time (s) worth starting a Slurm command with; below this the action fails
#: with "no time left" (our choice: ``scontrol`` round trips take 10-100 ms on a healthy
#: slurmctld, and a call killed half-way tells us nothing).
MIN_CALL_S = 0.2

Status = Literal["done", "refused", "failed"]
Action = Literal["drain", "fail-job", "resume"]


@dataclass(frozen=True)
class ActionResult:
    """What one action came to.

    ``action``: ``drain`` | ``fail-job`` | ``resume``; ``target``: the node name or job
    id; ``status``: ``done`` (Slurm accepted it), ``refused`` (not attempted on purpose:
    dry run, not ours, already done by this actuator) or ``failed`` (attempted or
    impossible: a Slurm error, a timeout, no time left); ``why``: one line for the log,
    empty when done; ``reason``: the drain/fail reason given (empty for resume).
    """

    action: Action
    target: str
    status: Status
    why: str = ""
    reason: str = ""

    @property
    def done(self) -> bool:
        return self.status == "done"

    def line(self) -> str:
        """The one log line for this result."""
        verb = {"drain": "drain", "fail-job": "fail job", "resume": "resume"}[self.action]
        if self.status == "done":
            past = {"drain": "drained", "fail-job": "failed job", "resume": "resumed"}[self.action]
            extra = " (node not drained)" if self.action == "fail-job" else ""
            return f"{past} {self.target}{extra}: {self.reason}" if self.reason else f"{past} {self.target}"
        if self.why == "dry run":
            return f"dry run: would {verb} {self.target}: {self.reason}"
        if self.status == "refused":
            gerund = {"drain": "draining", "fail-job": "failing job", "resume": "resuming"}[self.action]
            return f"not {gerund} {self.target}: {self.why}"
        return f"tool error: {verb} {self.target} failed: {self.why}"


class Actuator:
    """Drain / fail-job / resume through ``slurm`` (a :class:`gpuguard.slurm.SlurmCli` or
    anything with the same methods).

    ``dry_run``: refuse everything (``[slurm] drain = false``); ``deadline``: a
    :func:`time.monotonic` instant after which no Slurm command may still run (None: only
    the backend's own timeout); ``log``: where each result is logged (done and refused at
    WARNING, failed at ERROR as a tool error).
    """

    def __init__(self, slurm: Any, *, dry_run: bool = False, deadline: float | None = None,
                 log: logging.Logger | None = None):
        self.slurm = slurm
        self.dry_run = dry_run
        self.deadline = deadline
        self.log = log
        self._done: dict[tuple[str, str], ActionResult] = {}

    @classmethod
    def from_config(cls, cfg: Any, *, deadline: float | None = None, log: logging.Logger | None = None,
                    timeout_s: float | None = None) -> Actuator:
        """The actuator a hook or command uses: ``[slurm] bin_dir``, dry run unless
        ``[slurm] drain``; ``timeout_s`` caps each command (default: the backend's 15 s)."""
        slurm = SlurmCli(cfg.get("slurm", "bin_dir"), **({"timeout_s": timeout_s} if timeout_s else {}))
        return cls(slurm, dry_run=not cfg.get("slurm", "drain"), deadline=deadline, log=log)

    # -- actions -------------------------------------------------------------------------
    def drain(self, node: str, reason: str) -> ActionResult:
        """Drain ``node`` with ``reason`` (must start with ``gpuguard:``, else ``failed``).
        A reason already on the node that is not ours is left alone (``refused``); if that
        reason cannot be read, the drain goes ahead (a dying GPU outweighs the risk)."""
        if not reason.startswith(REASON_PREFIX):
            return self._finish(ActionResult("drain", node, "failed", f"reason must start with {REASON_PREFIX!r}",
                                             reason), remember=False)
        pre = self._precheck("drain", node, reason)
        if pre is not None:
            return pre
        try:
            current = self.slurm.node_reason(node, timeout_s=self._timeout())
        except (SlurmError, _NoTime):
            current = None
        if current and not current.startswith(REASON_PREFIX):
            return self._finish(ActionResult("drain", node, "refused",
                                             f"it already carries someone else's reason {current!r}", reason))
        return self._call("drain", node, reason, lambda t: self.slurm.drain_node(node, reason, timeout_s=t))

    def fail_job(self, job_id: str, reason: str) -> ActionResult:
        """Fail ``job_id`` without draining the node: ``reason`` into its AdminComment, then
        ``scancel`` (see :meth:`gpuguard.slurm.SlurmCli.fail_job`)."""
        pre = self._precheck("fail-job", job_id, reason)
        if pre is not None:
            return pre
        return self._call("fail-job", job_id, reason, lambda t: self.slurm.fail_job(job_id, reason, timeout_s=t))

    def resume(self, node: str) -> ActionResult:
        """Resume ``node`` only when its current reason starts with ``gpuguard:``;
        ``refused`` (with the reason found) otherwise."""
        pre = self._precheck("resume", node, "")
        if pre is not None:
            return pre
        try:
            current = self.slurm.node_reason(node, timeout_s=self._timeout())
        except _NoTime:
            return self._finish(ActionResult("resume", node, "failed", "no time left in the budget"))
        except SlurmError as e:
            return self._finish(ActionResult("resume", node, "failed", str(e)))
        if not current:
            return self._finish(ActionResult("resume", node, "refused", "it has no drain/down reason"))
        if not current.startswith(REASON_PREFIX):
            return self._finish(ActionResult("resume", node, "refused", f"its reason {current!r} is not gpuguard's"))
        return self._call("resume", node, "", lambda t: self.slurm.resume_node(node, timeout_s=t))

    # -- machinery ---------------------------------------------------------------------------
    def _precheck(self, action: Action, target: str, reason: str) -> ActionResult | None:
        earlier = self._done.get((action, target))
        if earlier is not None and earlier.status == "done":
            return self._finish(ActionResult(action, target, "refused", "already done by this run", reason),
                                remember=False)
        if self.dry_run:
            return self._finish(ActionResult(action, target, "refused", "dry run", reason), remember=False)
        return None

    def _timeout(self) -> float:
        cap = float(getattr(self.slurm, "timeout_s", 15.0))
        if self.deadline is None:
            return cap
        left = self.deadline - time.monotonic()
        if left < MIN_CALL_S:
            raise _NoTime
        return min(cap, left)

    def _call(self, action: Action, target: str, reason: str, fn: Any) -> ActionResult:
        try:
            fn(self._timeout())
        except _NoTime:
            return self._finish(ActionResult(action, target, "failed", "no time left in the budget", reason))
        except (SlurmError, ValueError) as e:
            return self._finish(ActionResult(action, target, "failed", str(e), reason))
        return self._finish(ActionResult(action, target, "done", "", reason))

    def _finish(self, res: ActionResult, remember: bool = True) -> ActionResult:
        if remember:
            self._done[(res.action, res.target)] = res
        if self.log is not None:
            (self.log.error if res.status == "failed" else self.log.warning)("%s", res.line())
        return res


class _NoTime(Exception):
    """Less than :data:`MIN_CALL_S` left before the deadline."""
