"""One NCCL probe of this node, judged and recorded: the entry point for ``gpuguard
health`` (idle nodes, at most every ``[nccl] interval_s``), the Prolog (when
``[nccl] prolog`` says so) and ``gpuguard nccl probe``.

Findings (codes in :data:`gpuguard.policy.DEFAULT_ACTIONS`):

* ``nccl.probe_failed`` (info): the probe could not run, hung, or printed nothing
  readable. gpuguard's own fault (or the install's): recorded, never drains.
* ``nccl.errors`` (critical): ``#wrong`` > 0 or out-of-bounds values (data corruption).
* ``nccl.failure`` (warning): a ``Test NCCL/CUDA failure``, an IB completion error, or an
  NCCL WARN without results and without wrong data. Most of these are setup faults
  (shared memory in a container, IMEX/fabric manager for NVLS, memory registration:
  ``IBV_WC_LOC_PROT_ERR``), so they alert; a failing link shows in the InfiniBand and
  NVLink checks, which drain on their own evidence.
* ``nccl.warn`` (warning): NCCL WARN lines in an otherwise complete, healthy probe.
* ``nccl.busbw_low_pending`` (warning): a low reading, re-measured low, not yet
  ``[nccl] consecutive_low`` in a row (or low once with no time left to re-measure).
* ``nccl.busbw_low`` (critical): ``consecutive_low`` re-measured low probes in a row.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from gpuguard.model import Finding, declare_codes
from gpuguard.net import nccl_baseline as nb
from gpuguard.net.nccl_parse import NcclLog
from gpuguard.net.nccl_probe import PROBE_FAILED, ProbeRun, build_argv, probe_timeout, run_probe

#: The NCCL family's finding codes: code -> (severity, default action, source).
CODES = declare_codes("nccl", {
    "nccl.busbw_low": ("critical", "drain",
        "[nccl] consecutive_low re-measured low probes in a row; Azure HPC node health checks fail a node below its "
        "per-SKU NCCL all-reduce busbw"),
    "nccl.busbw_low_pending": ("warning", "alert",
        "one low reading is not a fault yet (azurehpc-health-checks #628/#690: single low readings drained "
        "healthy nodes)"),
    "nccl.errors": ("critical", "drain",
        "#wrong > 0 is data corruption on the GPU/NVLink/NIC path; a failed NCCL test fails the node in Azure HPC "
        "health checks"),
    "nccl.failure": ("warning", "alert",
        "NCCL/CUDA failures and IB completion errors without wrong data are mostly setup faults (shm, IMEX, "
        "memory registration); the fabric checks drain on link evidence"),
    "nccl.warn": ("warning", "alert", "NCCL warned but the probe completed with correct data: look, do not drain"),
    "nccl.output_unreadable": ("warning", "alert",
        "a saved nccl-tests log that cannot be read is not evidence of health"),
    "nccl.probe_failed": ("info", "record",
        "the probe itself failed (binary missing, hang, unreadable output): gpuguard's or the install's fault, "
        "never a drain"),
})


@dataclass
class ProbeOutcome:
    """What one probe concluded. ``state`` as stored (see :mod:`gpuguard.net.schema`);
    ``probe_id`` is set once recorded."""

    state: str
    findings: list[Finding] = field(default_factory=list)
    tool_errors: list[str] = field(default_factory=list)
    reading: dict[int, float] = field(default_factory=dict)
    judgement: nb.Judgement | None = None
    consecutive: int = 0
    gpu_model: str | None = None
    probe_id: int | None = None
    runs: list[ProbeRun] = field(default_factory=list)


def _error_finding(run: ProbeRun) -> Finding | None:
    return None if run.log is None else errors_finding(run.log, run.returncode)


def errors_finding(log: NcclLog, returncode: int | None = None, what: str = "NCCL probe") -> Finding | None:
    """``nccl.errors`` (critical) for data corruption (``#wrong`` > 0, out-of-bounds
    values); else ``nccl.failure`` (warning) for failures, IB completion errors, or WARN
    lines without results; None when the output shows none of them. ``what`` starts the
    message (the probe, or the name of a saved log)."""
    bad = log.wrong_total or log.out_of_bounds_total or log.failures or log.ib_errors
    if not bad and not (log.warnings and not log.readable):
        return None
    parts = []
    if log.wrong_total:
        parts.append(f"#wrong {log.wrong_total}")
    if log.out_of_bounds_total:
        parts.append(f"{log.out_of_bounds_total} out-of-bounds values")
    if log.ib_errors:
        e = log.ib_errors[0]
        peer = f" from {e['peer']}" if e.get("peer") else ""  # NCCL <= 2.11 names no peer
        parts.append(f"IB completion error {e['wc_status_name']} (vendor err {e['vendor_err']}){peer}")
    if log.failures:
        parts.append(log.failures[0])
    if log.warnings and not log.ib_errors:
        parts.append("NCCL WARN " + log.warnings[0])
    corrupt = bool(log.wrong_total or log.out_of_bounds_total)
    code, severity = ("nccl.errors", "critical") if corrupt else ("nccl.failure", "warning")
    return Finding(code, severity, f"{what}: " + "; ".join(parts)[:160], evidence={
        "wrong": log.wrong_total, "out_of_bounds": log.out_of_bounds_total, "failures": log.failures[:5],
        "warnings": log.warnings[:5], "ib_errors": log.ib_errors[:5], "returncode": returncode})


def _failed(run: ProbeRun) -> Finding | None:
    """``nccl.probe_failed`` for a run that gives no usable reading, else None."""
    log = run.log
    why = run.error
    if why is None and log is not None and not log.readable:
        why = ("output unreadable: " + log.problems[0][1]) if log.problems else \
            ("no results" + (f" ({log.incomplete[0]})" if log.incomplete else ""))
    if why is None and run.returncode not in (0, None):
        why = f"exit status {run.returncode}"
    if why is None:
        return None
    return Finding(PROBE_FAILED, "info", f"NCCL probe failed: {why}"[:160],
                   evidence={"argv": run.argv, "returncode": run.returncode, "duration_s": round(run.duration_s, 2),
                             "output_tail": run.output_tail[-500:]})


def _gpu_model(run: ProbeRun) -> str | None:
    models = run.log.gpu_models() if run.log else []
    return models[0] if len(models) == 1 else None


def probe_node(cfg: Any, store: Any, *, hook: str, job_id: str | None = None, budget_left_s: float | None = None,
               record: bool = True, env: dict[str, str] | None = None) -> ProbeOutcome:
    """Run, judge and (``record``) store one probe. ``store`` may be None (no baseline:
    only errors and failures are found). Never raises for a probe or store fault; those
    land in :attr:`ProbeOutcome.tool_errors` or a ``nccl.probe_failed`` finding."""
    deadline = None if budget_left_s is None else time.monotonic() + budget_left_s
    out = ProbeOutcome("failed")
    if store is not None:
        try:
            from gpuguard.net.schema import ensure

            ensure(store)
        except Exception as e:  # store trouble: probe without a baseline, record nothing
            out.tool_errors.append(f"nccl store: {type(e).__name__}: {e}")
            store = None
    argv = build_argv(cfg)
    key = nb.config_key(argv)
    node = cfg.node_name
    run = run_probe(argv, probe_timeout(cfg, budget_left_s), env)
    out.runs.append(run)
    out.gpu_model = _gpu_model(run)
    err = _error_finding(run)
    if err is not None:
        out.state = "errors"
        out.findings.append(err)
    elif (f := _failed(run)) is not None:
        out.findings.append(f)
    else:
        _judge_reading(cfg, store, node, key, run, out, deadline, env)
    if run.log is not None and run.log.warnings and out.state == "ok":
        out.findings.append(Finding("nccl.warn", "warning", "NCCL probe: WARN " + run.log.warnings[0][:140],
                                    evidence={"warnings": run.log.warnings[:5]}))
    if store is not None and record:
        detail = {"argv": argv, "findings": [f.code for f in out.findings],
                  "judgement": out.judgement.__dict__ if out.judgement else None}
        row = {"node": node, "at": run.started_at, "hook": hook, "job_id": job_id, "gpu_model": out.gpu_model,
               "gpus": len({(d[1], d[2]) for t in run.log.tables for d in t.devices}) if run.log else None,
               "config_key": key, "state": out.state, "duration_s": sum(r.duration_s for r in out.runs),
               "ratio": min(out.judgement.ratio.values()) if out.judgement and out.judgement.ratio else None,
               "detail": json.dumps(detail, default=str)}
        try:
            algbw = {r.size_b: r.algbw_gbs for r in out.runs[-1].log.rows} if out.reading else {}
            out.probe_id = nb.record_probe(store, row, out.reading, algbw)
        except Exception as e:  # store trouble is ours: the findings still stand
            out.tool_errors.append(f"nccl store: {type(e).__name__}: {e}")
        else:
            _spool(cfg, row, out, algbw)
    return out


def _spool(cfg: Any, row: dict[str, Any], out: ProbeOutcome, algbw: dict[int, float]) -> None:
    """Leave the recorded probe in the spool for the cluster store's fleet median
    (:mod:`gpuguard.net.nccl_spool`); a spool fault is ours, recorded as a tool error."""
    from gpuguard.net.nccl_spool import spool_probe

    try:
        spool_probe(cfg, row, out.reading, algbw)
    except (OSError, ValueError) as e:
        out.tool_errors.append(f"nccl spool: {type(e).__name__}: {e}")


def _fleet(cfg: Any, store: Any, gpu_model: str | None, key: str, node: str) -> nb.Reference:
    """The fleet reference from ``[paths] cluster_store`` when it is a separate file
    (probes of many nodes), else from the node store (single host: the same file). A
    cluster store that does not exist on this node gives no fleet reference."""
    path = cfg.cluster_store_path
    if path == cfg.store_path:
        return nb.fleet_reference(store, gpu_model, key, node, time.time(), cfg.get("nccl", "fleet_min_nodes"))
    if not os.path.exists(path):
        return nb.Reference("fleet")  # no cluster store here (not created yet, not mounted): no fleet
    from gpuguard.store import open_readonly

    # Read-only: the cluster store has one writer (the controller); a node never migrates it.
    cluster = open_readonly(path)
    try:
        if not cluster.query("select 1 from sqlite_master where type = 'table' and name = 'nccl_busbw'"):
            return nb.Reference("fleet")  # no probe carried into it yet
        return nb.fleet_reference(cluster, gpu_model, key, node, time.time(), cfg.get("nccl", "fleet_min_nodes"))
    finally:
        cluster.close()


def _judge_reading(cfg: Any, store: Any, node: str, key: str, run: ProbeRun, out: ProbeOutcome,
                   deadline: float | None, env: dict[str, str] | None) -> None:
    min_b = cfg.get("nccl", "judge_min_bytes")
    out.reading = nb.judged_sizes(run.log, min_b)
    out.state = "ok"
    if store is None or not out.reading:
        return
    try:
        refs = [nb.node_reference(store, node, key, cfg.get("nccl", "baseline_probes"))]
        prior_low = nb.consecutive_low(store, node, key, cfg.get("nccl", "consecutive_low"))
    except Exception as e:
        out.tool_errors.append(f"nccl baseline: {type(e).__name__}: {e}")
        return
    try:
        refs.append(_fleet(cfg, store, out.gpu_model, key, node))
    except Exception as e:  # the fleet is context: judge against the node alone
        out.tool_errors.append(f"nccl fleet baseline: {type(e).__name__}: {e}")
    judge = lambda reading: nb.judge(reading, refs, cfg.get("nccl", "low_frac"),  # noqa: E731
                                     cfg.get("nccl", "fleet_low_frac"), cfg.get("nccl", "min_probes"))
    j = judge(out.reading)
    out.judgement = j
    if not j.low:
        return
    confirmed = False
    if cfg.get("nccl", "remeasure"):
        left = None if deadline is None else deadline - time.monotonic()
        again = run_probe(run.argv, probe_timeout(cfg, left), env)
        out.runs.append(again)
        if again.error is None and again.log is not None and again.log.readable and _error_finding(again) is None:
            reading2 = nb.judged_sizes(again.log, min_b)
            j2 = judge(reading2)
            out.reading, out.judgement = reading2, j2
            if not j2.low:
                return  # the low reading did not repeat: a healthy probe
            confirmed = True
    detail = ", ".join(f"{v:.0%} of {k}" for k, v in out.judgement.ratio.items() if k in out.judgement.against)
    if not confirmed:
        out.state = "low_unconfirmed"
        out.findings.append(Finding("nccl.busbw_low_pending", "warning",
                                    f"NCCL busbw low once ({detail} baseline), not re-measured",
                                    evidence={"ratio": out.judgement.ratio, "sizes": out.judgement.sizes}))
        return
    out.state = "low"
    out.consecutive = prior_low + 1
    need = cfg.get("nccl", "consecutive_low")
    ev = {"ratio": out.judgement.ratio, "against": out.judgement.against, "sizes": out.judgement.sizes,
          "consecutive": out.consecutive, "needed": need}
    if out.consecutive >= need:
        out.findings.append(Finding("nccl.busbw_low", "critical",
                                    f"NCCL all-reduce busbw at {detail} baseline, {out.consecutive} probes in a row",
                                    evidence=ev))
    else:
        out.findings.append(Finding("nccl.busbw_low_pending", "warning",
                                    f"NCCL busbw at {detail} baseline ({out.consecutive} of {need} low probes)",
                                    evidence=ev))


def prolog_wants_probe(cfg: Any, env: dict[str, str]) -> bool:
    """``[nccl] prolog``: ``always``, ``multi-node`` (``SLURM_JOB_NUM_NODES`` > 1; Slurm
    sets it in the Prolog environment) or ``never``."""
    mode = cfg.get("nccl", "prolog")
    if mode == "always":
        return True
    if mode == "multi-node":
        from gpuguard.hookenv import UINT32_MAX, parse_uint

        n = parse_uint(env.get("SLURM_JOB_NUM_NODES"), UINT32_MAX)  # the hook reader's check: junk is unset
        return n is not None and n > 1
    return False


#: Share of the Prolog budget the probe may use at most (our choice: the other half
#: stays for the GPU checks, the decision and starting the collector).
PROLOG_SHARE = 0.5


def prolog_probe(cfg: Any, store: Any, env: dict[str, str], job_id: str | None,
                 elapsed_s: float) -> tuple[list[Finding], list[str]]:
    """The Prolog's NCCL probe when ``[nccl] prolog`` asks for it (see
    :func:`prolog_wants_probe`), else ``([], [])``. It gets at most
    :data:`PROLOG_SHARE` of ``[prolog] time_budget_s`` minus ``elapsed_s`` already used,
    so it never runs past the Prolog budget; too little left is ``nccl.probe_failed``
    (recorded, the job proceeds). Returns ``(findings, tool_errors)``."""
    if not prolog_wants_probe(cfg, env):
        return [], []
    left = float(cfg.get("prolog", "time_budget_s")) * PROLOG_SHARE - elapsed_s
    out = probe_node(cfg, store, hook="prolog", job_id=job_id, budget_left_s=left)
    return out.findings, out.tool_errors
