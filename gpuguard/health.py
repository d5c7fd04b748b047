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

from gpuguard import durable
from gpuguard import policy as policy_mod
from gpuguard.checks import CheckContext, counters_of, run_checks
from gpuguard.config import Config
from gpuguard.hookenv import parse_job_gpus  # noqa: F401  (re-exported for callers of health)
from gpuguard.checks.inventory import TRACKED
from gpuguard.model import SEVERITY_RANK, Finding, NodeSnapshot
from gpuguard.rows import event_row, finding_row

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
    #: ``table -> rows`` the checks want stored with the run (``CheckContext.records``)
    records: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    #: False when the kernel log was to be scanned but could not be read (unreadable
    #: source, failed tool, cursor lock held): no XID finding means nothing then
    kernel_log_read: bool = True
    #: reason -> number of kernel-log lines with an XID/SXid marker that were not
    #: accepted (not parseable, or not the kernel's own: a forged ``logger`` line); their
    #: summary is also in ``tool_errors`` (:data:`REJECTED_ERROR`)
    xid_rejected: dict[str, int] = field(default_factory=dict)

    @property
    def worst_severity(self) -> str | None:
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


#: Start of the tool error that sums up the kernel-log lines with an XID/SXid marker
#: that were not accepted (followed by :meth:`gpuguard.xid.parse.ParseResult.rejected_summary`).
REJECTED_ERROR = "kernel log: XID/SXid line(s) not accepted: "


def scan_kernel_log(cfg: Config, store: Any, source: str | None = None, timeout_s: float = 5.0,
                    read_all_s: float | None = None) -> tuple[list[Any], str | None, list[str]]:
    """:func:`scan_kernel_log_rejected` without the rejected lines' reasons."""
    events, cursor, errors, _rejected = scan_kernel_log_rejected(cfg, store, source, timeout_s, read_all_s)
    return events, cursor, errors


def scan_kernel_log_rejected(cfg: Config, store: Any, source: str | None = None, timeout_s: float = 5.0,
                             read_all_s: float | None = None
                             ) -> tuple[list[Any], str | None, list[str], dict[str, int]]:
    """Read the kernel log since the stored cursor and parse XID/SXid events.

    Returns ``(events, new_cursor, tool_errors, rejected)``; ``rejected``: reason ->
    number of lines with an XID/SXid marker that were not accepted. The caller stores the cursor only after
    the events are stored, so a failed write re-reads them next time instead of losing
    them. The first scan (no cursor yet) follows ``xid.first_scan_lookback``: ``"boot"``
    reads a text file from the current boot's first kernel line
    (:func:`gpuguard.xid.logfile.boot_cursor`), ``"none"`` only sets the cursor.

    Spoofing rule: structured sources (kmsg, journalctl JSON, raw dmesg) deliver the
    kernel's own messages. A text file from ``[xid] kernel_log`` can hold any user's
    ``logger -t kernel`` line (``/var/log/syslog``, ``/var/log/messages``), so its events
    are marked ``untrusted_source`` (their findings are capped at ``alert``) unless
    ``[xid] kernel_log_kernel_only = true`` says the file holds kernel messages only. A
    ``source`` passed explicitly (``gpuguard check --kernel-log FILE``: the operator
    names the file) is trusted. Lines with an XID marker that are not accepted are
    reported in ``tool_errors`` with their reasons.

    A hook reads at most one step (:data:`gpuguard.xid.kernel_log.MAX_READ_BYTES`) per
    run and the next run goes on from the cursor. With ``read_all_s`` (an operator's
    ``check --kernel-log``) the source is read to its end within that many seconds: a
    check that stopped after the first step would pass a file whose XID comes later; not
    reaching the end is a tool error and no cursor (the check cannot pass).
    """
    from gpuguard.xid.kernel_log import KernelLogError, is_structured, read_since
    from gpuguard.xid.logtext import parse_log

    src = source or cfg.get("xid", "kernel_log")
    structured = is_structured(src)
    trusted = structured or source is not None or bool(cfg.get("xid", "kernel_log_kernel_only"))
    errors: list[str] = []
    cursor = read_cursor_file(cfg)
    if cursor is None and store is not None:
        try:
            cursor = store.get_cursor(CURSOR_NAME)
        except Exception as e:  # store trouble is a tool error; read from the start
            errors.append(f"store: {e}")
    lookback = cfg.get("xid", "first_scan_lookback")
    first = cursor is None
    if first and lookback == "boot" and not structured and source is None:
        # a text file keeps earlier boots: start at this boot's first kernel line
        from gpuguard.xid.logfile import boot_cursor

        cursor = boot_cursor(src, deadline=time.monotonic() + timeout_s / 2)
    try:
        lines, new_cursor = read_since(src, cursor, timeout_s)
    except KernelLogError as e:
        return [], None, [*errors, f"kernel log: {e}"], {}
    if first and lookback == "none":
        return [], new_cursor, errors, {}
    res = parse_log(lines, structured=structured)
    if read_all_s is not None:
        new_cursor = _read_rest(src, new_cursor, lines, res, structured, time.monotonic() + read_all_s, errors)
    if res.unparsed:
        errors.append(REJECTED_ERROR + res.rejected_summary())
    if not trusted:
        for ev in res.events:
            ev.untrusted_source = src
    return res.events, new_cursor, errors, dict(res.rejected)


def _read_rest(src: str, cursor: str | None, lines: list[str], res: Any, structured: bool, deadline: float,
               errors: list[str]) -> str | None:
    """Read ``src`` on from ``cursor`` until nothing new comes, adding to ``res``; the last
    cursor, or None (and a tool error) when ``deadline`` (monotonic) or a read error
    stopped it first. A text file's last line without its newline (a saved log cut short)
    is read too, as ``xid scan`` reads it; the cursor stays before it, so a hook going on
    from it reads the finished line."""
    from gpuguard.xid.kernel_log import KernelLogError, read_file, read_since
    from gpuguard.xid.logtext import parse_log

    while lines:
        left = deadline - time.monotonic()
        if left <= 0:
            errors.append(f"kernel log: {src} not read to its end within the time limit")
            return None
        try:
            lines, nxt = read_since(src, cursor, left)
        except KernelLogError as e:
            errors.append(f"kernel log: {e}")
            return None
        if nxt == cursor:
            break
        cursor = nxt
        res.merge(parse_log(lines, structured=structured))
    if not structured and cursor and cursor.startswith("file:"):
        try:
            tail, _ = read_file(cursor, src, finished=True)
        except KernelLogError as e:
            errors.append(f"kernel log: {e}")
            return None
        res.merge(parse_log(tail, structured=False))
    return cursor


CURSOR_FILE = "kernel_log.cursor.json"


def _legacy_cursor_path(cfg: Config) -> str:
    return os.path.join(cfg.get("paths", "state_dir"), "kernel_log.cursor")


def read_cursor_file(cfg: Config) -> str | None:
    """The kernel-log cursor kept beside the store (None if absent).

    The cursor lives in small files as well as the store so that a broken store (corrupt,
    locked, full) does not make every hook re-read the whole kernel log and drain the
    node again for an XID that was already acted on; the files are written to
    ``state_dir`` and ``run_dir`` (:mod:`gpuguard.durable`), so a read-only or full
    state directory does not either. A plain ``kernel_log.cursor`` file of earlier
    versions is read when no copy exists."""
    value, _seq = durable.read(durable.state_dirs(cfg), CURSOR_FILE)
    if isinstance(value, str) and value:
        return value
    try:
        fd = os.open(_legacy_cursor_path(cfg), os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as fh:
            return fh.read(4096).strip() or None
    except OSError:
        return None


def write_cursor_file(cfg: Config, cursor: str) -> None:
    """Write the cursor to every state directory that takes it. Raises ``OSError``
    only when none does."""
    durable.write(durable.state_dirs(cfg), CURSOR_FILE, cursor)


@dataclass
class Collected:
    """What :func:`collect` read: the GPU snapshot (None: our own fault), new kernel-log
    events, the cursor to store once they are acted on, and tool errors."""

    started: float
    snapshot: NodeSnapshot | None
    events: list[Any]
    new_cursor: str | None
    tool_errors: list[str]
    cursor_lock: Any = None
    #: reason -> count of XID/SXid-marked lines not accepted (:attr:`HealthResult.xid_rejected`)
    xid_rejected: dict[str, int] = field(default_factory=dict)

    def release_cursor(self) -> None:
        """Release the kernel-log cursor lock (:mod:`gpuguard.cursorlock`) once the
        cursor has moved or will not; idempotent."""
        if self.cursor_lock is not None:
            self.cursor_lock.release()


#: Longest a ``check --kernel-log`` without a budget reads its log (our choice: a year of a
#: busy kern.log, several GiB, parses in a few minutes).
READ_ALL_S = 600.0

#: Share of ``collect``'s budget the cursor lock may be waited for (our choice: the
#: snapshot and the checks keep the rest).
CURSOR_LOCK_SHARE = 0.25


def collect(cfg: Config, *, budget_s: float | None = None, nvidia_smi_file: str | None = None,
            kernel_log: str | None = None, scan_xid: bool = True, store: Any = None,
            lock_cursor: bool = False) -> Collected:
    """Take the GPU snapshot and read the kernel log since the cursor. Touches the store
    only to find a cursor when no cursor file exists (``store`` may be None).

    ``lock_cursor`` (a caller that moves the cursor): the kernel log is read under the
    cursor lock (:mod:`gpuguard.cursorlock`), waited for at most
    :data:`CURSOR_LOCK_SHARE` of ``budget_s``; the caller releases it with
    :meth:`Collected.release_cursor` after moving the cursor. When the lock is not taken
    the kernel log is not read this run (one tool error; no event, no cursor to move),
    so a lock failure never drains; when no directory can hold the lock it is read
    without it (one tool error)."""
    started = time.time()
    snap, errors = take_snapshot(cfg, budget_s=budget_s, nvidia_smi_file=nvidia_smi_file)
    events: list[Any] = []
    new_cursor = None
    lock = None
    rejected: dict[str, int] = {}
    if scan_xid and lock_cursor:
        from gpuguard import cursorlock

        try:
            lock = cursorlock.acquire(cfg, None if budget_s is None else budget_s * CURSOR_LOCK_SHARE)
            if lock.fd is None:
                errors.append(f"kernel log: {lock.why}")
        except cursorlock.LockNotTaken as e:
            errors.append(f"kernel log: not read this run: {e} (that run reads these events)")
            scan_xid = False
    if scan_xid:
        try:
            # an explicit source (check/health --kernel-log) is the operator's: read to its end
            read_all = None if kernel_log is None else (budget_s if budget_s is not None else READ_ALL_S)
            events, new_cursor, errs, rejected = scan_kernel_log_rejected(cfg, store, kernel_log,
                                                                          read_all_s=read_all)
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        errors += errs
    return Collected(started, snap, events, new_cursor, errors, lock, rejected)


def judge(cfg: Config, col: Collected, *, hook: str, store: Any = None, job_id: str | None = None,
          job_gpus: list[int] | None = None, record: bool = True,
          extra_findings: list[Finding] | None = None) -> HealthResult:
    """Run every enabled check on ``col`` and decide. With ``store`` the checks also see
    the history (counters and inventory of the last run, the idle baseline); without it
    they judge the live state alone, which is all a drain decision needs (every default
    drain rests on live state: XIDs, volatile ECC, lost GPUs, links). ``extra_findings``
    (the Prolog's NCCL probe) are decided and recorded with the checks' findings.
    ``hook="epilog"``: the decision is :func:`gpuguard.policy.after_job`'s (no job is left
    to fail: a fail-job finding is alerted, and the run records that)."""
    node = cfg.node_name
    tool_errors = list(col.tool_errors)
    previous: dict[str, Any] = {}
    inventory: dict[str, Any] = {}
    history = False
    if store is not None:
        try:
            previous = store.get_counters(node)
            inventory = {r["uuid"]: r for r in store.query("select * from inventory where node = ?", [node])}
            history = True
        except Exception as e:
            tool_errors.append(f"store: {e}")
    snap = col.snapshot
    # Our own problem (unreadable replay file): nothing to judge the GPUs by. XID events
    # still count, mapped to no GPU.
    snap_for_checks = snap if snap is not None else NodeSnapshot(taken_at=col.started, source="none", error=None)
    ctx = CheckContext(
        snapshot=snap_for_checks, previous=previous, history=history, previous_inventory=inventory,
        expected_gpu_count=cfg.get("node", "gpu_count") or None, job_gpu_indices=job_gpus,
        xid_events=col.events, settings=cfg.values["checks"],
        gpu_nodes_expected=gpus_expected(cfg, job_gpus), hook=hook, node=node, job_id=job_id,
        store=store if snap is not None else None, config=cfg,
    )
    disabled = list(cfg.get("checks", "disabled"))
    if snap is None:
        disabled += ["gpu_count", "driver"]
    findings, errs = run_checks(ctx, disabled)
    tool_errors += errs
    findings += extra_findings or []  # found before this run (the Prolog's NCCL probe)
    decision = policy_mod.decide(findings, cfg.policy, cfg.xid_policy)
    if hook == "epilog":  # the job has ended: nothing to fail (policy.after_job)
        decision = policy_mod.after_job(decision)
    return HealthResult(snap, findings, decision, tool_errors, col.events, records=ctx.records,
                        xid_rejected=dict(col.xid_rejected))


def run_health(cfg: Config, *, hook: str, store: Any = None, job_id: str | None = None,
               job_gpus: list[int] | None = None, nvidia_smi_file: str | None = None,
               kernel_log: str | None = None, scan_xid: bool = True, record: bool = True,
               budget_s: float | None = None) -> HealthResult:
    """Collect, judge, record and move the cursor in one go (``gpuguard check``).

    ``store`` is an open :class:`gpuguard.store.Store` or None (no history, nothing
    recorded). ``record=False`` reads history but writes nothing and leaves the kernel-log
    cursor alone (``gpuguard check`` on a live node must not consume the prolog's XIDs).
    The hooks use :mod:`gpuguard.nodecheck` instead, which acts before any store I/O.
    """
    col = collect(cfg, budget_s=budget_s, nvidia_smi_file=nvidia_smi_file, kernel_log=kernel_log,
                  scan_xid=scan_xid, store=store, lock_cursor=record)
    try:
        result = judge(cfg, col, hook=hook, store=store, job_id=job_id, job_gpus=job_gpus, record=record)
        result.kernel_log_read = not scan_xid or col.new_cursor is not None
        if store is not None and record:
            try:
                result.run_id = record_run(store, cfg, hook, job_id, col.started, result, col.new_cursor)
            except Exception as e:
                result.tool_errors.append(f"store: {e}")
        if record and col.new_cursor is not None:
            try:
                write_cursor_file(cfg, col.new_cursor)
            except OSError as e:
                result.tool_errors.append(f"cursor file: {e}")
    finally:
        col.release_cursor()
    return result


def record_run(store: Any, cfg: Config, hook: str, job_id: str | None, started: float,
               res: HealthResult, new_cursor: str | None, *, done: str | None = None) -> int:
    """Write the run, its findings, events, inventory changes and counters; then move the
    kernel-log cursor. ``decision`` is what the run did: ``done``
    (:func:`gpuguard.policy.done_outcome`: ``suppressed``, ``dry-run``), else the
    decision's outcome; ``policy_decision`` the policy's (``res.decision.decided``).
    Raises :class:`gpuguard.store.StoreError`."""
    node = cfg.node_name
    now = time.time()
    snap = res.snapshot
    run_id = store.insert("health_runs", {
        "node": node, "hook": hook, "job_id": job_id, "started_at": started, "finished_at": now,
        "decision": done or res.decision.outcome, "policy_decision": res.decision.decided,
        "reason": res.decision.reason,
        "tool_errors": json.dumps(res.tool_errors), "gpu_count": len(snap.gpus) if snap else None,
        "source": snap.source if snap else None,
    })
    store.insert_many("findings", [finding_row(f, a, node=node, at=now, job_id=job_id, run_id=run_id)
                                   for f, a in res.decision.actions])
    if res.xid_events:
        from gpuguard.xid.catalog import classify

        by_pci = snap.by_pci() if snap else {}
        rows = []
        for ev in res.xid_events:
            g = by_pci.get(ev.pci_bus_id) if ev.kind != "sxid" and ev.pci_bus_id else None
            # an event from a file any user can write to is kept for the operator but is no
            # evidence (action record): the verdict's hardware-fault cause reads the others
            untrusted = getattr(ev, "untrusted_source", None)
            rows.append(event_row(node=node, at=ev.timestamp or now, kind=ev.kind, code=ev.xid, gpu=g,
                                  pci_bus_id=ev.pci_bus_id, pid=ev.pid, process=ev.process, message=ev.message,
                                  action="record" if untrusted else classify(ev).action, job_id=job_id,
                                  source="kernel_log_untrusted" if untrusted else "kernel_log", raw=ev.raw))
        store.insert_many("events", rows)
    for table, rows in res.records.items():  # rows the checks asked to keep (idle baseline)
        store.insert_many(table, rows)
    if snap and snap.gpus:
        _record_inventory(store, node, snap, now)
        store.set_counters(node, counters_of(snap, store.get_counters(node)))
    if new_cursor is not None:
        store.set_cursor(CURSOR_NAME, new_cursor)
    return run_id


def _record_inventory(store: Any, node: str, snap: NodeSnapshot, now: float) -> None:
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
        store.upsert_many("inventory", rows, pk=("node", "uuid"))
        store.insert_many("inventory_changes", changes)
