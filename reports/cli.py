"""``gpuguard report ...``: sacct sync and the cost / wait / failures / efficiency reports.

A thin click layer over :mod:`gpuguard.reports.sync`, :mod:`~gpuguard.reports.queries`
and :mod:`~gpuguard.reports.render`. Exit status: 0 done; 1 a sync stored what it could
but skipped malformed rows, or Slurm / the store failed; 2 bad input (unreadable or
non-sacct file, bad date, bad option or config), with a one-line message naming it.
"""

from __future__ import annotations

import errno
import os
import re
import sys
import time
from datetime import datetime, timedelta, tzinfo

import click

from gpuguard.output import ZoneError, display_tz, output_file_options, output_options, printable, resolve_zone

DATE_HELP = "YYYY-MM-DD, YYYY-MM-DDTHH:MM[:SS], 'now' or -Nd (N days ago), in the report timezone"
_REL = re.compile(r"^-(\d+(?:\.\d+)?)([dh])$")


def parse_when(text: str, tz: tzinfo, now: float | None = None) -> float:
    """A date given on the command line -> UTC epoch. Raises :class:`click.BadParameter`."""
    now = time.time() if now is None else now
    t = text.strip()
    if t == "now":
        return now
    m = _REL.match(t)
    if m:
        from gpuguard.durations import UNIT_S, parse_duration

        unit = "days" if m.group(2) == "d" else "hours"
        try:  # finite and at most 100 years: 400 digits would be inf
            return now - parse_duration(m.group(1), unit) * UNIT_S[unit]
        except ValueError as e:
            raise click.BadParameter(f"{text!r}: {e}") from None
    try:
        dt = datetime.fromisoformat(t.replace(" ", "T"))
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected {DATE_HELP}") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=tz)
    return dt.timestamp()


def _tz(obj, override: str | None) -> tzinfo:
    """``--timezone``, else the display zone (:func:`gpuguard.output.display_tz`)."""
    try:
        return resolve_zone(override) if override else display_tz(obj.cfg)
    except ZoneError as e:
        raise click.BadParameter(str(e), param_hint="--timezone" if override else "[display]/[reports] timezone") \
            from None


def _open_store(obj, *, create: bool):
    from gpuguard.store import StoreError, open_store

    path = obj.cfg.cluster_store_path
    try:
        return open_store(path, create=create)
    except StoreError as e:
        if not create and not os.path.exists(path):
            raise click.ClickException(f"{path}: no cluster store yet; run `gpuguard report sync` first") from None
        click.echo(f"Error: {e}", err=True)
        sys.exit(1)


@click.group("report")
def report() -> None:
    """Cost, queue wait, failures and GPU efficiency from Slurm accounting (sacct)."""


def _check_input_file(path: str) -> None:
    """Raise a one-line :class:`click.ClickException` when ``path`` is not a readable
    regular file (missing, a FIFO or device, which would block or never end, unreadable)."""
    import stat

    try:
        st = os.stat(path)
    except OSError as e:
        raise click.ClickException(f"{path}: no such file" if e.errno == errno.ENOENT
                                   else f"{path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise click.ClickException(f"{path}: not a regular file")
    if not os.access(path, os.R_OK):
        raise click.ClickException(f"{path}: permission denied")


@report.command("sync")
@click.option("--since", metavar="DATE", help=f"pull jobs eligible or running since DATE ({DATE_HELP}); "
              "default: the last sync minus [reports] sync_overlap_s, or [reports] first_sync_days back")
@click.option("--from-file", "from_file", metavar="FILE", type=click.Path(dir_okay=False),
              help="import saved `sacct -P`/`-p` output (with its header line, or `-n` with the live "
                   "sync's field list: see the README) or `sacct --json` output instead")
@click.option("--timezone", "tz_name", metavar="ZONE", help="IANA zone the file's times were printed in "
              "(default: [reports] timezone, else $TZ, else the system zone)")
@click.option("--cluster", metavar="NAME", help="cluster name for rows without a Cluster field "
              "(default: [reports] cluster)")
@click.pass_obj
def sync_cmd(obj, since: str | None, from_file: str | None, tz_name: str | None, cluster: str | None) -> None:
    """Pull Slurm accounting into the cluster store's sacct cache (idempotent).

    Live: `sacct -a -X -P -n` since the last sync; jobs still pending or running are
    updated by later syncs. --from-file replays saved output (a site's history, a bug
    report's paste). Malformed rows (impossible values: a negative or oversized count, a
    Start after the End...) are reported with their line and skipped (exit 1); rows already
    stored are never lost. A `|` inside JobName or Comment is put back where it belongs;
    when either field could hold it, the job is stored with both unknown.
    """
    from gpuguard.reports.sacct import SacctParseError
    from gpuguard.reports.sync import import_file, sync_from_slurm
    from gpuguard.slurm import SlurmCli, SlurmError
    from gpuguard.store import StoreError

    cfg = obj.cfg
    tz = _tz(obj, tz_name)
    cluster_name = cluster if cluster is not None else cfg.get("reports", "cluster")
    if from_file and since:
        raise click.UsageError("--since applies to a live sync, not to --from-file")
    if from_file:
        _check_input_file(from_file)
    since_ts = parse_when(since, tz) if since else None
    store = _open_store(obj, create=True)
    tty = sys.stderr.isatty()
    try:
        if from_file:
            size = os.path.getsize(from_file)
            if tty:
                with click.progressbar(length=size, label=f"importing {os.path.basename(from_file)}",
                                       file=sys.stderr) as bar:
                    res = import_file(store, from_file, tz=tz, cluster=cluster_name, on_progress=bar.update)
            else:
                res = import_file(store, from_file, tz=tz, cluster=cluster_name)
        else:
            slurm = SlurmCli(cfg.get("slurm", "bin_dir"))
            if tty:
                click.echo("running sacct ...", err=True)
            res = sync_from_slurm(store, slurm, since=since_ts, cluster=cluster_name,
                                  first_sync_days=cfg.get("reports", "first_sync_days"),
                                  overlap_s=cfg.get("reports", "sync_overlap_s"),
                                  timeout_s=cfg.get("reports", "sacct_timeout_s"))
    except SacctParseError as e:
        raise click.ClickException(str(e)) from None
    except (SlurmError, StoreError) as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(1)
    finally:
        store.close()
    for line, msg in res.notes[:20]:
        click.echo(printable(f"{res.source}:{line}: note: {msg}"), err=True)
    for line, msg in res.malformed[:20]:
        click.echo(printable(f"{res.source}:{line}: skipped malformed row: {msg}"), err=True)
    if len(res.malformed) > 20:
        click.echo(f"{res.source}: ... and {len(res.malformed) - 20} more malformed rows", err=True)
    click.echo(res.summary())
    if res.malformed:
        sys.exit(1)


def _csv_list(ctx, param, value):
    """``a,b`` (repeatable) -> ``("a", "b")``."""
    out: list[str] = []
    for v in value or ():
        out += [x.strip() for x in v.split(",") if x.strip()]
    return tuple(out)


def _report_options(f):
    f = output_file_options()(f)
    f = output_options(formats=("text", "csv", "json", "html"))(f)
    for name in reversed(("user", "account", "partition", "qos", "state", "gpu-type")):
        f = click.option(f"--{name}", f"f_{name.replace('-', '_')}", metavar="A[,B]", multiple=True,
                         callback=_csv_list, help=f"only jobs with this {name} (comma-separated or repeated)")(f)
    f = click.option("--cluster", metavar="NAME", help="only this cluster's jobs (default: all)")(f)
    f = click.option("--timezone", "tz_name", metavar="ZONE",
                     help="zone of --since/--until, of day/week/month buckets and of printed times "
                          "(default: [reports] timezone, $TZ, system)")(f)
    from gpuguard.reports.buckets import BUCKETS
    from gpuguard.reports.queries import BY_CHOICES

    f = click.option("--per", type=click.Choice(BUCKETS), default=None,
                     help="one row per group and day / ISO week / month (usage cut at the bucket edges)")(f)
    f = click.option("--by", default="account", show_default=True, metavar="KEY[,KEY2]",
                     help=f"group rows by one or two of: {', '.join(BY_CHOICES)} "
                          "(gpus = allocated-GPU-count bucket), e.g. account,user")(f)
    f = click.option("--until", metavar="DATE", help=f"end of the window, exclusive ({DATE_HELP}); default now")(f)
    f = click.option("--since", metavar="DATE", help=f"start of the window ({DATE_HELP}); default 30 days "
                     "before --until")(f)
    return f


def _run(obj, names: list[str], since: str | None, until: str | None, by: str, tz_name: str | None,
         cluster: str | None, fmt: str, output: str | None, per: str | None = None,
         filters: dict | None = None, force: bool = False) -> None:
    from gpuguard.reports.queries import Filters, Rates, ReportError, by_keys, run_reports
    from gpuguard.reports.render import render
    from gpuguard.store import StoreError

    cfg = obj.cfg
    tz = _tz(obj, tz_name)
    try:
        by_keys(by)
    except ReportError as e:
        raise click.BadParameter(str(e).removeprefix("--by "), param_hint="--by") from None
    now = time.time()
    until_ts = parse_when(until, tz, now) if until else now
    since_ts = parse_when(since, tz, now) if since else until_ts - timedelta(days=30).total_seconds()
    flt = Filters(cluster=cluster, **(filters or {}))
    store = _open_store(obj, create=False)
    try:
        rates = Rates(gpu_hour_rate=cfg.get("reports", "gpu_hour_rate"),
                      gpu_hour_rates=dict(cfg.get("reports", "gpu_hour_rates")),
                      cpu_hour_rate=cfg.get("reports", "cpu_hour_rate"), currency=cfg.get("reports", "currency"))
        reps = run_reports(store, names, since=since_ts, until=until_ts, by=by, rates=rates,
                           idle_util_pct=cfg.get("reports", "idle_util_pct"), cluster=flt, per=per, tz=tz,
                           series=fmt == "html")
    except ReportError as e:
        raise click.ClickException(str(e)) from None
    except StoreError as e:
        if "no such table: sacct_jobs" in str(e):
            raise click.ClickException(f"{store.path}: no sacct cache; run `gpuguard report sync` first") from None
        click.echo(f"Error: {e}", err=True)
        sys.exit(1)
    finally:
        store.close()
    text = render(reps, fmt, tz, generated_at=now)
    if output:
        from gpuguard.output import write_output_file

        write_output_file(output, text, force=force)  # a new file unless --force (exit 2)
        click.echo(f"wrote {output}", err=True)
    else:
        click.echo(text, nl=False)


def _make(name: str, names: list[str], doc: str):
    @_report_options
    @click.pass_obj
    def cmd(obj, since, until, by, per, tz_name, cluster, f_user, f_account, f_partition, f_qos, f_state,
            f_gpu_type, fmt, output, force):
        filters = {"user": f_user, "account": f_account, "partition": f_partition, "qos": f_qos,
                   "state": f_state, "gpu_type": f_gpu_type}
        _run(obj, names, since, until, by, tz_name, cluster, fmt, output, per=per, filters=filters, force=force)

    cmd.__doc__ = doc
    return report.command(name)(cmd)


_make("cost", ["cost"], """GPU-hours, CPU-hours and cost per group; cost of failed, timed-out and
    node-failed jobs shown separately. Rates: [reports] gpu_hour_rate, gpu_hour_rates, cpu_hour_rate.""")
_make("wait", ["wait"], """Queue wait (start - eligible; start - submit beside it) per group: mean,
    p50/p90/p99 (nearest rank), max; jobs pending at the last sync with their current wait.""")
_make("failures", ["failures"], """Shares of COMPLETED, FAILED, CANCELLED, TIMEOUT, NODE_FAIL,
    OUT_OF_MEMORY, PREEMPTED among jobs ended in the window, and GPU-hours lost to each.""")
_make("efficiency", ["efficiency"], """GPU-hours weighted by utilisation and idle GPU-hours from
    gpuguard's job summaries; jobs with no summary counted as such.""")
_make("all", ["cost", "wait", "failures", "efficiency"], """Every report, in one output
    (one HTML page with --format html).""")
