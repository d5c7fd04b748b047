"""The compact GPU sample store, laid out from the metric table (``gpuguard.metrics``).

Tables (created by the store migrations of :mod:`gpuguard.samples_schema`):

* ``gpu_series``: one row per (job, node, GPU): ``id`` (integer), ``job_id``, ``node``,
  ``gpu_index``, ``gpu_uuid``, ``t0`` (epoch s of its first sample). Identity is stored
  once here instead of on every sample.
* ``gpu_samples``: ``(sid, t_ms, <one integer column per GPU_SAMPLED metric>)``,
  ``WITHOUT ROWID`` with primary key ``(sid, t_ms)``; ``t_ms`` = milliseconds since the
  series' ``t0``; values are ``round(value * scale)`` (``power_w_x10``). The primary key
  is the only index: every query reads one series over a time range. Measured: 29-31 B
  per GPU-sample on disk (``bench/store_bytes.py``), against 183 B for the old
  ``samples`` table with its two indexes.
* ``gpu_slow``: the same key, cumulative counters (:data:`gpuguard.metrics.GPU_SLOW`),
  written when the collector's slow path read them (once a minute).
* ``gpu_minutes``: per-minute aggregates kept after raw samples are pruned:
  ``(sid, minute, n, <metric>_mean, <metric>_dmin, <metric>_dmax)`` for each GPU_SAMPLED
  metric but the mask (for which the OR of the minute's masks is kept), integer-scaled
  like the raw table; ``minute`` counts whole minutes from the series' ``t0`` minute, and
  min/max are stored as distances below/above the rounded mean (small numbers: a few
  bytes fewer per row). ``minutes_view`` gives real units.
* ``samples``: a read-only VIEW with the old row shape (``job_id, node, at, gpu_index,
  gpu_uuid, <metric> ...`` in real units) for ad-hoc SQL; hot paths read the tables.

Writes go through :func:`write` (``Store.insert_many("samples", rows)`` routes here), which
takes the old dict rows, so callers name values in real units.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Sequence
from typing import Any

from gpuguard.metrics import GPU_SAMPLED, GPU_SLOW, series_attrs, stored_column

_SAMPLED_BY_NAME = {m.name: m for m in GPU_SAMPLED}

MINUTE_S = 60


def _cols(ms: Sequence[Any]) -> list[str]:
    return [stored_column(m) for m in ms]


class SeriesCache:
    """``(job_id, node, gpu_index) -> (sid, t0)`` for one store connection, and each
    series' last ``t_ms``, clock-step offset (:func:`write`) and first minute not closed
    yet (:func:`gpuguard.live_minutes.close_due`)."""

    def __init__(self) -> None:
        self.ids: dict[tuple[Any, ...], tuple[int, float]] = {}
        self.last: dict[int, int] = {}
        self.offset: dict[int, int] = {}
        self.live_next: dict[int, int] = {}

    def get(self, conn: sqlite3.Connection, job_id: str, node: str, gpu_index: int, uuid: str | None,
            at: float) -> tuple[int, float]:
        key = (job_id, node, gpu_index)
        hit = self.ids.get(key)
        if hit is not None:
            return hit
        row = conn.execute("select id, t0 from gpu_series where job_id = ? and node = ? and gpu_index = ?",
                           key).fetchone()
        if row is None:
            # t0 on a whole second, so t_ms of a 1 s collector stays a small integer
            t0 = float(int(at))
            cur = conn.execute("insert into gpu_series (job_id, node, gpu_index, gpu_uuid, t0) values (?,?,?,?,?)",
                               (*key, uuid, t0))
            row = (cur.lastrowid, t0)
        self.ids[key] = (int(row[0]), float(row[1]))
        return self.ids[key]


_FAST_INS = (f"insert or replace into gpu_samples (sid, t_ms, {', '.join(_cols(GPU_SAMPLED))}) "
             f"values ({', '.join('?' * (len(GPU_SAMPLED) + 2))})")
_SLOW_INS = (f"insert or replace into gpu_slow (sid, t_ms, {', '.join(_cols(GPU_SLOW))}) "
             f"values ({', '.join('?' * (len(GPU_SLOW) + 2))})")


_SCALES = tuple(m.scale for m in GPU_SAMPLED)
_SLOW_SCALE = tuple(m.scale for m in GPU_SLOW)


def _scaled(vals: Iterable[Any], scales: tuple[int, ...]) -> tuple[Any, ...]:
    # v - v == 0 only for a finite number: NaN/inf are no reading
    return tuple(None if v is None or v - v != 0 else round(v * sc) for v, sc in zip(vals, scales, strict=True))


def scaled_values(values: Iterable[Any], slow: Iterable[Any] | None) -> tuple[tuple[Any, ...], tuple[Any, ...] | None]:
    """``(values, slow)`` in real units (``GPU_SAMPLED`` / ``GPU_SLOW`` order) as the store
    keeps them: ``round(v * scale)``, None for None/NaN/inf; ``slow`` None when it holds
    no reading."""
    sv = None if slow is None else _scaled(slow, _SLOW_SCALE)
    return _scaled(values, _SCALES), (sv if sv is not None and any(v is not None for v in sv) else None)


def sample_row(r: dict[str, Any]) -> tuple[Any, ...]:
    """A dict row (``{"job_id", "node", "at", "gpu_index", "gpu_uuid", <metric>: value,
    ...}``, real units, missing metrics None) as the tuple :func:`write` takes."""
    vals, sv = scaled_values([r.get(m.name) for m in GPU_SAMPLED], [r.get(m.name) for m in GPU_SLOW])
    return (r.get("job_id"), r.get("node"), r["at"], r.get("gpu_index"), r.get("gpu_uuid"), vals, sv)


def write(conn: sqlite3.Connection, cache: SeriesCache, rows: Iterable[tuple[Any, ...] | dict[str, Any]]) -> int:
    """Store sample rows. A row is the tuple ``(job_id, node, at, gpu_index, gpu_uuid,
    values, slow)`` with ``values`` in :data:`GPU_SAMPLED` order and ``slow`` in
    :data:`GPU_SLOW` order (or None when the slow counters were not read), both already
    in the stored integer form (:func:`scaled_values`; what the collector buffers), or a
    dict in real units (:func:`sample_row`). A row with a slow counter read (not None)
    also goes to ``gpu_slow``. Call inside a transaction. Returns the number of rows.

    Each series' timeline stays in collection order: a sample stamped at or before the
    series' last one (the wall clock stepped back, or two samples in one millisecond) is
    stored 1 ms after it, and the series' later samples by the same offset, so the summary
    counts every sample of the attempt and intervals stay true; their ``at`` reads back
    shifted by the step. Each series' whole minutes before its newest sample are then
    closed (:func:`gpuguard.live_minutes.close_due`)."""
    fast: list[tuple[Any, ...]] = []
    slow: list[tuple[Any, ...]] = []
    ids = cache.ids
    last_of = cache.last
    offset = cache.offset
    touched: dict[int, float] = {}  # series written -> its t0
    for r in rows:
        if type(r) is dict:
            r = sample_row(r)
        job_id, node, at, gi, uuid, vals, sv = r
        hit = ids.get((job_id, node, gi))
        if hit is None:
            hit = cache.get(conn, str(job_id or ""), str(node or ""), int(gi if gi is not None else -1), uuid,
                            float(at))
            ids[(job_id, node, gi)] = hit  # the row's own spelling too
        sid, t0 = hit
        t_ms = round((at - t0) * 1000) + offset.get(sid, 0)
        last = last_of.get(sid)
        if last is None:
            last = last_of[sid] = conn.execute("select max(t_ms) from gpu_samples where sid = ?",
                                               (sid,)).fetchone()[0]
        if last is not None and t_ms <= last:
            # the clock stepped back (or two samples share a millisecond): keep the series
            # in collection order; later samples carry the step as an offset
            offset[sid] = offset.get(sid, 0) + last + 1 - t_ms
            t_ms = last + 1
        last_of[sid] = t_ms
        touched[sid] = t0
        fast.append((sid, t_ms, *vals))
        if sv is not None and any(v is not None for v in sv):
            slow.append((sid, t_ms, *sv))
    conn.executemany(_FAST_INS, fast)
    if slow:
        conn.executemany(_SLOW_INS, slow)
    if touched:
        from gpuguard.live_minutes import close_due

        for sid, t0 in touched.items():
            close_due(conn, cache.live_next, sid, t0, last_of[sid])
    return len(fast)


def series_of(conn: sqlite3.Connection, job_id: str, nodes: Sequence[str] | None = None
              ) -> list[tuple[int, str, int, str | None, float]]:
    """``[(sid, node, gpu_index, gpu_uuid, t0)]`` of a job, by node then GPU index."""
    sql = "select id, node, gpu_index, gpu_uuid, t0 from gpu_series where job_id = ?"
    params: list[Any] = [str(job_id)]
    if nodes:
        sql += f" and node in ({','.join('?' * len(nodes))})"
        params += list(nodes)
    return [tuple(r) for r in conn.execute(sql + " order by node, gpu_index", params)]  # type: ignore[misc]


def t_range(t0: float, start: float | None, end: float | None) -> tuple[int, int]:
    """``[lo, hi]`` in ``t_ms`` of a series starting at ``t0`` for epoch bounds (inclusive)."""
    lo = -(2**62) if start is None else round((start - t0) * 1000)
    hi = 2**62 if end is None else round((end - t0) * 1000)
    return lo, hi


def real_expr(m: Any) -> str:
    """SQL expression giving ``m`` in real units from the raw table."""
    c = stored_column(m)
    return c if m.scale == 1 else f"{c} / {float(m.scale)!r}"


#: A series with more samples than this is read in buckets of whole seconds, so at most
#: about this many rows per GPU come back to Python whatever the job's length (our choice:
#: 2,000 keeps a 33-minute job at 1 s (5.5 h at 10 s) exact and a 24 h job in 44 s
#: buckets, below the verdict's 60 s short window).
MAX_POINTS = 2_000



#: Per-window values of :func:`windows_of` per GPU (the verdict's short windows): the mean
#: of each GPU metric the verdict compares (:func:`gpuguard.metrics.series_attrs`), memory's peak.
WINDOW_VALUES = {**dict.fromkeys(series_attrs(), "mean"), "mem_used_mib": "max"}

_VALUE_METRICS = tuple(m for m in GPU_SAMPLED if m.name != "clock_event_mask")
#: Metrics whose bucket sum and count anyone reads (summary means, the verdict's window
#: means), and those whose bucket maximum anyone reads (summary max/peak, the verdict's
#: memory): what a bucket keeps, so what :mod:`gpuguard.live_minutes` stores.
SUMMED = tuple(m.name for m in _VALUE_METRICS if "mean" in m.stats or WINDOW_VALUES.get(m.name) == "mean")
MAXED = tuple(m.name for m in _VALUE_METRICS if {"max", "peak"} & set(m.stats) or WINDOW_VALUES.get(m.name) == "max")
_MAX_NEEDED = frozenset(MAXED)
#: Metrics with a percentile statistic (``p95`` ...): the summary counts their values.
PCT_SAMPLED = tuple(m.name for m in _VALUE_METRICS if any(st[0] == "p" and st[1:].isdigit() for st in m.stats))
_MASK_COL = stored_column(next(m for m in GPU_SAMPLED if m.name == "clock_event_mask"))


def grouped_sql(group: str) -> str:
    """The bucketed pass over one series' raw rows: ``(bucket, mask, count, min t_ms, max
    t_ms, sum t_ms, sums..., maxes..., counts...)`` per (``group`` expression over
    ``t_ms``, clock-event mask), in bucket order, for rows of ``sid = ?`` with ``t_ms``
    in ``[?, ?]`` (the row shape :mod:`gpuguard.bucket_rows` fills :class:`Buckets` from).
    Measured per day-long GPU series at 1 s: 0.08 s, against 0.15 s for one flag
    expression per bit in SQL and 0.11 s for a second pass for the masks."""
    agg = ([f"sum({stored_column(_SAMPLED_BY_NAME[n])})" for n in SUMMED]
           + [f"max({stored_column(_SAMPLED_BY_NAME[n])})" for n in MAXED]
           + [f"count({stored_column(_SAMPLED_BY_NAME[n])})" for n in SUMMED])
    return (f"select {group}, {_MASK_COL}, count(*), min(t_ms), max(t_ms), sum(t_ms), {', '.join(agg)} "
            f"from gpu_samples where sid = ? and t_ms between ? and ? group by 1, 2 order by 1")


class Buckets:
    """One GPU series read as time buckets, the single pass over its rows that both the
    job summary and the verdict use (:func:`read_buckets`). Lists are aligned, one entry
    per non-empty bucket in time order; times are ``t_ms`` of the series:

    * ``n``, ``t_min``, ``t_max``, ``t_sum``: samples in the bucket, first, last and summed
      sample time;
    * ``sums[m]``, ``counts[m]``: per :data:`SUMMED` metric, ``maxes[m]`` per
      :data:`MAXED` metric (stored integer scale);
    * ``bits[b]``: samples with clock-event bit ``b`` set;
    * ``live_ms``: the ``[a, b)`` range of ``t_ms`` read from the collector's closed
      minutes (:mod:`gpuguard.live_minutes`) instead of the raw rows, or None, and
      ``live_hists``: ``{metric: {value: count}}`` of the percentile metrics over that range.

    With ``bucket_ms == 0`` every sample is its own bucket (the series was short). With
    ``align_ms`` (non-zero only with ``bucket_ms``) buckets are aligned on the epoch:
    bucket ``k`` holds the samples with ``(t0 * 1000 + t_ms) // bucket_ms == k``, so that
    every series' buckets (and the spool part's windows) line up."""

    __slots__ = ("align_ms", "bits", "bucket_ms", "counts", "live_hists", "live_ms", "maxes", "n", "sid", "sums", "t0",
                 "t_max", "t_min", "t_sum")

    def __init__(self, sid: int, t0: float, bucket_ms: int, align_ms: int = 0):
        from gpuguard.model import CLOCK_EVENT_REASONS

        self.sid, self.t0, self.bucket_ms, self.align_ms = sid, t0, bucket_ms, align_ms
        self.n: list[int] = []
        self.t_min: list[int] = []
        self.t_max: list[int] = []
        self.t_sum: list[int] = []
        self.sums: dict[str, list[Any]] = {m: [] for m in SUMMED}
        self.counts: dict[str, list[int]] = {m: [] for m in SUMMED}
        self.maxes: dict[str, list[Any]] = {m: [] for m in MAXED}
        self.bits: dict[int, list[int]] = {bit: [] for bit, _label in CLOCK_EVENT_REASONS.values()}
        self.live_ms: tuple[int, int] | None = None
        self.live_hists: dict[str, dict[int, int]] = {}

    def group_sql(self) -> str:
        """SQL expression (over ``t_ms``) of the bucket a row of this series falls in."""
        if not self.bucket_ms:
            return "t_ms"
        if self.align_ms:
            return f"(t_ms + {round(self.t0 * 1000)}) / {self.bucket_ms}"
        return f"t_ms / {self.bucket_ms}"

    def per_sample_s(self) -> list[float]:
        """Seconds each bucket's samples stand for on average: from the bucket's first
        sample to the next bucket's first sample, over its sample count (the last bucket:
        to its own last sample, so the series' last sample counts nothing — the
        left-point rule; exact when every bucket holds one sample)."""
        out = []
        for i, (a, n) in enumerate(zip(self.t_min, self.n, strict=True)):
            end = self.t_min[i + 1] if i + 1 < len(self.t_min) else self.t_max[i]
            out.append((end - a) / n / 1000.0)
        return out


#: Series kept in a :func:`read_buckets` cache (a node's GPUs, with room to spare).
_CACHE_SERIES = 16


#: At most this many epoch-aligned buckets per series (:func:`read_buckets` with
#: ``align_s``): the spool part's windows (our choice: a 24 h job keeps 60 s windows, a
#: 7-day one 240 s; ~25 MB of Python numbers for 8 GPUs).
MAX_ALIGNED_BUCKETS = 4096


def bucket_width_ms(n: int, span_ms: int, max_points: int = MAX_POINTS, align_s: float | None = None) -> int:
    """Bucket width (ms) :func:`read_buckets` uses for a series of ``n`` samples spanning
    ``span_ms``: 0 (sample by sample) for at most ``max_points`` samples; else whole
    seconds giving at most ``max_points`` buckets, or with ``align_s`` the smallest
    ``align_s * 2**k`` giving at most :data:`MAX_ALIGNED_BUCKETS` (so the spool part's
    windows, which start at ``align_s`` and double, are unions of whole buckets)."""
    if n <= max_points:
        return 0
    if align_s:
        w = max(1, round(align_s * 1000))
        while span_ms // w + 1 > max(max_points, MAX_ALIGNED_BUCKETS):
            w *= 2
        return w
    return 1000 * -(-span_ms // (1000 * max_points))


def read_buckets(conn: sqlite3.Connection, sid: int, t0: float, lo: int = -(2**62), hi: int = 2**62,
                 max_points: int = MAX_POINTS, cache: dict[Any, Any] | None = None,
                 align_s: float | None = None, live_ok: bool = True) -> Buckets:
    """Series ``sid`` between ``t_ms`` ``lo`` and ``hi`` (inclusive) as :class:`Buckets`:
    one grouped SQL pass (plus a count). A series of
    more than ``max_points`` samples is bucketed (:func:`bucket_width_ms`); ``align_s``
    aligns its buckets on the epoch at ``align_s * 2**k`` seconds. With ``cache`` (the
    store's :attr:`Store.memo <gpuguard.store.Store.memo>`, which lives as long as that
    store object and is cleared by its sample writes), a result is kept keyed by the rows
    it covered (its first and last time, or None for the series' own first and last) and
    the bucketing asked for, so the Epilog's part and verdict reuse the pass its summary
    just made instead of reading the samples again.

    An epoch-aligned read whose buckets are whole minutes takes the minutes the collector
    closed while the job ran (:func:`gpuguard.live_minutes.closed_range`, checked against
    the raw row count) instead of their raw rows, so a day-long series costs its last
    minutes' rows, not 86,400 (``live_ok=False``: raw rows only; the same result)."""
    # min/max alone are two seeks of the primary key; count(*) alone scans the series' keys
    # (together they would decode every row: 2.5x the time)
    rng = "from gpu_samples where sid = ? and t_ms between ? and ?"
    a = conn.execute(f"select min(t_ms) {rng}", (sid, lo, hi)).fetchone()[0]
    b = conn.execute(f"select max(t_ms) {rng}", (sid, lo, hi)).fetchone()[0]
    # the same rows whatever bounds select them (the summary's from the job's start, the
    # part's from the series' first sample): a second read costs the two seeks above
    first = conn.execute("select min(t_ms) from gpu_samples where sid = ?", (sid,)).fetchone()[0]
    last = conn.execute("select max(t_ms) from gpu_samples where sid = ?", (sid,)).fetchone()[0]
    req = ("buckets", sid, "first" if a is not None and a == first else a,
           "last" if b is not None and b == last else b, max_points, align_s)
    hit = None if cache is None else cache.get(req)
    if hit is not None:
        return hit
    n = conn.execute(f"select count(*) {rng}", (sid, lo, hi)).fetchone()[0]
    bucket_ms = bucket_width_ms(n, (b - a) if n else 0, max_points, align_s)
    align_ms = 1 if bucket_ms and align_s else 0
    out = Buckets(sid, t0, bucket_ms, align_ms)
    group = out.group_sql()
    from gpuguard import live_minutes

    live = None
    if live_ok and bucket_ms and align_ms and bucket_ms % live_minutes.MINUTE_MS == 0:
        live = live_minutes.closed_range(conn, sid, t0, lo, hi)
    rows = None
    if live is not None:
        # the raw rows before and after the closed minutes, the closed minutes between;
        # used only when their counts add up to the range's (no raw row changed since)
        a, b_, n_live, hists = live
        around = (conn.execute(grouped_sql(group), (sid, lo, a - 1)).fetchall(),
                  conn.execute(grouped_sql(group), (sid, b_, hi)).fetchall())
        if n_live + sum(r[2] for part in around for r in part) == n:
            rows = [*around[0], *live_minutes.bucket_rows(conn, sid, t0, a, b_, bucket_ms), *around[1]]
            out.live_ms, out.live_hists = (a, b_), hists
    if rows is None:
        rows = conn.execute(grouped_sql(group), (sid, lo, hi)).fetchall()
    from gpuguard.bucket_rows import fill_columns, fill_rows

    if len({r[0] for r in rows}) == len(rows):
        fill_columns(out, rows, SUMMED, MAXED)  # one mask per bucket (the usual case): column by column
    else:
        fill_rows(out, rows, SUMMED, MAXED)
    if cache is not None:
        if sum(1 for k in cache if k[0] == "buckets") >= _CACHE_SERIES:
            for k in [k for k in cache if k[0] == "buckets"]:
                del cache[k]  # a few series of one job at a time: memory stays bounded
        cache[req] = out
    return out


def windows_of(b: Buckets, start: float, width_s: float, n_windows: int) -> dict[str, list[float | None]]:
    """One GPU's :class:`Buckets` regrouped into ``n_windows`` windows of ``width_s`` from
    epoch ``start`` (a bucket counts in the window holding its first sample): per
    :data:`WINDOW_VALUES` metric a list of window values in real units, ``None`` for a
    window without samples, plus ``"n"``: samples per window."""
    from gpuguard.metrics import BY_NAME

    sums = {m: [0] * n_windows for m in WINDOW_VALUES}
    cnts = {m: [0] * n_windows for m in WINDOW_VALUES}
    tops: dict[str, list[Any]] = {m: [None] * n_windows for m in WINDOW_VALUES}
    n = [0] * n_windows
    for i, t in enumerate(b.t_min):
        k = int((b.t0 + t / 1000.0 - start) // width_s)
        if not 0 <= k < n_windows:
            continue
        n[k] += b.n[i]
        for m, how in WINDOW_VALUES.items():
            if how == "max":
                v = b.maxes[m][i]
                if v is not None and (tops[m][k] is None or v > tops[m][k]):
                    tops[m][k] = v
            elif b.counts[m][i]:
                sums[m][k] += b.sums[m][i]
                cnts[m][k] += b.counts[m][i]
    out: dict[str, list[Any]] = {"n": n}
    for m, how in WINDOW_VALUES.items():
        sc = BY_NAME[m].scale
        if how == "max":
            out[m] = [None if v is None else v / sc for v in tops[m]]
        else:
            out[m] = [round(s / c / sc, 3) if c else None for s, c in zip(sums[m], cnts[m], strict=True)]
    return out
