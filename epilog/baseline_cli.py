"""``gpuguard template list``, ``gpuguard baseline show TEMPLATE``, ``gpuguard baseline
reset TEMPLATE``: a thin layer over :mod:`gpuguard.epilog.baseline`.

Both groups read the cluster store (``[paths] cluster_store``, on a single host the node
store). Exit 2 with a one-line error when the store cannot be opened or the template is
unknown.
"""

from __future__ import annotations

from typing import Any

import click

from gpuguard.epilog import baseline as baseline_mod
from gpuguard.epilog.compare import unit_of
from gpuguard.output import display_tz, emit, iso_time, output_options


def _open(obj: Any, *, write: bool = False):
    """The cluster store: read-only for the listing commands (a reader never creates,
    migrates or writes a store, so they work for any user who can read it), read-write
    only for ``baseline reset``."""
    from gpuguard.epilog.jobview import open_readonly
    from gpuguard.store import StoreError, open_store

    try:
        if write:
            return open_store(obj.cfg.cluster_store_path, create=False)
        return open_readonly(obj.cfg.cluster_store_path)
    except StoreError as e:
        raise click.ClickException(str(e)) from None


@click.group("template")
def template() -> None:
    """Job templates: the groups of runs that share a baseline."""


@template.command("list")
@output_options()
@click.pass_obj
def template_list(obj: Any, fmt: str) -> None:
    """List templates with their run counts and state (learning until [baseline] min_runs
    healthy runs) and when the baseline last re-learned by itself (after [baseline]
    relearn_runs consistent job-changed runs; JSON and CSV also name those runs)."""
    store = _open(obj)
    try:
        rows = baseline_mod.list_templates(store, cfg=obj.cfg)
    finally:
        store.close()
    tz = display_tz(obj.cfg)
    for r in rows:
        r["last_seen"] = iso_time(r["last_seen"] or None, tz)
        r["relearned_at"] = iso_time(r["relearned_at"] or None, tz)
    if not rows and fmt == "text":
        click.echo("no templates yet")
        return
    headers = ["name", "source", "jobs", "baseline_runs", "anomalous", "state", "last_seen", "relearned_at"]
    if fmt == "csv":
        for r in rows:
            r["relearned_from"] = " ".join(r["relearned_from"])
        headers.append("relearned_from")
    emit(fmt, rows, headers=headers)


@click.group("baseline")
def baseline() -> None:
    """Template baselines: median and MAD of each metric over the last healthy runs."""


def _known(store: Any, name: str) -> None:
    if not store.query("select 1 from templates where name = ?", [name]):
        raise click.ClickException(f"unknown template {name!r} (see `gpuguard template list`)")


@baseline.command("show")
@click.argument("template_name", metavar="TEMPLATE")
@output_options()
@click.pass_obj
def baseline_show(obj: Any, template_name: str, fmt: str) -> None:
    """Print TEMPLATE's baseline: per metric the median, MAD (raw) and run count."""
    store = _open(obj)
    try:
        _known(store, template_name)
        b = baseline_mod.compute_baseline(store, template_name, cfg=obj.cfg)
    finally:
        store.close()
    tz = display_tz(obj.cfg)
    if fmt == "json":
        doc = b.to_dict()
        doc["since"] = iso_time(b.since or None, tz)
        emit(fmt, doc)
        return
    rows = [{"metric": m, "unit": unit_of(m), "median": st.median, "mad": st.mad, "n": st.n}
            for m, st in b.stats.items()]
    if fmt == "text":
        click.echo(f"template {b.template}: {b.state}, {b.runs} baseline run(s)"
                   + (f" since {iso_time(b.since, tz)}" if b.since else ""))
    emit(fmt, rows, headers=["metric", "unit", "median", "mad", "n"])


@baseline.command("reset")
@click.argument("template_name", metavar="TEMPLATE")
@click.option("--yes", is_flag=True, help="do not ask for confirmation")
@click.pass_obj
def baseline_reset(obj: Any, template_name: str, yes: bool) -> None:
    """Forget TEMPLATE's baseline: it learns again from the next runs (use after a
    deliberate change to the job, e.g. a new model size)."""
    store = _open(obj, write=True)
    try:
        _known(store, template_name)
        if not yes:
            click.confirm(f"reset the baseline of {template_name}?", abort=True)
        baseline_mod.reset_baseline(store, template_name)
    finally:
        store.close()
    click.echo(f"baseline of {template_name} reset; it is learning again")
