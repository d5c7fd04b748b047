"""``gpuguard template list``, ``gpuguard baseline show TEMPLATE``, ``gpuguard baseline
reset TEMPLATE``: a thin layer over :mod:`gpuguard.epilog.baseline`.

Both groups read the cluster store (``[paths] cluster_store``, on a single host the node
store). Exit 2 with a one-line error when the store cannot be opened or the template is
unknown.
"""

from __future__ import annotations

import csv
import io
import json
import time
from typing import Any

import click

from gpuguard.epilog import baseline as baseline_mod
from gpuguard.epilog.metrics import METRICS


def _open(obj: Any, *, create: bool = False):
    from gpuguard.store import StoreError, open_store

    try:
        return open_store(obj.cfg.cluster_store_path, create=create)
    except StoreError as e:
        raise click.ClickException(str(e)) from None


def _iso(t: float | None) -> str:
    if not t:
        return ""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _emit(rows: list[dict[str, Any]], headers: list[str], fmt: str) -> None:
    if fmt == "json":
        click.echo(json.dumps(rows, indent=2, default=str))
        return
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=headers, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
        click.echo(buf.getvalue(), nl=False)
        return
    cols = [headers] + [["" if r.get(h) is None else str(r.get(h)) for h in headers] for r in rows]
    widths = [max(len(c[i]) for c in cols) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cols]
    lines.insert(1, "  ".join("-" * w for w in widths))
    click.echo("\n".join(lines))


_FMT = click.option("--format", "fmt", type=click.Choice(["text", "json", "csv"]), default="text",
                    show_default=True)


@click.group("template")
def template() -> None:
    """Job templates: the groups of runs that share a baseline."""


@template.command("list")
@_FMT
@click.pass_obj
def template_list(obj: Any, fmt: str) -> None:
    """List templates with their run counts and state (learning until [baseline] min_runs
    healthy runs) and when the baseline last re-learned by itself (after [baseline]
    relearn_runs consistent job-changed runs; JSON/CSV also name those runs)."""
    store = _open(obj)
    try:
        rows = baseline_mod.list_templates(store, cfg=obj.cfg)
    finally:
        store.close()
    for r in rows:
        r["last_seen"] = _iso(r["last_seen"])
        r["relearned_at"] = _iso(r["relearned_at"])
        r["relearned_from"] = ",".join(r["relearned_from"])
    if not rows and fmt == "text":
        click.echo("no templates yet")
        return
    _emit(rows, ["name", "source", "jobs", "baseline_runs", "anomalous", "state", "last_seen", "relearned_at"]
          + (["relearned_from"] if fmt != "text" else []), fmt)


@click.group("baseline")
def baseline() -> None:
    """Template baselines: median and MAD of each metric over the last healthy runs."""


def _known(store: Any, name: str) -> None:
    if not store.query("select 1 from templates where name = ?", [name]):
        raise click.ClickException(f"unknown template {name!r} (see `gpuguard template list`)")


@baseline.command("show")
@click.argument("template_name", metavar="TEMPLATE")
@_FMT
@click.pass_obj
def baseline_show(obj: Any, template_name: str, fmt: str) -> None:
    """Print TEMPLATE's baseline: per metric the median, MAD (raw) and run count."""
    store = _open(obj)
    try:
        _known(store, template_name)
        b = baseline_mod.compute_baseline(store, template_name, cfg=obj.cfg)
    finally:
        store.close()
    if fmt == "json":
        click.echo(json.dumps(b.to_dict(), indent=2, default=str))
        return
    rows = [{"metric": m, "unit": METRICS[m][0], "median": f"{st.median:.6g}", "mad": f"{st.mad:.4g}", "n": st.n}
            for m, st in b.stats.items()]
    if fmt == "text":
        click.echo(f"template {b.template}: {b.state}, {b.runs} baseline run(s)"
                   + (f" since {_iso(b.since)}" if b.since else ""))
    _emit(rows, ["metric", "unit", "median", "mad", "n"], fmt)


@baseline.command("reset")
@click.argument("template_name", metavar="TEMPLATE")
@click.option("--yes", is_flag=True, help="do not ask for confirmation")
@click.pass_obj
def baseline_reset(obj: Any, template_name: str, yes: bool) -> None:
    """Forget TEMPLATE's baseline: it learns again from the next runs (use after a
    deliberate change to the job, e.g. a new model size)."""
    store = _open(obj)
    try:
        _known(store, template_name)
        if not yes:
            click.confirm(f"reset the baseline of {template_name}?", abort=True)
        baseline_mod.reset_baseline(store, template_name)
    finally:
        store.close()
    click.echo(f"baseline of {template_name} reset; it is learning again")
