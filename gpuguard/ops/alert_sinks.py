"""Where alerts go: syslog/journald, a JSON webhook, mail. Each sink has a lowest severity
(``[alerts] *_min_severity``; empty = off) and raises :class:`SinkError` on failure
(``permanent`` when a retry cannot help, e.g. HTTP 400).

* **syslog**: :class:`logging.handlers.SysLogHandler` on ``/dev/log`` (journald listens
  there) or ``host:port`` (UDP); priority from severity (critical -> CRIT, warning ->
  WARNING, info -> INFO).
* **webhook**: ``POST`` of JSON with ``text`` (the one-line message Slack, Mattermost and
  Teams incoming webhooks display) and ``gpuguard`` (the structured alert).
* **mail**: an argument list, never a shell: ``PROG -oi -- RCPT...`` with headers on stdin
  for a sendmail, else ``PROG -s SUBJECT RCPT...`` with the body on stdin (how slurmctld
  calls its ``MailProg``).
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import subprocess
import sys
import urllib.error
import urllib.request
from typing import Any

SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}
SINKS = ("syslog", "webhook", "mail")


class SinkError(Exception):
    """Delivery failed; ``permanent``: retrying cannot help."""

    def __init__(self, msg: str, permanent: bool = False):
        super().__init__(msg)
        self.permanent = permanent


def enabled_sinks(cfg: Any) -> list[str]:
    """Sinks switched on by the config."""
    out = []
    if cfg.get("alerts", "syslog_min_severity"):
        out.append("syslog")
    if cfg.get("alerts", "webhook_url") and cfg.get("alerts", "webhook_min_severity"):
        out.append("webhook")
    if cfg.get("alerts", "mail_to") and cfg.get("alerts", "mail_min_severity"):
        out.append("mail")
    return out


def wants(cfg: Any, sink: str, severity: str) -> bool:
    """Does ``sink`` take alerts of ``severity``?"""
    floor = cfg.get("alerts", f"{sink}_min_severity")
    return bool(floor) and SEVERITY_RANK.get(severity, 0) >= SEVERITY_RANK[floor]


def deliver(cfg: Any, sink: str, payload: dict[str, Any], timeout_s: float) -> None:
    """Send ``payload`` (``text``, ``subject``, ``severity``, ``gpuguard``) to ``sink``.
    Raises :class:`SinkError`."""
    {"syslog": _syslog, "webhook": _webhook, "mail": _mail}[sink](cfg, payload, timeout_s)


def _syslog(cfg: Any, payload: dict[str, Any], timeout_s: float) -> None:
    addr_s = cfg.get("alerts", "syslog_address")
    address: Any = addr_s
    if ":" in addr_s and not addr_s.startswith("/"):
        host, _, port = addr_s.rpartition(":")
        address = (host, int(port))
    fac = logging.handlers.SysLogHandler.facility_names.get(cfg.get("alerts", "syslog_facility"))
    if fac is None:
        raise SinkError(f"syslog facility {cfg.get('alerts', 'syslog_facility')!r} unknown", permanent=True)
    try:
        handler = logging.handlers.SysLogHandler(address=address, facility=fac)
    except OSError as e:
        raise SinkError(f"syslog {addr_s}: {e.strerror or e}") from None
    handler.ident = "gpuguard: "
    level = {"critical": logging.CRITICAL, "warning": logging.WARNING}.get(payload["severity"], logging.INFO)
    rec = logging.LogRecord("gpuguard.alert", level, __file__, 0, "%s", (payload["text"],), None)
    errors: list[BaseException | None] = []
    handler.handleError = lambda record: errors.append(sys.exc_info()[1])  # type: ignore[method-assign]
    try:
        handler.emit(rec)
    finally:
        handler.close()
    if errors:
        raise SinkError(f"syslog {addr_s}: {errors[0]}")


def _webhook(cfg: Any, payload: dict[str, Any], timeout_s: float) -> None:
    url = cfg.get("alerts", "webhook_url")
    body = json.dumps({"text": payload["text"], "gpuguard": payload["gpuguard"]}).encode()
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Content-Type": "application/json", "User-Agent": "gpuguard"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            resp.read(65536)
    except urllib.error.HTTPError as e:
        # 408/429 and 5xx are worth a retry; any other 4xx will fail the same way again.
        raise SinkError(f"webhook: HTTP {e.code} {e.reason}",
                        permanent=400 <= e.code < 500 and e.code not in (408, 429)) from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise SinkError(f"webhook: {getattr(e, 'reason', None) or e}") from None


def mail_command(cfg: Any, subject: str, slurm_mailprog: str | None = None) -> tuple[list[str], bool]:
    """``(argv, sendmail_style)`` for the mail sink (see the module docstring)."""
    prog = cfg.get("alerts", "mail_program") or slurm_mailprog or "/usr/sbin/sendmail"
    rcpts = [str(r) for r in cfg.get("alerts", "mail_to")]
    if os.path.basename(prog).startswith("sendmail"):
        return [prog, "-oi", "--", *rcpts], True
    return [prog, "-s", subject, *rcpts], False


def _slurm_mailprog(cfg: Any) -> str | None:
    from gpuguard.slurm import SlurmCli, SlurmError

    try:
        out = SlurmCli(cfg.get("slurm", "bin_dir"), timeout_s=5.0).run("scontrol", "show", "config")
    except SlurmError:
        return None
    for line in out.splitlines():
        key, _, val = line.partition("=")
        if key.strip() == "MailProg":
            return val.strip() or None
    return None


def _mail(cfg: Any, payload: dict[str, Any], timeout_s: float) -> None:
    subject = payload["subject"]
    mailprog = None if cfg.get("alerts", "mail_program") else _slurm_mailprog(cfg)
    argv, sendmail = mail_command(cfg, subject, mailprog)
    body = payload["text"] + "\n\n" + json.dumps(payload["gpuguard"], indent=2, default=str) + "\n"
    if sendmail:
        body = f"To: {', '.join(argv[3:])}\nSubject: {subject}\n\n{body}"
    try:
        p = subprocess.run(argv, input=body, text=True, encoding="utf-8", errors="replace", capture_output=True,
                           timeout=timeout_s)
    except FileNotFoundError:
        raise SinkError(f"mail: {argv[0]} not found", permanent=True) from None
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SinkError(f"mail: {argv[0]}: {e}") from None
    if p.returncode != 0:
        raise SinkError(f"mail: {argv[0]} exit {p.returncode}: {(p.stderr or '').strip()[-200:]}")
