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
import re
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
        """The reason set on ``node`` as Slurm shows it (``REASON [user@time]``), or None;
        read by :func:`node_line`, so no text in it or in the node's comment is cut or
        forges it."""
        out = self.run("scontrol", "show", "node", node, "-o", timeout_s=timeout_s)
        line = node_line(out)
        if line.reason is None:
            return None
        return f"{line.reason} [{line.stamp}]" if line.stamp else line.reason

    def resume_node(self, node: str, *, timeout_s: float | None = None) -> None:
        """``scontrol update nodename=NODE state=resume``, unconditionally. Callers go
        through :meth:`gpuguard.actuator.Actuator.resume`, which first checks that the
        node's current reason is gpuguard's."""
        self.run("scontrol", "update", f"nodename={node}", "state=resume", timeout_s=timeout_s)

    # -- jobs -----------------------------------------------------------------------
    def show_job(self, job_id: str, *, timeout_s: float | None = None) -> dict[str, str]:
        """The job's ``Partition``, ``NumNodes``, ``TresPerNode``, ``Comment`` and ``JobName``
        (the names ``scontrol show job`` gives them), each read so that user text cannot
        forge another: a dict of those present (Slurm's ``(null)``/``N/A`` = absent).

        Not ``scontrol show job -o``: it prints user text (JobName, Comment, WorkDir,
        Command, StdOut...) unescaped between ``Key=value`` pairs, so a job named
        ``x Comment=gpuguard:template=victim`` carried a second Comment, and with several
        user fields no reading of that line is unambiguous (tests/data/scontrol/). Not
        ``squeue --json``: 22.05 ignores ``-j`` there and dumps every job. So two
        ``squeue -h -j JOBID -o`` calls, each with at most one user field, placed last:
        ``%P|%D|%b|%k`` (partition and gres names are the admin's and hold no ``|``; the
        comment is the rest of the output) and ``%j`` (the whole output: a name may hold
        ``|`` and newlines). Raises :class:`SlurmError`."""
        job = str(job_id)
        head = _one_value(self.run("squeue", "-h", "-j", job, "-o", "%P|%D|%b|%k", timeout_s=timeout_s))
        name = _one_value(self.run("squeue", "-h", "-j", job, "-o", "%j", timeout_s=timeout_s))
        parts = head.split("|", 3)
        if len(parts) != 4:
            raise SlurmError(f"squeue -j {job}: expected PARTITION|NODES|TRES|COMMENT, got {head[:200]!r}")
        fields = dict(zip(("Partition", "NumNodes", "TresPerNode", "Comment"), parts, strict=True))
        fields["JobName"] = name
        return {k: v for k, v in fields.items() if v not in ("", "(null)", "N/A")}

    def job_name(self, job_id: str, *, timeout_s: float | None = None) -> str | None:
        """The job's name as slurmdbd keeps it, for a job that has ended (slurmctld forgets
        it ``MinJobAge``, 300 s by default, after the end): ``sacct -X -n -P -j JOB
        --format=JobIDRaw,JobName`` (without ``-S``, ``-j`` searches from the epoch: sacct
        man page, ``--starttime``). The name is user text and may hold ``|`` or newlines: it
        is the text after ``JOB|`` up to the next line that starts with another component's
        ``ID|`` (a het job lists each component), final newline dropped. None when sacct has
        no such job or the name is empty. Raises :class:`SlurmError`."""
        job = str(job_id)
        out = self.run("sacct", "-X", "-n", "-P", "-j", job, "--format=JobIDRaw,JobName", timeout_s=timeout_s)
        m = re.search(rf"(?:\A|\n){re.escape(job)}\|(.*?)(?=\n\d+\||\n?\Z)", out, re.S)
        return (m.group(1) or None) if m else None

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


def _one_value(out: str) -> str:
    """A one-job ``squeue -h -o`` output without its final newline (only that one: a
    value's own newlines are kept)."""
    return out[:-1] if out.endswith("\n") else out


#: The free-text fields that close ``scontrol show node -o`` in Slurm 22.05, in print
#: order (measured on the testbed: tests/data/scontrol/show_node_hostile_reason.txt).
#: A drain reason holds user text (gpuguard's name the process: ``name=python``), Comment
#: and Extra the admin's; every field before them is Slurm's own.
_NODE_TEXT_KEYS = (" Reason=", " Comment=", " Extra=")
#: The ``[user@time]`` stamp Slurm appends to a reason it stores (``reason_uid``/``reason_time``).
_REASON_STAMP = re.compile(r" \[(?P<stamp>[^\]\s@]+@\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)\](?= Comment=| Extra=|$)")


@dataclass(frozen=True)
class NodeLine:
    """One ``scontrol show node -o`` line: ``fields`` the Slurm-written ``Key=value`` pairs
    before the free text (``NodeName``, ``State``, ...), ``reason`` without its stamp and
    ``stamp`` (``user@YYYY-MM-DDTHH:MM:SS``), each None when absent."""

    fields: dict[str, str]
    reason: str | None
    stamp: str | None


def node_line(text: str) -> NodeLine:
    """Read one ``scontrol show node -o`` line so that no text in a reason, node comment
    or extra can set another field: the ``Key=value`` pairs are read only before the
    first free-text field (:data:`_NODE_TEXT_KEYS`), and the reason runs to its stamp,
    the last one that ends the line or precedes `` Comment=``/`` Extra=`` (a reason that
    forges a stamp and ``Comment=`` is still the reason). Without a stamp the reason ends
    at the first `` Comment=``/`` Extra=``."""
    text = text.strip()
    cuts = [i for i in (text.find(k) for k in _NODE_TEXT_KEYS) if i >= 0]
    head = text[:min(cuts)] if cuts else text
    fields = dict(scontrol_fields(head))
    start = text.find(" Reason=")
    if start < 0 or start != min(cuts):
        return NodeLine(fields, None, None)
    rest = text[start + len(" Reason="):]
    stamps = list(_REASON_STAMP.finditer(rest))
    if stamps:
        m = stamps[-1]
        return NodeLine(fields, rest[:m.start()].strip() or None, m.group("stamp"))
    ends = [i for i in (rest.find(" Comment="), rest.find(" Extra=")) if i >= 0]
    return NodeLine(fields, rest[:min(ends)] if ends else rest or None, None)


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
