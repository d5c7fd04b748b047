"""The minutes the collector closes while a job runs (gpuguard/live_minutes.py) give the
Epilog exactly what the raw rows give: bucket by bucket, and the whole summary."""

from __future__ import annotations

import dataclasses
import random

import pytest

from gpuguard import live_minutes, samples
from gpuguard.epilog.summary import summarize_job
from gpuguard.retention import prune
from gpuguard.store import open_store

T0 = 1_764_460_800.0 + 37.0  # the job starts mid-minute


def _rows(rnd: random.Random, i: int, at: float, gpus: int = 2) -> list[dict]:
    out = []
    for g in range(gpus):
        out.append({"job_id": "9", "node": "n1", "at": at + rnd.random() * 0.004, "gpu_index": g,
                    "gpu_uuid": f"GPU-{g}",
                    "gpu_util_pct": None if rnd.random() < 0.02 else float(rnd.choice((97, 98, 99, 100, 35))),
                    "mem_util_pct": float(rnd.randint(30, 60)), "mem_used_mib": 61000.0 + rnd.randint(0, 2000),
                    "power_w": None if rnd.random() < 0.01 else 600.0 + rnd.randint(0, 900) / 10,
                    "temp_c": float(rnd.randint(60, 80)), "sm_clock_mhz": float(rnd.choice((1980, 1965, 1410))),
                    "clock_event_mask": rnd.choice((0, 0, 0, 4, 4 | 32, None)),
                    "ecc_volatile_uncorrected": 0 if i % 60 == 0 else None})
    return out


def _write_job(store, seconds: int, seed: int = 1, flush_s: int = 10) -> None:
    """``seconds`` of 1 s samples of 2 GPUs, flushed every ``flush_s`` as the collector
    does, with a 25-minute gap and a clock stepped back by 30 s."""
    rnd = random.Random(seed)
    batch: list[dict] = []
    for i in range(seconds):
        at = T0 + i + (1500 if i > seconds // 2 else 0) - (30 if i > 3 * seconds // 4 else 0)
        batch += _rows(rnd, i, at)
        if len(batch) >= 2 * flush_s:
            store.insert_many("samples", batch)
            batch = []
    if batch:
        store.insert_many("samples", batch)


def _same(a: samples.Buckets, b: samples.Buckets) -> None:
    for attr in ("bucket_ms", "align_ms", "n", "t_min", "t_max", "t_sum", "sums", "counts", "maxes", "bits"):
        assert getattr(a, attr) == getattr(b, attr), attr


@pytest.fixture
def store(tmp_path):
    s = open_store(str(tmp_path / "node.db"))
    yield s
    s.close()


def _reads(store, sid: int, t0: float, lo: int = -(2**62), hi: int = 2**62, align_s: float = 60.0):
    conn = store.db.conn
    live = samples.read_buckets(conn, sid, t0, lo, hi, max_points=200, align_s=align_s)
    raw = samples.read_buckets(conn, sid, t0, lo, hi, max_points=200, align_s=align_s, live_ok=False)
    return live, raw


def test_closed_minutes_give_the_raw_buckets(store) -> None:
    _write_job(store, 2 * 3600)
    conn = store.db.conn
    series = samples.series_of(conn, "9", ["n1"])
    assert len(series) == 2
    for sid, _n, _i, _u, t0 in series:
        # chunks are closed up to the last whole 10 minutes; the gap is one empty chunk
        chunks = conn.execute("select first_minute, end_minute, n from gpu_live_chunks where sid = ? "
                              "order by first_minute", (sid,)).fetchall()
        assert [e - f for f, e, _n in chunks].count(10) >= 11
        assert [(e - f, n) for f, e, n in chunks if n == 0] == [(15, 0)]  # minutes 70-85: no samples
        assert all(chunks[k][1] == chunks[k + 1][0] for k in range(len(chunks) - 1))
        for align_s, width_ms in ((60.0, 60_000), (120.0, 120_000), (30.0, 0)):
            live, raw = _reads(store, sid, t0, align_s=align_s)
            _same(live, raw)
            if width_ms and align_s * 1000 % 60_000 == 0:
                assert live.bucket_ms == width_ms and live.live_ms is not None
                a, b = live.live_ms
                assert b - a >= 100 * 60_000  # most of the job came from the closed minutes
            else:
                assert live.live_ms is None  # 30 s buckets (or 960 s at max_points) are not whole minutes
        # a read starting mid-chunk, and one ending mid-job
        mid = 47 * 60_000 + 17_123
        live, raw = _reads(store, sid, t0, lo=mid)
        _same(live, raw)
        assert live.live_ms is not None and live.live_ms[0] >= mid
        live, raw = _reads(store, sid, t0, hi=mid)
        _same(live, raw)
        assert live.live_ms is not None and live.live_ms[1] <= mid + 1


def test_summary_is_the_same_with_and_without_the_closed_minutes(store, monkeypatch) -> None:
    _write_job(store, 3 * 3600, seed=2)
    store.memo.clear()
    live = summarize_job(store, "9", "n1", exit_status_raw=0, ended_at=T0 + 5 * 3600, started_at=T0 - 5,
                         window_align_s=60.0)
    store.memo.clear()
    real = samples.read_buckets
    monkeypatch.setattr(samples, "read_buckets", lambda *a, **k: real(*a, **{**k, "live_ok": False}))
    raw = summarize_job(store, "9", "n1", exit_status_raw=0, ended_at=T0 + 5 * 3600, started_at=T0 - 5,
                        window_align_s=60.0)
    d_live, d_raw = dataclasses.asdict(live), dataclasses.asdict(raw)
    d_live.pop("created_at"), d_raw.pop("created_at")
    assert d_live == d_raw
    assert live.sample_count == 2 * 3 * 3600
    assert live.gpu_util_p95_pct == 100.0


def test_a_chunk_whose_raw_rows_changed_is_not_used(store) -> None:
    _write_job(store, 3600, seed=3)
    conn = store.db.conn
    sid, _n, _i, _u, t0 = samples.series_of(conn, "9", ["n1"])[0]
    assert _reads(store, sid, t0)[0].live_ms is not None
    with store.tx():  # one raw row of a closed minute deleted behind the collector's back
        conn.execute("delete from gpu_samples where sid = ? and t_ms = (select min(t_ms) from gpu_samples "
                     "where sid = ? and t_ms > 120000)", (sid, sid))
    assert live_minutes.closed_range(conn, sid, t0, -(2**62), 2**62) is not None  # the chunks are still there
    live, raw = _reads(store, sid, t0)
    _same(live, raw)
    assert live.live_ms is None


def test_one_write_closes_a_bounded_number_of_chunks_and_the_next_ones_catch_up(store) -> None:
    rnd = random.Random(4)
    rows = [r for i in range(3 * 3600) for r in _rows(rnd, i, T0 + i, gpus=1)]
    store.insert_many("samples", rows)  # 3 h in one write: 18 chunks due
    conn = store.db.conn
    sid = samples.series_of(conn, "9", ["n1"])[0][0]
    count = "select count(*) from gpu_live_chunks where sid = ?"
    assert conn.execute(count, (sid,)).fetchone()[0] == live_minutes.MAX_CHUNKS_PER_WRITE
    store.insert_many("samples", _rows(rnd, 0, T0 + 3 * 3600 + 1, gpus=1))
    assert conn.execute(count, (sid,)).fetchone()[0] == 18  # minutes 0..179 closed; 180 is the current one
    # a writer with a fresh cache (a restarted collector) goes on from the store
    store._series = None
    store.insert_many("samples", [r for i in range(601) for r in _rows(rnd, i, T0 + 3 * 3600 + 2 + i, gpus=1)])
    assert conn.execute(count, (sid,)).fetchone()[0] == 19


def test_retention_drops_the_closed_minutes_with_the_raw_rows(store) -> None:
    _write_job(store, 3600, seed=5)
    conn = store.db.conn
    sid, _n, _i, _u, t0 = samples.series_of(conn, "9", ["n1"])[0]
    out = prune(store, now=T0 + 30 * 60 + 2 * 86400, raw_days=2, minutes_days=90)
    assert out["samples_folded"] > 0
    first = conn.execute("select min(first_minute) from gpu_live_chunks where sid = ?", (sid,)).fetchone()[0]
    assert first is not None and (first + int(t0 // 60)) * 60 >= T0 + 30 * 60 - 60
    assert conn.execute("select count(*) from gpu_live_minutes where sid = ? and minute < ?",
                        (sid, first)).fetchone()[0] == 0
    live, raw = _reads(store, sid, t0)
    _same(live, raw)
    prune(store, now=T0 + 4 * 86400, raw_days=2, minutes_days=90)
    assert conn.execute("select count(*) from gpu_live_chunks").fetchone()[0] == 0
    assert conn.execute("select count(*) from gpu_live_minutes").fetchone()[0] == 0


def test_the_epilog_drops_the_jobs_working_rows_and_keeps_the_raw_ones(store) -> None:
    import logging

    from gpuguard.epilog.upkeep import drop_working_rows

    _write_job(store, 3600, seed=6)
    store.insert_many("steps", [{"job_id": "9", "node": "n1", "rank": 0, "step": k, "t": T0 + k, "step_time_s": 1.0}
                                for k in range(100)])
    conn = store.db.conn
    raw = conn.execute("select count(*) from gpu_samples").fetchone()[0]
    assert conn.execute("select count(*) from gpu_live_minutes").fetchone()[0] > 0
    assert conn.execute("select count(*) from step_windows").fetchone()[0] == 15  # 99 s over 15 7.5 s sub-windows
    assert len({int((T0 + k) / 7.5) for k in range(100)}) == 15
    drop_working_rows(store, "9", "n1", logging.getLogger("test"))
    for table in ("gpu_live_minutes", "gpu_live_chunks", "step_windows"):
        assert conn.execute(f"select count(*) from {table}").fetchone()[0] == 0, table
    assert conn.execute("select count(*) from gpu_samples").fetchone()[0] == raw == 2 * 3600
    assert conn.execute("select count(*) from steps").fetchone()[0] == 100


def test_cached_reads_are_keyed_by_the_rows_they_cover(store) -> None:
    """A read of the whole series is reused by a read whose bounds select the same rows,
    never by one that selects fewer or none."""
    _write_job(store, 3600, seed=7)
    conn = store.db.conn
    sid, _n, _i, _u, t0 = samples.series_of(conn, "9", ["n1"])[0]
    whole = samples.read_buckets(conn, sid, t0, cache=store.memo, align_s=60.0)
    assert samples.read_buckets(conn, sid, t0, lo=-5_000, hi=10**12, cache=store.memo, align_s=60.0) is whole
    part = samples.read_buckets(conn, sid, t0, lo=600_000, cache=store.memo, align_s=60.0)
    assert part is not whole and sum(part.n) < sum(whole.n)
    none = samples.read_buckets(conn, sid, t0, lo=10**11, cache=store.memo, align_s=60.0)
    assert none.n == [] and none is not whole
