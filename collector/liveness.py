"""Whether the job still runs on this node, for the collector's exit decision: the job's
cgroup, its user's processes, then its state from ``squeue`` (the order and the grace periods
are in the module docstring of :mod:`gpuguard.collector.run`, which re-exports these).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable

from gpuguard.collector.host import HostSampler

#: ``scontrol show job`` states in which the job still holds the node (slurm/slurm.h
#: ``job_states`` and state flags as scontrol prints them).
ALIVE_STATES = {"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "PENDING", "REQUEUED",
                "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED"}


def scontrol_job_state(scontrol: str, job_id: str, timeout_s: float = 5.0) -> str | None:
    """The job's state (``RUNNING``, ``COMPLETING``, ``CANCELLED``...) from
    ``squeue -h -t all -j N -o %T``, run from the directory of ``scontrol`` (the
    ``[slurm] bin_dir`` the collector was given); ``"UNKNOWN_JOB"`` when slurmctld no longer
    knows the job (``Invalid job id`` on stderr); ``None`` when it cannot answer (missing,
    slurmctld down, timeout).

    Not ``scontrol show job -o``: it prints the job name unescaped before ``JobState=``,
    so a job named ``x JobState=COMPLETED`` read as finished and its collector stopped
    (tests/data/scontrol/). ``%T`` alone is one Slurm-written word; ``-t all`` keeps
    finished jobs still in slurmctld's memory (without it squeue prints nothing for them)."""
    squeue = os.path.join(os.path.dirname(scontrol), "squeue")
    try:
        # errors="replace": output that is not UTF-8 must not crash the collector
        p = subprocess.run([squeue, "-h", "-t", "all", "-j", job_id, "-o", "%T"], capture_output=True, text=True,
                           encoding="utf-8", errors="replace", timeout=timeout_s, stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if "Invalid job id" in p.stderr:
        return "UNKNOWN_JOB"
    state = p.stdout.strip()
    return state if p.returncode == 0 and len(state.split()) == 1 else None


class JobLiveness:
    """Decides whether the job still runs on this node (the evidence and its order: the
    module docstring of :mod:`gpuguard.collector.run`).

    ``check()`` -> ``(alive, why)``. ``scontrol``: path to scontrol or ``None`` (skip).
    ``clock``: monotonic seconds (tests inject one).
    """

    def __init__(self, host: HostSampler, *, job_id: str, scontrol: str | None,
                 startup_grace_s: float = 120.0, scontrol_every_s: float = 30.0,
                 no_evidence_s: float = 600.0, clock: Callable[[], float] = time.monotonic,
                 state_fn: Callable[[str, str], str | None] = scontrol_job_state):
        self.host = host
        self.job_id = job_id
        self.scontrol = scontrol
        self.startup_grace_s = startup_grace_s
        self.scontrol_every_s = scontrol_every_s
        self.clock = clock
        self.state_fn = state_fn
        self.no_evidence_s = max(no_evidence_s, startup_grace_s)
        self.started = clock()
        self.last_evidence = self.started
        self.seen_procs = False
        self.empty_checks = 0
        self._next_scontrol = self.started

    def check(self) -> tuple[bool, str]:
        now = self.clock()
        cg = self.host.cgroup_exists() if self.host.discover() else None
        if cg is True:
            self.last_evidence = now
            return True, "job cgroup present"
        if cg is False:
            return False, "job cgroup removed"
        in_grace = now - self.started < self.startup_grace_s
        if self.host.procs is not None:
            n = len(self.host.procs.pids())
            if n:
                self.seen_procs = True
                self.empty_checks = 0
                self.last_evidence = now
            else:
                self.empty_checks += 1
                if (self.seen_procs or not in_grace) and self.empty_checks >= 2:
                    return False, f"no process of uid {self.host.uid} left"
        if self.scontrol and now >= self._next_scontrol and not in_grace:
            self._next_scontrol = now + self.scontrol_every_s
            state = self.state_fn(self.scontrol, self.job_id)
            if state is not None and state.split("+")[0] not in ALIVE_STATES:
                return False, f"scontrol: JobState={state}"
            if state is not None:
                self.last_evidence = now
        if now - self.last_evidence > self.no_evidence_s:
            # no cgroup, no uid to look for, scontrol silent: a collector that cannot tell
            # must not linger for weeks
            return False, f"no sign of the job for {now - self.last_evidence:.0f} s"
        return True, "no evidence the job ended"
