"""One health run: snapshot the GPUs, scan the kernel log, run the checks, decide, record.

Shared by the prolog, the epilog's post-job checks and ``gpuguard check``. Failures of
gpuguard itself (store, replay file, kernel-log reader, a crashing check) are collected in
``tool_errors`` and never turn into findings or drains (DESIGN.md, "Fail open on our own
errors"); hardware problems always become findings.
"""

from __future__ import annotations

import glob
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from gpuguard import policy as policy_mod
from gpuguard.checks import CheckContext, counters_of, run_checks
from gpuguard.config import Config
from gpuguard.hookenv import parse_job_gpus  # noqa: F401  (re-exported for callers of health)
from gpuguard.model import Finding, NodeSnapshot

CURSOR_NAME = "kernel_log"


@dataclass
class HealthResult:
    """What a health run saw and decided. ``snapshot`` is None only when the GPU source
    itself could not be opened (a tool error)."""

    snapshot: NodeSnapshot | None
    findings: list[Finding]
    decision: policy_mod.Decision
    tool_errors: list[str] = field(default_factory=list)
    xid_events: list[Any] = field(default_factory=list)
    run_id: int | None = None

    @property
    def worst_severity(self) -> str | None:
        from gpuguard.model import SEVERITY_RANK

        if not self.findings:
            return None
        return max((f.severity for f in self.findings), key=SEVERITY_RANK.__getitem__)


def gpus_expected(cfg: Config, job_gpus: list[int] | None) -> bool:
    """True when this node should have GPUs: configured count, job gres, or device files."""
    return bool(cfg.get("node", "gpu_count") or job_gpus or glob.glob("/dev/nvidia[0-9]*"))


def take_snapshot(cfg: Config, *, budget_s: float | None = None,
                  nvidia_smi_file: str | None = None) -> tuple[NodeSnapshot | None, list[str]]:
    """Snapshot from the configured source (or an nvidia-smi dump). Returns
    ``(snapshot or None, tool_errors)``; never raises for a bad replay file."""
    from gpuguard.gpu import open_source
    from gpuguard.gpu.replay import ReplayError

    kind = "replay" if nvidia_smi_file else cfg.get("gpu", "source")
    path = nvidia_smi_file or cfg.get("gpu", "replay_path")
    try:
        src = open_source(kind, replay_path=path, call_timeout_s=cfg.get("gpu", "call_timeout_s"),
                          total_budget_s=budget_s)
    except ReplayError as e:
        return None, [f"GPU source: {e}"]
    try:
        snap = src.snapshot()
    finally:
        src.close()
    if snap.error and snap.error.startswith("tool error:"):
        # gpuguard's own fault (a broken install): judge nothing rather than drain
        return None, [f"GPU source: {snap.error[len('tool error:'):].strip()}"]
    return snap, []


def scan_kernel_log(cfg: Config, store: Any, source: str | None = None,
                    timeout_s: float = 5.0) -> tuple[list[Any], str | None, list[str]]:
    """Read the kernel log since the stored cursor and parse XID/SXid events.

    Returns ``(events, new_cursor, tool_errors)``. The caller stores the cursor only after
    the events are stored, so a failed write re-reads them next time instead of losing
    them. With ``xid.first_scan_lookback = "none"`` the first scan only sets the cursor.
    """
    from gpuguard.xid.kernel_log import KernelLogError, read_since
    from gpuguard.xid.parse import parse_lines

    src = source or cfg.get("xid", "kernel_log")
    errors: list[str] = []
    cursor = read_cursor_file(cfg)
    if cursor is None and store is not None:
        try:
            cursor = store.get_cursor(CURSOR_NAME)
        except Exception as e:  # store trouble is a tool error; read from the start
            errors.append(f"store: {e}")
    try:
        lines, new_cursor = read_since(src, cursor, timeout_s)
    except KernelLogError as e:
        return [], None, [*errors, f"kernel log: {e}"]
    if cursor is None and cfg.get("xid", "first_scan_lookback") == "none":
        return [], new_cursor, errors
    res = parse_lines(lines)
    if res.unparsed:
        errors.append(f"kernel log: {res.unparsed} NVRM line(s) not understood")
    return res.events, new_cursor, errors


def _cursor_path(cfg: Config) -> str:
    return os.path.join(cfg.get("paths", "state_dir"), "kernel_log.cursor")


def read_cursor_file(cfg: Config) -> str | None:
    """The kernel-log cursor kept in ``{state_dir}/kernel_log.cursor`` (None if absent).

    The cursor lives in a small file as well as the store so that a broken store (corrupt,
    locked, full) does not make every prolog re-read the whole kernel log and drain the
    node again for an XID that was already acted on."""
    try:
        fd = os.open(_cursor_path(cfg), os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as fh:
            return fh.read(4096).strip() or None
    except OSError:
        return None


def write_cursor_file(cfg: Config, cursor: str) -> None:
    """Atomically replace the cursor file. Raises ``OSError``."""
    d = cfg.get("paths", "state_dir")
    os.makedirs(d, mode=0o755, exist_ok=True)
    tmp = _cursor_path(cfg) + f".{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as fh:
        fh.write(cursor + "\n")
    os.replace(tmp, _cursor_path(cfg))


def run_health(cfg: Config, *, hook: str, store: Any = None, job_id: str | None = None,
               job_gpus: list[int] | None = None, nvidia_smi_file: str | None = None,
               kernel_log: str | None = None, scan_xid: bool = True, record: bool = True,
               budget_s: float | None = None,
               extra_checks: Any = None) -> HealthResult:
    """Run every enabled check and decide (see the module docstring).

    ``store`` is an open :class:`gpuguard.store.Store` or None (no history, nothing
    recorded). ``record=False`` reads history but writes nothing and leaves the kernel-log
    cursor alone (``gpuguard check`` on a live node must not consume the prolog's XIDs).
    ``extra_checks(snapshot or None) -> (findings, tool_errors)`` adds findings decided
    and recorded with the checks' own (``gpuguard health``'s registered steps).
    """
    started = time.time()
    tool_errors: list[str] = []
    snap, errs = take_snapshot(cfg, budget_s=budget_s, nvidia_smi_file=nvidia_smi_file)
    tool_errors += errs
    node = cfg.node_name
    previous: dict[str, Any] = {}
    inventory: dict[str, Any] = {}
    if store is not None:
        try:
            previous = store.get_counters(node)
            inventory = {r["uuid"]: r for r in store.query("select * from inventory where node = ?", [node])}
        except Exception as e:
            tool_errors.append(f"store: {e}")
    events: list[Any] = []
    new_cursor = None
    if scan_xid:
        events, new_cursor, errs = scan_kernel_log(cfg, store, kernel_log)
        tool_errors += errs
    if snap is None:
        # Our own problem (unreadable replay file): nothing to judge the GPUs by. XID
        # events still count, mapped to no GPU.
        snap_for_checks = NodeSnapshot(taken_at=started, source="none", error=None)
    else:
        snap_for_checks = snap
    ctx = CheckContext(
        snapshot=snap_for_checks, previous=previous, previous_inventory=inventory,
        expected_gpu_count=cfg.get("node", "gpu_count") or None, job_gpu_indices=job_gpus,
        xid_events=events, settings=cfg.values["checks"],
        gpu_nodes_expected=gpus_expected(cfg, job_gpus), hook=hook, node=node, job_id=job_id,
        store=store if snap is not None else None, config=cfg,
    )
    disabled = list(cfg.get("checks", "disabled"))
    if snap is None:
        disabled += ["gpu_count", "driver"]
    findings, errs = run_checks(ctx, disabled)
    tool_errors += errs
    if extra_checks is not None:
        more, errs = extra_checks(snap)
        findings += more
        tool_errors += errs
    decision = policy_mod.decide(findings, cfg.policy, cfg.xid_policy)
    result = HealthResult(snap, findings, decision, tool_errors, events)
    if store is not None and record:
        try:
            result.run_id = record_run(store, cfg, hook, job_id, started, result, new_cursor)
        except Exception as e:
            result.tool_errors.append(f"store: {e}")
    if store is not None and record:
        for table, rows in ctx.records.items():  # e.g. the idle-baseline readings
            try:
                store.insert_many(table, rows)
            except Exception as e:
                result.tool_errors.append(f"store: {e}")
    if record and new_cursor is not None:
        # The decision above has acted on these events: move on even if the store failed.
        try:
            write_cursor_file(cfg, new_cursor)
        except OSError as e:
            result.tool_errors.append(f"cursor file: {e}")
    return result


def record_run(store: Any, cfg: Config, hook: str, job_id: str | None, started: float,
               res: HealthResult, new_cursor: str | None) -> int:
    """Write the run, its findings, events, inventory changes and counters; then move the
    kernel-log cursor. Raises :class:`gpuguard.store.StoreError`."""
    node = cfg.node_name
    now = time.time()
    snap = res.snapshot
    run_id = store.insert("health_runs", {
        "node": node, "hook": hook, "job_id": job_id, "started_at": started, "finished_at": now,
        "decision": res.decision.outcome, "reason": res.decision.reason,
        "tool_errors": json.dumps(res.tool_errors), "gpu_count": len(snap.gpus) if snap else None,
        "source": snap.source if snap else None,
    })
    store.insert_many("findings", [
        {"run_id": run_id, "node": node, "at": now, "job_id": job_id, "code": f.code, "severity": f.severity,
         "action": a, "gpu_index": f.gpu_index, "gpu_uuid": f.gpu_uuid, "message": f.message,
         "evidence": json.dumps(f.evidence, default=str)}
        for f, a in res.decision.actions
    ])
    if res.xid_events:
        from gpuguard.xid.catalog import classify

        by_pci = snap.by_pci() if snap else {}
        rows = []
        for ev in res.xid_events:
            g = by_pci.get(ev.pci_bus_id) if ev.kind != "sxid" and ev.pci_bus_id else None
            rows.append({
                "node": node, "at": ev.timestamp or now, "kind": ev.kind, "code": ev.xid,
                "gpu_index": g.index if g else None, "gpu_uuid": g.uuid if g else None,
                "pci_bus_id": ev.pci_bus_id, "pid": ev.pid, "process": ev.process, "message": ev.message,
                "action": classify(ev).action, "job_id": job_id, "source": "kernel_log", "raw": ev.raw[:2000],
            })
        store.insert_many("events", rows)
    if snap and snap.gpus:
        _record_inventory(store, node, snap, now)
        store.set_counters(node, counters_of(snap))
    if new_cursor is not None:
        store.set_cursor(CURSOR_NAME, new_cursor)
    return run_id


def _record_inventory(store: Any, node: str, snap: NodeSnapshot, now: float) -> None:
    from gpuguard.checks.inventory import TRACKED

    old = {r["uuid"]: r for r in store.query("select * from inventory where node = ?", [node])}
    changes = []
    rows = []
    for g in snap.gpus:
        if not g.uuid:
            continue
        prev = old.get(g.uuid)
        row = {"node": node, "uuid": g.uuid, "gpu_index": g.index, "last_seen": now,
               "first_seen": prev["first_seen"] if prev else now}
        for f in TRACKED:
            row[f] = getattr(g, f)
            if prev and row[f] is not None and prev.get(f) not in (None, row[f]):
                changes.append({"at": now, "node": node, "uuid": g.uuid, "gpu_index": g.index,
                                "field": f, "old": str(prev.get(f)), "new": str(row[f])})
        rows.append(row)
    with store.tx():
        store.db["inventory"].upsert_all(rows, pk=("node", "uuid"))
        if changes:
            store.db["inventory_changes"].insert_all(changes)
