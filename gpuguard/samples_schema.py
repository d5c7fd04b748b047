"""The compact sample tables' DDL and migrations (layout: :mod:`gpuguard.samples`): the
collector's migration set (``gpuguard.collector.schema``) calls these steps."""

from __future__ import annotations

import sqlite3

from gpuguard.metrics import GPU_SAMPLED, GPU_SLOW, stored_column
from gpuguard.samples import _cols


def _view_sql() -> str:
    vals = [f"s.{stored_column(m)}" + (f" / {float(m.scale)!r}" if m.scale != 1 else "") + f" as {m.name}"
            for m in GPU_SAMPLED]
    slow = [f"w.{stored_column(m)} as {m.name}" for m in GPU_SLOW]
    return ("create view samples as select g.job_id as job_id, g.node as node, g.t0 + s.t_ms / 1000.0 as at, "
            f"g.gpu_index as gpu_index, g.gpu_uuid as gpu_uuid, {', '.join(vals + slow)} "
            "from gpu_samples s join gpu_series g on g.id = s.sid "
            "left join gpu_slow w on w.sid = s.sid and w.t_ms = s.t_ms")


def migrate(conn: sqlite3.Connection) -> None:
    """Create the compact tables, move the rows of an old ``samples`` table into them
    (values scaled and rounded as the table says), drop it and create the view. Runs
    inside the migration's transaction."""
    fast = ", ".join(f"{c} integer" for c in _cols(GPU_SAMPLED))
    slow = ", ".join(f"{c} integer" for c in _cols(GPU_SLOW))
    agg = []
    for m in GPU_SAMPLED:
        c = stored_column(m)
        agg += [f"{c}_or integer"] if m.name == "clock_event_mask" else [
            f"{c}_min integer", f"{c}_mean real", f"{c}_max integer"]
    # (the first layout of gpu_minutes; migrate_minutes replaces it)
    ddl = f"""
        create table gpu_series (id integer primary key, job_id text not null, node text not null,
            gpu_index integer not null, gpu_uuid text, t0 real not null, unique (job_id, node, gpu_index));
        create table gpu_samples (sid integer not null, t_ms integer not null, {fast},
            primary key (sid, t_ms)) without rowid;
        create table gpu_slow (sid integer not null, t_ms integer not null, {slow},
            primary key (sid, t_ms)) without rowid;
        create table gpu_minutes (sid integer not null, minute integer not null, n integer not null,
            {', '.join(agg)}, primary key (sid, minute)) without rowid
    """
    for stmt in ddl.split(";"):  # not executescript: it would commit the migration's transaction
        conn.execute(stmt)
    old = {r[1] for r in conn.execute("pragma table_info(samples)")}
    if old:
        conn.execute("insert or ignore into gpu_series (job_id, node, gpu_index, gpu_uuid, t0) "
                     "select coalesce(job_id, ''), coalesce(node, ''), coalesce(gpu_index, -1), max(gpu_uuid), "
                     "min(at) from samples group by 1, 2, 3")
        key = ("from samples o join gpu_series g on g.job_id = coalesce(o.job_id, '') and g.node = "
               "coalesce(o.node, '') and g.gpu_index = coalesce(o.gpu_index, -1)")
        t = "cast(round((o.at - g.t0) * 1000) as integer)"
        vals = ", ".join(f"cast(round(o.{m.name} * {m.scale}) as integer)" if m.name in old else "null"
                         for m in GPU_SAMPLED)
        conn.execute(f"insert or replace into gpu_samples select g.id, {t}, {vals} {key}")
        svals = ", ".join(f"o.{m.name}" if m.name in old else "null" for m in GPU_SLOW)
        conn.execute(f"insert or replace into gpu_slow select g.id, {t}, {svals} {key} "
                     f"where {' or '.join(f'o.{m.name} is not null' for m in GPU_SLOW if m.name in old) or '0'}")
        conn.execute("drop table samples")
    conn.execute(_view_sql())


def minute_columns() -> list[str]:
    """Columns of ``gpu_minutes`` after ``sid, minute, n``, from the metric table."""
    out = []
    for m in GPU_SAMPLED:
        c = stored_column(m)
        out += [f"{c}_or"] if m.name == "clock_event_mask" else [f"{c}_mean", f"{c}_dmin", f"{c}_dmax"]
    return out


def migrate_minutes(conn: sqlite3.Connection) -> None:
    """Second layout of ``gpu_minutes`` (module docstring): minutes relative to the series,
    min/max as distances from the mean. Rows of the first layout are converted."""
    cols = ", ".join(f"{c} integer" for c in minute_columns())
    conn.execute(f"create table gpu_minutes_new (sid integer not null, minute integer not null, "
                 f"n integer not null, {cols}, primary key (sid, minute)) without rowid")
    old = {r[1] for r in conn.execute("pragma table_info(gpu_minutes)")}
    if old:
        sel = []
        for m in GPU_SAMPLED:
            c = stored_column(m)
            if m.name == "clock_event_mask":
                sel.append(f"o.{c}_or")
            else:
                mean = f"cast(round(o.{c}_mean) as integer)"
                sel += [mean, f"{mean} - o.{c}_min", f"o.{c}_max - {mean}"]
        conn.execute(f"insert into gpu_minutes_new select o.sid, o.minute - cast(g.t0 / 60 as integer), o.n, "
                     f"{', '.join(sel)} from gpu_minutes o join gpu_series g on g.id = o.sid")
        conn.execute("drop table gpu_minutes")
    conn.execute("alter table gpu_minutes_new rename to gpu_minutes")
    conn.execute("drop view if exists minutes_view")
    conn.execute(_minutes_view_sql())


def _minutes_view_sql() -> str:
    parts = []
    for m in GPU_SAMPLED:
        c = stored_column(m)
        if m.name == "clock_event_mask":
            parts.append(f"m.{c}_or as {m.name}_or")
            continue
        div = f" / {float(m.scale)!r}" if m.scale != 1 else ""
        parts += [f"(m.{c}_mean - m.{c}_dmin){div} as {m.name}_min", f"m.{c}_mean{div} as {m.name}_mean",
                  f"(m.{c}_mean + m.{c}_dmax){div} as {m.name}_max"]
    return ("create view minutes_view as select g.job_id as job_id, g.node as node, g.gpu_index as gpu_index, "
            "(cast(g.t0 / 60 as integer) + m.minute) * 60 as minute_at, m.n as n, "
            f"{', '.join(parts)} from gpu_minutes m join gpu_series g on g.id = m.sid")


def add_missing_columns(conn: sqlite3.Connection) -> list[str]:
    """Add the columns of metric-table rows added since the compact tables were created
    (``ALTER TABLE ... ADD COLUMN``; old rows read NULL: not sampled then) and rebuild the
    ``samples`` view. A new sampled metric's store change is one collector migration step
    calling this. Returns the columns added."""
    added = []
    from gpuguard.live_minutes import minute_columns as live_columns

    want = {"gpu_samples": [stored_column(m) for m in GPU_SAMPLED],
            "gpu_slow": [stored_column(m) for m in GPU_SLOW],
            "gpu_minutes": minute_columns(),
            "gpu_live_minutes": live_columns()}
    for table, cols in want.items():
        have = {r[1] for r in conn.execute(f"pragma table_info({table})")}
        if not have:
            continue  # created later by its own migration step, with every column
        for c in cols:
            if c not in have:
                conn.execute(f"alter table {table} add column {c} integer")
                added.append(f"{table}.{c}")
    conn.execute("drop view if exists samples")
    conn.execute(_view_sql())
    conn.execute("drop view if exists minutes_view")
    conn.execute(_minutes_view_sql())
    return added
