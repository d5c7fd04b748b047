"""Is a node in maintenance? A node is when it is inside a Slurm reservation with the
``MAINT`` flag (``scontrol show reservation``; Slurm's own way to say "being serviced":
the scontrol man page, RESERVATIONS, ``Flags=MAINT``) or inside one of the config's
``[maintenance] windows``.

In maintenance, ``gpuguard health`` still runs and records its findings, but sends no
alert and neither drains nor resumes the node; the suppression is recorded as a node
action and shown by ``gpuguard node show``.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from dataclasses import asdict, dataclass
from typing import Any


class MaintenanceError(ValueError):
    """A malformed maintenance window; ``str()`` names the entry and the problem."""


@dataclass(frozen=True)
class Window:
    """One configured window: Slurm hostlist ``nodes`` (``gpu[01-04],dgx7``), UTC epoch
    ``start_at``/``end_at``, free-text ``reason``."""

    nodes: str
    start_at: float
    end_at: float
    reason: str

    def covers(self, node: str, now: float) -> bool:
        import hostlist

        return self.start_at <= now < self.end_at and node in hostlist.expand_hostlist(self.nodes)


@dataclass(frozen=True)
class Maintenance:
    """``active``: in maintenance now; ``source``: ``reservation NAME`` or ``window``;
    ``reason``: why (the window's reason, the reservation's name); ``until``: UTC epoch
    end (None when unknown)."""

    active: bool
    source: str = ""
    reason: str = ""
    until: float | None = None

    def line(self) -> str:
        """One line for logs and ``node show``."""
        if not self.active:
            return "not in maintenance"
        end = "" if self.until is None else " until " + dt.datetime.fromtimestamp(self.until, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return f"in maintenance ({self.source}{': ' + self.reason if self.reason else ''}){end}"


def _when(v: Any, what: str) -> float:
    if isinstance(v, dt.datetime):
        t = v
    elif isinstance(v, str):
        try:
            t = dt.datetime.fromisoformat(v.replace("Z", "+00:00"))
        except ValueError:
            raise MaintenanceError(f"{what} {v!r} is not an ISO 8601 time") from None
    else:
        raise MaintenanceError(f"{what} must be a time, got {type(v).__name__}")
    if t.tzinfo is None:
        raise MaintenanceError(f"{what} {v!s} has no UTC offset (write Z or +01:00)")
    return t.timestamp()


def parse_windows(raw: list[Any]) -> list[Window]:
    """Validate ``[maintenance] windows`` (tables with ``nodes``, ``start``, ``end`` and
    an optional ``reason``). Raises :class:`MaintenanceError`."""
    out: list[Window] = []
    if not raw:
        return out
    import hostlist

    for i, w in enumerate(raw):
        where = f"window {i + 1}"
        if not isinstance(w, dict):
            raise MaintenanceError(f"{where} must be a table with nodes, start, end")
        unknown = set(w) - {"nodes", "start", "end", "reason"}
        if unknown:
            raise MaintenanceError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
        nodes = w.get("nodes")
        if not isinstance(nodes, str) or not nodes:
            raise MaintenanceError(f"{where}: nodes must be a Slurm host list such as \"gpu[01-04]\"")
        try:
            hostlist.expand_hostlist(nodes)
        except hostlist.BadHostlist as e:
            raise MaintenanceError(f"{where}: nodes {nodes!r}: {e}") from None
        start, end = _when(w.get("start"), f"{where}: start"), _when(w.get("end"), f"{where}: end")
        if end <= start:
            raise MaintenanceError(f"{where}: end is not after start")
        out.append(Window(nodes, start, end, str(w.get("reason", ""))))
    return out


def parse_reservations(text: str) -> list[dict[str, str]]:
    """``scontrol show reservation -o`` -> one field dict per reservation (empty for
    "No reservations in the system")."""
    from gpuguard.slurm import scontrol_fields

    return [dict(scontrol_fields(line)) for line in text.splitlines() if line.startswith("ReservationName=")]


def maint_reservation(reservations: list[dict[str, str]], node: str) -> dict[str, str] | None:
    """The first ACTIVE reservation with the MAINT flag that holds ``node``, or None."""
    import hostlist

    for r in reservations:
        flags = r.get("Flags", "").split(",")
        if "MAINT" not in flags or r.get("State") != "ACTIVE":
            continue
        try:
            if node in hostlist.expand_hostlist(r.get("Nodes", "")):
                return r
        except hostlist.BadHostlist:
            continue
    return None


def _slurm_time(s: str) -> float | None:
    try:  # scontrol prints local wall-clock time without an offset
        return dt.datetime.fromisoformat(s).timestamp()
    except ValueError:
        return None


def status(cfg: Any, node: str, *, slurm: Any = None, now: float | None = None,
           reservations_text: str | None = None) -> tuple[Maintenance, list[str]]:
    """Maintenance state of ``node`` now. Reads the config windows and, when
    ``[maintenance] slurm_reservations``, ``scontrol show reservation -o`` through
    ``slurm`` (a :class:`gpuguard.slurm.SlurmCli`) or ``reservations_text``.

    Returns ``(Maintenance, tool_errors)``; a Slurm failure is a tool error and counts as
    "no reservation" (the config windows still apply).
    """
    import time

    now = time.time() if now is None else now
    errors: list[str] = []
    if cfg.get("maintenance", "slurm_reservations") and (slurm is not None or reservations_text is not None):
        text = reservations_text
        if text is None:
            from gpuguard.slurm import SlurmError

            try:
                text = slurm.run("scontrol", "show", "reservation", "-o")
            except SlurmError as e:
                errors.append(f"maintenance: {e}")
                text = ""
        r = maint_reservation(parse_reservations(text), node)
        if r is not None:
            return Maintenance(True, f"reservation {r.get('ReservationName', '?')}", "Slurm MAINT reservation",
                               _slurm_time(r.get("EndTime", ""))), errors
    for w in parse_windows(cfg.get("maintenance", "windows")):
        if w.covers(node, now):
            return Maintenance(True, "window", w.reason, w.end_at), errors
    return Maintenance(False), errors


def _cache_path(cfg: Any) -> str:
    return os.path.join(cfg.get("paths", "state_dir"), "maintenance.json")


def save(cfg: Any, m: Maintenance) -> None:
    """Keep the last state for hooks that must not query Slurm (:func:`cached`).
    Raises ``OSError``."""
    from gpuguard.ops.files import atomic_write

    atomic_write(_cache_path(cfg), json.dumps(asdict(m)) + "\n")


def cached(cfg: Any, node: str, now: float | None = None) -> Maintenance:
    """Maintenance as the last health run saw it (still running: ``until`` in the
    future), else the config windows alone. Never raises."""
    import time

    now = time.time() if now is None else now
    try:
        with open(_cache_path(cfg), encoding="utf-8") as fh:
            m = Maintenance(**json.load(fh))
        if m.active and (m.until is None or m.until > now):
            return m
    except (OSError, ValueError, TypeError):
        pass  # no cache yet, or a broken one: fall back to the windows
    try:
        return status(cfg, node, now=now)[0]
    except MaintenanceError:
        return Maintenance(False)


def record_suppressed(cfg: Any, m: Maintenance, outcome: str, reason: str, *, by: str, log: Any) -> None:
    """A hook kept from ``outcome`` (``drain``/``fail-job``) by maintenance ``m``: log it
    and record a ``suppressed`` node action (so ``gpuguard node show`` says so). Opens the
    store itself, only on this rare path; never raises."""
    log.warning("%s: would %s: %s", m.line(), outcome, reason)
    try:
        from gpuguard.ops.nodes import record_action
        from gpuguard.store import open_store

        st = open_store(cfg.store_path)
        try:
            record_action(st, node=cfg.node_name, action="suppressed", by=by, outcome="refused",
                          why=f"would {outcome}: {m.line()}", reason=reason, policy_decision=outcome)
        finally:
            st.close()
    except Exception as e:
        log.error("tool error: recording the suppressed %s: %s: %s", outcome, type(e).__name__, e)
