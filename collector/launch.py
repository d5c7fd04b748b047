"""Per-job preparation for the prolog, and collector stop for the epilog. Runs as root.

:func:`prepare_job` (called by ``gpuguard-prolog`` after a ``proceed`` decision):

1. creates the job's record directory ``{paths.job_dir_root}/{SLURM_JOB_ID}`` owned by
   the job's user (``SLURM_JOB_UID``/``SLURM_JOB_GID``), mode 0700 (:func:`ensure_job_dir`);
2. if ``[prolog] start_collector``, starts ``python -m gpuguard.collector.run`` detached
   (:func:`start_collector`).

:func:`stop_collector` (called by the epilog) sends SIGTERM, waits, escalates to SIGKILL.

Why the collector launch looks the way it does (SLURM-FACTS.md §6e): slurmd runs every
hook in its own process group and ``killpg(SIGKILL)``s that group the moment the hook
exits, and it reads the hook's stdout until EOF. So the child is started with
``start_new_session=True`` (``setsid()`` before ``exec``), with stdin and stdout on
``/dev/null`` and stderr on the gpuguard log file, and :func:`start_collector` returns
only once it has seen the child lead its own session and process group.

Files (``state_dir`` and ``job_dir_root`` come from ``[paths]``, ``{node}`` expanded):

* ``{state_dir}/collector.{job_id}.pid``: the collector's pid, one line, written
  atomically (temp file + ``rename``), mode 0644. One collector per job per node: a pid
  file naming a live collector of the same job refuses a second start. A pid is trusted
  only after ``/proc/PID/cmdline`` shows ``-m gpuguard.collector.run ... --job-id N``
  and ``/proc/PID/stat`` is not a zombie (pid files survive reboots: SLURM-FACTS §2.11).
* ``{job_dir_root}/{job_id}/``: see :func:`ensure_job_dir`.

Errors: :class:`JobDirError`, :class:`CollectorRunning`, :class:`LaunchError` (all
subclasses of :class:`PrepareError`); the prolog logs them as tool errors and lets the job
run.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pwd
import select
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from gpuguard.collector.jobdir import (
    JobDirError,
    PrepareError,
    _check_job_id,
    ensure_job_dir,
    job_dir_path,
    remove_job_dir,
)
from gpuguard.hookenv import read_hook_env

# Re-exported: the job-directory half of preparation lives in collector.jobdir.
__all__ = [
    "CollectorRunning",
    "JobDirError",
    "LaunchError",
    "PrepareError",
    "PrepareResult",
    "StopResult",
    "collector_argv",
    "ensure_job_dir",
    "is_collector",
    "job_dir_path",
    "pid_file_path",
    "prepare_job",
    "read_pid_file",
    "remove_job_dir",
    "start_collector",
    "stop_collector",
]

RUN_MODULE = "gpuguard.collector.run"
#: Largest pid Linux can hand out (``PID_MAX_LIMIT`` on 64-bit: 2**22). A pid file naming
#: anything outside ``1..PID_MAX`` is garbage (``pidfd_open`` would raise OverflowError
#: beyond a C int, and ``kill(-1)`` signals every process).
PID_MAX = 4194304
#: How long :func:`start_collector` waits for the child to lead its own session.
SESSION_WAIT_S = 1.0
_DEFAULT_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


class CollectorRunning(PrepareError):
    """A live collector for this job already exists (pid in :attr:`pid`)."""

    def __init__(self, msg: str, pid: int):
        super().__init__(msg)
        self.pid = pid


class LaunchError(PrepareError):
    """The collector process could not be started or did not detach."""


@dataclass
class PrepareResult:
    """What :func:`prepare_job` did: the job directory (``None`` when not created) and the
    collector's pid (``None`` when not started)."""

    job_dir: str | None
    collector_pid: int | None


@dataclass
class StopResult:
    """Outcome of :func:`stop_collector`.

    ``pid``: the pid named by the pid file (``None``: no or unreadable pid file).
    ``was_running``: that pid was a live collector of this job when we looked.
    ``exited``: no collector of this job is running any more (``True`` when none was).
    ``signal_sent``: the last signal sent, ``"SIGTERM"`` or ``"SIGKILL"``, else ``None``.

    For the epilog: ``pid is None`` -> no collector was started (or its pid file is gone);
    ``pid`` set and ``was_running`` false -> the collector died before the epilog (crash,
    OOM kill, SIGKILL): what it flushed is in the store, the rest is lost;
    ``signal_sent == "SIGKILL"`` -> it ignored SIGTERM for ``timeout_s`` and its unflushed
    rows (at most ``flush_s`` worth) are lost.
    """

    pid: int | None
    was_running: bool
    exited: bool
    signal_sent: str | None


# -- paths ------------------------------------------------------------------------------


def pid_file_path(cfg: Any, job_id: str) -> str:
    """``{paths.state_dir}/collector.{job_id}.pid``."""
    return os.path.join(cfg.get("paths", "state_dir"), f"collector.{_check_job_id(job_id)}.pid")


# -- process identity --------------------------------------------------------------------


def _proc_state(pid: int) -> str | None:
    """One-letter state from ``/proc/PID/stat`` (``"Z"`` zombie), ``None`` when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    # comm may hold spaces and parentheses: the state follows the *last* ')'.
    rest = data[data.rfind(b")") + 2:]
    return rest[:1].decode() or None


def is_collector(pid: int, job_id: str) -> bool:
    """True when ``pid`` is a live (non-zombie) ``gpuguard.collector.run`` of ``job_id``
    according to ``/proc/PID/cmdline``."""
    if pid <= 1:
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = fh.read().split(b"\0")
    except OSError:
        return False
    if RUN_MODULE.encode() not in argv:
        return False
    try:
        i = argv.index(b"--job-id")
    except ValueError:
        return False
    if i + 1 >= len(argv) or argv[i + 1] != str(job_id).encode():
        return False
    return _proc_state(pid) not in (None, "Z", "X")


def _pid_or_none(text: str) -> int | None:
    """``text`` as a pid in ``1..PID_MAX`` (ASCII digits only), else ``None``."""
    if not (text.isascii() and text.isdigit()):  # at most 64 bytes were read
        return None
    pid = int(text)
    return pid if 1 <= pid <= PID_MAX else None


def read_pid_file(path: str) -> int | None:
    """The pid in ``path``; ``None`` when missing, unreadable, or not ASCII digits
    naming a pid in ``1..PID_MAX``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        text = os.read(fd, 64).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    return _pid_or_none(text)


def _write_pid_file(path: str, pid: int) -> None:
    d = os.path.dirname(path)
    os.makedirs(d, mode=0o755, exist_ok=True)
    tmp = os.path.join(d, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, f"{pid}\n".encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


# -- start -------------------------------------------------------------------------------


def collector_argv(cfg: Any, job_id: str, *, gpus: str | None, uid: int | None,
                   extra: list[str] | None = None) -> list[str]:
    """The collector's command line (an argument list; no shell)."""
    from gpuguard.collector.supervise import restart_file_path

    argv = [sys.executable, "-m", RUN_MODULE, "--supervise", "--restart-file", restart_file_path(cfg, job_id),
            "--job-id", _check_job_id(job_id), "--node", cfg.node_name]
    if cfg.path:
        argv += ["--config", os.path.abspath(cfg.path)]
    if gpus:
        argv += ["--gpus", gpus]
    if uid is not None:
        argv += ["--uid", str(uid)]
    return argv + list(extra or [])


def start_collector(cfg: Any, job_id: str, *, gpus: str | None, uid: int | None,
                    env: dict[str, str] | None = None, extra_args: list[str] | None = None,
                    log: logging.Logger | None = None) -> int:
    """Start the job's collector detached and return its pid.

    ``gpus``: the job's GPUs as the prolog sees them (``SLURM_JOB_GPUS``, else
    ``CUDA_VISIBLE_DEVICES``: indices or ``GPU-`` UUIDs, comma-separated; ``None``: the
    job has none). ``uid``: the job's user (for the /proc fallback). ``env``: the child's
    environment (default: this process's, with ``PATH`` set when missing).
    ``extra_args``: more ``gpuguard.collector.run`` options (tests).

    Raises :class:`CollectorRunning` when the pid file names a live collector of this job,
    :class:`LaunchError` when the process cannot be started, or within :data:`SESSION_WAIT_S`
    does not lead its own session or show the collector's command line (it is then killed).
    """
    log = log or logging.getLogger("gpuguard")
    pid_path = pid_file_path(cfg, job_id)
    old = read_pid_file(pid_path)
    if old is not None and is_collector(old, job_id):
        raise CollectorRunning(f"collector for job {job_id} already running (pid {old})", old)
    argv = collector_argv(cfg, job_id, gpus=gpus, uid=uid, extra=extra_args)
    child_env = dict(os.environ if env is None else env)
    child_env.setdefault("PATH", _DEFAULT_PATH)
    if cfg.path:
        child_env["GPUGUARD_CONFIG"] = os.path.abspath(cfg.path)
    err_fd = _open_log_for_child(cfg)
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=err_fd if err_fd is not None else subprocess.DEVNULL,
            start_new_session=True, close_fds=True, env=child_env, cwd="/",
        )
    except OSError as e:
        raise LaunchError(f"cannot start collector: {e.strerror or e}") from None
    finally:
        if err_fd is not None:
            os.close(err_fd)
    pid = proc.pid
    if not _wait_detached(pid, job_id, SESSION_WAIT_S):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        proc.wait()
        raise LaunchError(f"collector pid {pid} did not detach within {SESSION_WAIT_S} s")
    # The prolog exits right after this and the collector is reparented (init reaps it).
    # Mark the handle finished so Popen neither warns "still running" nor keeps it on its
    # list of children to poll.
    proc.returncode = 0
    try:
        _write_pid_file(pid_path, pid)
    except OSError as e:
        log.warning("collector pid %d started, but pid file %s not written: %s", pid, pid_path, e)
    log.info("collector started: pid %d, gpus=%s", pid, gpus or "-")
    return pid


def _open_log_for_child(cfg: Any) -> int | None:
    path = cfg.get("paths", "log_file")
    if not path:
        return None
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o755, exist_ok=True)
        return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
    except OSError:
        return None


def _wait_detached(pid: int, job_id: str, timeout_s: float) -> bool:
    """Poll until ``pid`` is its own session and process-group leader (it no longer shares
    the hook's group that slurmd will ``killpg``) and ``/proc/PID/cmdline`` already shows
    the collector: ``Popen`` returns once the close-on-exec pipe closes, which is a moment
    before the kernel sets the new argument area, and a pid file must never name a process
    that :func:`is_collector` does not recognise."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if os.getsid(pid) == pid and os.getpgid(pid) == pid and is_collector(pid, job_id):
                return True
        except ProcessLookupError:
            return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)


def prepare_job(cfg: Any, env: dict[str, str], log: logging.Logger) -> PrepareResult:
    """Create the job's record directory and start the detached collector.

    ``env``: the prolog's environment (``SLURM_JOB_ID``, ``SLURM_JOB_UID``,
    ``SLURM_JOB_GID``, ``SLURM_JOB_GPUS`` / ``CUDA_VISIBLE_DEVICES``: SLURM-FACTS §4).
    Both parts are attempted; a live collector of the same job is logged and kept. Raises
    :class:`PrepareError` naming every part that failed (the prolog logs it as a tool
    error and lets the job run).
    """
    job_id = _check_job_id(env.get("SLURM_JOB_ID", ""))
    henv = read_hook_env(env)
    errors: list[str] = []
    uid: int | None = henv.job_uid
    gid: int | None = henv.job_gid
    if uid is None:
        errors.append(f"job user unknown (SLURM_JOB_UID/SLURM_JOB_GID): SLURM_JOB_UID {env.get('SLURM_JOB_UID')!r} "
                      "is not a uid")
    elif gid is None:
        try:
            gid = pwd.getpwuid(uid).pw_gid
        except KeyError as e:
            errors.append(f"job user unknown (SLURM_JOB_UID/SLURM_JOB_GID): {e}")
    job_dir = None
    if uid is not None and gid is not None:
        try:
            job_dir = ensure_job_dir(cfg.get("paths", "job_dir_root"), job_id, uid, gid, log)
        except JobDirError as e:
            errors.append(str(e))
    pid = None
    if cfg.get("prolog", "start_collector"):
        gpus = henv.gpus_spec
        try:
            pid = start_collector(cfg, job_id, gpus=gpus, uid=uid, env=env, log=log)
        except CollectorRunning as e:
            log.warning("%s: not starting another", e)
            pid = e.pid
        except PrepareError as e:
            errors.append(str(e))
    if errors:
        raise PrepareError("; ".join(errors))
    return PrepareResult(job_dir, pid)


# -- stop --------------------------------------------------------------------------------


def _wait_gone(pid: int, job_id: str, pidfd: int | None, timeout_s: float) -> bool:
    deadline = time.monotonic() + max(0.0, timeout_s)
    while True:
        # an exited child of ours stays a zombie until its parent reaps it: is_collector
        # counts a zombie as gone, and this process does not reap what it did not start
        if not is_collector(pid, job_id):
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if pidfd is not None:
            # a pidfd polls readable once the process has exited (Linux >= 5.3)
            select.select([pidfd], [], [], min(left, 0.2))
        else:
            time.sleep(min(left, 0.02))


def stop_collector(cfg: Any, job_id: str, timeout_s: float = 5.0) -> StopResult:
    """Stop the collector of ``job_id`` on this node and remove its pid file.

    SIGTERM (the collector flushes and exits 0), wait up to ``timeout_s`` seconds, then
    SIGKILL and wait up to one more second. The pid is signalled only after
    ``/proc/PID/cmdline`` shows our collector for this job; signals go through a pidfd
    (``pidfd_open``/``pidfd_send_signal``) so a reused pid cannot be hit. Never raises
    for a missing, stale or garbage pid file: a stale pid gives
    ``StopResult(pid, False, True, None)``; garbage (not ASCII digits, or a pid outside
    ``1..PID_MAX`` such as ``2147483648`` or ``99999999999999999999``) counts as no pid
    file, ``StopResult(None, False, True, None)``; the pid file is removed either way.
    """
    pid_path = pid_file_path(cfg, job_id)
    pid = read_pid_file(pid_path)
    if pid is None:
        _remove(pid_path)
        return StopResult(None, False, True, None)
    pidfd = None
    with contextlib.suppress(OSError, AttributeError, OverflowError, ValueError):
        pidfd = os.pidfd_open(pid)
    try:
        if not is_collector(pid, job_id):  # checked after pidfd_open: the fd pins this process
            _remove(pid_path)
            return StopResult(pid, False, True, None)
        sent = _signal(pid, pidfd, signal.SIGTERM)
        exited = _wait_gone(pid, job_id, pidfd, timeout_s)
        if not exited:
            sent = _signal(pid, pidfd, signal.SIGKILL) or sent
            exited = _wait_gone(pid, job_id, pidfd, 1.0)
        _remove(pid_path)
        return StopResult(pid, True, exited, sent)
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _signal(pid: int, pidfd: int | None, sig: signal.Signals) -> str | None:
    try:
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        return None
    except OSError as e:
        if e.errno == errno.ESRCH:
            return None
        raise
    return sig.name
