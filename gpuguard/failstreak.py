"""Escalate a ``fail-job`` fault that persists to a drain.

``fail-job`` cancels the job and leaves the node up (SLURM-FACTS §5: a non-zero Prolog
exit would drain it). For a fault that stays, that is a black hole: the idle node keeps
attracting jobs and the Prolog cancels each one. So the Prolog counts, per finding code,
the jobs it failed on this node in a row; when ``[prolog] fail_job_escalate_count`` jobs
were failed for the same code within ``[prolog] fail_job_escalate_window_s``, the node is
drained instead (the job is then requeued elsewhere, like any drain), with the reason
``gpuguard: CODE failed N jobs in a row within W s; drained: MESSAGE``.

In a row: a Prolog run on this node that does not fail the job for a code (the fault
cleared: the job proceeded, or it was failed for other codes only) forgets that code's
count, so a transient fault never escalates. Our own faults never count: a broken config
never fails a job (:mod:`gpuguard.prolog.hook`), and a streak file that cannot be read or
written escalates nothing (logged as a tool error; the job is failed as before).

The counts are a small JSON file (:data:`FILE`, ``{code: [[epoch_s, job_id], ...]}``)
kept by :mod:`gpuguard.durable` in ``[paths] state_dir`` and ``run_dir``: no store I/O
before the Prolog has acted.
"""

from __future__ import annotations

import time
from typing import Any

FILE = "fail_streak.json"


def _load(dirs: list[str]) -> dict[str, list[list[Any]]]:
    from gpuguard import durable

    value, _ = durable.read(dirs, FILE)
    if not isinstance(value, dict):
        return {}
    out: dict[str, list[list[Any]]] = {}
    for code, rows in value.items():
        if isinstance(code, str) and isinstance(rows, list):
            out[code] = [r for r in rows if isinstance(r, list) and len(r) == 2
                         and isinstance(r[0], (int, float)) and isinstance(r[1], str)]
    return out


def note(cfg: Any, codes: list[str], job_id: str | None, *, now: float | None = None) -> tuple[str, int] | None:
    """Record that this Prolog run failed job ``job_id`` for the fail-job finding
    ``codes`` (empty: it failed no job) and forget every other code's count. Returns
    ``(code, n)`` for the first code of ``codes`` (their order: the decision's, most
    severe first) whose distinct jobs failed within the window reach the threshold, else
    None. Only reads when the file has nothing to forget and nothing is added. Raises
    ``OSError`` when the file cannot be written (the caller logs it; nothing escalates)."""
    from gpuguard import durable

    dirs = durable.state_dirs(cfg)
    if not dirs:
        return None
    now = time.time() if now is None else now
    window_s = float(cfg.get("prolog", "fail_job_escalate_window_s"))
    need = int(cfg.get("prolog", "fail_job_escalate_count"))
    old = _load(dirs)
    new: dict[str, list[list[Any]]] = {}
    for code in codes:
        # a job counts once (a requeued job's second Prolog is the same job)
        rows = [r for r in old.get(code, []) if now - r[0] < window_s and r[1] != job_id]
        rows.append([now, str(job_id)])
        new[code] = rows[-max(need, 1):]  # the last `need` failures decide
    if new != old:
        durable.write(dirs, FILE, new)
    if need < 1:
        return None
    for code in codes:
        if len(new[code]) >= need:
            return code, len(new[code])
    return None


def reason(code: str, n: int, window_s: float, message: str) -> str:
    """The drain reason of an escalation, cut and cleaned like every drain reason
    (:func:`gpuguard.policy.format_reason`): ``gpuguard: CODE failed N jobs in a row within
    W s; drained: MESSAGE``."""
    from gpuguard.model import Finding
    from gpuguard.policy import format_reason

    text = f"failed {n} jobs in a row within {window_s:g} s; drained: {message}"
    return format_reason([Finding(code=code, severity="critical", message=text)])
