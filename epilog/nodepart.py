"""This node's spool part (:mod:`gpuguard.epilog.part`) built straight from the node store.

:func:`build_node_part` gives the dict :func:`gpuguard.epilog.part.build_part` gives for
:func:`gpuguard.epilog.jobdata.load_job` of this node, without loading the job as Python
objects first:

* **GPUs**: each series comes from the bucketed pass the job summary just made
  (:func:`gpuguard.samples.read_buckets`, kept in the store's memo). A short series
  (at most :data:`gpuguard.samples.MAX_POINTS` samples) is read sample by sample and cut
  into windows by :func:`gpuguard.epilog.part.build_part`'s own rule (medians per
  window): the same part as before. A long series is read in buckets aligned on the
  epoch at ``[verdict] short_window_s * 2**k`` (the summary's ``window_align_s``), so a
  window is a union of whole buckets and its values come from the buckets' sums: the
  window's *mean* of each series the verdict reads as means (utilisation, memory
  utilisation, power, temperature, SM clock: :data:`gpuguard.epilog.jobdata.SERIES_ATTR`;
  a median needs every sample back in Python: 0.1 s per GPU-day), its largest memory used
  and ECC count, and the clock-event reasons active in at least half of its samples.
* **Ranks**: up to :data:`gpuguard.epilog.jobdata.MAX_STEP_RECORDS` step records are read
  and windowed as before; more are windowed by SQLite (one window-function query): exact
  counts, sums and mean times per window, and step-time quantiles over the means of
  :data:`SUB_WINDOWS` sub-windows per window (the exact quantiles need a sort of every
  record: 0.5 s per rank-day, against 0.2 s).
* host samples, checkpoints, hardware events and findings: the queries of ``load_job``.

A store without the compact sample tables or the ``steps`` columns written by this
gpuguard goes through ``load_job`` + ``build_part`` unchanged.
"""

from __future__ import annotations

import math
import sqlite3
import time
from collections.abc import Mapping
from typing import Any

from gpuguard import samples
from gpuguard.epilog import jobdata, part
from gpuguard.metrics import BY_NAME, stored_column

#: Sub-windows per window whose mean step times stand for the records in a window's
#: quantiles, for a node with more than :data:`gpuguard.epilog.jobdata.MAX_STEP_RECORDS`
#: records (our choice: 7.5 s at 60 s windows, finer than the 5 s-per-day buckets the
#: verdict reads; SQLite then sorts one row per sub-window, not one per record).
SUB_WINDOWS = 8

_STEP_COLS = {"job_id", "node", "rank", "t", "step_time_s", "samples", "tokens", "data_wait_s", "fwd_bwd_s",
              "comm_s", "optim_s"}
#: (part key, steps column) of the per-window totals.
_TOTALS = (("samples", "samples"), ("tokens", "tokens"), ("data_wait", "data_wait_s"), ("fwd_bwd", "fwd_bwd_s"),
           ("comm", "comm_s"), ("optim", "optim_s"))
#: Quantile ranks computed per window: nearest rank of these percentiles (as the part's
#: ``_nearest_rank``: ``ceil(p / 100 * n)``, in floating point on both sides).
_PCTS = (*part.QUANTILES, 95)


def build_node_part(store: Any, job_id: str, node: str, *, window_s: float, job: Mapping[str, Any],
                    summary: Mapping[str, Any] | None, gpu_names: Mapping[str, str] | None = None,
                    align_s: float | None = None, now: float | None = None) -> dict[str, Any]:
    """The part of ``node`` for ``job_id`` at windows of ``window_s`` seconds (module
    docstring), from ``store`` (a :class:`gpuguard.store.Store`). ``align_s``: the
    summary's ``window_align_s`` (its bucketed pass is reused when it matches; any value
    works, a mismatch costs one more pass); ``window_s`` should be ``align_s * 2**k`` so
    that a window holds whole buckets, and is raised to the widest bucket (the part's
    ``window_s`` says which was used). Other arguments as
    :func:`gpuguard.epilog.part.build_part`. Raises :class:`gpuguard.store.StoreError`
    and ``sqlite3.Error``."""
    tables = jobdata._tables(store)
    step_cols = {r[1] for r in store.db.conn.execute("pragma table_info(steps)")} if "steps" in tables else set()
    if "gpu_series" not in tables or ("steps" in tables and not _STEP_COLS <= step_cols):
        data = jobdata.load_job(store, job_id, [node])
        return part.build_part(data, node, window_s=window_s, job=job, summary=summary, gpu_names=gpu_names,
                               now=now)
    conn = store.db.conn
    memo = getattr(store, "memo", None)
    caps = _capacities(store, tables, node)
    names = gpu_names or {}
    series = [(idx, uuid, samples.read_buckets(conn, sid, t0, cache=memo, align_s=align_s))
              for sid, _n, idx, uuid, t0 in samples.series_of(conn, job_id, [node])]
    # a window is never narrower than the widest bucket (a 7-day series: 240 s)
    window_s = max([float(window_s)] + [b.bucket_ms / 1000.0 for _i, _u, b in series])
    from gpuguard.beside import Beside

    # the steps' windows on a second connection while this one builds the GPU windows
    ranks_read = Beside(store, lambda reader: _ranks(reader, job_id, node, window_s)) if "steps" in tables else None
    gpus, firsts, lasts = [], [], []
    for idx, uuid, b in series:
        if b.n:
            firsts.append(b.t0 + b.t_min[0] / 1000.0)
            lasts.append(b.t0 + (b.t_max[-1] if b.bucket_ms else b.t_min[-1]) / 1000.0)
        if not b.bucket_ms:
            wins = part._gpu_windows(jobdata.series_from_buckets(conn, node, idx, uuid, b), window_s)
        else:
            wins = _bucket_windows(conn, b, window_s)
        gpus.append({"index": idx, "uuid": uuid, "name": names.get(uuid or ""), "mem_total_mib": caps.get(uuid),
                     **wins})
    ranks, span = ranks_read.result() if ranks_read is not None else ([], None)
    if span:
        firsts.append(span[0])
        lasts.append(span[1])
    host: dict[str, tuple[list[float], list[float | None]]] = {node: ([], [])}
    if "host_samples" in tables:
        for at, rss in conn.execute("select at, rss_mib from host_samples where job_id = ? and node = ? order by at",
                                    (job_id, node)):
            host[node][0].append(float(at))
            host[node][1].append(jobdata._f(rss))
    ckpt = _checkpoints(store, tables, job_id, node)
    hw_events: list[dict[str, Any]] = []
    hw_findings: list[dict[str, Any]] = []
    if firsts:
        hw_events, hw_findings = jobdata._load_hw(store, tables, job_id, [node], min(firsts), max(lasts))
    ev_keys = ("at", "node", "kind", "code", "gpu_index", "gpu_uuid", "action", "message", "job_id")
    fi_keys = ("at", "node", "code", "severity", "action", "gpu_index", "gpu_uuid", "message", "job_id")
    return {
        "format": part.FORMAT, "v": part.VERSION, "job_id": str(job_id), "node": node,
        "written_at": round(time.time() if now is None else now, 3), "window_s": float(window_s),
        "job": dict(job), "summary": dict(summary) if summary else None, "gpus": gpus, "ranks": ranks,
        "host": part._host_windows(host, node, window_s),
        "checkpoints_s": [part._r(x, 6) for x in ckpt[:part.MAX_LIST]],
        "hw_events": part._clean([e for e in hw_events if e.get("kind") not in part.OWN_EVENT_KINDS], ev_keys),
        "hw_findings": part._clean(hw_findings, fi_keys),
    }


def _capacities(store: Any, tables: set[str], node: str) -> dict[str | None, float]:
    """GPU UUID -> memory capacity in MiB from the inventory's product names (as ``load_job``)."""
    out: dict[str | None, float] = {}
    if "inventory" in tables:
        for uuid, name in store.db.conn.execute("select uuid, name from inventory where node = ?", (node,)):
            cap = jobdata.capacity_from_name(name)
            if cap:
                out[uuid] = cap
    return out


def _checkpoints(store: Any, tables: set[str], job_id: str, node: str) -> list[float]:
    out: list[float] = []
    if "checkpoints" in tables:
        for r in store.query("select * from checkpoints where job_id = ? and node = ?", [job_id, node]):
            for c in jobdata._CKPT_COLS:
                v = jobdata._f(r.get(c))
                if v is not None:
                    out.append(v)
                    break
    return out


def _r4(x: float) -> float:
    """:func:`gpuguard.epilog.part._r` of a finite float (4 significant digits, whole
    numbers kept), by the C formatter: a long job's part rounds some 100,000 values."""
    return float(f"{x:.4g}") if -1000.0 < x < 1000.0 else round(x, 0)


def _r4n(x: float | None) -> float | None:
    return None if x is None else _r4(x)


#: (part key, metric) of the per-window means: every series the verdict reads as means
#: (:data:`gpuguard.epilog.jobdata.SERIES_ATTR`), as ``part._gpu_windows`` gives medians.
_GPU_MEANS = tuple((attr, name) for name, attr in jobdata.SERIES_ATTR.items())


def _bucket_windows(conn: Any, b: samples.Buckets, ws: float) -> dict[str, list[Any]]:
    """Part windows of ``ws`` seconds of one bucketed, epoch-aligned series (module
    docstring); a bucket wider than the window falls in the window of its first sample."""
    ws_ms = round(ws * 1000)
    off = round(b.t0 * 1000) if b.align_ms else 0
    ecc_col = stored_column(BY_NAME["ecc_volatile_uncorrected"])
    ecc = dict(conn.execute(f"select (t_ms + {round(b.t0 * 1000)}) / {ws_ms}, max({ecc_col}) from gpu_slow "
                            "where sid = ? group by 1", (b.sid,)))
    if off:
        keys = [(t + off) // ws_ms for t in b.t_min]
    else:
        keys = [math.floor((b.t0 + t / 1000.0) / ws) for t in b.t_min]
    # [i, j) bucket ranges of each window (one bucket per window at the first width)
    starts = [i for i in range(len(keys)) if i == 0 or keys[i] != keys[i - 1]]
    one = len(starts) == len(keys)

    def merged(col: list[Any], how: Any) -> list[Any]:
        if one:
            return col
        ends = [*starts[1:], len(keys)]
        return [how(col[i:j]) for i, j in zip(starts, ends, strict=True)]

    def total(xs: list[Any]) -> Any:
        vals = [x for x in xs if x is not None]
        return sum(vals) if vals else None

    def top(xs: list[Any]) -> Any:
        return max((x for x in xs if x is not None), default=None)

    ns = merged(b.n, sum)
    t0 = b.t0
    out: dict[str, list[Any]] = {"t": [round(t0 + ts / n / 1000.0, 1) for ts, n in zip(merged(b.t_sum, sum), ns,
                                                                                          strict=True)]}
    for a, m in _GPU_MEANS:
        sc = BY_NAME[m].scale
        out[a] = [_r4(sm / c / sc) if c else None
                  for sm, c in zip(merged(b.sums[m], total), merged(b.counts[m], sum), strict=True)]
    mem_sc = BY_NAME["mem_used_mib"].scale
    out["mem"] = [part._r(x / mem_sc, 6) if x is not None else None for x in merged(b.maxes["mem_used_mib"], top)]
    masks = [0] * len(ns)
    for bit, counts in b.bits.items():
        for k, c in enumerate(merged(counts, sum)):
            if c and 2 * c >= ns[k]:
                masks[k] |= bit
    out["mask"] = masks
    t0_ms = round(t0 * 1000)
    out["ecc"] = [ecc.get((b.t_min[i] + t0_ms) // ws_ms) for i in starts]
    return out


def _ranks(store: Any, job_id: str, node: str, ws: float) -> tuple[list[dict[str, Any]], tuple[float, float] | None]:
    """The part's ``ranks`` and the steps' time span ``(first t - its step time, last t)``."""
    conn = store.db.conn
    n, lo, hi = conn.execute("select count(*), min(t), max(t) from steps where job_id = ? and node = ? and "
                             "t is not null", (job_id, node)).fetchone()
    if not n:
        return [], None
    if n <= jobdata.MAX_STEP_RECORDS:
        recs = jobdata._load_steps(store, job_id, [node])
        return part._rank_windows(recs, ws), (recs[0].t - (recs[0].step_time_s or 0.0), recs[-1].t)
    # the earliest record's step time: the scan stops at it (usually rank 0's first step)
    first_st = conn.execute("select step_time_s from steps where job_id = ? and node = ? and t = ? limit 1",
                            (job_id, node, lo)).fetchone()[0]
    return _rank_windows_sql(conn, job_id, node, ws, SUB_WINDOWS, n), (lo - (first_st or 0.0), hi)


def _kept_sub_windows(conn: Any, job_id: str, node: str, sub_s: float, n_timed: int | None) -> str | None:
    """The sub-window source of :func:`_rank_windows_sql` from ``step_windows`` (kept by
    triggers as the records were ingested: :func:`gpuguard.epilog.schema._step_windows`)
    when ``sub_s`` is ``STEP_SUBWINDOW_S * 2**k`` and its record count is ``n_timed``
    (the job's records with a time); else None (read ``steps``)."""
    from gpuguard.epilog.schema import NO_RANK, STEP_SUBWINDOW_S

    ratio = sub_s / STEP_SUBWINDOW_S
    merge = round(ratio)
    if n_timed is None or merge < 1 or merge != ratio or merge & (merge - 1):
        return None
    try:
        kept = conn.execute("select sum(nrec) from step_windows where job_id = ? and node = ?",
                            (job_id, node)).fetchone()[0]
    except sqlite3.OperationalError:
        return None  # a store not migrated yet (read-only)
    if kept != n_timed:
        return None
    return (f"select nullif(rank, {NO_RANK}) as rank, min(t_min) as t, sum(nrec) as nrec, sum(t_sum) as tsum, "
            "sum(st_sum) / sum(st_n) as st, sum(st_n) as cst, sum(st_sum) as sst, "
            + ", ".join(f"sum({c}) as {c}" for _k, c in _TOTALS)
            + f" from step_windows where job_id = ? and node = ? group by rank, sw / {merge}")


def _rank_windows_sql(conn: Any, job_id: str, node: str, ws: float, sub_windows: int | None,
                      n_timed: int | None = None) -> list[dict[str, Any]]:
    """Per rank and window, by SQLite (module docstring); quantiles over the means of
    ``sub_windows`` sub-windows per window, or with None over every record (the same
    result as :func:`gpuguard.epilog.part.build_part`'s). ``n_timed``: the job's record
    count with a time, when known: the sub-windows are then read from ``step_windows``
    when it holds them all (:func:`_kept_sub_windows`)."""
    pos = "case when step_time_s > 0 then {} end"
    exact = ("select rank, t, 1 as nrec, t as tsum, " + pos.format("step_time_s") + " as st, "
             + ", ".join(f"{pos.format(c)} as {c}" for _k, c in _TOTALS)
             + " from steps where job_id = ? and node = ? and t is not null")
    params: list[Any] = [job_id, node]
    if sub_windows:
        sub = ws / sub_windows
        src = _kept_sub_windows(conn, job_id, node, sub, n_timed)
        if src is None:
            src = ("select rank, min(t) as t, count(*) as nrec, sum(t) as tsum, avg(st) as st, count(st) as cst, "
                   "sum(st) as sst, " + ", ".join(f"sum({c}) as {c}" for _k, c in _TOTALS)
                   + f" from ({exact}) group by rank, cast(t / ? as integer)")
            params.append(sub)
        n_expr, s_expr = "sum(cst) over p", "sum(sst) over p"
    else:
        src = exact
        n_expr, s_expr = "count(st) over p", "sum(st) over p"
    ranks_sql = " or ".join([f"rn = max(1, cast({p} / 100.0 * qn as integer) + ({p} / 100.0 * qn > "
                             f"cast({p} / 100.0 * qn as integer)))" for p in _PCTS]
                            + ["rn = (qn + 1) / 2", "rn = qn / 2 + 1", "qn <= 5"])
    sql = (f"select rank, w, rn, qn, st, nrec, tsum, n, s, {', '.join(c for _k, c in _TOTALS)} from ("
           f"select rank, cast(t / ? as integer) as w, st, "
           f"row_number() over (partition by rank, cast(t / ? as integer) order by st nulls last) as rn, "
           f"count(st) over p as qn, sum(nrec) over p as nrec, sum(tsum) over p as tsum, {n_expr} as n, "
           f"{s_expr} as s, " + ", ".join(f"sum({c}) over p as {c}" for _k, c in _TOTALS)
           + f" from ({src}) window p as (partition by rank, cast(t / ? as integer))) "
           f"where st is not null and ({ranks_sql}) or rn = 1 order by rank is null, rank, w, rn")
    rows = conn.execute(sql, [ws, ws, *params, ws])
    out: list[dict[str, Any]] = []
    cur: dict[str, Any] | None = None
    win: list[Any] = []

    def flush() -> None:
        if win:
            _emit(cur, win)  # type: ignore[arg-type]

    for row in rows:
        rank, w = row[0], row[1]
        if cur is None or cur["rank"] != rank:
            flush()
            win = []
            cur = {"rank": rank, **{k: [] for k in ("t", "n", "p50", "p95", "q", "sum_s", "samples", "tokens",
                                                     *part._PHASES)}}
            out.append(cur)
        if win and win[0][1] != w:
            _emit(cur, win)
            win = []
        win.append(row)
    flush()
    return out


def _emit(r: dict[str, Any], win: list[Any]) -> None:
    """Append one window (its selected rows, ``rn`` ascending) to rank dict ``r``."""
    _rank, _w, _rn, qn, _st, nrec, tsum, n, s, *totals = win[0]
    vals = {row[2]: row[4] for row in win if row[4] is not None}

    def at(p: float) -> float | None:
        return vals.get(max(1, math.ceil(p / 100 * qn))) if qn else None

    r["t"].append(round(tsum / nrec, 1))
    r["n"].append(n or 0)
    if not qn:
        med = None
    elif qn % 2:
        med = vals.get((qn + 1) // 2)
    else:
        a, b = vals.get(qn // 2), vals.get(qn // 2 + 1)
        med = None if a is None or b is None else (a + b) / 2
    r["p50"].append(_r4n(med))
    r["p95"].append(_r4n(at(95)))
    r["q"].append([_r4n(vals.get(k)) for k in range(1, qn + 1)] if qn <= len(part.QUANTILES)
                  else [_r4n(at(q)) for q in part.QUANTILES])
    r["sum_s"].append(part._r(s or 0.0, 6))
    for (k, _c), v in zip(_TOTALS, totals, strict=True):
        r[k].append(part._r(v, 6) if v is not None else None)
