"""``gpuguard job show JOBID [--full] [--format text|json|csv|html]``: what the store knows about one job.

A thin layer (STYLE.md): :func:`job_report` gathers, :func:`format_text` formats; the
click command only parses and prints. Registered in :mod:`gpuguard.cli` with
``from gpuguard.epilog.cli import job; main.add_command(job)``.

Times are epoch seconds in the store and ISO 8601 with offset in the display zone here
(:mod:`gpuguard.output`).
"""

from __future__ import annotations

import sys
from datetime import tzinfo
from typing import Any, NoReturn

import click

from gpuguard.epilog.summary import METRICS, XID_KINDS, load_summaries
from gpuguard.metrics import gpu_columns
from gpuguard.output import cell, display_tz, emit, isoify, output_file_options, output_options, table
from gpuguard.store import StoreError


class JobNotFound(LookupError):
    """The store holds nothing about the job."""


def job_report(store: Any, job_id: str, tz: tzinfo | None = None) -> dict[str, Any]:
    """Everything ``store`` holds about ``job_id``, JSON-ready, times in ISO 8601 with
    offset in ``tz`` (default UTC; :func:`gpuguard.output.iso_time`)::

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
    return isoify({"job_id": job_id, "nodes": nodes, "verdict": verdict, "gpus": gpus, "summaries": summaries,
                    "health_runs": runs, "findings": findings, "events": ev_list}, tz)


# -- text --------------------------------------------------------------------------------
def summary_rows(s: dict[str, Any]) -> list[list[Any]]:
    """``[metric, value, unit]`` rows of one node's summary, in display order."""
    rows: list[list[Any]] = [
        ["exit status", s["exit_text"], f"raw {cell(s['exit_status_raw'])}"],
        ["collector", s["collector_status"], ""],
        ["samples", s["sample_count"], "rows"],
        ["first sample", s["first_sample_at"], ""],
        ["last sample", s["last_sample_at"], ""],
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
    out += ["", "GPUs", table([[g["node"], g["gpu_index"], g["gpu_uuid"]] for g in rep["gpus"]],
                               ["NODE", "GPU", "UUID"]) if rep["gpus"] else "  none recorded"]
    for s in rep["summaries"]:
        out += ["", f"Summary ({s['node']})", table(summary_rows(s), ["METRIC", "VALUE", "UNIT"])]
        if s["gpus"]:
            cols = gpu_columns()
            grows = [[g["gpu_index"], g["sample_count"], *[g.get(f) for f, _label in cols],
                      ", ".join(f"{k} {cell(v)}s" for k, v in sorted(g["clock_event_s"].items())) or "-"]
                     for g in s["gpus"]]
            out += ["", f"Per GPU ({s['node']})",
                    table(grows, ["GPU", "SAMPLES", *[label for _f, label in cols], "CLOCK_EVENTS"])]
    out += ["", "Findings"]
    out.append(table([[f["node"], f["hook"], f["severity"], f["action"], f["code"], f["gpu_index"], f["message"]]
                       for f in rep["findings"]], ["NODE", "HOOK", "SEVERITY", "ACTION", "CODE", "GPU", "MESSAGE"])
               if rep["findings"] else "  none")
    out += ["", "Events"]
    out.append(table([[e["node"], e["at"], e["kind"], e["code"], e["gpu_index"], e["action"], e["message"]]
                       for e in rep["events"]], ["NODE", "AT", "KIND", "CODE", "GPU", "ACTION", "MESSAGE"])
               if rep["events"] else "  none")
    return "\n".join(out)


# -- click ---------------------------------------------------------------------------------
@click.group("job")
def job() -> None:
    """Per-job metrics and findings recorded by the prolog, collector and epilog."""


@job.command("show")
@click.argument("job_id")
@output_options(formats=("text", "json", "csv", "html"))
@click.option("--full", is_flag=True, help="text: every metric, finding and event after the one-screen page")
@output_file_options()
@click.option("--timezone", "tz_name", metavar="ZONE", help="zone of printed times (default: [display] timezone, "
              "$TZ, the system zone)")
@click.option("--store", "store_path", metavar="FILE",
              help="store to read, read-only (default: the cluster store when readable, else the job's AdminComment)")
@click.pass_obj
def job_show(obj: Any, job_id: str, fmt: str, full: bool, output: str | None, force: bool, tz_name: str | None,
             store_path: str | None) -> None:
    """Show JOB_ID on one screen: header (user, account, state, exit, elapsed vs limit,
    nodes, GPUs), the verdict with its evidence, per-GPU utilisation/memory/power bars and
    what to check; --full adds every table. --format html writes a self-contained page
    with per-GPU and per-rank time-series plots. JSON is :func:`job_report`'s document plus
    ``job`` (the header); CSV one row per node and summary metric (``node, metric, value,
    unit``). The data come from :mod:`gpuguard.epilog.jobview`: the header from the
    user's own sacct (Slurm's PrivateData decides who sees a job), the rest from the
    cluster store opened read-only when this user can read it, else from the job's
    AdminComment; ``source`` says which. Exit 2 for a job that is not visible, an
    unreadable store named with --store, or a bad option."""
    from gpuguard.epilog.advice import AdviceError, load_advice
    from gpuguard.epilog.jobpage import format_page
    from gpuguard.output import resolve_zone

    cfg = _job_show_config(obj, store_path)
    from gpuguard.epilog.jobview import JobNotVisible, job_view, open_readonly
    from gpuguard.slurm import SlurmCli

    try:
        tz = resolve_zone(tz_name) if tz_name else display_tz(cfg)
        advice = load_advice(cfg.get("job_page", "advice_file") if cfg is not None else "")
        # the data source (gpuguard.epilog.jobview): the user's own sacct for the header,
        # the cluster store read-only when readable, else the job's AdminComment
        rep, used = job_view(job_id, cfg=cfg, slurm=SlurmCli(cfg.get("slurm", "bin_dir")), store_path=store_path,
                             tz=tz)
        series = None
        if fmt == "html" and used:
            from gpuguard.epilog.jobpage_html import load_series

            store = open_readonly(used)
            try:
                series = load_series(store, job_id)
            finally:
                store.close()
    except (StoreError, ValueError, AdviceError, JobNotVisible) as e:
        _fail(str(e))
    idle = cfg.get("job_page", "idle_gpu_pct") if cfg is not None else 5.0
    rows = [{"node": s["node"], "metric": m, "value": v, "unit": u}
            for s in rep["summaries"] for m, v, u in summary_rows(s)]
    headers = ["node", "metric", "value", "unit"]
    if fmt in ("json", "csv") and not output:
        emit(fmt, dict(rep, job=isoify(rep["job"], tz)), rows=rows, headers=headers)
        return
    if fmt == "csv":
        from gpuguard.output import to_csv

        text = to_csv(rows, headers)
    elif fmt == "html":
        from gpuguard.epilog.jobpage_html import render_html

        text = render_html(rep, series, tz=tz, advice=advice, idle_gpu_pct=idle)
    elif fmt == "json":
        from gpuguard.output import to_json

        text = to_json(dict(rep, job=isoify(rep["job"], tz)))
    else:
        text = format_page(rep, tz=tz, advice=advice, idle_gpu_pct=idle)
        if full:
            text += "\n\n" + format_text(rep)
    if output:
        from gpuguard.output import write_output_file

        write_output_file(output, text, force=force)  # a new file unless --force (exit 2)
        click.echo(f"wrote {output}", err=True)
    else:
        from gpuguard.output import printable

        click.echo(printable(text) if fmt == "text" else text)


def _job_show_config(obj: Any, store_path: str | None) -> Any:
    """The config ``job show`` runs with: the CLI's, else the loaded file, else defaults.

    A config that fails to load is fatal (exit 2) unless --store names the store, since
    then the page can be built from built-in defaults alone.
    """
    cfg = None
    if obj is not None and hasattr(obj, "cfg"):
        try:
            cfg = obj.cfg
        except click.ClickException as e:
            if store_path is None:
                _fail(e.message)
    elif store_path is None:
        from gpuguard import config as config_mod

        try:
            cfg = config_mod.load()
        except config_mod.ConfigError as e:
            _fail(str(e))
    if cfg is None:
        from gpuguard.config import from_dict

        cfg = from_dict({})
    return cfg


def _fail(msg: str) -> NoReturn:
    click.echo(f"Error: {msg}", err=True)
    sys.exit(2)
