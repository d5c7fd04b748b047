"""Tiered retention of the node store: raw samples for days, per-minute aggregates for
months, summaries and events until an operator prunes them.

:func:`prune` (``gpuguard store prune``, and the Epilog after its summary and verdict,
bounded by ``[store] prune_budget_s``):

1. raw GPU samples older than ``[store] raw_days`` are folded into ``gpu_minutes`` (per GPU
   per UTC minute: count, min/mean/max of each sampled metric, integer-scaled as the raw
   rows; the OR of the clock-event masks; layout in :mod:`gpuguard.samples`, real units
   through the ``minutes_view`` view) and deleted with their slow counters, one GPU
   series at a time, so a budget can stop between series and the next run goes on;
2. ``host_samples`` older than ``raw_days`` are deleted, and the training records
   (``steps``, ``checkpoints``, ``step_windows``) of the jobs whose summary is older than
   ``raw_days`` (the summary keeps their aggregates), job by job in summary order from a
   cursor (``retention.records``), in bounded deletes, so a budget can stop anywhere; and
   those of a job that was never summarised (its node died before the Epilog) once its
   newest record is older than ``raw_days``;
3. ``gpu_minutes`` older than ``[store] minutes_days`` are deleted, and GPU series left
   without rows;
4. only when asked (``summaries_days``/``events_days`` not None): ``job_summaries``,
   ``verdicts``/``comparisons`` and ``events``/``findings`` older than that.

Measured (``bench/store_bytes.py``): a GPU-minute row costs about 50 B, i.e. < 1 B per
GPU-second against ~30 B per raw sample.
"""

from __future__ import annotations

import time
from typing import Any

from gpuguard.metrics import GPU_SAMPLED, stored_column
from gpuguard.model import CLOCK_EVENT_REASONS
from gpuguard.store import StoreError

#: Seconds per day.
DAY_S = 86400.0


def _minute_select() -> str:
    parts = []
    for m in GPU_SAMPLED:
        c = stored_column(m)
        if m.name == "clock_event_mask":
            bits = " | ".join(f"max({c} & {bit})" for bit, _label in CLOCK_EVENT_REASONS.values())
            parts.append(f"({bits})")
        else:
            mean = f"cast(round(avg({c})) as integer)"
            parts += [mean, f"{mean} - min({c})", f"max({c}) - {mean}"]
    return ", ".join(parts)


def _fold_series(conn: Any, sid: int, t0: float, cutoff: float) -> int:
    """Fold one series' raw rows before ``cutoff`` (epoch s) into minutes; return rows folded."""
    hi = round((cutoff - t0) * 1000)
    n = conn.execute("select count(*) from gpu_samples where sid = ? and t_ms < ?", (sid, hi)).fetchone()[0]
    if not n:
        return 0
    # an existing minute (folded before, then more raw rows of it arrived) is recomputed
    # only from the raw rows still present; the boundary minute is rare and small
    conn.execute(
        f"insert or replace into gpu_minutes select sid, cast((? + t_ms / 1000.0) / 60 as integer) - ? as minute, "
        f"count(*), {_minute_select()} from gpu_samples where sid = ? and t_ms < ? group by minute",
        (t0, int(t0 // 60), sid, hi))
    conn.execute("delete from gpu_samples where sid = ? and t_ms < ?", (sid, hi))
    conn.execute("delete from gpu_slow where sid = ? and t_ms < ?", (sid, hi))
    from gpuguard.live_minutes import forget_before

    forget_before(conn, sid, t0, hi)
    return n


#: Training-record rows deleted per statement (our choice: a 7-day job at 8 ranks has ~5 M;
#: a bounded delete keeps each transaction short and lets a budget stop between them).
RECORD_BATCH = 20_000

#: The cursor (``cursors`` table) holding the ``created_at`` of the last summary whose
#: job's training records were deleted.
RECORDS_CURSOR = "retention.records"


def _prune_records(store: Any, raw_cut: float, stop_at: float | None) -> tuple[int, bool]:
    """Delete the training records of the jobs summarised before ``raw_cut`` (module
    docstring, step 2). Returns ``(step rows deleted, finished)``."""
    conn = store.db.conn
    since = float(store.get_cursor(RECORDS_CURSOR) or 0.0)
    jobs = conn.execute("select job_id, node, created_at from job_summaries where created_at >= ? and "
                        "created_at < ? order by created_at", (since, raw_cut)).fetchall()
    deleted = 0
    for job_id, node, created in jobs:
        n, done = _delete_job_records(store, job_id, node, stop_at)
        deleted += n
        if not done:
            return deleted, False
        store.set_cursor(RECORDS_CURSOR, repr(created))
    n, done = _prune_orphan_records(store, raw_cut, stop_at)
    return deleted + n, done


def _delete_job_records(store: Any, job_id: str, node: str, stop_at: float | None) -> tuple[int, bool]:
    """Delete one job's training records on ``node`` in bounded deletes. Returns
    ``(step rows deleted, finished)``."""
    conn = store.db.conn
    deleted = 0
    while True:
        if stop_at is not None and time.monotonic() >= stop_at:
            return deleted, False
        with store.tx():
            n = conn.execute("delete from steps where rowid in (select rowid from steps where job_id = ? and "
                             "node = ? limit ?)", (job_id, node, RECORD_BATCH)).rowcount
            if n < RECORD_BATCH:
                conn.execute("delete from checkpoints where job_id = ? and node = ?", (job_id, node))
                conn.execute("delete from step_windows where job_id = ? and node = ?", (job_id, node))
                conn.execute("delete from train_offsets where job_id = ? and node = ?", (job_id, node))
        deleted += n
        if n < RECORD_BATCH:
            return deleted, True


def _newest_record_t(conn: Any, job_id: str, node: str) -> float | None:
    """The newest time among each rank's highest-step record: a few index seeks per rank
    on ``steps (job_id, node, rank, step)`` (a loose index scan), not a pass over the
    job's rows."""
    key = (job_id, node)
    last = "select t from steps where job_id = ? and node = ? and {} order by step desc limit 1"
    first = "select min(rank) from steps where job_id = ? and node = ?"
    row = conn.execute(last.format("rank is null"), key).fetchone()
    times = [row[0]] if row else []
    rank = conn.execute(first, key).fetchone()[0]
    while rank is not None:
        times.append(conn.execute(last.format("rank = ?"), (*key, rank)).fetchone()[0])
        rank = conn.execute(first + " and rank > ?", (*key, rank)).fetchone()[0]
    times = [t for t in times if t is not None]
    return max(times) if times else None


def _prune_orphan_records(store: Any, raw_cut: float, stop_at: float | None) -> tuple[int, bool]:
    """Delete the training records of jobs that were never summarised (their node died
    or the Epilog never ran), once their newest record is older than ``raw_cut``: the
    collector's ingest bookkeeping (``train_offsets``, dropped by the Epilog) names them.
    A job with no record time, or a recent one (a job still running), stays."""
    conn = store.db.conn
    jobs = conn.execute("select distinct o.job_id, o.node from train_offsets o where not exists "
                        "(select 1 from job_summaries j where j.job_id = o.job_id and j.node = o.node)").fetchall()
    deleted = 0
    for job_id, node in jobs:
        if stop_at is not None and time.monotonic() >= stop_at:
            return deleted, False
        newest = _newest_record_t(conn, job_id, node)
        if newest is None or newest >= raw_cut:
            continue
        n, done = _delete_job_records(store, job_id, node, stop_at)
        deleted += n
        if not done:
            return deleted, False
    return deleted, True


def prune(store: Any, *, now: float | None = None, raw_days: float, minutes_days: float,
          summaries_days: float | None = None, events_days: float | None = None,
          budget_s: float | None = None) -> dict[str, Any]:
    """Apply the retention tiers (module docstring) to ``store`` (a :class:`~gpuguard.store.Store`).

    Returns counts ``{"samples_folded", "series_done", "series_left", "host_samples",
    "step_records", "minutes", "summaries", "events", "complete"}``; ``complete`` is False when
    ``budget_s`` (wall seconds) ran out, and the next call continues. Raises
    ``ValueError`` for a negative age and :class:`~gpuguard.store.StoreError` when the store
    cannot be written."""
    for name, v in (("raw_days", raw_days), ("minutes_days", minutes_days), ("summaries_days", summaries_days),
                    ("events_days", events_days)):
        if v is not None and not v >= 0:  # NaN too: every comparison with it is false
            raise ValueError(f"{name} must be >= 0, got {v}")
    now = time.time() if now is None else now
    stop_at = None if budget_s is None else time.monotonic() + budget_s
    raw_cut = now - raw_days * DAY_S
    out: dict[str, Any] = {"samples_folded": 0, "series_done": 0, "series_left": 0, "host_samples": 0,
                           "step_records": 0, "minutes": 0, "summaries": 0, "events": 0, "complete": True}
    conn = store.db.conn
    memo = getattr(store, "memo", None)
    if memo is not None:
        memo.clear()  # bucketed reads of rows about to be folded away
    try:
        old = conn.execute("select g.id, g.t0 from gpu_series g where g.t0 < ? and exists "
                           "(select 1 from gpu_samples s where s.sid = g.id and s.t_ms < round((? - g.t0) * 1000)) "
                           "order by g.t0", (raw_cut, raw_cut)).fetchall()
        for k, (sid, t0) in enumerate(old):
            if stop_at is not None and time.monotonic() >= stop_at:
                out["series_left"] = len(old) - k
                out["complete"] = False
                break
            with store.tx():
                out["samples_folded"] += _fold_series(conn, sid, t0, raw_cut)
            out["series_done"] += 1
        if out["complete"]:
            out["step_records"], done = _prune_records(store, raw_cut, stop_at)
            out["complete"] = done
        with store.tx():
            out["host_samples"] = conn.execute("delete from host_samples where at < ?", (raw_cut,)).rowcount
            minute_cut = int((now - minutes_days * DAY_S) // 60)
            out["minutes"] = conn.execute(
                "delete from gpu_minutes where minute < ? - (select cast(g.t0 / 60 as integer) from gpu_series g "
                "where g.id = gpu_minutes.sid)", (minute_cut,)).rowcount
            conn.execute("delete from gpu_series where t0 < ? and not exists (select 1 from gpu_samples s "
                         "where s.sid = gpu_series.id) and not exists (select 1 from gpu_minutes m "
                         "where m.sid = gpu_series.id)", (raw_cut,))
            if summaries_days is not None:
                cut = now - summaries_days * DAY_S
                out["summaries"] = conn.execute("delete from job_summaries where created_at < ?", (cut,)).rowcount
                conn.execute("delete from comparisons where at < ?", (cut,))
                conn.execute("delete from verdicts where at < ?", (cut,))
            if events_days is not None:
                cut = now - events_days * DAY_S
                out["events"] = conn.execute("delete from events where at < ?", (cut,)).rowcount
                conn.execute("delete from findings where at < ?", (cut,))
    except StoreError:
        raise
    except Exception as e:  # sqlite3.Error: locked, read-only, full disk
        raise StoreError(f"store {store.path}: prune failed: {e}") from None
    return out
