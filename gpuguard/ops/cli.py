"""Command line of the operations side: ``gpuguard health``, ``gpuguard node ...``,
``gpuguard alert ...``, ``gpuguard metrics ...`` (thin: parse, call, format)."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

import click

from gpuguard.clitypes import DAYS, POSITIVE_SECONDS
from gpuguard.output import emit, output_options
from gpuguard.ops import schema as _schema  # noqa: F401  (registers the "ops" store migration set)


def _cfg(ctx: click.Context) -> Any:
    return ctx.find_root().obj.cfg


def _iso(cfg: Any, t: float | None) -> str | None:
    from gpuguard.output import display_tz, iso_time

    return iso_time(t, display_tz(cfg))


def _store_for(cfg: Any, node: str, create: bool = False, *, read_only: bool = False) -> Any:
    """The store holding ``node``'s records: the configured path with ``{node}`` set to
    ``node`` (several slurmd on one host keep one store each); ``read_only`` for the
    listings (:func:`gpuguard.store.open_readonly`: never migrated or written). Exits 2
    when missing."""
    from gpuguard.store import StoreError, open_readonly, open_store

    path = cfg.values["paths"]["store"].replace("{node}", node)
    try:
        if read_only:
            return open_readonly(path)
        return open_store(path, create=create)
    except StoreError as e:
        raise click.ClickException(str(e)) from None


# --- health -----------------------------------------------------------------------------
@click.command("health")
@click.option("--kernel-log", metavar="SRC", help="kernel log to scan (default: the config's)")
@click.option("--list", "list_steps", is_flag=True, help="list the registered health steps and exit")
@output_options(("text", "json"))
@click.pass_context
def health(ctx: click.Context, kernel_log: str | None, list_steps: bool, fmt: str) -> None:
    """Run the node health check once, as Slurm's HealthCheckProgram does
    (``gpuguard-health``): node checks and registered steps, drain on a hardware fault,
    resume a node gpuguard drained once it is clean, queue and send alerts, write metrics.

    Exit 0 (also for findings: the node's state carries the result); 2 for bad config.
    """
    from gpuguard.ops.steps import load_steps

    if list_steps:
        for name, st in sorted(load_steps().items()):
            every = st.every_s if not callable(st.every_s) else st.every_s(_cfg(ctx))
            click.echo(f"{name:20} every {every or 'run'}  {(st.fn.__doc__ or '').strip().splitlines()[0] if st.fn.__doc__ else ''}")
        return
    import logging

    from gpuguard.ops.healthcheck import main_run

    cfg = _cfg(ctx)
    log = logging.getLogger("gpuguard.health.cli")
    log.addHandler(logging.StreamHandler(sys.stderr))
    log.setLevel(logging.WARNING)
    out = main_run(cfg, log, kernel_log=kernel_log)
    if out.skipped:
        click.echo(f"skipped: {out.skipped}")
        return
    doc = {"node": cfg.node_name, "decision": out.result.decision.outcome, "reason": out.result.decision.reason,
           "maintenance": out.maintenance.line(),
           "findings": [dict(f.to_dict(), action=a) for f, a in out.result.decision.actions],
           "actions": [{k: a.get(k) for k in ("action", "by", "outcome", "why", "reason", "recovery")} for a in out.actions],
           "tool_errors": out.tool_errors}
    if fmt == "json":
        emit(fmt, doc)
        return
    click.echo(f"{doc['node']}: {doc['decision']}" + (f" ({doc['reason']})" if doc["reason"] else "")
               + f"; {doc['maintenance']}")
    for f in doc["findings"]:
        click.echo(f"  {f['severity']:8} {f['action']:8} {f['code']} {f['message']}")
    for a in doc["actions"]:
        click.echo(f"  node {a['action']} {a['outcome']}: {a['reason']}" + (f" ({a['why']})" if a["why"] else ""))


# --- node ------------------------------------------------------------------------------
@click.group("node")
def node() -> None:
    """gpuguard's drains and resumes, and each node's history."""


@node.command("list")
@click.option("--all", "show_all", is_flag=True, help="also list drains that are not gpuguard's")
@output_options()
@click.pass_context
def node_list(ctx: click.Context, show_all: bool, fmt: str) -> None:
    """Nodes drained by gpuguard now (from ``sinfo -R``), with reason, time, who drained
    them and what it takes to bring them back (from the node's store, where readable)."""
    from gpuguard.ops.nodes import effective_recovery, last_drain
    from gpuguard.recovery import RECOVERY_TEXT
    from gpuguard.slurm import REASON_PREFIX, SlurmCli, SlurmError
    from gpuguard.store import StoreError

    cfg = _cfg(ctx)
    try:
        reasons = SlurmCli(cfg.get("slurm", "bin_dir")).node_reasons()
    except SlurmError as e:
        raise click.ClickException(str(e)) from None
    rows = []
    for r in reasons:
        ours = r.reason.startswith(REASON_PREFIX)
        if not ours and not show_all:
            continue
        import hostlist

        for n in hostlist.expand_hostlist(r.nodes):
            row = {"node": n, "since": r.time, "slurm_user": r.user, "reason": r.reason, "ours": ours,
                   "by": "", "recovery": "", "evidence": ""}
            if ours:
                try:
                    st = _store_for(cfg, n, read_only=True)
                except click.ClickException:
                    st = None
                try:
                    rec = last_drain(st, n) if st is not None else None
                    if rec and rec["reason"] and r.reason.startswith(rec["reason"][:40]):
                        row["by"] = rec["by"]
                        row["recovery"] = RECOVERY_TEXT[effective_recovery(st, n, rec)]
                        ev = json.loads(rec["evidence"] or "[]")
                        row["evidence"] = "; ".join(f"{e['code']}: {e['message']}" for e in ev
                                                    if isinstance(e, dict))[:200]
                except StoreError:
                    pass  # a node whose store cannot be read: Slurm's view only
                finally:
                    if st is not None:
                        st.close()
            rows.append(row)
    emit(fmt, rows, headers=["node", "since", "by", "reason", "recovery"] + (["ours"] if show_all else []))


@node.command("show")
@click.argument("name")
@click.option("--since", metavar="DAYS", type=DAYS, default=30.0, show_default=True, help="history window in days")
@output_options()
@click.pass_context
def node_show(ctx: click.Context, name: str, since: float, fmt: str) -> None:
    """A node's Slurm state and reason, maintenance, and its history of findings (above
    ``record``), drains, resumes and suppressed actions, newest first."""
    import time

    from gpuguard.ops import maintenance
    from gpuguard.ops.nodes import effective_recovery, history, last_drain, read_node
    from gpuguard.recovery import RECOVERY_TEXT
    from gpuguard.slurm import SlurmCli, SlurmError
    from gpuguard.store import StoreError

    cfg = _cfg(ctx)
    slurm = SlurmCli(cfg.get("slurm", "bin_dir"))
    try:
        info = read_node(slurm, name)
        state, reason = info.state, info.full_reason
    except (SlurmError, ValueError) as e:
        info, state, reason = None, f"unknown ({e})", None
    maint, _ = maintenance.status(cfg, name, slurm=slurm)
    st = _store_for(cfg, name, read_only=True)
    try:
        rows = history(st, name, since=time.time() - since * 86400)
        rec = last_drain(st, name)
        kind = effective_recovery(st, name, rec) if rec else None
    except StoreError as e:  # a store no hook has written the history tables into yet
        raise click.ClickException(f"{e} (no gpuguard history for {name} yet?)") from None
    finally:
        st.close()
    for r in rows:
        r["at"] = _iso(cfg, r["at"])
    if fmt != "text":
        doc = {"node": name, "state": state, "reason": reason, "maintenance": maint.line(),
               "drain": {"by": rec["by"], "at": _iso(cfg, rec["at"]), "recovery": kind}
               if (info is not None and info.drained and info.ours and rec) else None,
               "history": rows}
        emit(fmt, doc, rows=rows, headers=["at", "kind", "what", "detail", "recovery"])
        return
    click.echo(f"node {name}: {state}" + (f"  reason: {reason}" if reason else ""))
    click.echo(f"maintenance: {maint.line()}")
    if info is not None and info.drained and info.ours and rec:
        click.echo(f"drained by {rec['by']} at {_iso(cfg, rec['at'])}: "
                   f"{RECOVERY_TEXT[kind or 'manual']}")
    if rows:
        emit("text", rows, headers=["at", "kind", "what", "detail"])
    else:
        click.echo("no history in the window")


@node.command("drain")
@click.argument("name")
@click.option("--reason", required=True, help="why (stored; the Slurm reason becomes 'gpuguard: manual: REASON')")
@output_options()
@click.pass_context
def node_drain(ctx: click.Context, name: str, reason: str, fmt: str) -> None:
    """Drain a node by hand through gpuguard: recorded as by hand, never resumed by
    ``gpuguard health`` (recovery ``manual``). Exit 1 when Slurm refused or failed."""
    from gpuguard.ops import act
    from gpuguard.ops.nodes import record_action, who
    from gpuguard.policy import REASON_MAX

    cfg = _cfg(ctx)
    clean = " ".join(reason.replace('"', "'").split())
    if not clean:
        raise click.BadParameter("must not be empty", param_hint="--reason")
    full = f"gpuguard: manual: {clean} (by {who()})"[:REASON_MAX]
    status, why = act.drain(cfg, name, full)
    st = _store_for(cfg, name, create=True)
    try:
        record_action(st, node=name, action="drain", by="hand", outcome=status, why=why, reason=full,
                      recovery="manual", evidence={"reason": clean})
    finally:
        st.close()
    _result(fmt, {"node": name, "action": "drain", "status": status, "why": why, "reason": full})
    sys.exit(0 if status == "done" else 1)


@node.command("resume")
@click.argument("name")
@click.option("--force", is_flag=True, help="resume even a node drained by someone else (an admin, NHC, Slurm)")
@output_options()
@click.pass_context
def node_resume(ctx: click.Context, name: str, force: bool, fmt: str) -> None:
    """Resume a node by hand. Without --force only a gpuguard drain is resumed (any
    recovery kind: a human has decided). Recorded as by hand. Exit 1 when refused or
    failed."""
    from gpuguard.ops import act
    from gpuguard.ops.nodes import read_node, record_action
    from gpuguard.slurm import SlurmCli, SlurmError

    cfg = _cfg(ctx)
    prior = None
    try:
        prior = read_node(SlurmCli(cfg.get("slurm", "bin_dir")), name)
    except (SlurmError, ValueError):
        pass
    forced = bool(force and prior is not None and not prior.ours)
    if forced:
        click.echo(f"--force: resuming {name} although its reason is not gpuguard's: {prior.full_reason}", err=True)
        status, why = act.force_resume(cfg, name)
    else:
        status, why = act.resume(cfg, name)
    st = _store_for(cfg, name, create=True)
    try:
        record_action(st, node=name, action="resume", by="hand", outcome=status, why=why,
                      reason=(prior.full_reason if prior else "") or "",
                      evidence={"forced": forced})
    finally:
        st.close()
    _result(fmt, {"node": name, "action": "resume", "status": status, "why": why, "forced": forced,
                  "reason": (prior.full_reason if prior else None)})
    sys.exit(0 if status == "done" else 1)


def _result(fmt: str, doc: dict[str, Any]) -> None:
    """One action's outcome: ``ACTION NODE: STATUS (WHY)`` or the dict as JSON/CSV."""
    emit(fmt, doc, rows=[doc], text=lambda: f"{doc['action']} {doc['node']}: {doc['status']}"
         + (f" ({doc['why']})" if doc["why"] else ""))


# --- alert ------------------------------------------------------------------------------
@click.group("alert")
def alert() -> None:
    """Queued alerts and their delivery."""


@alert.command("send")
@click.option("--timeout", "timeout_s", type=POSITIVE_SECONDS, default=60.0, show_default=True,
              help="stop sending after this many seconds (the rest waits for the next run)")
@output_options()
@click.pass_context
def alert_send(ctx: click.Context, timeout_s: float, fmt: str) -> None:
    """Take the spool, de-duplicate, and deliver due alerts with retries (run by
    ``gpuguard health`` and by the ``gpuguard-alert-send`` timer)."""
    import logging
    import time

    from gpuguard.ops.alert_send import send

    cfg = _cfg(ctx)
    st = _store_for(cfg, cfg.node_name, create=True)
    log = logging.getLogger("gpuguard.alert.cli")
    log.addHandler(logging.StreamHandler(sys.stderr))
    try:
        rep = send(cfg, st, deadline=time.monotonic() + timeout_s, log=log)
    finally:
        st.close()
    doc = dataclasses.asdict(rep)
    emit(fmt, doc, rows=[doc], text=lambda: ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in doc.items()))


@alert.command("list")
@output_options()
@click.pass_context
def alert_list(ctx: click.Context, fmt: str) -> None:
    """Alert groups (code, node, GPU) with their counts and delivery state."""
    cfg = _cfg(ctx)
    st = _store_for(cfg, cfg.node_name, create=True)
    try:
        rows = st.query("select a.id, a.node, a.code, a.gpu_index as gpu, a.severity, a.count, a.notified_count "
                        "as notified, a.first_at, a.last_at, a.message, (select group_concat(sink || ':' || status) "
                        "from alert_deliveries d where d.alert_id = a.id) as deliveries from alerts a "
                        "order by a.last_at desc limit 500")
    finally:
        st.close()
    for r in rows:
        r["first_at"], r["last_at"] = _iso(cfg, r["first_at"]), _iso(cfg, r["last_at"])
    emit(fmt, rows, headers=["id", "node", "code", "gpu", "severity", "count", "notified", "first_at", "last_at",
                             "deliveries"])


# --- metrics ----------------------------------------------------------------------------
@click.group("metrics")
def metrics() -> None:
    """Prometheus metrics: node health and per-job GPU metrics."""


def _registry(cfg: Any) -> Any:
    from gpuguard.ops.metrics import build_registry
    from gpuguard.store import StoreError, open_store

    try:
        st = open_store(cfg.store_path, create=False)
    except StoreError:
        st = None
    try:
        reg, errors = build_registry(cfg, st)
    finally:
        if st is not None:
            st.close()
    for e in errors:
        click.echo(f"tool error: {e}", err=True)
    return reg


@metrics.command("show")
@click.option("--openmetrics", is_flag=True, help="OpenMetrics text instead of the Prometheus text format")
@click.pass_context
def metrics_show(ctx: click.Context, openmetrics: bool) -> None:
    """Print the metrics of this node."""
    reg = _registry(_cfg(ctx))
    if openmetrics:
        from prometheus_client.openmetrics.exposition import generate_latest
    else:
        from prometheus_client import generate_latest
    click.echo(generate_latest(reg).decode(), nl=False)


@metrics.command("write")
@click.pass_context
def metrics_write(ctx: click.Context) -> None:
    """Write ``[metrics] textfile_dir/gpuguard_NODE.prom`` atomically (for a timer when
    ``gpuguard health`` does not run often enough)."""
    from prometheus_client import write_to_textfile

    from gpuguard.ops.metrics import textfile_path

    cfg = _cfg(ctx)
    if not cfg.get("metrics", "textfile_dir"):
        raise click.ClickException("[metrics] textfile_dir is not set")
    path = textfile_path(cfg)
    try:
        write_to_textfile(path, _registry(cfg))
    except OSError as e:
        raise click.ClickException(f"{path}: {e.strerror or e}") from None
    click.echo(f"wrote {path}")


def register(main: click.Group) -> None:
    """Attach these commands to the ``gpuguard`` group."""
    for cmd in (health, node, alert, metrics):
        main.add_command(cmd)
