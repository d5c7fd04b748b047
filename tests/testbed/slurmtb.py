"""Helpers for integration tests against the testbed from ``tests/testbed/testbed.sh``.

Every Slurm command is run with an argument list (never a shell string) and a minimal,
explicit environment (PATH + SLURM_CONF), so the tests are hermetic.

    from testbed import slurmtb            # or: import slurmtb
    tb = slurmtb.Testbed()                 # TESTBED env var or /tmp/gpuguard-testbed
    jid = tb.submit("#!/bin/bash\\necho hi\\n", user="gg_alice", gres="gpu:2")
    rec = tb.wait_job(jid)                 # {'State': 'COMPLETED', 'ExitCode': '0:0', ...}
    tb.job_output(jid)                     # contents of $TESTBED/jobs/<jid>.out

Module-level functions (``slurmtb.submit(...)`` etc.) use a default ``Testbed()``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTBED_SH = HERE / "testbed.sh"
DEFAULT_TESTBED = "/tmp/gpuguard-testbed"
PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
RUNUSER = "/usr/sbin/runuser"

TEST_USERS = ("gg_alice", "gg_bob", "gg_carol")
ACCOUNTS = {"gg_alice": ("acct_a", "acct_b"), "gg_bob": ("acct_b",), "gg_carol": ("acct_c",)}
NODES = ("n1", "n2")
GPUS_PER_NODE = 4

# sacct -X -P fields returned by sacct_job()/wait_job()
SACCT_FIELDS = (
    "JobIDRaw",
    "JobName",
    "Account",
    "User",
    "Partition",
    "State",
    "ExitCode",
    "DerivedExitCode",
    "Reason",
    "Submit",
    "Start",
    "End",
    "Elapsed",
    "AllocTRES",
    "ReqTRES",
    "NNodes",
    "NodeList",
    "Comment",
    "AdminComment",
)
ACTIVE_STATES = (
    "PENDING",
    "RUNNING",
    "REQUEUED",
    "SUSPENDED",
    "COMPLETING",
    "CONFIGURING",
    "RESIZING",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
)


HELD_RE = re.compile(r"held|Held")


class SlurmError(RuntimeError):
    pass


class JobHeld(SlurmError):
    """wait_job(): the job is held (e.g. launch_failed_requeued_held) and will not finish."""


@dataclass
class Drain:
    """One line of ``sinfo -R -o '%E|%U|%H|%N'``, with the node list expanded."""

    reason: str
    user: str  # e.g. 'root(0)' or 'slurm(64030)'
    timestamp: str  # e.g. '2026-11-30T03:40:01'
    nodes: list[str]


class Testbed:
    def __init__(self, testbed: str | os.PathLike | None = None):
        self.root = Path(testbed or os.environ.get("TESTBED") or DEFAULT_TESTBED)
        self.etc = self.root / "etc"
        self.slurm_conf = self.etc / "slurm.conf"
        self.gpuguard_toml = self.etc / "gpuguard.toml"
        self.jobs_dir = self.root / "jobs"
        self.log_dir = self.root / "log"
        self.dev_dir = self.root / "dev"

    # ------------------------------------------------------------------ plumbing
    @property
    def env(self) -> dict[str, str]:
        return {"PATH": PATH, "SLURM_CONF": str(self.slurm_conf), "LANG": "C.UTF-8"}

    def run(
        self,
        args: list[str],
        *,
        user: str | None = None,
        check: bool = True,
        timeout: float = 60,
        input: str | None = None,
    ) -> subprocess.CompletedProcess:
        """Run a command (argument list) with the testbed env, optionally as ``user``."""
        argv = [str(a) for a in args]
        if user and user != "root":
            argv = [RUNUSER, "-u", user, "--", *argv]
        cp = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout, input=input, cwd="/")
        if check and cp.returncode != 0:
            raise SlurmError(f"{argv!r} exited {cp.returncode}\nstdout: {cp.stdout}\nstderr: {cp.stderr}")
        return cp

    def testbed_sh(self, *args: str, timeout: float = 600, extra_env: dict | None = None):
        env = dict(os.environ, TESTBED=str(self.root), **(extra_env or {}))
        return subprocess.run(
            ["bash", str(TESTBED_SH), *args], env=env, capture_output=True, text=True, timeout=timeout
        )

    # ------------------------------------------------------------------ jobs
    def submit(
        self,
        script: str | None = None,
        *,
        user: str = "gg_alice",
        wrap: str | None = None,
        account: str | None = None,
        gres: str | None = None,
        nodes: int | None = None,
        nodelist: str | None = None,
        ntasks: int | None = None,
        comment: str | None = None,
        job_name: str | None = None,
        time_limit: str | None = None,
        output: str | None = None,
        error: str | None = None,
        export: str = "NONE",
        extra: list[str] | tuple = (),
    ) -> int:
        """sbatch as ``user`` with --export=NONE; returns the job id.

        Give either ``script`` (file content; written to $TESTBED/jobs) or ``wrap`` (a command
        line for ``--wrap``). Output goes to $TESTBED/jobs/<jobid>.out unless ``output`` is set.
        Note: with --export=NONE, ``srun`` inside the batch script also runs with
        SLURM_EXPORT_ENV=NONE; use ``srun --export=ALL`` there to pass the script's variables.
        """
        if (script is None) == (wrap is None):
            raise ValueError("give exactly one of script= or wrap=")
        args = [
            "sbatch",
            "--parsable",
            f"--export={export}",
            f"--chdir={self.jobs_dir}",
            f"--output={output or self.jobs_dir / '%j.out'}",
        ]
        if error:
            args.append(f"--error={error}")
        for flag, val in (
            ("--account", account),
            ("--gres", gres),
            ("--nodes", nodes),
            ("--nodelist", nodelist),
            ("--ntasks", ntasks),
            ("--comment", comment),
            ("--job-name", job_name),
            ("--time", time_limit),
        ):
            if val is not None:
                args.append(f"{flag}={val}")
        args.extend(extra)
        if wrap is not None:
            args.append(f"--wrap={wrap}")
        else:
            path = self.jobs_dir / f"script-{uuid.uuid4().hex[:12]}.sh"
            path.write_text(script)
            path.chmod(0o755)
            args.append(str(path))
        out = self.run(args, user=user).stdout.strip()
        return int(out.split(";")[0])

    def squeue_state(self, jobid: int) -> str | None:
        """squeue state of the job, or None once it has left the queue."""
        st = self.squeue_state_reason(jobid)
        return st[0] if st else None

    def squeue_state_reason(self, jobid: int) -> tuple[str, str] | None:
        """(state, reason) from squeue, e.g. ('PENDING', 'launch_failed_requeued_held');
        None once the job has left the queue."""
        cp = self.run(["squeue", "-h", "-j", str(jobid), "-o", "%T|%r"], check=False)
        out = cp.stdout.strip()
        if not out:
            return None
        state, _, reason = out.partition("|")
        return state, reason

    def sacct_job(self, jobid: int, fields=SACCT_FIELDS) -> dict[str, str] | None:
        """The job's allocation line from ``sacct -X -P`` as a dict, or None if not recorded yet.

        After a requeue sacct keeps several records for one id; the last one is returned.
        """
        cp = self.run(["sacct", "-X", "-P", "-n", "-D", "-j", str(jobid), "-o", ",".join(fields)])
        lines = [ln for ln in cp.stdout.splitlines() if ln.strip()]
        if not lines:
            return None
        return dict(zip(fields, lines[-1].split("|", len(fields) - 1), strict=False))

    def sacct_steps(self, jobid: int, fields=("JobID", "State", "ExitCode", "NodeList")) -> list[dict]:
        cp = self.run(["sacct", "-P", "-n", "-j", str(jobid), "-o", ",".join(fields)])
        return [
            dict(zip(fields, ln.split("|", len(fields) - 1), strict=False))
            for ln in cp.stdout.splitlines()
            if ln.strip()
        ]

    def wait_job(
        self, jobid: int, timeout: float = 120, poll: float = 0.2, fail_if_held: bool = True
    ) -> dict[str, str]:
        """Wait until the job has left squeue (so all epilogs have run) and sacct shows a final
        state; return the sacct record. Raises TimeoutError (with the job's details) if not.

        A job that is held (e.g. requeued+held after a Prolog failure, which drains the node)
        never finishes by itself: with ``fail_if_held`` it raises JobHeld at once instead of
        waiting out the timeout."""
        deadline = time.monotonic() + timeout
        while (st := self.squeue_state_reason(jobid)) is not None:
            if fail_if_held and st[0] == "PENDING" and HELD_RE.search(st[1]):
                raise JobHeld(f"job {jobid} is held ({st[1]}); drains: {self.drains()}\n" + self.show_job_text(jobid))
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {jobid} still in squeue after {timeout}s:\n" + self.show_job_text(jobid))
            time.sleep(poll)
        rec = None
        while True:
            rec = self.sacct_job(jobid)
            if rec and rec["State"].split()[0] not in ACTIVE_STATES:
                return rec
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {jobid}: sacct still shows {rec} after {timeout}s")
            time.sleep(poll)

    def wait_state(self, jobid: int, states: tuple[str, ...] | str, timeout: float = 60, poll: float = 0.2) -> str:
        """Wait until squeue shows one of ``states`` (e.g. 'RUNNING'); returns it."""
        states = (states,) if isinstance(states, str) else tuple(states)
        deadline = time.monotonic() + timeout
        while True:
            st = self.squeue_state(jobid)
            if st in states:
                return st
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {jobid} is {st}, not {states}, after {timeout}s")
            time.sleep(poll)

    def show_job(self, jobid: int) -> dict[str, str]:
        """``scontrol show job -o`` as a dict (only while slurmctld still knows the job)."""
        out = self.run(["scontrol", "-o", "show", "job", str(jobid)]).stdout.strip()
        result: dict[str, str] = {}
        key = None
        for tok in out.split(" "):
            if "=" in tok and not tok.startswith("="):
                key, _, val = tok.partition("=")
                result[key] = val
            elif key:  # value with spaces, e.g. Reason or Comment
                result[key] += " " + tok
        return result

    def show_job_text(self, jobid: int) -> str:
        return self.run(["scontrol", "show", "job", str(jobid)], check=False).stdout

    def job_output(self, jobid: int) -> str:
        p = self.jobs_dir / f"{jobid}.out"
        return p.read_text() if p.exists() else ""

    def cancel(self, jobid: int) -> None:
        self.run(["scancel", str(jobid)], check=False)

    def release_requeued(self, jobid: int) -> None:
        """Release a job requeued+held after a Prolog failure and make it eligible now
        (otherwise it waits ~2 min with reason BeginTime)."""
        self.run(["scontrol", "release", str(jobid)])
        self.run(["scontrol", "update", f"JobId={jobid}", "StartTime=now"])

    # ------------------------------------------------------------------ nodes
    def drains(self) -> list[Drain]:
        """``sinfo -R -o '%E|%U|%H|%N'`` (full reason, not cut at 20 chars)."""
        out = self.run(["sinfo", "-h", "-R", "-o", "%E|%U|%H|%N"]).stdout
        result = []
        for ln in out.splitlines():
            if not ln.strip():
                continue
            reason, user, ts, nodelist = ln.rsplit("|", 3)
            result.append(Drain(reason, user, ts, self.hostnames(nodelist)))
        return result

    def drain_reason(self, node: str) -> str | None:
        for d in self.drains():
            if node in d.nodes:
                return d.reason
        return None

    def hostnames(self, nodelist: str) -> list[str]:
        return self.run(["scontrol", "show", "hostnames", nodelist]).stdout.split()

    def node_state(self, node: str) -> str:
        """Long state, e.g. 'idle', 'mixed', 'drained', 'idle*', 'completing'."""
        return self.run(["sinfo", "-h", "-N", "-n", node, "-o", "%T"]).stdout.strip()

    def node_states(self) -> dict[str, str]:
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"]).stdout
        return dict(ln.split(None, 1) for ln in out.splitlines() if ln.strip())

    def drain_node(self, node: str, reason: str) -> None:
        self.run(["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"])

    def resume_node(self, node: str, wait: bool = True, timeout: float = 30) -> None:
        """Resume a drained/down node and (by default) wait until it is plain 'idle'/'mixed'."""
        self.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], check=False)
        if wait:
            self.wait_node(node, ("idle", "mixed", "allocated"), timeout)

    def wait_node(self, node: str, states=("idle",), timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while True:
            st = self.node_state(node)
            if st in states:
                return st
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {node} is {st!r}, not {states}, after {timeout}s")
            time.sleep(0.2)

    # ------------------------------------------------------------------ housekeeping
    def reset(self, timeout: float = 60) -> None:
        """Between tests: cancel every job, wait for the queue to empty, resume every node
        that is not idle, and wait until all nodes are idle."""
        ids = self.run(["squeue", "-h", "-o", "%i"]).stdout.split()
        if ids:
            self.run(["scancel", *ids], check=False)
        deadline = time.monotonic() + timeout
        while self.run(["squeue", "-h", "-o", "%i"]).stdout.strip():
            if time.monotonic() > deadline:
                raise TimeoutError("queue did not empty: " + self.run(["squeue"], check=False).stdout)
            time.sleep(0.2)
        for node, st in self.node_states().items():
            if st != "idle":
                self.resume_node(node, wait=False)
        for node in NODES:
            self.wait_node(node, ("idle",), max(1.0, deadline - time.monotonic()))

    def gpuguard_config_text(self, root: Path, *, store: str | None = None, cluster_store: str | None = None,
                      extra: str = "") -> str:
        """gpuguard.toml for the testbed: per node ``{root}/{node}/`` holds the replay GPU
        snapshot ``gpus.json``, the kernel log ``kern.log``, the store (unless ``store``
        names one shared file), state and job dirs; the spool and the log are shared; the
        cluster store (the job judge's, written by EpilogSlurmctld's worker as SlurmUser)
        is ``{root}/cluster/cluster.db`` unless ``cluster_store`` names another.
        ``extra`` adds further sections ([verdict], [reports], ...)."""
        cluster_store = f"{root}/cluster/cluster.db" if cluster_store is None else cluster_store
        return f"""
[paths]
store = "{store or f'{root}/{{node}}/node.db'}"
cluster_store = "{cluster_store}"
state_dir = "{root}/{{node}}/state"
run_dir = "{root}/{{node}}/run"
job_dir_root = "{root}/{{node}}/jobs"
spool_dir = "{root}/spool"
log_file = "{root}/gpuguard.log"
[gpu]
source = "replay"
replay_path = "{root}/{{node}}/gpus.json"
[xid]
kernel_log = "{root}/{{node}}/kern.log"
kernel_log_kernel_only = true
[collector]
interval_s = 1.0
flush_s = 2.0
[epilog]
slurmctld_wait_s = 10.0
""" + extra

    def install_gpuguard(self, root: Path, gpus_json: str, **toml) -> None:
        """Start ``root`` afresh (a replay snapshot ``gpus_json`` and an empty kernel log
        per node, the spool and the cluster store's directory, owned by SlurmUser) and install :meth:`gpuguard_config_text` (keywords pass through).
        Without a replay config the Prolog would, rightly, drain the fake-GPU nodes."""
        subprocess.run(["rm", "-rf", "--", str(root)], check=True)
        for node in NODES:
            d = root / node
            d.mkdir(parents=True)
            (d / "kern.log").write_text("")
            (d / "gpus.json").write_text(gpus_json)
        (root / "spool").mkdir()
        (root / "cluster").mkdir()
        (root / "gpuguard.log").touch()
        root.chmod(0o755)
        # the controller's worker runs as SlurmUser: it writes the cluster store, adds its
        # manifest to the spool, removes judged jobs and logs (root writes anyway)
        for p in (root / "spool", root / "cluster", root / "gpuguard.log"):
            shutil.chown(p, "slurm", "slurm")
        self.write_toml(self.gpuguard_config_text(root, **toml))

    def write_toml(self, text: str) -> None:
        """Replace gpuguard.toml next to slurm.conf (hooks read it per run: no restart)."""
        tmp = self.gpuguard_toml.with_suffix(".toml.tmp")
        tmp.write_text(text)
        tmp.chmod(0o644)
        tmp.replace(self.gpuguard_toml)

    def log_tail(self, name: str = "slurmctld", lines: int = 50) -> str:
        p = self.log_dir / f"{name}.log"
        return "\n".join(p.read_text(errors="replace").splitlines()[-lines:]) if p.exists() else ""


_default: Testbed | None = None


def default() -> Testbed:
    global _default
    if _default is None:
        _default = Testbed()
    return _default


def submit(*a, **kw) -> int:
    return default().submit(*a, **kw)


def wait_job(*a, **kw) -> dict:
    return default().wait_job(*a, **kw)


def sacct_job(*a, **kw):
    return default().sacct_job(*a, **kw)


def drains() -> list[Drain]:
    return default().drains()


def drain_reason(node: str):
    return default().drain_reason(node)


def node_state(node: str) -> str:
    return default().node_state(node)


def resume_node(*a, **kw) -> None:
    return default().resume_node(*a, **kw)


def release_requeued(jobid: int) -> None:
    return default().release_requeued(jobid)


def job_output(jobid: int) -> str:
    return default().job_output(jobid)


def reset(*a, **kw) -> None:
    return default().reset(*a, **kw)
