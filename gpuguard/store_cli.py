"""``gpuguard store ...``: store maintenance (retention, :mod:`gpuguard.retention`)."""

from __future__ import annotations

from typing import Any

import click

from gpuguard.clitypes import DAYS
from gpuguard.output import emit, output_options


@click.group("store")
def store_group() -> None:
    """Node store maintenance."""


@store_group.command("prune")
@click.option("--store", "store_path", metavar="FILE", help="store file (default: [paths] store)")
@click.option("--raw-days", type=DAYS, default=None,
              help="keep raw samples this many days (default: [store] raw_days)")
@click.option("--minutes-days", type=DAYS, default=None,
              help="keep per-minute aggregates this many days (default: [store] minutes_days)")
@click.option("--summaries-days", type=DAYS, default=None,
              help="also delete job summaries, verdicts and comparisons older than this (default: keep)")
@click.option("--events-days", type=DAYS, default=None,
              help="also delete events and findings older than this (default: keep)")
@output_options()
@click.pass_obj
def store_prune(obj: Any, store_path: str | None, raw_days: float | None, minutes_days: float | None,
                summaries_days: float | None, events_days: float | None, fmt: str) -> None:
    """Fold raw samples past their retention into per-minute aggregates and delete what is
    past every tier. Exit 2 when the store cannot be opened or written."""
    from gpuguard.retention import prune
    from gpuguard.store import StoreError, open_store

    cfg = obj.cfg
    try:
        st = open_store(store_path or cfg.store_path, create=False)
    except StoreError as e:
        raise click.ClickException(str(e)) from None
    try:
        res = prune(st, raw_days=cfg.get("store", "raw_days") if raw_days is None else raw_days,
                    minutes_days=cfg.get("store", "minutes_days") if minutes_days is None else minutes_days,
                    summaries_days=summaries_days, events_days=events_days)
    except StoreError as e:
        raise click.ClickException(str(e)) from None
    finally:
        st.close()
    emit(fmt, res, rows=[res], text=lambda: (
        f"folded {res['samples_folded']} raw sample(s) of {res['series_done']} GPU series into minutes; "
        f"deleted {res['host_samples']} host sample(s), {res['step_records']} training step record(s), "
        f"{res['minutes']} minute row(s), "
        f"{res['summaries']} summary(ies), {res['events']} event(s)"))
