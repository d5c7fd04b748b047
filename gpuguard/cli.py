"""gpuguard command line (click). A thin layer: parse, call the library, format.

Exit codes: 0 success; ``gpuguard check`` 0 healthy / 1 warnings / 2 critical; 2 for bad
input or configuration (a one-line error naming the input).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from gpuguard import config as config_mod


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


click.ClickException.exit_code = 2  # bad input/config: exit 2 everywhere


@click.group()
@click.option("--config", "config_path", metavar="FILE", help="config file (default: $GPUGUARD_CONFIG, "
              "gpuguard.toml beside $SLURM_CONF, /etc/gpuguard/gpuguard.toml, beside /etc/slurm/slurm.conf; "
              "see the README)")
@click.version_option(package_name="gpuguard")
@click.pass_context
def main(ctx: click.Context, config_path: str | None) -> None:
    """gpuguard: GPU node health, per-job metrics and sacct reports for Slurm."""
    ctx.obj = _Obj(config_path)


def _table(rows: list[list[Any]], headers: list[str]) -> str:
    cols = [headers] + [[("" if c is None else str(c)) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cols) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cols]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# --- check --------------------------------------------------------------------------
@main.command()
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
@click.option("--from-nvidia-smi", "nvsmi", metavar="FILE",
              help="judge a saved `nvidia-smi -q` or `-q -x` dump instead of the live GPUs")
@click.option("--gpu-source", type=click.Choice(["nvml", "replay"]), help="override [gpu] source")
@click.option("--replay", "replay_path", metavar="FILE", help="replay file (with --gpu-source replay)")
@click.option("--kernel-log", metavar="SRC", help="kernel log to scan for XIDs: auto|kmsg|journalctl|dmesg|FILE|none "
              "(default: the config's; 'none' with --from-nvidia-smi)")
@click.option("--record", is_flag=True, help="store the run and advance the kernel-log cursor like the prolog does")
@click.option("--list", "list_checks", is_flag=True, help="list the checks and exit")
@click.pass_obj
def check(obj: _Obj, as_json: bool, nvsmi: str | None, gpu_source: str | None, replay_path: str | None,
          kernel_log: str | None, record: bool, list_checks: bool) -> None:
    """Run every health check once and print the findings with their policy action.

    Exit status: 0 healthy (info only), 1 warnings, 2 critical findings. Reads the
    node store for history but writes nothing unless --record is given.
    """
    from gpuguard.checks import load_all

    if list_checks:
        for name, fn in sorted(load_all().items()):
            click.echo(f"{name:16} {(fn.__doc__ or '').strip().splitlines()[0]}")
        return
    cfg = obj.cfg
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
                _fail(f"{nvsmi}: not a regular file")
        except OSError as e:
            _fail(f"{nvsmi}: {e.strerror}")
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
        _fail("; ".join(res.tool_errors))
    if as_json:
        from gpuguard.policy import summarize

        doc = summarize(res.decision)
        doc["tool_errors"] = res.tool_errors
        doc["gpus"] = len(res.snapshot.gpus)
        click.echo(json.dumps(doc, indent=2, default=str))
    else:
        rows = [[f.severity, a, f.code, "" if f.gpu_index is None else f.gpu_index, f.message]
                for f, a in res.decision.actions]
        click.echo(f"{len(res.snapshot.gpus)} GPU(s) from {res.snapshot.source}")
        if rows:
            click.echo(_table(rows, ["SEVERITY", "ACTION", "CODE", "GPU", "MESSAGE"]))
        else:
            click.echo("no findings")
        click.echo(f"decision: {res.decision.outcome}" + (f" ({res.decision.reason})" if res.decision.reason else ""))
        for e in res.tool_errors:
            click.echo(f"tool error: {e}", err=True)
    worst = res.worst_severity
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
@click.option("--json", "as_json", is_flag=True)
@click.option("--from-nvidia-smi", "nvsmi", metavar="FILE", help="read a saved `nvidia-smi -q` / `-q -x` dump")
@click.pass_obj
def gpu_show(obj: _Obj, as_json: bool, nvsmi: str | None) -> None:
    """Print every GPU: identity, temperature, power, clocks, ECC, PCIe, throttle reasons."""
    snap = _snapshot(obj, nvsmi)
    if as_json:
        click.echo(json.dumps(snap.to_dict(), indent=2))
        return
    if snap.error:
        click.echo(f"source error: {snap.error}")
    rows = []
    for g in snap.gpus:
        rows.append([g.index, g.name, g.pci_bus_id, g.temp_c, g.power_w, g.sm_clock_mhz,
                     f"{g.mem_used_mib}/{g.mem_total_mib}", g.ecc_volatile_uncorrected,
                     f"{g.pcie_gen_current}x{g.pcie_width_current}",
                     ",".join(g.clock_event_reasons or []) or "-", ",".join(sorted(g.read_errors)) or "-"])
    click.echo(_table(rows, ["GPU", "NAME", "PCI", "TEMP_C", "POWER_W", "SM_MHZ", "MEM_MIB",
                             "ECC_UNC_VOL", "PCIE", "CLOCK_EVENTS", "READ_ERRORS"]))


@gpu.command("snapshot")
@click.option("-o", "--output", required=True, metavar="FILE",
              help="file to write (gpuguard-snapshot/1 JSON, a replay fixture)")
@click.option("--from-nvidia-smi", "nvsmi", metavar="FILE", help="read a saved `nvidia-smi -q` / `-q -x` dump")
@click.pass_obj
def gpu_snapshot(obj: _Obj, output: str, nvsmi: str | None) -> None:
    """Record the GPUs' state as a replay snapshot (for tests, triage and bug reports)."""
    from gpuguard.gpu.replay import dump_snapshot

    from gpuguard.inputs import InputError, write_output

    snap = _snapshot(obj, nvsmi)
    try:
        write_output(output, dump_snapshot(snap) + "\n")
    except InputError as e:
        _fail(str(e))
    click.echo(f"wrote {len(snap.gpus)} GPU(s) to {output}")


# --- config ----------------------------------------------------------------------------
@main.group("config")
def config_group() -> None:
    """Inspect the configuration."""


@config_group.command("show")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text")
@click.pass_obj
def config_show(obj: _Obj, fmt: str) -> None:
    """Print the effective configuration and where each value came from."""
    rows = config_mod.describe(obj.cfg)
    if fmt == "json":
        click.echo(json.dumps([{"key": k, "value": v, "origin": o} for k, v, o in rows], indent=2))
        return
    click.echo(f"# config file: {obj.cfg.path or '(none: defaults only)'}")
    click.echo(_table([[k, json.dumps(v), o] for k, v, o in rows], ["KEY", "VALUE", "FROM"]))


@config_group.command("example")
def config_example() -> None:
    """Print a complete gpuguard.toml with every key at its default, commented out."""
    click.echo(config_mod.example_toml(), nl=False)


def _register_subcommands() -> None:
    """Attach the command groups that live beside the code they drive."""
    from gpuguard.epilog.baseline_cli import baseline, template
    from gpuguard.epilog.cli import job
    from gpuguard.epilog.cluster_cli import cluster
    from gpuguard.reports.cli import report
    from gpuguard.xid.cli import xid

    for group in (xid, job, template, baseline, report, cluster):
        main.add_command(group)


_register_subcommands()

if __name__ == "__main__":
    main()
