"""``gpuguard-taskprolog``: the Slurm TaskProlog. Runs as the job user inside each task.

Slurm parses the TaskProlog's stdout: a line ``export NAME=value`` puts ``NAME`` into the
task's environment, the value taken literally up to the end of the line, quotes included
(SLURM-FACTS.md §6f). So this prints exactly one line,
``export GPUGUARD_JOB_DIR=/path``, and only when ``{paths.job_dir_root}/{SLURM_JOB_ID}``
is a real directory (not a symlink) owned by the current uid; otherwise nothing.

A failing TaskProlog fails the job (SLURM-FACTS.md §5): this always exits 0, and imports
only the standard library and :mod:`gpuguard.config` (tomllib; no click, no sqlite).
"""

from __future__ import annotations

import os
import stat
import sys

from gpuguard.hookenv import is_job_id


def job_dir_export(env: dict[str, str], uid: int | None = None) -> str | None:
    """The ``export`` line for ``env`` (``SLURM_JOB_ID``; the config as in
    :func:`gpuguard.config.load`), or ``None``. ``uid``: the owner the directory must have
    (default: the real uid). Raises whatever the config loader raises."""
    job_id = env.get("SLURM_JOB_ID", "")
    if not is_job_id(job_id):
        return None
    from gpuguard import config as config_mod

    root = config_mod.load().get("paths", "job_dir_root")
    path = os.path.join(root, job_id)
    if "\n" in path or "\r" in path:
        return None  # would break Slurm's line protocol
    try:
        st = os.lstat(path)
    except OSError:
        return None
    want = os.getuid() if uid is None else uid
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != want:
        return None
    return f"export GPUGUARD_JOB_DIR={path}"


def _export_bytes(env: dict[str, str]) -> bytes:
    """:func:`job_dir_export` as bytes; b"" when there is none or it raised (a broken
    config: the job runs without the export, as for a missing directory)."""
    try:
        return (job_dir_export(env) or "").encode()
    except Exception:
        return b""


#: Longest wait for the config and the job directory (s). The task starts only after the
#: TaskProlog, at every task of every step (SLURM-FACTS.md §3), and a config or job
#: directory on a hung mount used to hold it until the job's time limit; a healthy run
#: takes about 0.1 s. Our choice: 5 s, then the job runs without GPUGUARD_JOB_DIR.
TIMEOUT_S = 5.0


def main() -> int:
    """Console script entry point; always returns 0. The config and the job directory
    are read in a child process (:func:`gpuguard.hookrun.call_in_child`) waited for at
    most :data:`TIMEOUT_S`: on a hung filesystem the job starts without the export and
    one line on stderr says so, instead of the task waiting for ever."""
    try:
        from gpuguard.hookrun import call_in_child

        env = dict(os.environ)
        got = call_in_child(lambda: _export_bytes(env), TIMEOUT_S)
        if got is None:
            sys.stderr.write(f"gpuguard-taskprolog: tool error: config and job directory not read within "
                             f"{TIMEOUT_S:g} s (a hung filesystem?); GPUGUARD_JOB_DIR not set\n")
        elif got:
            sys.stdout.write(got.decode() + "\n")
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # nothing may fail the job, and there is no log to write to
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
