"""What every Slurm hook of gpuguard shares: a hard time budget and a clean exit.

**The watchdog.** A hook's work runs in a forked child process; the parent (the process
slurmd waits for) does nothing but relay the child's output and wait, at most the
budget. A thread would not do: a thread blocked in uninterruptible sleep (a hung NFS or
disk, a D-state ``read``) keeps the whole process from exiting, ``os._exit`` included,
and slurmd would wait for it and then drain the node with "Prolog error". The parent
never touches the store, the job directory or the kernel log, so it cannot hang on them.
At the budget it sends SIGKILL to the child (which dies whenever its system call
returns), logs the overrun and exits. slurmd reads the hook's stdout until EOF, so the
child writes into pipes the parent owns, never into slurmd's pipe.

**The exit status.** A crash or an overrun is gpuguard's own fault: it is logged as a
tool error and the hook returns ``fallback_rc`` (0), never a failure that would drain the
node -- except when the child has already *announced* its verdict (:func:`announce`, done
by the Prolog right after the live checks, before any store I/O): a Prolog that decided
to drain exits 1 even if the bookkeeping after the decision hangs.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from gpuguard.hookenv import is_job_id  # noqa: F401  (re-exported: hooks and path builders)


#: Longest wait for a hook's config to be found and read (s). Our choice: half the
#: shortest shipped hook budget (20 s), so a config (or the slurm.conf beside it) on a hung
#: shared filesystem leaves the hook its shipped defaults and time to finish.
CONFIG_READ_TIMEOUT_S = 10.0


def load_config(timeout_s: float | None = None) -> tuple[Any, str | None]:
    """``(config, None)``, or ``(the shipped defaults, the one-line error)`` when the
    config is broken, a dangling symlink or not found anywhere (hooks never run on silent
    defaults: :func:`gpuguard.config.load` with ``require``). A hook loads it once and hands it to its work.

    The config is found and read (:func:`gpuguard.config.read`) in a forked child, waited
    for at most ``timeout_s`` (default :data:`CONFIG_READ_TIMEOUT_S`): the hook's parent
    reads it before the watchdog runs (the budget is in it), and a stalled read (a config
    beside a slurm.conf on a hung NFS mount: the process sleeps in D state, which no
    signal ends) would otherwise hold the hook past every budget until slurmd drains the
    node for it. The child sends the bytes; the parent parses them."""
    import json

    from gpuguard import config as config_mod  # imported once, here: the child inherits it

    timeout_s = CONFIG_READ_TIMEOUT_S if timeout_s is None else timeout_s

    def read_in_child() -> bytes:
        path, data, error = _read_config(config_mod)
        return json.dumps({"path": path, "data": data.decode("latin-1"), "error": error,
                           "slurm_conf": os.environ.get("SLURM_CONF")}).encode()

    answer = _answer_from_child(read_in_child, timeout_s)
    if answer is _TIMED_OUT:
        return config_mod.from_dict({}), (f"config not read within {timeout_s:g} s (a hung filesystem?); "
                                          f"looked at $GPUGUARD_CONFIG and {', '.join(config_mod.config_candidates())}")
    try:
        got = json.loads(answer) if answer is not None else None
    except ValueError:
        got = None
    if got is None:  # no child to be had, or it died before it sent a whole answer
        return _parsed(config_mod, *_read_config(config_mod))
    if got["slurm_conf"] and not os.environ.get("SLURM_CONF"):
        os.environ["SLURM_CONF"] = got["slurm_conf"]  # what export_slurm_conf set in the child
    return _parsed(config_mod, got["path"], got["data"].encode("latin-1"), got["error"])


def _leave_hook_pipes() -> None:
    """In a forked helper child: put stdin, stdout and stderr on /dev/null. slurmd (and
    slurmstepd for the TaskProlog) reads the hook's stdout until EOF (SLURM-FACTS.md §6e),
    so a child stuck on a hung filesystem must not hold that pipe after the hook gave up
    on it and exited."""
    try:
        fd = os.open(os.devnull, os.O_RDWR)
        for n in (0, 1, 2):
            os.dup2(fd, n)
        if fd > 2:
            os.close(fd)
    except OSError:
        pass


def call_in_child(work: Callable[[], bytes], timeout_s: float) -> bytes | None:
    """``work()``'s bytes, computed in a forked child with its stdio on /dev/null, or
    ``None`` when the child raised, died or did not answer within ``timeout_s`` seconds
    (then it is sent SIGKILL and not waited for: a process in D state on a hung NFS or
    FUSE mount may never return). For hooks that must touch a filesystem (the config, a
    job directory) outside :func:`run_watched`: the TaskProlog; :func:`load_config` reads
    the config so."""
    answer = _answer_from_child(work, timeout_s)
    return None if answer is _TIMED_OUT else answer


#: :func:`_answer_from_child`'s answer for a child that did not answer in time.
_TIMED_OUT: Any = object()


def _answer_from_child(work: Callable[[], bytes], timeout_s: float) -> bytes | None:
    """:func:`call_in_child`, telling a child that did not answer in time
    (:data:`_TIMED_OUT`) from one that could not be forked, raised or died (None)."""
    import select
    import signal
    import time

    try:
        r, w = os.pipe()
        pid = os.fork()
    except OSError:
        return None
    if pid == 0:
        try:
            import gc

            gc.disable()
            os.close(r)
            _leave_hook_pipes()
            msg = b"ok:" + work()
            while msg:
                msg = msg[os.write(w, msg):]
        finally:
            os._exit(0)
    os.close(w)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    try:
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([r], [], [], left)[0]:
                continue
            chunk = os.read(r, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
        else:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
            return _TIMED_OUT
    finally:
        os.close(r)
    try:
        os.waitpid(pid, 0)
    except OSError:
        pass
    got = b"".join(chunks)
    return got[3:] if got.startswith(b"ok:") else None


def _read_config(config_mod: Any) -> tuple[str | None, bytes, str | None]:
    """(path, bytes, None) of the hook's config, or (None, b"", the error)."""
    # a hook without SLURM_CONF (EpilogSlurmctld) runs scontrol/sacctmgr against the
    # slurm.conf its daemon was started with
    config_mod.export_slurm_conf()
    try:
        return (*config_mod.read(require=True), None)
    except config_mod.ConfigError as e:
        return None, b"", str(e)


def _parsed(config_mod: Any, path: str | None, data: bytes, error: str | None) -> tuple[Any, str | None]:
    if error is not None:
        return config_mod.from_dict({}), error
    try:
        return config_mod.parse(path, data), None
    except config_mod.ConfigError as e:
        return config_mod.from_dict({}), str(e)


#: Write end of the pipe to the watchdog parent in the child; None when not watched.
_ANNOUNCE_FD: int | None = None


def announce(rc: int) -> None:
    """Tell the watchdog the exit status decided so far (used when the budget runs out
    before the work returns). A no-op outside a watched child."""
    if _ANNOUNCE_FD is None:
        return
    try:
        os.write(_ANNOUNCE_FD, f"{int(rc)}\n".encode())
    except OSError:
        pass


def _log_overrun(message: str, log_file: str | None) -> None:
    """One line to stderr and, from a daemon thread given 0.5 s, to the log file: the
    parent must not block on a hung filesystem either."""
    try:
        os.write(2, (message + "\n").encode())
    except OSError:
        pass
    if not log_file:
        return

    def append() -> None:
        import time as _time

        try:
            fd = os.open(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o640)
            try:
                stamp = _time.strftime("%Y-%m-%dT%H:%M:%S%z")
                os.write(fd, f"{stamp} watchdog[{os.getpid()}] ERROR {message}\n".encode())
            finally:
                os.close(fd)
        except OSError:
            pass

    t = threading.Thread(target=append, daemon=True)
    t.start()
    t.join(0.5)


def run_watched(work: Callable[[], int], budget: float, hook: str, fallback_rc: int = 0,
                log_file: str | None = None) -> int:
    """Run ``work()`` in a forked child under the watchdog (module docstring); return its
    exit status, the status it announced, or ``fallback_rc`` when it crashed or was still
    running after ``budget`` seconds (logged to stderr and ``log_file``)."""
    import signal
    import time

    ctl_r, ctl_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: do the work, report through the pipes
        global _ANNOUNCE_FD
        rc = fallback_rc
        try:
            os.close(ctl_r)
            os.close(out_r)
            os.close(err_r)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            _ANNOUNCE_FD = ctl_w
            rc = _run_guarded(work, hook, fallback_rc)
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(rc)
    for fd in (ctl_w, out_w, err_w):
        os.close(fd)
    deadline = time.monotonic() + budget
    announced: int | None = None
    relay = {out_r: 1, err_r: 2}
    status: int | None = None
    open_fds = [ctl_r, out_r, err_r]
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        announced = _pump(open_fds, relay, ctl_r, min(left, 0.05), announced)[1]
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = st
            # what the child wrote between the last select and its exit is still in the
            # pipes: relay it (without waiting: a process it left behind may hold them open)
            ready = True
            while ready and open_fds and time.monotonic() < deadline:
                ready, announced = _pump(open_fds, relay, ctl_r, 0, announced)
            break
    if status is None:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
        rc = announced if announced is not None else fallback_rc
        _log_overrun(f"tool error: {hook} exceeded its time budget of {budget:.1f} s (work still blocked); "
                     f"exiting {rc}" + (" as announced" if announced is not None else ""), log_file)
        return rc
    for fd in open_fds:
        os.close(fd)
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    _log_overrun(f"tool error: {hook} worker died with signal {os.WTERMSIG(status)}; exiting {fallback_rc}",
                 log_file)
    return announced if announced is not None else fallback_rc


def _pump(open_fds: list[int], relay: dict[int, int], ctl_r: int, wait_s: float,
          announced: int | None) -> tuple[bool, int | None]:
    """One relay step of :func:`run_watched`: wait up to ``wait_s`` s for the child's pipes,
    copy what its stdout/stderr pipes hold to this process's fds (``relay``: pipe -> fd),
    read an announced exit status from ``ctl_r``, and drop pipes at EOF from ``open_fds``.
    Returns (whether any pipe was ready, the announced status so far)."""
    import select

    ready, _, _ = select.select(open_fds, [], [], wait_s)
    for fd in ready:
        data = os.read(fd, 65536)
        if not data:
            open_fds.remove(fd)
        elif fd == ctl_r:
            for tok in data.split():
                if tok.lstrip(b"-").isdigit():
                    announced = int(tok)
        else:
            try:
                os.write(relay[fd], data)
            except OSError:
                pass
    return bool(ready), announced


def _run_guarded(work: Callable[[], int], hook: str, fallback_rc: int) -> int:
    """``work()``; a crash is logged and gives ``fallback_rc``."""
    try:
        return int(work())
    except BaseException as e:  # a bug in gpuguard: log it, never fail the hook
        try:
            from gpuguard.log import LOG

            LOG.exception("tool error: %s crashed: %s", hook, e)
        except BaseException:
            pass
        return fallback_rc


def run_with_budget(work: Callable[[], int], budget: float, hook: str, fallback_rc: int = 0) -> int:
    """Run ``work()`` in a daemon thread; return its exit status, or ``fallback_rc`` when
    it raises or is still running after ``budget`` seconds (both logged). In-process: a
    thread in uninterruptible sleep can still hold the process; the Prolog and Epilog use
    :func:`run_watched`."""
    result: list[int] = []

    def target() -> None:
        try:
            result.append(work())
        except BaseException as e:  # a bug in gpuguard: log it, never fail the hook
            try:
                from gpuguard.log import LOG

                LOG.exception("tool error: %s crashed: %s", hook, e)
            finally:
                result.append(fallback_rc)

    t = threading.Thread(target=target, name=f"gpuguard-{hook}", daemon=True)
    t.start()
    t.join(budget)
    if not result:
        from gpuguard.log import LOG

        LOG.error("tool error: %s exceeded its time budget of %.1f s; exiting %d", hook, budget, fallback_rc)
        return fallback_rc
    return result[0]


def exit_hook(rc: int) -> None:
    """Flush and leave with ``os._exit(rc)`` (daemon threads stuck in C calls stay behind)."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(rc)
