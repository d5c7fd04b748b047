"""``gpuguard job show JOBID [--json]``: what the store knows about one job.

A thin layer (STYLE.md): :func:`job_report` gathers, :func:`format_text` formats; the
click command only parses and prints. Registered in :mod:`gpuguard.cli` with
``from gpuguard.epilog.cli import job; main.add_command(job)``.

Times are epoch seconds in the store and ISO 8601 UTC here (DESIGN.md, "Storage").
"""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn

import click

from gpuguard.epilog.summary import METRICS, XID_KINDS, load_summaries
from gpuguard.store import StoreError


def _iso(t: Any) -> Any:
    if not isinstance(t, (int, float)) or isinstance(t, bool):
        return t
    from gpuguard.xid.parse import utc_iso

    return utc_iso(t)


def _isoify(obj: Any) -> Any:
    """Copy of ``obj`` with every value under a key ``at`` or ``*_at`` made ISO 8601."""
    if isinstance(obj, dict):
        return {k: (_iso(v) if k == "at" or k.endswith("_at") else _isoify(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_isoify(v) for v in obj]
    return obj


class JobNotFound(LookupError):
    """The store holds nothing about the job."""


def job_report(store: Any, job_id: str) -> dict[str, Any]:
    """Everything ``store`` holds about ``job_id``, JSON-ready, times in ISO 8601::

        {"job_id": str, "nodes": [str], "gpus": [{"node", "gpu_index", "gpu_uuid"}],
         "summaries": [JobSummary.to_dict()...], "health_runs": [{"node", "hook", "decision",
         "reason", "started_at"}], "findings": [{"node", "hook", "at", "code", "severity",
         "action", "gpu_index", "message"}], "events": [{"node", "at", "kind", "code",
         "gpu_index", "pid", "action", "message"}]}

    Events are those tagged with the job and the XID events inside each node's summary
    window. Raises :class:`JobNotFound` when there is nothing, :class:`StoreError` when
    the store cannot be read.
    """
    job_id = str(job_id)
    summaries = [s.to_dict() for s in load_summaries(store, job_id)]
    runs = store.query("select node, hook, decision, reason, started_at from health_runs where job_id = ? "
                       "order by started_at, id", [job_id])
    gpus = store.query("select distinct node, gpu_index, gpu_uuid from samples where job_id = ? "
                       "order by node, gpu_index", [job_id])
    if not gpus:
        gpus = [{"node": s["node"], "gpu_index": g["gpu_index"], "gpu_uuid": g["gpu_uuid"]}
                for s in summaries for g in s["gpus"]]
    findings = store.query(
        "select f.node, coalesce(r.hook, 'verdict') as hook, f.at, f.code, f.severity, f.action, f.gpu_index, "
        "f.message from findings f left join health_runs r on r.id = f.run_id where f.job_id = ? "
        "order by f.at, f.id", [job_id])
    ev_cols = "id, node, at, kind, code, gpu_index, pid, action, message"
    events = {r["id"]: r for r in store.query(f"select {ev_cols} from events where job_id = ?", [job_id])}
    kinds = ",".join("?" * len(XID_KINDS))
    for s in summaries:
        if s.get("started_at") is not None and s.get("ended_at") is not None:
            for r in store.query(f"select {ev_cols} from events where node = ? and kind in ({kinds}) "
                                 "and at > ? and at <= ?", [s["node"], *XID_KINDS, s["started_at"], s["ended_at"]]):
                events[r["id"]] = r
    ev_list = sorted(events.values(), key=lambda r: (r["at"] or 0, r["id"]))
    for r in ev_list:
        del r["id"]
    steps_nodes = store.query("select distinct node from steps where job_id = ?", [job_id])
    nodes = sorted({s["node"] for s in summaries} | {r["node"] for r in runs} | {g["node"] for g in gpus}
                   | {r["node"] for r in steps_nodes} | {e["node"] for e in ev_list})
    if not nodes:
        raise JobNotFound(job_id)
    from gpuguard.epilog.verdict import load_verdict

    try:
        verdict = load_verdict(store, job_id)
    except Exception:  # a store from before migration 3, or a half-written verdict
        verdict = None
    return _isoify({"job_id": job_id, "nodes": nodes, "verdict": verdict, "gpus": gpus, "summaries": summaries,
                    "health_runs": runs, "findings": findings, "events": ev_list})


# -- text --------------------------------------------------------------------------------
def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return format(v, ".6g")
    return str(v)


def _table(rows: list[list[Any]], headers: list[str]) -> str:
    cols = [headers] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cols) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cols]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary_rows(s: dict[str, Any]) -> list[list[Any]]:
    """``[metric, value, unit]`` rows of one node's summary, in display order."""
    rows: list[list[Any]] = [
        ["exit status", s["exit_text"], f"raw {_fmt(s['exit_status_raw'])}"],
        ["collector", s["collector_status"], ""],
        ["samples", s["sample_count"], "rows"],
        ["first sample", s["first_sample_at"], "UTC"],
        ["last sample", s["last_sample_at"], "UTC"],
        ["sample interval (median)", s["sample_interval_s"], "s"],
    ]
    rows += [[name, s.get(name), unit] for name, (unit, _doc) in METRICS.items()]
    for reason, secs in sorted(s["clock_event_gpu_s"].items()):
        rows.append([f"clock event {reason}", secs, "GPU-s"])
    rows += [
        ["step records", s["step_records"], "records"],
        ["steps", s["steps"], "steps"],
        ["ranks", s["ranks"], "ranks"],
        ["checkpoints", s["checkpoint_count"], "checkpoints"],
        ["NaN/inf loss", s["nonfinite_loss_count"], "steps"],
        ["malformed records", s["malformed_records"], "lines"],
        ["rejected files", len(s["rejected_files"]), "files"],
    ]
    return rows


def format_text(rep: dict[str, Any]) -> str:
    """The readable form of :func:`job_report`: per node a one-line headline (exit,
    collector, post-job decision), then GPUs, summary tables, findings and events."""
    out = [f"job {rep['job_id']} on {', '.join(rep['nodes'])}"]
    if rep.get("verdict"):
        from gpuguard.epilog.verdict import format_verdict

        out += [format_verdict(rep["verdict"]), ""]
    for s in rep["summaries"]:
        pj = s.get("post_job") or {}
        post = pj.get("outcome") or "not run"
        if pj.get("reason"):
            post += f" ({pj['reason']})"
        out.append(f"  {s['node']}: {s['exit_text']}, collector {s['collector_status']}, "
                   f"{len(s['gpus'])} GPU(s), post-job check: {post}")
    out += ["", "GPUs", _table([[g["node"], g["gpu_index"], g["gpu_uuid"]] for g in rep["gpus"]],
                               ["NODE", "GPU", "UUID"]) if rep["gpus"] else "  none recorded"]
    for s in rep["summaries"]:
        out += ["", f"Summary ({s['node']})", _table(summary_rows(s), ["METRIC", "VALUE", "UNIT"])]
        if s["gpus"]:
            grows = [[g["gpu_index"], g["sample_count"], g["gpu_util_mean_pct"], g["sm_clock_mean_mhz"],
                      g["power_mean_w"], g["temp_max_c"], g["mem_used_peak_mib"],
                      g["ecc_volatile_uncorrected_increase"],
                      ", ".join(f"{k} {_fmt(v)}s" for k, v in sorted(g["clock_event_s"].items())) or "-"]
                     for g in s["gpus"]]
            out += ["", f"Per GPU ({s['node']})",
                    _table(grows, ["GPU", "SAMPLES", "UTIL_MEAN_%", "SM_MEAN_MHZ", "POWER_MEAN_W", "TEMP_MAX_C",
                                   "MEM_PEAK_MIB", "ECC_UNC_NEW", "CLOCK_EVENTS"])]
    out += ["", "Findings"]
    out.append(_table([[f["node"], f["hook"], f["severity"], f["action"], f["code"], f["gpu_index"], f["message"]]
                       for f in rep["findings"]], ["NODE", "HOOK", "SEVERITY", "ACTION", "CODE", "GPU", "MESSAGE"])
               if rep["findings"] else "  none")
    out += ["", "Events"]
    out.append(_table([[e["node"], e["at"], e["kind"], e["code"], e["gpu_index"], e["action"], e["message"]]
                       for e in rep["events"]], ["NODE", "AT", "KIND", "CODE", "GPU", "ACTION", "MESSAGE"])
               if rep["events"] else "  none")
    return "\n".join(out)


# -- click ---------------------------------------------------------------------------------
@click.group("job")
def job() -> None:
    """Per-job metrics and findings recorded by the prolog, collector and epilog."""


@job.command("show")
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of tables")
@click.option("--store", "store_path", metavar="FILE",
              help="store to read, read-only (default: the cluster store when readable, else the job's AdminComment)")
@click.pass_obj
def job_show(obj: Any, job_id: str, as_json: bool, store_path: str | None) -> None:
    """Print JOB_ID: a header from sacct (user, account, state, elapsed vs time limit,
    nodes, GPUs), then the verdict and its evidence, nodes, GPUs, the summary, findings
    and events — from the cluster store when this user can read it (opened read-only),
    else from the job's AdminComment through sacct (:mod:`gpuguard.epilog.jobview`). Who
    may see a job is Slurm's decision (PrivateData). Exit 2 for a job that is not
    visible or a store that cannot be read."""
    if obj is not None and hasattr(obj, "cfg"):
        cfg = obj.cfg
    else:
        from gpuguard import config as config_mod

        try:
            cfg = config_mod.load()
        except config_mod.ConfigError as e:
            _fail(str(e))
    from gpuguard.epilog.jobview import JobNotVisible, job_view
    from gpuguard.slurm import SlurmCli

    try:
        rep = job_view(job_id, cfg=cfg, slurm=SlurmCli(cfg.get("slurm", "bin_dir")), store_path=store_path)
    except (JobNotVisible, StoreError) as e:
        _fail(str(e))
    if as_json:
        click.echo(json.dumps(rep, indent=2, default=str))
    else:
        click.echo(format_view(rep))


def format_header(h: dict[str, Any]) -> list[str]:
    """The job header lines (sacct's view of the job)."""
    gpus = "-" if h.get("gpus") is None else str(h["gpus"])
    return [f"job {h['job_id']} ({h.get('name') or '-'}): user {h['user']}, account {h['account']}, "
            f"partition {h['partition']}, state {h['state']}",
            f"  elapsed {h['elapsed']} of {h['time_limit']} limit; nodes {h['nodes']} ({h.get('num_nodes')}); "
            f"GPUs {gpus}"]


def format_view(rep: dict[str, Any]) -> str:
    """Text of :func:`gpuguard.epilog.jobview.job_view`: the header, then the full store
    report (:func:`format_text`) or what the AdminComment carries."""
    out = [*format_header(rep["header"]), f"  source: {rep['source']}", ""] if rep.get("header") else []
    if "summaries" in rep:
        return "\n".join(out) + format_text(rep)
    from gpuguard.epilog.verdict import format_verdict

    if rep.get("verdict"):
        out.append(format_verdict(rep["verdict"]))
    else:
        out.append(rep.get("note") or "no verdict")
    figs = rep.get("node_figures") or {}
    if figs:
        out += ["", _table([[n, len(f.get("gpus") or []), f.get("gpu_util_mean_pct"), f.get("power_mean_w"),
                             f.get("sm_clock_mean_mhz"), f.get("temp_max_c"), f.get("mem_used_peak_mib"),
                             f.get("step_time_p50_s")] for n, f in sorted(figs.items())],
                           ["NODE", "GPUS", "UTIL_MEAN_%", "POWER_MEAN_W", "SM_MEAN_MHZ", "TEMP_MAX_C", "MEM_PEAK_MIB",
                            "STEP_P50_S"])]
    if rep.get("missing_nodes"):
        out.append("no data from node(s): " + ", ".join(rep["missing_nodes"]))
    return "\n".join(out)


def _fail(msg: str) -> NoReturn:
    click.echo(f"Error: {msg}", err=True)
    sys.exit(2)
