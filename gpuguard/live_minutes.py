"""Minutes the collector closes while a job runs, so the Epilog reads minutes, not samples.

Every sample write (:func:`gpuguard.samples.write`) closes the minutes of a GPU series
that can no longer change (a series' ``t_ms`` only grows) in chunks of
:data:`CHUNK_MIN` minutes: one grouped pass over the chunk's raw rows
(:func:`gpuguard.samples.grouped_sql`, the same pass :func:`gpuguard.samples.read_buckets`
makes) is stored as

* ``gpu_live_minutes``: ``(sid, minute, mask, n, t_first, t_last, t_sum, <c>_sum, <c>_n,
  ..., <c>_max, ...)``, one row per minute and clock-event mask: the sample count, first,
  last and summed ``t_ms`` (relative to the minute's start), and per
  :data:`gpuguard.samples.SUMMED` metric the sum and count (NULL when it is ``n``), per
  :data:`gpuguard.samples.MAXED` metric the maximum, integer-scaled like the raw rows;
  ``minute`` counts UTC minutes from the series' ``t0`` minute; a NULL mask is kept as -1;
* ``gpu_live_chunks``: ``(sid, first_minute, end_minute, n, hist)``: the chunk's span
  (end exclusive), its raw sample count and the ``{value: count}`` histogram of each
  percentile metric (:data:`gpuguard.samples.PCT_SAMPLED`, JSON). A gap without samples
  is one empty chunk.

An epoch-aligned bucketed read (:func:`gpuguard.samples.read_buckets`) then takes the
closed chunks inside its range whose sample counts still match the raw rows
(:func:`closed_range`) and reads only the raw rows around them. Measured
(``bench/epilog_long.py``): a 24 h x 8 GPU summary reads 11,520 minute rows and the last
minutes' raw rows instead of 691,200 rows. The raw rows stay the record: retention folds
and deletes both tiers together (:func:`forget_before`), and a chunk whose count does not
match (rows replaced or deleted since) is not used, so the result is always the raw
rows' (``tests/test_live_minutes.py`` compares the two reads). The Epilog drops a job's
closed minutes once its summary and part are written (:func:`drop_job`): they are a
working set of the running job (~1-2 B per GPU-sample while it runs), not a retention tier.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from gpuguard import samples
from gpuguard.metrics import stored_column

#: Milliseconds per minute (minutes are UTC minutes: aligned on the epoch).
MINUTE_MS = 60_000

#: Minutes closed together (our choice): the collector pays one grouped pass per GPU every
#: 10 minutes, and the Epilog reads at most about 10 minutes of raw rows per GPU.
CHUNK_MIN = 10

#: At most this many chunks are closed by one write (a series that was not closed before,
#: e.g. written before this table existed, catches up over several flushes), so a
#: collector flush stays bounded.
MAX_CHUNKS_PER_WRITE = 12


def _c(name: str) -> str:
    return stored_column(samples._SAMPLED_BY_NAME[name])


def minute_columns() -> list[str]:
    """Columns of ``gpu_live_minutes`` after ``sid, minute, mask, n, t_first, t_last,
    t_sum``, from the metric table."""
    return ([x for n in samples.SUMMED for x in (f"{_c(n)}_sum", f"{_c(n)}_n")]
            + [f"{_c(n)}_max" for n in samples.MAXED])


def migrate(conn: sqlite3.Connection) -> None:
    """Create the two tables (module docstring). Runs inside the migration's transaction."""
    cols = ", ".join(f"{c} integer" for c in minute_columns())
    conn.execute("create table if not exists gpu_live_minutes (sid integer not null, minute integer not null, "
                 "mask integer not null, n integer not null, t_first integer not null, t_last integer not null, "
                 f"t_sum integer not null, {cols}, primary key (sid, minute, mask)) without rowid")
    conn.execute("create table if not exists gpu_live_chunks (sid integer not null, first_minute integer not null, "
                 "end_minute integer not null, n integer not null, hist text not null, "
                 "primary key (sid, first_minute)) without rowid")


def _origin(t0: float) -> tuple[int, int]:
    """``(t0_ms, base)``: the series' start in epoch ms and its UTC minute."""
    t0_ms = round(t0 * 1000)
    return t0_ms, t0_ms // MINUTE_MS


def _start_ms(t0_ms: int, base: int, minute: int) -> int:
    """``t_ms`` (series-relative) at which series minute ``minute`` starts."""
    return (base + minute) * MINUTE_MS - t0_ms


def _close_chunk(conn: sqlite3.Connection, sid: int, t0_ms: int, base: int, first: int, end: int) -> None:
    lo, hi = _start_ms(t0_ms, base, first), _start_ms(t0_ms, base, end) - 1
    rows = conn.execute(samples.grouped_sql(f"(t_ms + {t0_ms}) / {MINUTE_MS} - {base}"), (sid, lo, hi)).fetchall()
    ns, nm = len(samples.SUMMED), len(samples.MAXED)
    out = []
    total = 0
    for r in rows:
        minute, mask, n = r[0], r[1], r[2]
        start = _start_ms(t0_ms, base, minute)
        sums, maxes, counts = r[6:6 + ns], r[6 + ns:6 + ns + nm], r[6 + ns + nm:]
        vals: list[Any] = []
        for s_, c_ in zip(sums, counts, strict=True):
            vals += [s_, None if c_ == n else c_]
        out.append((sid, minute, -1 if mask is None else mask, n, r[3] - start, r[4] - start, r[5] - n * start,
                    *vals, *maxes))
        total += n
    hist = {}
    for name in samples.PCT_SAMPLED:
        c = _c(name)
        hist[name] = conn.execute(f"select {c}, count(*) from gpu_samples where sid = ? and t_ms between ? and ? "
                                  f"and {c} is not null group by 1", (sid, lo, hi)).fetchall()
    if out:
        cols = ["sid", "minute", "mask", "n", "t_first", "t_last", "t_sum", *minute_columns()]
        conn.executemany(f"insert or replace into gpu_live_minutes ({', '.join(cols)}) "
                         f"values ({', '.join('?' * len(cols))})", out)
    conn.execute("insert or replace into gpu_live_chunks (sid, first_minute, end_minute, n, hist) values (?,?,?,?,?)",
                 (sid, first, end, total, json.dumps(hist, separators=(",", ":"))))


def close_due(conn: sqlite3.Connection, next_of: dict[int, int], sid: int, t0: float, last_t_ms: int) -> None:
    """Close the whole chunks of series ``sid`` (``t0`` its start) before the minute of its
    newest sample ``last_t_ms``. ``next_of``: per series, the first minute not closed yet
    (the writer's :class:`gpuguard.samples.SeriesCache` keeps it; read from the store the
    first time). Call inside the write's transaction; raises ``sqlite3.Error``."""
    t0_ms, base = _origin(t0)
    cur = (last_t_ms + t0_ms) // MINUTE_MS - base
    nxt = next_of.get(sid)
    if nxt is None:
        nxt = conn.execute("select max(end_minute) from gpu_live_chunks where sid = ?", (sid,)).fetchone()[0]
        if nxt is None:
            first = conn.execute("select min(t_ms) from gpu_samples where sid = ?", (sid,)).fetchone()[0]
            nxt = cur if first is None else (first + t0_ms) // MINUTE_MS - base
    for _ in range(MAX_CHUNKS_PER_WRITE):
        if cur - nxt < CHUNK_MIN:
            break
        first = conn.execute("select min(t_ms) from gpu_samples where sid = ? and t_ms >= ?",
                             (sid, _start_ms(t0_ms, base, nxt))).fetchone()[0]
        f_min = cur if first is None else (first + t0_ms) // MINUTE_MS - base
        if f_min - nxt >= CHUNK_MIN:  # a gap without samples: one empty chunk up to the next sample
            conn.execute("insert or replace into gpu_live_chunks (sid, first_minute, end_minute, n, hist) "
                         "values (?, ?, ?, 0, '{}')", (sid, nxt, f_min))
            nxt = f_min
            continue
        _close_chunk(conn, sid, t0_ms, base, nxt, nxt + CHUNK_MIN)
        nxt += CHUNK_MIN
    next_of[sid] = nxt


def catch_up(conn: sqlite3.Connection, sid: int, t0: float) -> None:
    """Close every chunk of series ``sid`` that is due, however many (:func:`close_due`
    without its per-write bound): for a series written in one go, as a benchmark's store is."""
    last = conn.execute("select max(t_ms) from gpu_samples where sid = ?", (sid,)).fetchone()[0]
    if last is None:
        return
    next_of: dict[int, int] = {}
    while True:
        before = next_of.get(sid)
        close_due(conn, next_of, sid, t0, last)
        if next_of[sid] == before:
            return


def _has_rows(conn: sqlite3.Connection, sid: int, lo: int, hi: int) -> bool:
    return conn.execute("select 1 from gpu_samples where sid = ? and t_ms between ? and ? limit 1",
                        (sid, lo, hi)).fetchone() is not None


def closed_range(conn: sqlite3.Connection, sid: int, t0: float, lo: int, hi: int
                 ) -> tuple[int, int, int, dict[str, dict[int, int]]] | None:
    """The closed chunks of series ``sid`` a read of ``t_ms`` in ``[lo, hi]`` can take:
    ``(a, b, n, hists)``, the contiguous run's ``t_ms`` range ``[a, b)`` (every raw row
    in it lies in ``[lo, hi]``), the samples they counted and their merged percentile
    histograms; None when there is no such chunk. The caller checks ``n`` against the raw
    rows (:func:`gpuguard.samples.read_buckets`: the range's count less the rows read
    around it) and reads the raw rows when they differ (rows replaced or deleted since).
    Raises ``sqlite3.Error``."""
    t0_ms, base = _origin(t0)
    run: list[tuple[int, int, int, str]] = []
    for first, end, n, hist in conn.execute("select first_minute, end_minute, n, hist from gpu_live_chunks "
                                            "where sid = ? order by first_minute", (sid,)):
        s_ms, e_ms = _start_ms(t0_ms, base, first), _start_ms(t0_ms, base, end)
        if run and first != run[-1][1]:
            break  # a gap (deleted since): the run ends
        if s_ms < lo and (e_ms <= lo or _has_rows(conn, sid, s_ms, lo - 1)):
            continue  # holds rows before the read's range
        if e_ms - 1 > hi and (s_ms > hi or _has_rows(conn, sid, hi + 1, e_ms - 1)):
            break  # holds rows after it
        run.append((first, end, n, hist))
    if not run:
        return None
    a, b = _start_ms(t0_ms, base, run[0][0]), _start_ms(t0_ms, base, run[-1][1])
    hists: dict[str, dict[int, int]] = {name: {} for name in samples.PCT_SAMPLED}
    for r in run:
        for name, pairs in json.loads(r[3]).items():
            h = hists.get(name)
            if h is None:
                continue
            for v, c in pairs:
                h[v] = h.get(v, 0) + c
    return a, b, sum(r[2] for r in run), hists


def bucket_rows(conn: sqlite3.Connection, sid: int, t0: float, a: int, b: int, bucket_ms: int) -> list[tuple]:
    """The closed minutes in ``t_ms`` ``[a, b)`` (as :func:`closed_range` gave them) as
    rows of :func:`gpuguard.samples.grouped_sql`'s shape, keyed by epoch-aligned bucket of
    ``bucket_ms`` (a multiple of a minute), in bucket order."""
    t0_ms, base = _origin(t0)
    m_a, m_b = (a + t0_ms) // MINUTE_MS - base, (b + t0_ms) // MINUTE_MS - base
    start = f"(({base} + minute) * {MINUTE_MS} - {t0_ms})"
    vals = ([f"{_c(n)}_sum" for n in samples.SUMMED] + [f"{_c(n)}_max" for n in samples.MAXED]
            + [f"coalesce({_c(n)}_n, n)" for n in samples.SUMMED])
    return conn.execute(
        f"select ({base} + minute) * {MINUTE_MS} / {bucket_ms}, nullif(mask, -1), n, t_first + {start}, "
        f"t_last + {start}, t_sum + n * {start}, {', '.join(vals)} from gpu_live_minutes "
        "where sid = ? and minute >= ? and minute < ? order by minute, mask", (sid, m_a, m_b)).fetchall()


def forget_before(conn: sqlite3.Connection, sid: int, t0: float, t_ms: int) -> None:
    """Drop the closed chunks of series ``sid`` that start before ``t_ms`` (retention is
    folding its raw rows before it) and the minutes no chunk covers any more."""
    t0_ms, base = _origin(t0)
    cut = (t_ms + t0_ms) // MINUTE_MS - base
    conn.execute("delete from gpu_live_chunks where sid = ? and first_minute < ?", (sid, cut))
    keep = conn.execute("select min(first_minute) from gpu_live_chunks where sid = ?", (sid,)).fetchone()[0]
    if keep is None:
        conn.execute("delete from gpu_live_minutes where sid = ?", (sid,))
    else:
        conn.execute("delete from gpu_live_minutes where sid = ? and minute < ?", (sid, keep))


def drop_job(conn: sqlite3.Connection, job_id: str, node: str) -> int:
    """Drop the closed minutes and chunks of job ``job_id``'s GPU series on ``node`` (the
    Epilog, once its summary and part are written: they only spared it reading the raw
    rows, which stay; a later read of the job reads those). Call inside a transaction;
    returns the minute rows dropped; raises ``sqlite3.Error``."""
    sids = [r[0] for r in conn.execute("select id from gpu_series where job_id = ? and node = ?", (job_id, node))]
    n = 0
    for sid in sids:
        n += conn.execute("delete from gpu_live_minutes where sid = ?", (sid,)).rowcount
        conn.execute("delete from gpu_live_chunks where sid = ?", (sid,))
    return n
