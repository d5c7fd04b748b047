"""Prometheus metrics through :mod:`prometheus_client` (no hand-written exposition).

Written by ``gpuguard health`` (each run) and ``gpuguard metrics write`` to
``[metrics] textfile_dir/gpuguard_{node}.prom`` for node_exporter's textfile collector,
atomically (``prometheus_client.write_to_textfile``: a temporary file, then a rename);
``gpuguard metrics show --openmetrics`` prints the OpenMetrics form.

Node health (labels ``node``, and ``gpu``/``code``/``severity``/``action``/``xid``):
``gpuguard_node_drained``, ``gpuguard_node_maintenance``,
``gpuguard_health_last_run_timestamp_seconds``, ``gpuguard_health_findings``,
``gpuguard_health_tool_errors``, ``gpuguard_xid_events_total``, ``gpuguard_alerts_pending``.

Per job and GPU (labels ``node``, ``job_id``, ``user``, ``account``, ``gpu``, ``uuid``):
``gpuguard_job_gpu_info`` (1), ``gpuguard_job_gpu_sample_timestamp_seconds`` and one
``gpuguard_job_gpu_<name>`` per metric-table row with a ``prom`` export
(:class:`gpuguard.metrics.Prom`): ``utilization_ratio``, ``memory_utilization_ratio``,
``memory_used_bytes``, ``power_watts``, ``temperature_celsius``, ``sm_clock_hertz``,
``energy_joules`` (the driver's cumulative counter: use ``rate()``) — from the newest
collector sample of each running job (:mod:`gpuguard.ops.jobmap`), for jobs sampled or
started within :data:`JOB_FRESH_S` (a job whose Epilog never ran drops out by itself).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any
from gpuguard.ops import schema as _schema  # noqa: F401  (registers the "ops" store migration set)

#: A running-job record without a sample for this long (and older than that) is not
#: exported (our choice: 10 collector intervals at the slowest sane 60 s).
JOB_FRESH_S = 600.0

_JOB_LABELS = ["node", "job_id", "user", "account", "gpu", "uuid"]


def _exported() -> list[tuple[Any, str]]:
    """``(metric, table)`` of every GPU metric the metric table exports (its ``prom``):
    sampled ones from ``gpu_samples``, slow counters from ``gpu_slow``."""
    from gpuguard.metrics import GPU_SAMPLED, GPU_SLOW

    return ([(m, "gpu_samples") for m in GPU_SAMPLED if m.prom]
            + [(m, "gpu_slow") for m in GPU_SLOW if m.prom])


def _newest(store: Any, job_id: str, node: str, exported: list[tuple[Any, str]]) -> dict[int, dict[str, Any]]:
    """Per GPU index of the job on ``node``: its UUID, the newest sample's epoch time and
    each exported metric's newest value in real units (slow counters: their newest
    reading) of ``exported`` (:func:`_exported`). Two primary-key seeks per GPU, whatever
    the job's length."""
    from gpuguard.metrics import stored_column

    conn = store.db.conn
    out: dict[int, dict[str, Any]] = {}
    for sid, idx, uuid, t0 in conn.execute("select id, gpu_index, gpu_uuid, t0 from gpu_series "
                                           "where job_id = ? and node = ?", (job_id, node)).fetchall():
        row: dict[str, Any] = {"gpu_uuid": uuid}
        for table in ("gpu_samples", "gpu_slow"):
            ms = [m for m, t in exported if t == table]
            got = conn.execute(f"select t_ms, {', '.join(stored_column(m) for m in ms)} from {table} "
                               "where sid = ? order by t_ms desc limit 1", (sid,)).fetchone()
            if got is None:
                continue
            if table == "gpu_samples":
                row["at"] = t0 + got[0] / 1000.0
            for m, v in zip(ms, got[1:], strict=True):
                row[m.name] = None if v is None else v / m.scale
        if "at" in row:
            out[idx] = row
    return out


def textfile_path(cfg: Any) -> str:
    """``{textfile_dir}/gpuguard_{node}.prom`` (one file per slurmd node name, so several
    slurmd on one host do not overwrite each other)."""
    return os.path.join(cfg.get("metrics", "textfile_dir"), f"gpuguard_{cfg.node_name}.prom")


def build_registry(cfg: Any, store: Any, *, health: Any = None, now: float | None = None) -> tuple[Any, list[str]]:
    """A fresh :class:`prometheus_client.CollectorRegistry` with the metrics above.
    Returns ``(registry, tool_errors)``; store problems skip the metrics they feed."""
    from prometheus_client import CollectorRegistry, Counter, Gauge

    now = time.time() if now is None else now
    node = cfg.node_name
    reg = CollectorRegistry()
    errors: list[str] = []
    drained = Gauge("gpuguard_node_drained", "1 when the node carries a gpuguard drain reason", ["node"], registry=reg)
    maint = Gauge("gpuguard_node_maintenance", "1 when the node is in maintenance (MAINT reservation or window)",
                  ["node"], registry=reg)
    last = Gauge("gpuguard_health_last_run_timestamp_seconds", "end of the newest health run (any hook)",
                 ["node", "hook"], registry=reg)
    findings = Gauge("gpuguard_health_findings", "findings of the newest health run, by code",
                     ["node", "code", "severity", "action", "gpu"], registry=reg)
    tool_err = Gauge("gpuguard_health_tool_errors", "gpuguard's own errors in the newest health run", ["node"],
                     registry=reg)
    xids = Counter("gpuguard_xid_events", "XID/SXid events read from the kernel log", ["node", "gpu", "xid"],
                   registry=reg)
    pending = Gauge("gpuguard_alerts_pending", "alert deliveries waiting to be sent or retried", ["node"], registry=reg)
    if health is not None and health.maintenance is not None:
        maint.labels(node).set(1 if health.maintenance.active else 0)
    else:
        from gpuguard.ops.maintenance import cached

        maint.labels(node).set(1 if cached(cfg, node, now).active else 0)
    if store is not None:
        try:
            _node_metrics(store, node, drained, last, findings, tool_err, xids, pending)
        except Exception as e:
            errors.append(f"node metrics: {type(e).__name__}: {e}")
        try:
            _job_metrics(cfg, store, node, reg, now)
        except Exception as e:
            errors.append(f"job metrics: {type(e).__name__}: {e}")
    return reg, errors


def _node_metrics(store: Any, node: str, drained: Any, last: Any, findings: Any, tool_err: Any, xids: Any,
                  pending: Any) -> None:
    rows = store.query("select action, outcome from node_actions where node = ? and action in ('drain', 'resume') "
                       "and outcome = 'done' order by at desc, id desc limit 1", [node])
    drained.labels(node).set(1 if rows and rows[0]["action"] == "drain" else 0)
    for r in store.query("select hook, max(finished_at) as t from health_runs where node = ? group by hook", [node]):
        last.labels(node, r["hook"]).set(r["t"])
    run = store.query("select id, tool_errors from health_runs where node = ? order by finished_at desc, id desc "
                      "limit 1", [node])
    if run:
        tool_err.labels(node).set(len(json.loads(run[0]["tool_errors"] or "[]")))
        for f in store.query("select code, severity, action, gpu_index, count(*) as n from findings where run_id = ? "
                             "group by code, severity, action, gpu_index", [run[0]["id"]]):
            findings.labels(node, f["code"], f["severity"], f["action"],
                            "" if f["gpu_index"] is None else str(f["gpu_index"])).set(f["n"])
    # an event read from a file any user can write to is no XID of the GPU (gpuguard.health)
    for e in store.query("select gpu_index, code, count(*) as n from events where node = ? and "
                         "coalesce(source, '') != 'kernel_log_untrusted' group by gpu_index, code", [node]):
        xids.labels(node, "" if e["gpu_index"] is None else str(e["gpu_index"]), str(e["code"])).inc(e["n"])
    n = store.query("select count(*) as n from alert_deliveries where status = 'pending'")[0]["n"]
    pending.labels(node).set(n)


def _job_metrics(cfg: Any, store: Any, node: str, reg: Any, now: float) -> None:
    from prometheus_client import Gauge

    from gpuguard.ops.jobmap import running_jobs

    info = Gauge("gpuguard_job_gpu_info", "a GPU held by a running job (value 1; the labels are the point)",
                 _JOB_LABELS, registry=reg)
    exported = _exported()
    gauges = {m.name: Gauge(f"gpuguard_job_gpu_{m.prom.name}", f"{m.description} (newest sample)", _JOB_LABELS,
                            registry=reg) for m, _t in exported}
    ts = Gauge("gpuguard_job_gpu_sample_timestamp_seconds", "time of the newest sample", _JOB_LABELS, registry=reg)
    for job in running_jobs(cfg):
        jid = str(job.get("job_id", ""))
        latest = _newest(store, jid, node, exported)
        newest = max((r["at"] for r in latest.values()), default=None)
        if now - (newest or float(job.get("started_at") or 0)) > JOB_FRESH_S:
            continue
        for g in sorted(set(job.get("gpus") or []) | set(latest)):
            r = latest.get(g) or {}
            labels = [node, jid, str(job.get("user", "")), str(job.get("account", "")), str(g), r.get("gpu_uuid") or ""]
            info.labels(*labels).set(1)
            if r:
                ts.labels(*labels).set(r["at"])
                for m, _t in exported:
                    if r.get(m.name) is not None:
                        gauges[m.name].labels(*labels).set(r[m.name] * m.prom.per_unit)


def write_textfile(cfg: Any, store: Any, *, health: Any = None) -> list[str]:
    """Write :func:`textfile_path` atomically; returns the tool errors met on the way.
    Raises ``OSError`` when the directory is not writable."""
    from prometheus_client import write_to_textfile

    reg, errors = build_registry(cfg, store, health=health)
    os.makedirs(cfg.get("metrics", "textfile_dir"), mode=0o755, exist_ok=True)
    write_to_textfile(textfile_path(cfg), reg)
    return errors
