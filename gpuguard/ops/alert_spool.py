"""The alert queue hooks write to: one JSON line per alert appended to a spool file.

A hook never talks to the network: a webhook that hangs would hold the job (Prolog) or the
node (Epilog). It appends under ``flock`` (waiting at most :data:`LOCK_WAIT_S`) and
returns; ``gpuguard alert send`` (run at the end of every ``gpuguard health`` and by a
timer) takes the spool, de-duplicates into the store and delivers with retries.

Which findings become alerts: those whose policy action is ``alert``, ``fail-job`` or
``drain`` (``record`` means "store only"). In maintenance nothing is queued.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

#: Longest a hook waits for the spool lock (the sender holds it for one read + insert).
LOCK_WAIT_S = 0.5

#: Policy actions that page someone.
ALERTING_ACTIONS = ("alert", "fail-job", "drain")


@dataclass
class Alert:
    """One alert occurrence. ``count``: occurrences it stands for (an XID finding seen 20
    times in one kernel-log scan is one Alert with count 20); ``at``: UTC epoch s."""

    node: str
    code: str
    severity: str
    message: str
    gpu_index: int | None = None
    count: int = 1
    action: str = ""
    source: str = ""
    job_id: str | None = None
    at: float = field(default_factory=time.time)
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        """De-duplication key: code, node and GPU."""
        return f"{self.code}|{self.node}|{'' if self.gpu_index is None else self.gpu_index}"


def spool_path(cfg: Any) -> str:
    """``[alerts] spool_file``, default ``{state_dir}/alerts.spool``."""
    return cfg.get("alerts", "spool_file") or os.path.join(cfg.get("paths", "state_dir"), "alerts.spool")


def _flock(fd: int, wait_s: float) -> bool:
    end = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= end:
                return False
            time.sleep(0.01)


def enqueue_many(cfg: Any, alerts: list[Alert]) -> int:
    """Append ``alerts`` to the spool; returns how many were queued. Raises ``OSError``
    (the caller logs it as a tool error) and :class:`SpoolFull` past
    ``[alerts] spool_max_bytes``."""
    if not alerts:
        return 0
    path = spool_path(cfg)
    os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o755, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        if not _flock(fd, LOCK_WAIT_S):
            raise OSError(f"{path}: spool locked for more than {LOCK_WAIT_S} s")
        if os.fstat(fd).st_size > cfg.get("alerts", "spool_max_bytes"):
            raise SpoolFull(f"{path}: spool over {cfg.get('alerts', 'spool_max_bytes')} bytes; alert dropped")
        data = "".join(json.dumps(asdict(a), default=str, separators=(",", ":")) + "\n" for a in alerts)
        os.write(fd, data.encode())
    finally:
        os.close(fd)
    return len(alerts)


def enqueue(cfg: Any, alert: Alert) -> int:
    """Queue one alert (see :func:`enqueue_many`)."""
    return enqueue_many(cfg, [alert])


def enqueue_findings(cfg: Any, node: str, actions: list[tuple[Any, str]], *, source: str,
                     job_id: str | None = None) -> int:
    """Queue the ``(finding, action)`` pairs of a decision whose action pages someone.
    The count of an XID finding is its number of kernel-log events."""
    alerts = []
    for f, action in actions:
        if action not in ALERTING_ACTIONS:
            continue
        count = f.evidence.get("count", 1) if isinstance(f.evidence, dict) else 1
        alerts.append(Alert(node=node, code=f.code, severity=f.severity, message=f.message,
                            gpu_index=f.gpu_index, count=int(count) if isinstance(count, int) and count > 0 else 1,
                            action=action, source=source, job_id=job_id,
                            evidence={k: v for k, v in (f.evidence or {}).items() if k in ("xid", "pci_bus_id", "meaning", "source")}))
    return enqueue_many(cfg, alerts)


def enqueue_from_hook(cfg: Any, node: str, actions: list[tuple[Any, str]], *, source: str,
                      job_id: str | None, log: Any) -> None:
    """What a Prolog/Epilog calls: queue, fail open (any error is logged as a tool error),
    nothing in maintenance (:func:`gpuguard.ops.maintenance.cached`)."""
    if not any(a in ALERTING_ACTIONS for _f, a in actions):
        return
    try:
        from gpuguard.ops.maintenance import cached

        if cached(cfg, node).active:
            return
        enqueue_findings(cfg, node, actions, source=source, job_id=job_id)
    except Exception as e:
        log.error("tool error: alert queue: %s: %s", type(e).__name__, e)


class SpoolFull(OSError):
    """The spool is over its size cap."""


def take(cfg: Any) -> list[Alert]:
    """Read and empty the spool under its lock (the sender's side). Malformed lines are
    skipped. Raises ``OSError``."""
    path = spool_path(cfg)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        return []
    out: list[Alert] = []
    try:
        if not _flock(fd, 5.0):
            raise OSError(f"{path}: spool locked")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        for line in b"".join(chunks).decode("utf-8", "replace").splitlines():
            try:
                d = json.loads(line)
                out.append(Alert(**{k: d[k] for k in d if k in Alert.__dataclass_fields__}))
            except (ValueError, TypeError):
                continue  # a torn or foreign line: drop it, keep the rest
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)
    return out
