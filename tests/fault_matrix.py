"""The fault-injection matrix: every case runs the real hook programs the way slurmd runs
them and counts drains against what the case calls for.

How a hook is run (SLURM-FACTS.md §3-4): the console script (``gpuguard-prolog``,
``gpuguard-epilog``) as a child process with an environment of only what slurmd gives the
Prolog/Epilog (``SLURM_*``, the GPU variables, ``SLURM_CONF``, ``PWD``, ``SHLVL``: no
``PATH``, ``HOME`` or ``USER``), stdin on ``/dev/null``, stdout/stderr on pipes, and the
config found as ``gpuguard.toml`` next to ``$SLURM_CONF``. ``scontrol`` is a fake in the
config's ``[slurm] bin_dir`` that logs every call and keeps node state like slurmctld
(``update nodename=N state=drain`` sets the reason, ``show node`` prints it, ``resume``
clears it); ``mode`` files make it fail (exit 1) or hang (sleep 60 s).

What is counted per case: ``drains`` = drain requests slurmctld *applied* (the node went
from undrained to drained: a re-drain of an already drained node counts too), ``want`` =
drains the case calls for (a hardware fault: 1, else 0); a case passes when every hook
exited as Slurm should see it (Prolog 0 or 1, Epilog 0), no hook process outlived
``time_budget_s + STARTUP_MARGIN_S`` (the budget clock starts once the interpreter is
up; slurmd's ``PrologEpilogTimeout`` must cover both), drains == want, and the case's own
check holds. Used by ``tests/test_fault_matrix.py`` and ``bench/fault_matrix.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

BIN = Path(sys.executable).parent
TESTS = Path(__file__).parent
#: Hook budget in the matrix (s): short, so hung cases stay quick on 2 shared cores.
BUDGET_S = 3.0
#: Allowance for interpreter start and exit on a loaded 2-core VM (s).
STARTUP_MARGIN_S = 2.0
UID = GID = 1001

XID79 = "[ 6781741.548779] NVRM: Xid (PCI:0000:3a:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"
XID79_KERNEL_ONLY = "kernel: NVRM: Xid (PCI:0000:3a:00): 79, pid=1818990, name=python3, GPU has fallen off the bus.\n"
SPOOF_SYSLOG = ("Nov 30 03:40:01 n1 kernel: NVRM: Xid (PCI:0000:3a:00): 79, pid=1, name=x, "
                "GPU has fallen off the bus.\n")  # what `logger -t kernel` writes into /var/log/syslog

FAKE_SCONTROL = r'''#!/usr/bin/env python3
import json, os, sys, time
here = os.path.dirname(os.path.abspath(__file__))
root = os.path.dirname(here)
open(os.path.join(root, "calls.jsonl"), "a").write(json.dumps(sys.argv[1:]) + "\n")
mode_file = os.path.join(here, "scontrol.mode")
mode = open(mode_file).read().strip() if os.path.exists(mode_file) else "ok"
if mode == "hang":
    time.sleep(60)
if mode == "fail":
    sys.stderr.write("slurm_update error: Unable to contact slurm controller (connect failure)\n")
    sys.exit(1)
st = os.path.join(root, "nodes.json")
nodes = json.load(open(st)) if os.path.exists(st) else {}
a = sys.argv[1:]
kv = dict(x.split("=", 1) for x in a if "=" in x)
if a[:1] == ["update"] and "nodename" in kv:
    if kv.get("state") == "drain":
        if kv["nodename"] not in nodes:
            open(os.path.join(root, "drains.log"), "a").write(kv.get("reason", "") + "\n")
        else:
            open(os.path.join(root, "redrains.log"), "a").write(kv.get("reason", "") + "\n")
        nodes[kv["nodename"]] = kv.get("reason", "")
    elif kv.get("state") == "resume":
        nodes.pop(kv["nodename"], None)
    json.dump(nodes, open(st, "w"))
elif a[:2] == ["show", "node"] and len(a) > 2:
    r = nodes.get(a[2])
    print(f"NodeName={a[2]} State=IDLE{'+DRAIN' if r else ''} " + (f"Reason={r} [root@2026-01-01T00:00:00]" if r else ""))
'''

FAKE_OTHER = r'''#!/usr/bin/env python3
import json, os, sys, time
here = os.path.dirname(os.path.abspath(__file__))
open(os.path.join(os.path.dirname(here), "calls.jsonl"), "a").write(json.dumps([os.path.basename(sys.argv[0])] + sys.argv[1:]) + "\n")
mode_file = os.path.join(here, os.path.basename(sys.argv[0]) + ".mode")
if os.path.exists(mode_file) and open(mode_file).read().strip() == "hang":
    time.sleep(60)
'''

#: Runs the Prolog with a fake pynvml (or none) in place of the real one: the only
#: difference from the console script is the injected module.
NVML_LAUNCHER = r'''
import json, os, sys
spec = json.loads(os.environ.pop("GPUGUARD_MATRIX_NVML"))
sys.path.insert(0, os.environ.pop("GPUGUARD_MATRIX_TESTS"))
if spec.get("missing"):
    sys.modules["pynvml"] = None  # nvidia-ml-py not installed: `import pynvml` fails
else:
    from fake_pynvml import FakeNvml, h100_gpu
    fake = FakeNvml([h100_gpu(i) for i in range(4)])
    for func, gpu in spec.get("hang", []):
        fake.hang(func, gpu=gpu, max_s=60)
    sys.modules["pynvml"] = fake.module
from gpuguard.prolog.hook import main
main()
'''


@dataclass
class HookRun:
    hook: str
    job_id: str
    rc: int
    wall_s: float
    stderr: str = ""


@dataclass
class Node:
    """One simulated GPU node: config beside a ``slurm.conf``, replay GPUs, a kernel log
    file, fake Slurm commands, its own store and state directories."""

    root: Path
    budget_s: float = BUDGET_S
    kernel_only: bool = True
    extra_toml: str = ""
    store: str | None = None
    state_dir: str | None = None
    run_dir: str | None = None
    gpu_source: str = "replay"
    kernel_log: str | None = None  # default: the kern.log file
    runs: list[HookRun] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for d in ("etc", "bin", "jobs", "state", "run"):
            (self.root / d).mkdir(exist_ok=True)
        (self.root / "etc" / "slurm.conf").write_text("# placeholder: gpuguard.toml is found beside it\n")
        (self.root / "bin" / "scontrol").write_text(FAKE_SCONTROL)
        for tool in ("sacctmgr", "sacct", "sinfo", "scancel"):
            (self.root / "bin" / tool).write_text(FAKE_OTHER)
        for f in (self.root / "bin").iterdir():
            f.chmod(0o755)
        (self.root / "kern.log").touch()
        from conftest import node_snapshot

        from gpuguard.gpu.replay import dump_snapshot

        (self.root / "gpus.json").write_text(dump_snapshot(node_snapshot(4)))
        self.write_config()

    # -- setup -------------------------------------------------------------------------
    def write_config(self, text: str | None = None) -> None:
        if text is None:
            r = self.root
            text = f"""[node]
name = "n1"
[paths]
store = "{self.store or r / 'node.db'}"
state_dir = "{self.state_dir or r / 'state'}"
run_dir = "{self.run_dir or r / 'run'}"
job_dir_root = "{r / 'jobs'}"
log_file = "{r / 'gpuguard.log'}"
[gpu]
source = "{self.gpu_source}"
replay_path = "{r / 'gpus.json'}"
call_timeout_s = 1.0
[xid]
kernel_log = "{self.kernel_log or r / 'kern.log'}"
kernel_log_kernel_only = {'true' if self.kernel_only else 'false'}
[slurm]
bin_dir = "{r / 'bin'}"
[prolog]
time_budget_s = {self.budget_s}
start_collector = false
[epilog]
time_budget_s = {self.budget_s}
[collector]
interval_s = 0.5
flush_s = 1.0
""" + self.extra_toml
        (self.root / "etc" / "gpuguard.toml").write_text(text)

    def set_mode(self, tool: str, mode: str) -> None:
        (self.root / "bin" / f"{tool}.mode").write_text(mode)

    def resume(self) -> None:
        """The operator resumes the node (``scontrol update state=resume``): the same
        XID must not drain it again."""
        st = self.root / "nodes.json"
        if st.exists():
            nodes = json.loads(st.read_text())
            nodes.pop("n1", None)
            st.write_text(json.dumps(nodes))

    def log_kernel(self, text: str) -> None:
        with open(self.root / "kern.log", "a") as fh:
            fh.write(text)

    # -- running hooks -------------------------------------------------------------------
    def env(self, hook: str, job_id: str) -> dict[str, str]:
        """What slurmd puts in the Prolog/Epilog environment (SLURM-FACTS.md §4)."""
        e = {
            "SLURM_JOB_ID": job_id, "SLURM_JOBID": job_id, "SLURM_JOB_UID": str(UID), "SLURM_UID": str(UID),
            "SLURM_JOB_GID": str(GID), "SLURM_JOB_USER": "slurmtest", "SLURM_JOB_ACCOUNT": "acct",
            "SLURM_JOB_PARTITION": "debug", "SLURM_JOB_GPUS": "0,1", "CUDA_VISIBLE_DEVICES": "0,1",
            "GPU_DEVICE_ORDINAL": "0,1", "SLURMD_NODENAME": "n1", "SLURM_NODELIST": "n1",
            "SLURM_CLUSTER_NAME": "tb", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_CPUS_PER_NODE": "2",
            "SLURM_JOB_RESTART_COUNT": "0", "SLURM_JOB_WORK_DIR": str(self.root),
            "SLURM_CONF": str(self.root / "etc" / "slurm.conf"),
            "SLURM_SCRIPT_CONTEXT": "prolog_slurmd" if hook == "prolog" else "epilog_slurmd",
            "PWD": str(self.root), "SHLVL": "1",
        }
        if hook == "epilog":
            e.update(SLURM_JOB_EXIT_CODE="0", SLURM_JOB_EXIT_CODE2="0:0", SLURM_JOB_DERIVED_EC="0")
        return e

    def start(self, hook: str, job_id: str, *, nvml: dict | None = None) -> tuple[subprocess.Popen, float]:
        env = self.env(hook, job_id)
        if nvml is not None:
            env["GPUGUARD_MATRIX_TESTS"] = str(TESTS)
            env["GPUGUARD_MATRIX_NVML"] = json.dumps(nvml)
            argv = [sys.executable, "-c", NVML_LAUNCHER]
        else:
            argv = [str(BIN / f"gpuguard-{hook}")]
        t = time.monotonic()
        p = subprocess.Popen(argv, env=env, cwd=self.root, stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        return p, t

    def finish(self, hook: str, job_id: str, p: subprocess.Popen, t: float) -> HookRun:
        try:
            _out, err = p.communicate(timeout=self.budget_s + 30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)  # slurmd's killpg after PrologEpilogTimeout
            _out, err = p.communicate()
        run = HookRun(hook, job_id, p.returncode, time.monotonic() - t, err.decode(errors="replace")[-2000:])
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # what slurmd does when the hook exits
        self.runs.append(run)
        return run

    def hook(self, hook: str, job_id: str, **kw) -> HookRun:
        p, t = self.start(hook, job_id, **kw)
        return self.finish(hook, job_id, p, t)

    def concurrently(self, hooks: list[tuple[str, str]]) -> list[HookRun]:
        started = [(h, j, *self.start(h, j)) for h, j in hooks]
        return [self.finish(h, j, p, t) for h, j, p, t in started]

    # -- reading results ---------------------------------------------------------------------
    def drains(self) -> int:
        """Drains slurmctld applied, re-drains of a drained node included."""
        n = 0
        for name in ("drains.log", "redrains.log"):
            f = self.root / name
            if f.exists():
                n += len(f.read_text().splitlines())
        return n

    def log(self) -> str:
        f = self.root / "gpuguard.log"
        return f.read_text() if f.exists() else ""

    def query(self, sql: str, params: tuple = ()) -> list[tuple]:
        con = sqlite3.connect(f"file:{self.store or self.root / 'node.db'}?mode=ro", uri=True, timeout=5)
        try:
            return con.execute(sql, params).fetchall()
        finally:
            con.close()

    def make_job_dir(self, job_id: str, files: dict[str, str]) -> Path:
        d = self.root / "jobs" / job_id
        d.mkdir(mode=0o700, exist_ok=True)
        os.chown(d, UID, GID)
        for name, text in files.items():
            (d / name).write_text(text)
            os.chown(d / name, UID, GID)
        return d


@dataclass
class Case:
    name: str
    want: int  # drains the case calls for
    run: Callable[[Node], str | None]  # returns None when its own check holds, else why not
    node: dict = field(default_factory=dict)  # Node(...) options
    needs_root_mounts: bool = False


@dataclass
class Result:
    case: str
    hooks: int
    rcs: str
    drains: int
    want: int
    max_wall_s: float
    past_budget: int
    bad_rc: int
    check: str | None

    @property
    def ok(self) -> bool:
        return self.drains == self.want and not self.past_budget and not self.bad_rc and self.check is None


def _rc_ok(r: HookRun) -> bool:
    return r.rc in ((0, 1) if r.hook == "prolog" else (0,))


def run_case(case: Case, base: Path) -> Result:
    node = Node(base / case.name.replace(" ", "_").replace("/", "_"), **case.node)
    try:
        check = case.run(node)
    except Exception as e:  # the harness's own failure shows in the table
        check = f"harness: {type(e).__name__}: {e}"
    limit = node.budget_s + STARTUP_MARGIN_S
    runs = node.runs
    return Result(
        case=case.name, hooks=len(runs), rcs=",".join(f"{r.hook[0].upper()}{r.rc}" for r in runs),
        drains=node.drains(), want=case.want,
        max_wall_s=max((r.wall_s for r in runs), default=0.0),
        past_budget=sum(r.wall_s > limit for r in runs), bad_rc=sum(not _rc_ok(r) for r in runs), check=check)


def table(results: list[Result]) -> str:
    """The matrix as a fixed-width table with a totals line."""
    head = ("case", "hooks", "exit codes", "drains", "want", "max s", "past budget", "check")
    rows = [(r.case, str(r.hooks), r.rcs, str(r.drains), str(r.want), f"{r.max_wall_s:.2f}", str(r.past_budget),
             "ok" if r.ok else (r.check or "FAIL")) for r in results]
    false_drains = sum(max(0, r.drains - r.want) for r in results)
    missed = sum(max(0, r.want - r.drains) for r in results)
    past = sum(r.past_budget for r in results)
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [head, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(f"TOTAL {len(results)} cases, {sum(r.hooks for r in results)} hook runs: "
                 f"{false_drains} false drains, {missed} missed drains, {past} hooks past budget "
                 f"(budget {BUDGET_S:g} s unless the case names one, + {STARTUP_MARGIN_S:g} s start-up), "
                 f"{sum(not r.ok for r in results)} case(s) failing")
    return "\n".join(lines)


@contextlib.contextmanager
def mounted(target: Path, opts: list[str]):
    """``mount`` for the duration (root only); unmounted lazily at the end."""
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", *opts, str(target)], check=True, capture_output=True)
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


@contextlib.contextmanager
def hung_fs(target: Path):
    """A FUSE mount that never answers (root only): every access to ``target`` blocks in
    uninterruptible sleep (state D), as on a hung NFS or a dead disk, until the
    connection is aborted at the end (blocked processes then get ENOTCONN)."""
    target.mkdir(parents=True, exist_ok=True)
    fd = os.open("/dev/fuse", os.O_RDWR)
    try:
        subprocess.run(["mount", "-t", "fuse", "-o", f"fd={fd},rootmode=40000,user_id=0,group_id=0", "gpuguard-hung",
                        str(target)], pass_fds=[fd], check=True, capture_output=True)
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], capture_output=True)
        os.close(fd)


def can_fuse() -> bool:
    return can_mount() and os.access("/dev/fuse", os.W_OK)


def can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None and os.path.exists("/proc/self/mountinfo")


def hold_lock(db: Path, seconds: float) -> threading.Event:
    """Hold an exclusive lock on the SQLite store for ``seconds`` in a thread."""
    ready = threading.Event()

    def hold() -> None:
        con = sqlite3.connect(str(db), timeout=1, isolation_level=None)
        con.execute("BEGIN EXCLUSIVE")
        ready.set()
        time.sleep(seconds)
        con.execute("ROLLBACK")
        con.close()

    threading.Thread(target=hold, daemon=True).start()
    ready.wait(5)
    return ready
