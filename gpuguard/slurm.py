"""Slurm access behind one small interface.

pyslurm cannot be installed against the Slurm these machines get (PyPI carries only its
25.11 line; Debian 12 ships Slurm 22.05), so :class:`SlurmCli` drives the Slurm commands
(``scontrol``, ``sinfo``, ``sacct``, ``sacctmgr``) by absolute path with argument lists —
never a shell string — and a timeout. Another backend (pyslurm, slurmrestd) can implement
the same methods.

Hooks run with no ``PATH`` (SLURM-FACTS.md §3), hence ``bin_dir``.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass

REASON_PREFIX = "gpuguard:"


class SlurmError(Exception):
    """A Slurm command failed or timed out; ``str()`` names the command and its stderr."""


@dataclass
class NodeReason:
    """One row of ``sinfo -R -o '%E|%U|%H|%N'`` (reason, user, time, node list)."""

    reason: str
    user: str
    time: str
    nodes: str


class SlurmCli:
    """Slurm through its command-line tools.

    ``bin_dir``: directory of the Slurm commands; ``timeout_s``: per command;
    ``deadline``: a :func:`time.monotonic` instant no command may run past (a hook's
    budget), None for none.
    """

    def __init__(self, bin_dir: str = "/usr/bin", timeout_s: float = 15.0, deadline: float | None = None):
        self.bin_dir = bin_dir
        self.timeout_s = timeout_s
        self.deadline = deadline

    def run(self, tool: str, *args: str, timeout_s: float | None = None) -> str:
        """Run ``tool args...``; return stdout. The timeout is ``timeout_s`` (default: the
        instance's), capped by what is left until ``deadline`` (a :func:`time.monotonic`
        instant: the caller's time budget). Raises :class:`SlurmError`, also when less
        than 0.2 s is left."""
        limit = timeout_s or self.timeout_s
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left < 0.2:
                raise SlurmError(f"{tool} {' '.join(args[:3])}: not run: no time left in the budget")
            limit = min(limit, left)
        exe = os.path.join(self.bin_dir, tool)
        cmd = [exe, *args]
        env = dict(os.environ)
        env.setdefault("PATH", f"{self.bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin")
        # Every time the parsers read is YYYY-MM-DDTHH:MM:SS; an operator's SLURM_TIME_FORMAT
        # (``relative``: "Tomorr 12:00", or any strftime format) would turn them into text
        # no parser can place in a year. "standard" is Slurm's default (src/common/parse_time.c,
        # slurm_make_time_str: %FT%T).
        env["SLURM_TIME_FORMAT"] = "standard"
        try:
            # job names, comments and paths in Slurm's output are the users' bytes: one that
            # is not UTF-8 (a Latin-1 terminal) must not fail the whole sacct/scontrol call
            p = subprocess.run(cmd, capture_output=True, text=True, encoding="utf-8", errors="replace",
                               timeout=limit, env=env, stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            raise SlurmError(f"{exe}: not found (set [slurm] bin_dir)") from None
        except (OSError, ValueError) as e:  # e.g. an argument with a NUL byte
            raise SlurmError(f"{tool} {' '.join(args[:3])}: cannot run: {e}") from None
        except subprocess.TimeoutExpired:
            raise SlurmError(f"{tool} {' '.join(args[:3])}: timed out after {limit:g} s") from None
        if p.returncode != 0:
            msg = (p.stderr or p.stdout).strip().splitlines()
            raise SlurmError(f"{tool} {' '.join(args[:3])}: exit {p.returncode}: {msg[-1] if msg else ''}")
        return p.stdout

    # -- nodes ----------------------------------------------------------------------
    # The raw commands. Hooks and CLI commands act through gpuguard.actuator.Actuator,
    # which adds the ``gpuguard:`` ownership rules, the time budget and typed results.
    def drain_node(self, node: str, reason: str, *, timeout_s: float | None = None) -> None:
        """``scontrol update nodename=NODE state=drain reason=REASON``. The reason must
        start with :data:`REASON_PREFIX` (raises ValueError otherwise) so that a resume can
        tell our drains from everyone else's (the LBNL NHC convention)."""
        if not reason.startswith(REASON_PREFIX):
            raise ValueError(f"drain reason must start with {REASON_PREFIX!r}")
        self.run("scontrol", "update", f"nodename={node}", "state=drain", f"reason={reason}", timeout_s=timeout_s)

    def node_reasons(self, *, timeout_s: float | None = None) -> list[NodeReason]:
        """Full drain/down reasons. Plain ``sinfo -R`` cuts them at 20 characters
        (SLURM-FACTS §6b), so the format is given explicitly."""
        out = self.run("sinfo", "-h", "-R", "-o", "%E|%U|%H|%N", timeout_s=timeout_s)
        rows = []
        for line in out.splitlines():
            parts = line.rsplit("|", 3)
            if len(parts) == 4:
                rows.append(NodeReason(*parts))
        return rows

    def node_reason(self, node: str, *, timeout_s: float | None = None) -> str | None:
        """The reason set on ``node`` (``scontrol show node -o``), or None."""
        out = self.run("scontrol", "show", "node", node, "-o", timeout_s=timeout_s)
        for tok in scontrol_fields(out):
            if tok[0] == "Reason":
                return tok[1] or None
        return None

    def resume_node(self, node: str, *, timeout_s: float | None = None) -> None:
        """``scontrol update nodename=NODE state=resume``, unconditionally. Callers go
        through :meth:`gpuguard.actuator.Actuator.resume`, which first checks that the
        node's current reason is gpuguard's."""
        self.run("scontrol", "update", f"nodename={node}", "state=resume", timeout_s=timeout_s)

    # -- jobs -----------------------------------------------------------------------
    def show_job(self, job_id: str, *, timeout_s: float | None = None) -> dict[str, str]:
        """``scontrol show job -o JOBID`` as a field dict (``JobName``, ``Comment``, ...)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id), timeout_s=timeout_s)
        return dict(scontrol_fields(out))

    def fail_job(self, job_id: str, reason: str, *, timeout_s: float | None = None) -> None:
        """Fail a job from the Prolog *without* draining the node: note ``reason`` in the
        job's AdminComment (``scontrol`` may still update a job that has not finished:
        SLURM-FACTS §6c) and cancel it. A non-zero Prolog exit cannot do this in Slurm
        22.05: any Prolog failure drains the node with "Prolog error" (SLURM-FACTS §5).
        The cancel is attempted even when the comment fails; raises :class:`SlurmError`
        for the first failure."""
        try:
            self.run("scontrol", "update", f"job={job_id}", f"AdminComment={reason}", timeout_s=timeout_s)
        finally:
            self.run("scancel", str(job_id), timeout_s=timeout_s)

    def set_admin_comment(self, job_id: str, text: str) -> None:
        """Store ``text`` in the job's AdminComment through slurmdbd: ``scontrol`` refuses
        finished jobs (SLURM-FACTS §6c), ``sacctmgr modify job`` works from
        EpilogSlurmctld. slurmdbd cuts values at 65,535 bytes silently; so do we, loudly."""
        data = text.encode()
        if len(data) > 65535:
            raise ValueError(f"AdminComment is {len(data)} bytes; slurmdbd keeps at most 65535")
        self.run("sacctmgr", "-i", "modify", "job", "where", f"jobid={job_id}", "set", f"AdminComment={text}")

    # -- accounting -------------------------------------------------------------------
    def sacct(self, *, fields: tuple[str, ...] | list[str], start: str | None = None, end: str | None = None,
              all_users: bool = True, allocations_only: bool = True, delimiter: str = "|",
              timeout_s: float | None = None, duplicates: bool = False) -> str:
        """``sacct [-a] [-X] [-D] -P -n --delimiter=D --format=F1,F2,... [-S start] [-E end]``;
        returns its stdout: one job per line, ``fields`` in order, no header. ``start``/
        ``end`` are sacct time specs (``YYYY-MM-DDTHH:MM:SS`` in sacct's local zone).
        Without ``-s`` sacct returns the jobs eligible or running in the window (sacct
        man page, ``--starttime``). ``duplicates``: ``-D``, every attempt of a requeued job
        (without it sacct prints only the last). Raises :class:`SlurmError`."""
        args = ["-P", "-n", f"--delimiter={delimiter}", f"--format={','.join(fields)}"]
        if duplicates:
            args.insert(0, "-D")
        if all_users:
            args.insert(0, "-a")
        if allocations_only:
            args.insert(0, "-X")
        if start:
            args += ["-S", start]
        if end:
            args += ["-E", end]
        return self.run("sacct", *args, timeout_s=timeout_s)


def scontrol_fields(text: str) -> list[tuple[str, str]]:
    """Split one-line ``scontrol show -o`` output into (key, value) pairs. Values may
    contain spaces (``Reason=gpuguard: xid.79 ...``), so a token without ``=`` is glued
    to the previous value."""
    pairs: list[tuple[str, str]] = []
    for tok in text.strip().split(" "):
        if "=" in tok and tok.split("=", 1)[0].replace("_", "").replace(":", "").isalnum():
            k, v = tok.split("=", 1)
            pairs.append((k, v))
        elif pairs:
            k, v = pairs[-1]
            pairs[-1] = (k, f"{v} {tok}")
    return pairs
