"""The node Epilog's spool part built straight from the store (gpuguard.epilog.nodepart):
the same part as build_part(load_job(...)) for a short job, exact window sums and means
from the summary's aligned buckets for a long one, and SQL step windows equal to the
Python ones."""

from __future__ import annotations

import random

import pytest

import gpuguard.epilog.schema  # noqa: F401
from gpuguard import samples
from gpuguard.epilog import jobdata, nodepart, part
from gpuguard.epilog.summary import summarize_job
from gpuguard.store import open_store

T0 = 1_764_460_800.0  # a multiple of 60 s


def _store(tmp_path, n_samples: int, n_steps: int, ranks=(0, 1), seed=1):
    rnd = random.Random(seed)
    s = open_store(str(tmp_path / "node.db"))
    s.insert("health_runs", {"node": "n1", "hook": "prolog", "job_id": "5", "started_at": T0 - 2,
                             "finished_at": T0 - 1, "decision": "proceed", "reason": ""})
    s.insert("inventory", {"node": "n1", "uuid": "GPU-0", "name": "NVIDIA H100 80GB HBM3"})
    rows = []
    for g in range(2):
        for i in range(n_samples):
            rows.append({"job_id": "5", "node": "n1", "at": T0 + i + 0.5, "gpu_index": g, "gpu_uuid": f"GPU-{g}",
                         "gpu_util_pct": rnd.choice((90, 95, 99, None)), "mem_util_pct": 40.0,
                         "mem_used_mib": 1000 + i, "power_w": 500 + rnd.random() * 100, "temp_c": 60 + rnd.randint(0, 9),
                         "sm_clock_mhz": 1980 - rnd.choice((0, 0, 300)),
                         "clock_event_mask": rnd.choice((0, 0, 4, 4 | 32, 1)),
                         "ecc_volatile_uncorrected": i // 500 if i % 60 == 0 else None})
    s.insert_many("samples", rows)
    steps = []
    for r in ranks:
        for k in range(n_steps):
            st = rnd.choice((0.0, None, 0.5 + rnd.random(), 0.5 + rnd.random(), 1.0))
            steps.append({"job_id": "5", "node": "n1", "rank": r, "step": k, "t": T0 + k * 0.4, "step_time_s": st,
                          "samples": rnd.choice((None, 8)), "tokens": 1024, "data_wait_s": rnd.choice((None, 0.1)),
                          "fwd_bwd_s": 0.3, "comm_s": 0.1, "optim_s": None})
    s.insert_many("steps", steps)
    s.insert_many("host_samples", [{"job_id": "5", "node": "n1", "at": T0 + 30 * i, "rss_mib": 100.0 + i}
                                   for i in range(n_samples // 30)])
    s.insert_many("checkpoints", [{"job_id": "5", "node": "n1", "rank": 0, "step": 1, "t": T0 + 5,
                                   "duration_s": 12.5}])
    s.insert("events", {"node": "n1", "at": T0 + 100, "kind": "xid", "code": 79, "job_id": "5",
                        "action": "drain", "source": "kernel_log", "message": "fell off the bus"})
    return s


@pytest.mark.parametrize("ws", [60.0, 120.0, 45.0])
def test_short_job_part_is_build_part_of_load_job(tmp_path, ws):
    s = _store(tmp_path, 1200, 900)
    summarize_job(s, "5", "n1", exit_status_raw=0, window_align_s=60.0)
    old = part.build_part(jobdata.load_job(s, "5", ["n1"]), "n1", window_s=ws, job={"user": "u"}, summary=None,
                          gpu_names={"GPU-0": "x"}, now=1.0)
    new = nodepart.build_node_part(s, "5", "n1", window_s=ws, job={"user": "u"}, summary=None,
                                   gpu_names={"GPU-0": "x"}, align_s=60.0, now=1.0)
    assert new == old
    assert (len(new["gpus"]), len(new["ranks"]), new["checkpoints_s"], [e["code"] for e in new["hw_events"]],
            new["gpus"][0]["mem_total_mib"]) == (2, 2, [12.5], [79], 81920.0)


def test_long_series_windows_are_exact_means_of_aligned_buckets(tmp_path):
    n = samples.MAX_POINTS + 400  # bucketed at 60 s
    s = _store(tmp_path, n, 10)
    summ = summarize_job(s, "5", "n1", exit_status_raw=0, window_align_s=60.0)
    p = nodepart.build_node_part(s, "5", "n1", window_s=120.0, job={}, summary=summ.to_dict(), align_s=60.0, now=1.0)
    g = p["gpus"][0]
    conn = s.db.conn
    sid, t0 = conn.execute("select id, t0 from gpu_series where gpu_index = 0").fetchone()
    rows = conn.execute("select t_ms, gpu_util_pct, mem_used_mib, power_w_x10, clock_event_mask from gpu_samples "
                        "where sid = ? order by t_ms", (sid,)).fetchall()
    by: dict[int, list] = {}
    for r in rows:
        by.setdefault(int((t0 * 1000 + r[0]) // 120000), []).append(r)
    assert len(g["t"]) == len(by)
    for k, w in enumerate(sorted(by)):
        rs = by[w]
        util = [r[1] for r in rs if r[1] is not None]
        assert g["t"][k] == round(t0 + sum(r[0] for r in rs) / len(rs) / 1000, 1)
        assert g["util"][k] == part._r(sum(util) / len(util))
        assert g["power"][k] == part._r(sum(r[3] for r in rs) / len(rs) / 10)
        assert g["mem"][k] == max(r[2] for r in rs)
        assert g["mask"][k] == sum(b for b in (1, 4, 32) if 2 * sum(1 for r in rs if r[4] & b) >= len(rs))
    ecc: dict[int, int] = {}
    for t_ms, v in conn.execute("select t_ms, ecc_volatile_uncorrected from gpu_slow where sid = ?", (sid,)):
        w = int((t0 * 1000 + t_ms) // 120000)
        ecc[w] = max(ecc.get(w, v), v)
    assert g["ecc"] == [ecc.get(w) for w in sorted(by)] and g["ecc"][-1] == 4 and g["ecc"].count(None) == 0
    # the part reused the summary's pass: one cached bucket set per GPU, aligned on 60 s
    keys = [k for k in s.memo if k[0] == "buckets"]
    assert sorted(k[2:] for k in keys) == [("first", "last", samples.MAX_POINTS, 60.0)] * 2
    assert all(s.memo[k].bucket_ms == 60000 and s.memo[k].align_ms == 1 for k in keys)


def test_sql_step_windows_equal_the_python_ones(tmp_path):
    s = _store(tmp_path, 10, 3000, ranks=(0, 1, None), seed=3)
    recs = jobdata._load_steps(s, "5", ["n1"])
    for ws in (60.0, 7.0, 1.0):
        assert nodepart._rank_windows_sql(s.db.conn, "5", "n1", ws, None) == part._rank_windows(recs, ws)


def test_long_step_windows_keep_exact_counts_and_sums(tmp_path, monkeypatch):
    s = _store(tmp_path, 10, 3000, seed=4)
    recs = jobdata._load_steps(s, "5", ["n1"])
    assert len(recs) == 6000
    monkeypatch.setattr(jobdata, "MAX_STEP_RECORDS", 1000)  # the SQL sub-window path
    exact = part._rank_windows(recs, 60.0)
    ranks, span = nodepart._ranks(s, "5", "n1", 60.0)
    for a, b in zip(ranks, exact, strict=True):
        assert [a[k] for k in ("rank", "t", "n", "sum_s", "samples", "tokens", "data_wait", "optim")] == \
               [b[k] for k in ("rank", "t", "n", "sum_s", "samples", "tokens", "data_wait", "optim")]
        assert all(len(q) == 5 for q in a["q"])
    first = min(recs, key=lambda r: r.t)
    assert span == (first.t - (first.step_time_s or 0.0), max(r.t for r in recs))


def test_window_is_never_narrower_than_the_aligned_buckets(tmp_path):
    s = open_store(str(tmp_path / "node.db"))
    n = samples.MAX_ALIGNED_BUCKETS + 100  # one sample a minute for ~70 h: 60 s buckets would be too many
    s.insert_many("samples", [{"job_id": "5", "node": "n1", "at": T0 + 60 * i, "gpu_index": 0, "gpu_uuid": "GPU-0",
                               "gpu_util_pct": 50 + i % 2} for i in range(n)])
    b = samples.read_buckets(s.db.conn, 1, T0, align_s=60.0)
    assert (b.bucket_ms, len(b.n), b.n[:2]) == (120000, (n + 1) // 2, [2, 2])
    p = nodepart.build_node_part(s, "5", "n1", window_s=60.0, job={}, summary=None, align_s=60.0, now=1.0)
    assert p["window_s"] == 120.0 and len(p["gpus"][0]["t"]) == (n + 1) // 2 and p["gpus"][0]["util"][0] == 50.5


def test_kept_step_sub_windows_give_what_the_steps_give(tmp_path):
    """The step_windows rows the insert trigger keeps give the part's step windows the raw
    steps give: 7.5 s sub-windows at 60 s windows, merged pairwise at 120 s, a rank-less
    rank, records without a time skipped; any delete drops them and the steps are read."""
    s = _store(tmp_path, 10, 3000, ranks=(0, 1, None), seed=5)
    s.insert_many("steps", [{"job_id": "5", "node": "n1", "rank": 0, "step": 9999, "t": None, "step_time_s": 1.0}])
    conn = s.db.conn
    n = conn.execute("select count(*) from steps where job_id = '5' and node = 'n1' and t is not null").fetchone()[0]
    assert n == 9000
    assert conn.execute("select sum(nrec), count(distinct rank) from step_windows").fetchone() == (9000, 3)
    for ws in (60.0, 120.0, 45.0):
        kept = nodepart._kept_sub_windows(conn, "5", "n1", ws / nodepart.SUB_WINDOWS, n)
        assert (kept is None) == (ws == 45.0)
        got = nodepart._rank_windows_sql(conn, "5", "n1", ws, nodepart.SUB_WINDOWS, n)
        assert got == nodepart._rank_windows_sql(conn, "5", "n1", ws, nodepart.SUB_WINDOWS)
        assert [r["rank"] for r in got] == [0, 1, None]
    assert nodepart._kept_sub_windows(conn, "5", "n1", 7.5, n + 1) is None  # a count that does not match
    with s.tx():
        conn.execute("delete from steps where job_id = '5' and node = 'n1' and step = 7 and rank = 1")
    assert conn.execute("select count(*) from step_windows").fetchone()[0] == 0
    assert nodepart._kept_sub_windows(conn, "5", "n1", 7.5, n - 1) is None
