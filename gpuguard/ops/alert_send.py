"""``gpuguard alert send``: spool -> de-duplicated alerts -> sinks, with retries.

1. **Ingest.** The spool (:mod:`gpuguard.ops.alert_spool`) is emptied into ``alerts``:
   an occurrence joins the open group of its key (code, node, GPU) when it falls within
   ``[alerts] dedup_window_s`` of the group's first occurrence, adding its count;
   otherwise it opens a new group.
2. **Notify.** A group is notified once ``group_wait_s`` after its first occurrence, with
   the count so far; occurrences after that are notified once more when the window
   closes ("x N more"). One notification makes one delivery row per sink that takes its
   severity (:func:`gpuguard.ops.alert_sinks.wants`).
3. **Deliver.** Due deliveries are sent oldest first while time is left before
   ``deadline``; at most ``rate_limit_per_hour`` per sink per hour (the rest wait, they are
   not dropped); a failure is retried after ``retry_base_s * 2**(attempts-1)`` (capped at
   ``retry_max_s``) until ``max_attempts``, then given up and logged. A permanent failure
   (HTTP 400...) is given up at once.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from dataclasses import dataclass
from typing import Any

from gpuguard.ops.alert_sinks import SEVERITY_RANK, SinkError, deliver, enabled_sinks, wants
from gpuguard.ops import schema as _schema  # noqa: F401  (registers the "ops" store migration set)


@dataclass
class SendReport:
    """Counts of one send: spooled occurrences ingested, notifications made, deliveries
    sent / failed for now / given up / held back by the rate limit or the deadline."""

    ingested: int = 0
    notified: int = 0
    sent: int = 0
    retrying: int = 0
    given_up: int = 0
    held: int = 0


def ingest(cfg: Any, store: Any, now: float | None = None) -> int:
    """Move the spool into ``alerts`` (step 1). Returns the occurrences ingested."""
    from gpuguard.ops.alert_spool import take

    now = time.time() if now is None else now
    occurrences = take(cfg)
    try:
        _merge(store, occurrences, float(cfg.get("alerts", "dedup_window_s")))
    except Exception:
        from gpuguard.ops.alert_spool import enqueue_many

        enqueue_many(cfg, occurrences)  # put them back for the next send
        raise
    return len(occurrences)


def _merge(store: Any, occurrences: list[Any], window: float) -> None:
    with store.tx():
        for a in sorted(occurrences, key=lambda a: a.at):
            rows = list(store.db.query("select * from alerts where key = ? and first_at > ? order by first_at desc limit 1",
                                       [a.key, a.at - window]))
            if rows:
                r = rows[0]
                sev = max(r["severity"], a.severity, key=lambda s: SEVERITY_RANK.get(s, 0))
                store.db["alerts"].update(r["id"], {"count": r["count"] + a.count, "last_at": max(r["last_at"], a.at),
                                                    "severity": sev, "message": a.message})
            else:
                store.db["alerts"].insert({
                    "key": a.key, "node": a.node, "code": a.code, "gpu_index": a.gpu_index, "severity": a.severity,
                    "first_at": a.at, "last_at": a.at, "count": a.count, "notified_count": 0, "notified_at": None,
                    "message": a.message, "evidence": json.dumps(a.evidence, default=str), "source": a.source,
                })


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def payload(alert: dict[str, Any], kind: str, count: int) -> dict[str, Any]:
    """The message of one notification: ``text`` (one line), ``subject``, ``severity`` and
    ``gpuguard`` (the structured alert: node, code, GPU, count, first/last seen...)."""
    gpu = "" if alert["gpu_index"] is None else f" gpu{alert['gpu_index']}"
    times = f"x{count}" if count > 1 else "once"
    if kind == "repeat":
        head = f"still {alert['code']}: {count} more since {_iso(alert['notified_at'])}"
    else:
        head = alert["message"]
    text = f"[{alert['severity']}] {alert['node']}{gpu} {alert['code']}: {head} ({times}, first {_iso(alert['first_at'])})"
    return {
        "text": text,
        "subject": f"gpuguard {alert['severity']}: {alert['node']}{gpu} {alert['code']}",
        "severity": alert["severity"],
        "gpuguard": {"node": alert["node"], "code": alert["code"], "gpu_index": alert["gpu_index"],
                     "severity": alert["severity"], "count": count, "total_count": alert["count"], "kind": kind,
                     "first_at": _iso(alert["first_at"]), "last_at": _iso(alert["last_at"]),
                     "message": alert["message"], "source": alert["source"],
                     "evidence": json.loads(alert["evidence"] or "{}")},
    }


def notify_due(cfg: Any, store: Any, now: float | None = None) -> int:
    """Turn due alert groups into delivery rows (step 2). Returns notifications made."""
    now = time.time() if now is None else now
    wait = float(cfg.get("alerts", "group_wait_s"))
    window = float(cfg.get("alerts", "dedup_window_s"))
    sinks = enabled_sinks(cfg)
    made = 0
    with store.tx():
        for a in list(store.db.query("select * from alerts where count > notified_count")):
            if a["notified_count"] == 0:
                if now - a["first_at"] < wait:
                    continue
                kind, count = "new", a["count"]
            else:
                if now - a["first_at"] < window:
                    continue  # repeats inside the window wait for it to close
                kind, count = "repeat", a["count"] - a["notified_count"]
            body = payload(a, kind, count)
            for sink in sinks:
                if wants(cfg, sink, a["severity"]):
                    store.db["alert_deliveries"].insert({
                        "alert_id": a["id"], "sink": sink, "created_at": now, "kind": kind, "count": count,
                        "status": "pending", "attempts": 0, "next_at": now, "sent_at": None, "error": None,
                        "payload": json.dumps(body, default=str)})
            store.db["alerts"].update(a["id"], {"notified_count": a["count"], "notified_at": now})
            made += 1
    return made


def _backoff(cfg: Any, attempts: int) -> float:
    return min(float(cfg.get("alerts", "retry_base_s")) * 2 ** (attempts - 1), float(cfg.get("alerts", "retry_max_s")))


def deliver_due(cfg: Any, store: Any, *, deadline: float | None, log: Any = None,
                now: float | None = None, report: SendReport | None = None) -> SendReport:
    """Send due deliveries (step 3) until ``deadline`` (monotonic; None = no limit)."""
    report = report or SendReport()
    now = time.time() if now is None else now
    limit = int(cfg.get("alerts", "rate_limit_per_hour"))
    max_attempts = int(cfg.get("alerts", "max_attempts"))
    sent_last_hour = {r["sink"]: r["n"] for r in store.query(
        "select sink, count(*) as n from alert_deliveries where status = 'sent' and sent_at > ? group by sink",
        [now - 3600])}
    for d in store.query("select * from alert_deliveries where status = 'pending' and next_at <= ? order by id", [now]):
        sink = d["sink"]
        if sent_last_hour.get(sink, 0) >= limit:
            report.held += 1
            continue
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left < 0.5:
            report.held += 1
            continue
        timeout = float(cfg.get("alerts", "webhook_timeout_s"))
        timeout = timeout if left is None else max(0.2, min(timeout, left - 0.2))
        attempts = d["attempts"] + 1
        try:
            deliver(cfg, sink, json.loads(d["payload"]), timeout)
        except SinkError as e:
            give_up = e.permanent or attempts >= max_attempts
            upd = {"attempts": attempts, "error": str(e)[:500],
                   "status": "failed" if give_up else "pending",
                   "next_at": now + _backoff(cfg, attempts)}
            _update(store, d["id"], upd)
            if give_up:
                report.given_up += 1
                if log:
                    log.error("alert %s to %s given up after %d attempt(s): %s", d["alert_id"], sink, attempts, e)
            else:
                report.retrying += 1
            continue
        _update(store, d["id"], {"attempts": attempts, "status": "sent", "sent_at": now, "error": None})
        sent_last_hour[sink] = sent_last_hour.get(sink, 0) + 1
        report.sent += 1
    return report


def _update(store: Any, row_id: int, values: dict[str, Any]) -> None:
    def go() -> None:
        with store.tx():
            store.db["alert_deliveries"].update(row_id, values)
    store._guard("delivery update", go)


def send(cfg: Any, store: Any, *, deadline: float | None = None, log: Any = None, now: float | None = None) -> SendReport:
    """Ingest, notify, deliver (the whole of ``gpuguard alert send``)."""
    report = SendReport()
    report.ingested = ingest(cfg, store, now=now)
    report.notified = notify_due(cfg, store, now=now)
    return deliver_due(cfg, store, deadline=deadline, log=log, now=now, report=report)
