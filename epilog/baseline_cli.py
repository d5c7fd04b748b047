"""``gpuguard template list``, ``gpuguard baseline show TEMPLATE``, ``gpuguard baseline
reset TEMPLATE [--gpu-model NAME]``: a thin layer over :mod:`gpuguard.epilog.baseline`.

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
    healthy runs on a GPU model) and when the baseline last re-learned by itself (after
    [baseline] relearn_runs consistent job-changed runs; JSON and CSV also name those
    runs). A baseline is kept per GPU model: baseline_runs and state are those on the GPU
    model of the template's newest run (gpu_model); gpu_models lists every model's runs."""
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
    headers = ["name", "source", "jobs", "baseline_runs", "anomalous", "state", "last_seen", "relearned_at",
               "gpu_model"]
    if fmt != "json":
        for r in rows:
            r["gpu_model"] = r["gpu_model"] or "-"
            r["gpu_models"] = "; ".join(f"{m or 'unknown'}: {n}" for m, n in r["gpu_models"].items())
    if fmt == "csv":
        for r in rows:
            r["relearned_from"] = " ".join(r["relearned_from"])
        headers += ["relearned_from", "gpu_models"]
    emit(fmt, rows, headers=headers)


@click.group("baseline")
def baseline() -> None:
    """Template baselines: median and MAD of each metric over the last healthy runs."""


def _known(store: Any, name: str) -> None:
    if not store.query("select 1 from templates where name = ?", [name]):
        raise click.ClickException(f"unknown template {name!r} (see `gpuguard template list`)")


@baseline.command("show")
@click.argument("template_name", metavar="TEMPLATE")
@click.option("--gpu-model", "gpu_model", metavar="NAME", default=None,
              help="the GPU model's baseline (its NVML product name, as `template list` shows it); "
                   "default: the model of the template's newest run")
@output_options()
@click.pass_obj
def baseline_show(obj: Any, template_name: str, gpu_model: str | None, fmt: str) -> None:
    """Print TEMPLATE's baseline on one GPU model (a baseline is kept per model): per
    metric the median, MAD (raw) and run count, and the runs on its other models."""
    store = _open(obj)
    try:
        _known(store, template_name)
        if gpu_model is not None and gpu_model not in baseline_mod.model_runs(store, template_name, 1):
            raise click.ClickException(f"template {template_name!r} has no baseline run on GPU model "
                                       f"{gpu_model!r} (see `gpuguard template list --format json`)")
        b = baseline_mod.compute_baseline(store, template_name, cfg=obj.cfg, gpu_model=gpu_model)
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
        click.echo(f"template {b.template} on {b.gpu_model or 'an unknown GPU model'}: {b.state}, "
                   f"{b.runs} baseline run(s)" + (f" since {iso_time(b.since, tz)}" if b.since else ""))
        if b.other_models:
            click.echo("other GPU models (see --gpu-model): "
                       + "; ".join(f"{m or 'unknown'}: {n} run(s)" for m, n in b.other_models.items()))
    emit(fmt, rows, headers=["metric", "unit", "median", "mad", "n"])


@baseline.command("reset")
@click.argument("template_name", metavar="TEMPLATE")
@click.option("--gpu-model", "gpu_model", metavar="NAME", default=None,
              help="forget only this GPU model's runs (its NVML product name, as `template list --format json` "
                   "names it; \"\" = runs whose model was not known); the other models keep theirs")
@click.option("--yes", is_flag=True, help="do not ask for confirmation")
@click.pass_obj
def baseline_reset(obj: Any, template_name: str, gpu_model: str | None, yes: bool) -> None:
    """Forget TEMPLATE's baseline on every GPU model, or with --gpu-model on that model
    only: the runs judged until now stop counting and it learns again from the next runs
    (use after a deliberate change to the job, e.g. a new model size; --gpu-model after
    a change on one partition, e.g. a new node image). The verdicts stay for `job show`.
    Exit 2 for an unknown template or a model the template never ran on."""
    store = _open(obj, write=True)
    try:
        _known(store, template_name)
        if gpu_model is not None and gpu_model not in baseline_mod.template_models(store, template_name):
            known = ", ".join(repr(m) for m in baseline_mod.template_models(store, template_name)) or "none"
            raise click.ClickException(f"template {template_name!r} has no run on GPU model {gpu_model!r} "
                                       f"(its models: {known})")
        what = "every GPU model" if gpu_model is None else f"GPU model {gpu_model or 'unknown'}"
        if not yes:
            click.confirm(f"reset the baseline of {template_name} ({what})?", abort=True)
        models = baseline_mod.model_runs(store, template_name, 1)
        baseline_mod.reset_baseline(store, template_name, gpu_model=gpu_model)
    finally:
        store.close()
    if gpu_model is not None:
        click.echo(f"baseline of {template_name} on {gpu_model or 'an unknown GPU model'} reset; it is learning "
                   "again there (other GPU models unchanged)")
        return
    on = f" on {len(models)} GPU models" if len(models) > 1 else ""
    click.echo(f"baseline of {template_name} reset{on}; it is learning again")
