"""gpuguard command line (click). A thin layer: parse, call the library, format.

Exit codes: 0 success; 2 for bad input or configuration (a one-line error naming the
input). ``gpuguard check`` is a health check and follows the monitoring-plugin convention
instead (:data:`CHECK_UNKNOWN`): 0 healthy / 1 warnings / 2 critical / 3 could not check.
"""

from __future__ import annotations

import json
import sys
from typing import Any
import click

from gpuguard import config as config_mod
from gpuguard.output import emit, output_file_options, output_options, table, write_output_file


class _Obj:
    def __init__(self, config_path: str | None):
        self.config_path = config_path
        self._cfg: config_mod.Config | None = None

    @property
    def cfg(self) -> config_mod.Config:
        if self._cfg is None:
            try:
                self._cfg = config_mod.load(self.config_path)
            except config_mod.ConfigError as e:
                raise click.ClickException(str(e)) from None
        return self._cfg


def _fail(msg: str) -> None:
    click.echo(f"Error: {msg}", err=True)
    sys.exit(2)


click.ClickException.exit_code = 2  # bad input/config: exit 2 everywhere but `check`

#: ``gpuguard check``'s exit status when it could not check (bad or unreadable input, a
#: usage or config error, no GPU source readable). Source: the Nagios plugin guidelines
#: (0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN, "invalid command line arguments ... that
#: prevent it from performing the specified operation" is UNKNOWN), which monitoring
#: systems (Nagios, Icinga, Checkmk, Zabbix agents) read; ``check``'s documented 2 for a
#: critical finding stays, so a typo in a path never pages as a critical GPU.
CHECK_UNKNOWN = 3


class _CheckCommand(click.Command):
    """A command whose click errors (parsing and body) exit :data:`CHECK_UNKNOWN`."""

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        try:
            return super().make_context(*args, **kwargs)
        except click.ClickException as e:
            e.exit_code = CHECK_UNKNOWN
            raise

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.ClickException as e:
            e.exit_code = CHECK_UNKNOWN
            raise


def _kernel_log_file_problem(path: str) -> str | None:
    """Why the kernel-log FILE named with ``check --kernel-log`` cannot be scanned, one
    line, or None. Checked before the run: a missing or binary file would otherwise read
    as "no XID events" and the check would pass."""
    from gpuguard.inputs import InputError, read_head
    from gpuguard.xid.cli import not_a_log
    from gpuguard.xid.stream import HEAD_BYTES

    try:
        data = read_head(path, HEAD_BYTES)  # the hooks read a log of any size in steps
    except InputError as e:
        return f"kernel log {e}"
    if data[:2] == b"\x1f\x8b":
        return (f"kernel log {path} is gzip-compressed; --kernel-log reads plain text "
                "(zcat it to a file, or use gpuguard xid scan FILE)")
    if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
        return (f"kernel log {path} is UTF-16 text; --kernel-log reads UTF-8 "
                "(iconv -f utf-16 -t utf-8 it to a file, or use gpuguard xid scan FILE)")
    why = not_a_log(data)
    return f"kernel log {path} {why}" if why else None


def _cannot_check(msg: str) -> None:
    """``gpuguard check`` could not check: one line, exit :data:`CHECK_UNKNOWN`."""
    click.echo(f"Error: {msg}", err=True)
    sys.exit(CHECK_UNKNOWN)


class _MainGroup(click.Group):
    """The top-level group: a store failure no command caught (a table missing from a
    store no writer has migrated, a store turned corrupt while read) ends as one line
    naming the store, exit 2 (``check``: :data:`CHECK_UNKNOWN`), never a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as e:
            store_mod = sys.modules.get("gpuguard.store")  # not imported: no StoreError was raised
            if store_mod is None or not isinstance(e, store_mod.StoreError):
                raise
            err = click.ClickException(str(e))
            if ctx.invoked_subcommand == "check":
                err.exit_code = CHECK_UNKNOWN
            raise err from None


@click.group(cls=_MainGroup)
@click.option("--config", "config_path", metavar="FILE", help="config file (default: $GPUGUARD_CONFIG, "
              "gpuguard.toml beside $SLURM_CONF, /etc/gpuguard/gpuguard.toml, beside /etc/slurm/slurm.conf; "
              "see the README)")
@click.version_option(package_name="gpuguard")
@click.pass_context
def main(ctx: click.Context, config_path: str | None) -> None:
    """gpuguard: GPU node health, per-job metrics and sacct reports for Slurm."""
    ctx.obj = _Obj(config_path)


# --- check --------------------------------------------------------------------------
@main.command(cls=_CheckCommand)
@output_options()
@click.option("--from-nvidia-smi", "nvsmi", metavar="FILE",
              help="judge a saved `nvidia-smi -q` or `-q -x` dump, or `--query-gpu` CSV with its header, "
                   "instead of the live GPUs")
@click.option("--gpu-source", type=click.Choice(["nvml", "replay"]), help="override [gpu] source")
@click.option("--replay", "replay_path", metavar="FILE", help="replay file (with --gpu-source replay)")
@click.option("--kernel-log", metavar="SRC", help="kernel log to scan for XIDs: auto|kmsg|journalctl|dmesg|FILE|none "
              "(default: the config's; 'none' with --from-nvidia-smi)")
@click.option("--record", is_flag=True, help="store the run and advance the kernel-log cursor like the prolog does")
@click.option("--list", "list_checks", is_flag=True, help="list the checks and exit")
@click.option("--from-file", "from_files", metavar="FILE", multiple=True,
              help="judge saved interconnect outputs instead of the live node (repeatable): nccl-tests logs, "
                   "ibstat, ibstatus, ibv_devinfo -v, perfquery [-x], nvidia-smi nvlink -s / -e, nvidia-smi topo -m, "
                   "dcgmi nvlink --link-status, dcgmi diag [-j], dcgmi dmon -e 230")
@click.pass_obj
def check(obj: _Obj, fmt: str, nvsmi: str | None, gpu_source: str | None, replay_path: str | None,
          kernel_log: str | None, record: bool, list_checks: bool, from_files: tuple[str, ...]) -> None:
    """Run every health check once and print the findings with their policy action.

    Exit status: 0 healthy (info only), 1 warnings, 2 critical findings, 3 could not
    check (a file that is missing, unreadable or not the format named, a bad option or
    config, no GPU source readable; one line on stderr; also when nothing worse was found
    but the kernel log to scan could not be read, its tool error on stderr, or it holds
    lines with an XID/SXid marker that were not accepted — not parseable, or not the
    kernel's own, such as a forged `logger` line — one line per reason on stderr: such
    a line may be the XID the check is for): the monitoring-plugin convention
    (Nagios plugin guidelines: 3 UNKNOWN). Reads the node store for history but writes
    nothing unless --record is given.
    """
    from gpuguard.checks import load_all

    if list_checks:
        for name, fn in sorted(load_all().items()):
            click.echo(f"{name:16} {(fn.__doc__ or '').strip().splitlines()[0]}")
        return
    cfg = obj.cfg
    if from_files:
        _check_files(cfg, list(from_files), fmt)
        return
    if gpu_source:
        cfg.values["gpu"]["source"] = gpu_source
    if replay_path:
        cfg.values["gpu"]["replay_path"] = replay_path
    if cfg.values["gpu"]["source"] == "replay" and not cfg.values["gpu"]["replay_path"] and not nvsmi:
        raise click.UsageError("--gpu-source replay needs --replay FILE")
    if nvsmi:
        import os
        import stat

        try:
            if not stat.S_ISREG(os.stat(nvsmi).st_mode):
                _cannot_check(f"{nvsmi}: not a regular file")
        except OSError as e:
            _cannot_check(f"{nvsmi}: {e.strerror}")
    if kernel_log and kernel_log not in ("none", "auto", "kmsg", "journalctl", "dmesg"):
        why = _kernel_log_file_problem(kernel_log)
        if why:
            _cannot_check(why)
    from gpuguard.health import run_health
    from gpuguard.store import StoreError, open_store

    store = None
    if not nvsmi:
        try:
            store = open_store(cfg.store_path, create=record)
        except StoreError as e:
            if record:
                click.echo(f"warning: {e}", err=True)
    kl = kernel_log or ("none" if nvsmi else None)
    res = run_health(cfg, hook="check", store=store, nvidia_smi_file=nvsmi,
                     kernel_log=None if kl == "none" else kl, scan_xid=kl != "none", record=record)
    if res.snapshot is None:
        _cannot_check("; ".join(res.tool_errors))
    rows = [{"severity": f.severity, "action": a, "code": f.code, "gpu": f.gpu_index, "message": f.message}
            for f, a in res.decision.actions]
    if fmt == "json":
        from gpuguard.policy import summarize

        doc = summarize(res.decision)
        doc["tool_errors"] = res.tool_errors
        doc["gpus"] = len(res.snapshot.gpus)
        doc["incomplete"] = res.snapshot.incomplete
        doc["xid_rejected"] = res.xid_rejected
        emit(fmt, doc)
    elif fmt == "csv":
        emit(fmt, rows, headers=["severity", "action", "code", "gpu", "message"])
    else:
        click.echo(f"{len(res.snapshot.gpus)} GPU(s) from {res.snapshot.source}")
        if rows:
            click.echo(table([list(r.values()) for r in rows], ["SEVERITY", "ACTION", "CODE", "GPU", "MESSAGE"]))
        else:
            click.echo("no findings")
        click.echo(f"decision: {res.decision.outcome}" + (f" ({res.decision.reason})" if res.decision.reason else ""))
    sys.exit(_check_status(res, fmt))


def _check_status(res: Any, fmt: str) -> int:
    """``gpuguard check``'s exit status for a health result (its docstring); prints the
    tool errors on stderr (text and CSV; JSON has them in the document), the XID/SXid
    lines not accepted as one line per reason."""
    from gpuguard.health import REJECTED_ERROR

    for e in res.tool_errors if fmt != "json" else []:
        if not e.startswith(REJECTED_ERROR):  # said one reason a line below
            click.echo(f"tool error: {e}", err=True)
    for why, n in sorted(res.xid_rejected.items(), key=lambda kv: (-kv[1], kv[0])) if fmt != "json" else []:
        click.echo(f"kernel log: {n} XID/SXid line(s) not accepted: {why}", err=True)
    worst = res.worst_severity
    if res.snapshot.incomplete and fmt != "json":
        click.echo(f"incomplete: {res.snapshot.incomplete}", err=True)
    if worst not in ("critical", "warning") and (not res.kernel_log_read or res.snapshot.incomplete
                                                 or res.xid_rejected):
        # the XID scan did not happen, an XID line could not be judged, or the dump was
        # cut: "healthy" would be a pass on an unread input
        return CHECK_UNKNOWN
    return {"critical": 2, "warning": 1}.get(worst or "", 0)


def _check_files(cfg: config_mod.Config, paths: list[str], fmt: str) -> None:
    """``gpuguard check --from-file``: triage saved outputs (:mod:`gpuguard.net.triage`).
    Exits 2/1 on critical/warning findings, else 3 (could not check) when a part of a file
    could not be read (``res.problems``), else 0."""
    from gpuguard.inputs import InputError, read_input
    from gpuguard.model import SEVERITY_RANK
    from gpuguard.net.triage import TriageError, triage
    from gpuguard.policy import decide, summarize

    files = []
    for p in paths:
        try:
            files.append((p, read_input(p, 64 * 2**20).decode("utf-8", "replace")))
        except InputError as e:
            _cannot_check(str(e))
    try:
        res = triage(files, cfg)
    except TriageError as e:
        _cannot_check(str(e))
    decision = decide(res.findings, cfg.policy, cfg.xid_policy)
    rows = [{"severity": f.severity, "action": a, "code": f.code, "gpu": f.gpu_index, "message": f.message}
            for f, a in decision.actions]
    if fmt == "json":
        doc = summarize(decision)
        doc.update({"read": res.summary, "problems": res.problems})
        emit(fmt, doc)
    elif fmt == "csv":
        emit(fmt, rows, headers=["severity", "action", "code", "gpu", "message"])
    else:
        for line in res.summary:
            click.echo(line)
        click.echo(table([list(r.values()) for r in rows], ["SEVERITY", "ACTION", "CODE", "GPU", "MESSAGE"])
                   if rows else "no findings")
        for p in res.problems:
            click.echo(f"unreadable: {p}")
        click.echo(f"decision: {decision.outcome}" + (f" ({decision.reason})" if decision.reason else ""))
    worst = max((f.severity for f in res.findings), key=SEVERITY_RANK.__getitem__, default=None)
    if worst not in ("critical", "warning") and res.problems:
        sys.exit(CHECK_UNKNOWN)  # a row not read may be the fault: "healthy" would be a pass on it
    sys.exit({"critical": 2, "warning": 1}.get(worst or "", 0))


# --- gpu --------------------------------------------------------------------------------
@main.group()
def gpu() -> None:
    """Read the GPUs through the configured source."""


def _snapshot(obj: _Obj, nvsmi: str | None):
    from gpuguard.health import take_snapshot

    snap, errs = take_snapshot(obj.cfg, nvidia_smi_file=nvsmi)
    if snap is None:
        _fail("; ".join(errs))
    return snap


@gpu.command("show")
@output_options()
@click.option("--from-nvidia-smi", "nvsmi", metavar="FILE", help="read a saved `nvidia-smi -q` / `-q -x` dump")
@click.pass_obj
def gpu_show(obj: _Obj, fmt: str, nvsmi: str | None) -> None:
    """Print every GPU: identity, temperature, power, clocks, ECC, PCIe, clock-event
    (throttle) reasons. JSON is the full snapshot; CSV and text one row per GPU; a value
    the source did not give is ``-``. Exit status 2 when the GPUs cannot be read, and
    when the dump was cut short (what it holds is printed, the problem on stderr)."""
    snap = _snapshot(obj, nvsmi)
    _print_gpus(snap, fmt)
    if snap.incomplete:
        click.echo(f"Error: incomplete: {snap.incomplete}", err=True)
        sys.exit(2)


def _unknown_dash(value: Any) -> Any:
    return "-" if value is None else value


def _print_gpus(snap: Any, fmt: str) -> None:
    """``gpu show``'s output of ``snap`` in ``fmt``."""
    if fmt == "json":
        emit(fmt, snap.to_dict())
        return
    rows = [{"gpu": g.index, "name": g.name, "pci_bus_id": g.pci_bus_id, "temp_c": g.temp_c, "power_w": g.power_w,
             "sm_clock_mhz": g.sm_clock_mhz, "mem_used_mib": g.mem_used_mib, "mem_total_mib": g.mem_total_mib,
             "ecc_volatile_uncorrected": g.ecc_volatile_uncorrected,
             "pcie_link": (f"gen{_unknown_dash(g.pcie_gen_current)} x{_unknown_dash(g.pcie_width_current)}"
                           if (g.pcie_gen_current, g.pcie_width_current) != (None, None) else "-"),
             "clock_event_reasons": ",".join(g.clock_event_reasons or []),
             "read_errors": ",".join(sorted(g.read_errors))} for g in snap.gpus]
    if fmt == "csv":
        emit(fmt, rows, headers=list(rows[0]) if rows else ["gpu"])
        return
    if snap.error:
        click.echo(f"source error: {snap.error}")
    dash = _unknown_dash
    click.echo(table([[r["gpu"], dash(r["name"]), r["pci_bus_id"], dash(r["temp_c"]), dash(r["power_w"]),
                       dash(r["sm_clock_mhz"]), f"{dash(r['mem_used_mib'])}/{dash(r['mem_total_mib'])}",
                       dash(r["ecc_volatile_uncorrected"]), r["pcie_link"],
                       r["clock_event_reasons"] or "-", r["read_errors"] or "-"] for r in rows],
                     ["GPU", "NAME", "PCI", "TEMP_C", "POWER_W", "SM_MHZ", "MEM_MIB", "ECC_UNC_VOL", "PCIE",
                      "CLOCK_EVENTS", "READ_ERRORS"]))


@gpu.command("snapshot")
@output_file_options("file to write (gpuguard-snapshot/1 JSON, a replay fixture)", required=True)
@click.option("--from-nvidia-smi", "nvsmi", metavar="FILE", help="read a saved `nvidia-smi -q` / `-q -x` dump")
@click.pass_obj
def gpu_snapshot(obj: _Obj, output: str, force: bool, nvsmi: str | None) -> None:
    """Record the GPUs' state as a replay snapshot (for tests, triage and bug reports).
    An existing FILE is replaced only with --force (exit 2 otherwise, nothing written)."""
    from gpuguard.gpu.replay import dump_snapshot

    snap = _snapshot(obj, nvsmi)
    write_output_file(output, dump_snapshot(snap) + "\n", force=force)
    click.echo(f"wrote {len(snap.gpus)} GPU(s) to {output}")


# --- config ----------------------------------------------------------------------------
@main.group("config")
def config_group() -> None:
    """Inspect the configuration."""


@config_group.command("show")
@output_options()
@click.pass_obj
def config_show(obj: _Obj, fmt: str) -> None:
    """Print the effective configuration and where each value came from. Also checks
    what only the Epilog reads, across keys (``[baseline] runs >= min_runs``, the verdict's
    windows): a config the Epilog would refuse exits 2 here with its one line, rather than
    leaving every job unjudged with a tool error in the node logs."""
    from gpuguard.epilog.baseline import BaselineSettings
    from gpuguard.epilog.compare import Settings

    try:
        BaselineSettings.from_config(obj.cfg)
        Settings.from_config(obj.cfg)
    except config_mod.ConfigError as e:
        _fail(str(e))
    rows = [{"key": k, "value": v, "origin": o} for k, v, o in config_mod.describe(obj.cfg)]
    if fmt != "text":
        emit(fmt, rows, headers=["key", "value", "origin"])
        return
    click.echo(f"# config file: {obj.cfg.path or '(none: defaults only)'}")
    click.echo(table([[r["key"], json.dumps(r["value"]), r["origin"]] for r in rows], ["KEY", "VALUE", "FROM"]))


@config_group.command("example")
def config_example() -> None:
    """Print a complete gpuguard.toml with every key at its default, commented out."""
    click.echo(config_mod.example_toml(), nl=False)


def _register_subcommands() -> None:
    """Attach the command groups that live beside the code they drive."""
    from gpuguard.epilog.baseline_cli import baseline, template
    from gpuguard.epilog.cli import job
    from gpuguard.epilog.cluster_cli import cluster
    from gpuguard.net.cli import nccl
    from gpuguard.reports.cli import report
    from gpuguard.store_cli import store_group
    from gpuguard.xid.cli import xid

    for group in (xid, job, template, baseline, report, nccl, store_group, cluster):
        main.add_command(group)
    from gpuguard.ops.cli import register

    register(main)


_register_subcommands()

if __name__ == "__main__":
    main()
