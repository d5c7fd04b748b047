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
``gpuguard_job_gpu_info`` (1), ``gpuguard_job_gpu_utilization_ratio``,
``gpuguard_job_gpu_memory_used_bytes``, ``gpuguard_job_gpu_power_watts``,
``gpuguard_job_gpu_temperature_celsius``, ``gpuguard_job_gpu_sm_clock_hertz``,
``gpuguard_job_gpu_sample_timestamp_seconds`` — from the newest collector sample of each
running job (:mod:`gpuguard.ops.jobmap`), for jobs sampled or started within
:data:`JOB_FRESH_S` (a job whose Epilog never ran drops out by itself).
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
#: samples column -> (metric suffix, help, scale to base unit)
_SAMPLE_METRICS = {
    "gpu_util_pct": ("utilization_ratio", "GPU utilisation (0-1) in the newest sample", 0.01),
    "mem_used_mib": ("memory_used_bytes", "GPU memory used", 1024 * 1024),
    "power_w": ("power_watts", "GPU power draw", 1.0),
    "temp_c": ("temperature_celsius", "GPU temperature", 1.0),
    "sm_clock_mhz": ("sm_clock_hertz", "SM clock", 1e6),
}


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
    for e in store.query("select gpu_index, code, count(*) as n from events where node = ? group by gpu_index, code",
                         [node]):
        xids.labels(node, "" if e["gpu_index"] is None else str(e["gpu_index"]), str(e["code"])).inc(e["n"])
    n = store.query("select count(*) as n from alert_deliveries where status = 'pending'")[0]["n"]
    pending.labels(node).set(n)


def _job_metrics(cfg: Any, store: Any, node: str, reg: Any, now: float) -> None:
    from prometheus_client import Gauge

    from gpuguard.ops.jobmap import running_jobs

    info = Gauge("gpuguard_job_gpu_info", "a GPU held by a running job (value 1; the labels are the point)",
                 _JOB_LABELS, registry=reg)
    gauges = {col: Gauge(f"gpuguard_job_gpu_{name}", doc, _JOB_LABELS, registry=reg)
              for col, (name, doc, _s) in _SAMPLE_METRICS.items()}
    ts = Gauge("gpuguard_job_gpu_sample_timestamp_seconds", "time of the newest sample", _JOB_LABELS, registry=reg)
    cols = ", ".join(_SAMPLE_METRICS)
    for job in running_jobs(cfg):
        jid = str(job.get("job_id", ""))
        latest = {r["gpu_index"]: r for r in store.query(
            f"select gpu_index, gpu_uuid, max(at) as at, {cols} from samples where job_id = ? and node = ? "
            "group by gpu_index", [jid, node])}
        newest = max((r["at"] for r in latest.values()), default=None)
        if now - (newest or float(job.get("started_at") or 0)) > JOB_FRESH_S:
            continue
        for g in sorted(set(job.get("gpus") or []) | set(latest)):
            r = latest.get(g) or {}
            labels = [node, jid, str(job.get("user", "")), str(job.get("account", "")), str(g), r.get("gpu_uuid") or ""]
            info.labels(*labels).set(1)
            if r:
                ts.labels(*labels).set(r["at"])
                for col, (_n, _d, scale) in _SAMPLE_METRICS.items():
                    if r.get(col) is not None:
                        gauges[col].labels(*labels).set(r[col] * scale)


def write_textfile(cfg: Any, store: Any, *, health: Any = None) -> list[str]:
    """Write :func:`textfile_path` atomically; returns the tool errors met on the way.
    Raises ``OSError`` when the directory is not writable."""
    from prometheus_client import write_to_textfile

    reg, errors = build_registry(cfg, store, health=health)
    os.makedirs(cfg.get("metrics", "textfile_dir"), mode=0o755, exist_ok=True)
    write_to_textfile(textfile_path(cfg), reg)
    return errors
