"""The spool part's file format (version 2, numpy .npz; version 1, gzip JSON, still read)
and the judge's columnar view of it (StepTable, GpuSeries arrays)."""

from __future__ import annotations

import gzip
import io
import json
import logging
import math
import random
import zipfile

import numpy as np
import pytest

from gpuguard.epilog import part, part_codec
from gpuguard.epilog.jobdata import GpuSeries, JobData, StepRec
from gpuguard.epilog.metrics import _step_metrics
from gpuguard.epilog.spool import SpoolError
from gpuguard.epilog.steptable import StepTable

T0 = 1767225600.0


def _doc(node="n1", job_id="5", windows=4):
    """A part dict as build_part makes it: lists with None where a window has no value."""
    ts = [T0 + 60 * i + 30 for i in range(windows)]
    return {
        "format": "gpuguard-part", "v": 2, "job_id": job_id, "node": node, "written_at": T0, "window_s": 60.0,
        "job": {"comment": "gpuguard:template=t"}, "summary": {"job_id": job_id, "node": node},
        "gpus": [{"index": 0, "uuid": "GPU-a", "name": "NVIDIA H100 80GB HBM3", "mem_total_mib": None,
                  "t": ts, "util": [97.5, None, 98.0, 96.0], "mem": [1000.0, 1001.0, 1002.0, 1003.0],
                  "power": [500.0] * 4, "temp": [60.0] * 4, "clock": [1755.0, 1740.0, None, 1755.0],
                  "mask": [0, 4, 4, 0], "ecc": [0, 0, None, 1]}],
        "ranks": [{"rank": 0, "t": ts, "n": [60, 60, 0, 60], "p50": [1.0, 1.1, None, 0.9],
                   "p95": [1.2, 1.3, None, 1.0], "q": [[0.8, 0.9, 1.0, 1.1, 1.2], [1.1], [], [0, 0.9]],
                   "sum_s": [60.0, 66.0, None, 54.0], "samples": [1920.0, 1920.0, None, 1920.0],
                   "tokens": [None] * 4, "data_wait": [1.2, 1.3, None, 1.1], "fwd_bwd": [48.0, 52.8, None, 43.2],
                   "comm": [6.0, None, None, 5.4], "optim": [3.0, 3.3, None, 2.7]}],
        "host": {"t": ts[:2], "rss": [2048.0, None]},
        "checkpoints_s": [12.5], "hw_events": [], "hw_findings": [],
    }


def _v1(doc) -> bytes:
    return gzip.compress(json.dumps(dict(doc, v=1)).encode())


def test_v2_round_trip_keeps_every_value_and_none_as_nan():
    blob = part_codec.encode(_doc())
    assert blob[:4] == b"PK\x03\x04"
    p = part.decode_part(blob)
    assert (p["format"], p["v"], p["job_id"], p["node"], p["window_s"], p["summary"]) == (
        "gpuguard-part", 2, "5", "n1", 60.0, {"job_id": "5", "node": "n1"})
    g = p["gpus"][0]
    assert (g["index"], g["uuid"], g["name"]) == (0, "GPU-a", "NVIDIA H100 80GB HBM3")
    assert np.array_equal(g["util"], [97.5, np.nan, 98.0, 96.0], equal_nan=True)
    assert g["mask"].dtype == np.int64 and g["mask"].tolist() == [0, 4, 4, 0]
    assert np.array_equal(g["ecc"], [0, 0, np.nan, 1], equal_nan=True)
    r = p["ranks"][0]
    assert r["q"].shape == (4, 5)
    assert np.array_equal(r["q"][1], [1.1, np.nan, np.nan, np.nan, np.nan], equal_nan=True)
    assert np.array_equal(p["host"]["rss"], [2048.0, np.nan], equal_nan=True)
    # the documented reader: numpy.load sees the same members
    z = np.load(io.BytesIO(blob))
    assert json.loads(bytes(z["meta"]))["gpus"] == [{"index": 0, "uuid": "GPU-a", "name": "NVIDIA H100 80GB HBM3",
                                                      "mem_total_mib": None, "n": 4}]


def test_v1_part_of_a_node_not_yet_upgraded_gives_the_same_judge_view():
    v1, v2 = part.decode_part(_v1(_doc())), part.decode_part(part_codec.encode(_doc()))
    assert v1["v"] == 1
    a, b = part.to_job_data("5", {"n1": v1}), part.to_job_data("5", {"n1": v2})
    assert list(a.steps) == list(b.steps) and a.gpus == b.gpus and (a.start, a.end, a.host) == (b.start, b.end, b.host)


def test_judge_view_exact_values():
    d = part.to_job_data("5", {"n1": part.decode_part(part_codec.encode(_doc()))})
    g = d.gpus[0]
    assert (g.util, g.clock, g.mask, g.ecc_unc) == ([97.5, None, 98.0, 96.0], [1755.0, 1740.0, None, 1755.0],
                                                    [0, 4, 4, 0], [0, 0, None, 1])
    assert d.mem_total_mib == {"n1/gpu0": 81920.0}  # from the product name
    # one node: up to five quantiles per window; window 3 has none and no p50 -> no record;
    # window 4's 0 is not a step time
    assert [(s.t, s.step_time_s) for s in d.steps] == [(T0 + 30, 0.8), (T0 + 30, 0.9), (T0 + 30, 1.0), (T0 + 30, 1.1),
                                                       (T0 + 30, 1.2), (T0 + 90, 1.1), (T0 + 210, 0.9)]
    s = d.steps[5]  # totals scaled by the record's share of the window's step time: 1.1 / 66
    assert (s.node, s.rank, s.samples, s.tokens, s.comm_s) == ("n1", 0, 1920.0 * (1.1 / 66.0), None, None)
    assert math.isclose(s.fwd_bwd_s, 52.8 * 1.1 / 66.0)
    assert (d.start, d.end, d.host) == (T0 + 30 - 0.8, T0 + 210, {"n1": ([T0 + 30, T0 + 90], [2048.0, None])})


def test_many_rank_windows_keep_the_middle_quantile(monkeypatch):
    parts = {f"n{i}": part.decode_part(part_codec.encode(_doc(node=f"n{i}"))) for i in range(2)}
    monkeypatch.setattr(part, "MAX_STEP_RECORDS", 8)  # 8 rank-windows -> one record per window
    d = part.to_job_data("5", parts)
    assert [(s.node, s.step_time_s) for s in d.steps] == [("n0", 1.0), ("n1", 1.0), ("n0", 1.1), ("n1", 1.1),
                                                          ("n0", 0.9), ("n1", 0.9)]


def _npz(**arrays) -> bytes:
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    return buf.getvalue()


def _members_of(doc):
    meta, arrays = part_codec._split(doc)
    return meta, arrays


def test_other_versions_and_malformed_archives_are_refused_with_one_line():
    meta, arrays = _members_of(_doc())
    raw = lambda m: np.frombuffer(json.dumps(m).encode(), dtype=np.uint8)  # noqa: E731
    with pytest.raises(SpoolError, match=r"part version 3 is not 2 \(or 1\)"):
        part.decode_part(_npz(meta=raw(dict(meta, v=3)), **arrays))
    with pytest.raises(SpoolError, match="not a gpuguard part"):
        part.decode_part(_npz(meta=raw({"format": "other"}), **arrays))
    with pytest.raises(SpoolError, match="member gpu_util: \\|O"):
        part.decode_part(_npz(meta=raw(meta), **dict(arrays, gpu_util=np.array([1, None], dtype=object))))
    with pytest.raises(SpoolError, match="member gpu_mask: <f8"):
        part.decode_part(_npz(meta=raw(meta), **dict(arrays, gpu_mask=np.zeros(4))))
    with pytest.raises(SpoolError, match="gpu_util has shape \\(3,\\), not 4 rows"):
        part.decode_part(_npz(meta=raw(meta), **dict(arrays, gpu_util=np.zeros(3))))
    with pytest.raises(SpoolError, match="unexpected part member 'extra.npy'"):
        part.decode_part(_npz(meta=raw(meta), extra=np.zeros(1), **arrays))
    with pytest.raises(SpoolError, match=r"members unknown to version 2: \['rank_x'\]"):
        part.decode_part(_npz(meta=raw(meta), rank_x=np.zeros(4), **arrays))
    with pytest.raises(SpoolError, match="part member rank_q is missing"):
        part.decode_part(_npz(meta=raw(meta), **{k: v for k, v in arrays.items() if k != "rank_q"}))
    with pytest.raises(SpoolError, match="neither .npz nor gzip"):
        part.decode_part(b"not a part")
    with pytest.raises(SpoolError, match="not a readable part archive"):
        part.decode_part(part_codec.encode(_doc())[:300])


def test_a_member_declaring_a_huge_shape_is_refused_before_it_is_allocated():
    meta, arrays = _members_of(_doc())
    blob = _npz(meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
    fake = io.BytesIO()  # the header claims 10^12 rows; the data is 4
    np.lib.format.write_array_header_1_0(fake, {"descr": "<f8", "fortran_order": False, "shape": (10**12,)})
    fake.write(np.zeros(4).tobytes())
    zin = zipfile.ZipFile(io.BytesIO(blob))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, fake.getvalue() if info.filename == "gpu_t.npy" else zin.read(info))
    with pytest.raises(SpoolError, match="member gpu_t: shape \\(1000000000000,\\) larger than its data"):
        part.decode_part(out.getvalue())
    bz = io.BytesIO()  # bzip2 is not what numpy writes, and zipfile does not bound its output per read
    with zipfile.ZipFile(bz, "w", zipfile.ZIP_BZIP2) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info))
    with pytest.raises(SpoolError, match="member .*: compression 12"):
        part.decode_part(bz.getvalue())


def test_spool_reads_both_versions_prefers_v2_and_logs_skipped_files(tmp_path, caplog):
    spool = str(tmp_path)
    part.write_part(spool, "5", "n1", _v1(_doc("n1")))  # write_part names it .part.npz; rename to v1's name
    d = tmp_path / "5"
    (d / "n1.part.npz").rename(d / "n1.part.json.gz")
    part.write_part(spool, "5", "n2", _v1(_doc("n2")))
    (d / "n2.part.npz").rename(d / "n2.part.json.gz")
    part.write_part(spool, "5", "n2", part_codec.encode(_doc("n2")))  # upgraded node wrote both: v2 wins
    meta, arrays = _members_of(_doc("n3"))
    part.write_part(spool, "5", "n3", _npz(meta=np.frombuffer(json.dumps(dict(meta, v=3)).encode(), np.uint8),
                                           **arrays))
    log = logging.getLogger("test.spool")
    with caplog.at_level(logging.WARNING, logger="test.spool"):
        got = part.read_parts(spool, "5", log)
    assert {n: p["v"] for n, p in got.items()} == {"n1": 1, "n2": 2}
    assert [r.getMessage() for r in caplog.records] == [
        f"spool: {d / 'n3.part.npz'} skipped: part version 3 is not 2 (or 1)"]
    from gpuguard.epilog.cluster import wait_for_parts

    assert sorted(wait_for_parts(spool, "5", ["n1", "n2"], timeout_s=0)) == ["n1", "n2"]


def test_step_table_reads_as_the_records_it_holds():
    recs = [StepRec("a", 0, 1.0, 0.5, 32.0, None, 0.1, 0.3, None, 0.05), StepRec(None, None, 2.0, None, None, 7.0,
                                                                              None, None, 0.2, None)]
    tab = StepTable.of(recs)
    assert len(tab) == 2 and list(tab) == recs and tab[1] == recs[1] and list(tab[1:]) == recs[1:]
    assert tab.node_names() == {"a"} and tab.column("samples") == [32.0, None]
    assert tab.rank_series() == {("a", 0): ([1.0], [0.3], [None])}
    data = JobData("1", ["a"], 1.0, 2.0, [], recs, [r.t for r in recs], {}, [], [], [], {})
    assert data.step_columns() is data.step_columns()  # made once
    assert list(data.step_columns(1.5, 3.0)) == recs[1:]


def _step_metrics_loop(recs):
    """The plain loop over records the columnar step metrics must equal, value for value."""
    from gpuguard.metrics import percentile
    from gpuguard.robust import clean

    times, counts, by_rank = [], [], {}
    wait, comm = [0, 0.0, 0.0], [0, 0.0, 0.0]
    for r in recs:
        st = r.step_time_s
        n = r.samples if r.samples is not None else r.tokens
        counts.append(n)
        if not st:
            continue
        times.append(st)
        if n is not None:
            acc = by_rank.setdefault((r.node, r.rank), [0.0, 0.0])
            acc[0] += n
            acc[1] += st
        for acc, v in ((wait, r.data_wait_s), (comm, r.comm_s)):
            if v is not None:
                acc[0] += 1
                acc[1] += v
                acc[2] += st
    out = {"step_time_p50_s": percentile(sorted(times), 50), "step_time_p95_s": percentile(sorted(times), 95),
           "throughput_per_s": None, "data_wait_share": None, "comm_share": None,
           "samples_per_step": percentile(sorted(clean(counts)), 50)}
    if times:
        if by_rank:
            out["throughput_per_s"] = sum(n / s for n, s in by_rank.values() if s > 0)
        for acc, name in ((wait, "data_wait_share"), (comm, "comm_share")):
            if acc[0] and acc[2] > 0:
                out[name] = acc[1] / acc[2]
    return out


def test_columnar_step_metrics_equal_the_record_loop_bit_for_bit():
    rng = random.Random(3)

    def maybe(x, p=0.1):
        return None if rng.random() < p else x
    for n in (0, 1, 5, 400, 3000):
        recs = sorted((StepRec(rng.choice(["a", "b", None]), rng.choice([0, 1, None, 7]), 1000 + rng.uniform(0, n),
                               rng.choice([None, 0.0, rng.uniform(0.5, 2), rng.uniform(0.5, 2)]),
                               maybe(rng.choice([32, rng.uniform(1, 100)])), maybe(rng.uniform(1, 1e5), 0.5),
                               maybe(rng.uniform(0, 0.1), 0.3), maybe(rng.uniform(0, 1)), maybe(rng.uniform(0, 0.2)),
                               None) for _ in range(n)), key=lambda r: r.t)
        data = JobData("1", ["a"], None, None, [], recs, [r.t for r in recs], {}, [], [], [], {})
        for t0, t1 in ((0.0, 1e12), (1000 + n / 3, 1000 + n / 2)):
            assert _step_metrics(data, t0, t1) == _step_metrics_loop(data.steps_between(t0, t1))


def test_gpu_series_array_follows_its_list():
    g = GpuSeries("n1", 0, None, t=[1.0, 2.0], util=[50.0, None])
    assert np.array_equal(g.array("util"), [50.0, np.nan], equal_nan=True)
    g.util = [10.0]
    assert g.array("util").tolist() == [10.0]  # a new list: made again


def test_gpu_series_follow_the_metric_table_across_releases():
    """A node whose metric table lacks a compared series (or has one more) still gives a
    part the controller reads: the missing series is no values, the unknown one is carried."""
    meta, arrays = _members_of(_doc())
    assert np.isnan(arrays["gpu_mem_util"]).all()  # the doc has no mem_util column: no values
    arrays.pop("gpu_mem_util")
    arrays["gpu_future_metric"] = np.arange(4.0)
    p = part.decode_part(_npz(meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays))
    assert p["gpus"][0]["future_metric"].tolist() == [0.0, 1.0, 2.0, 3.0]
    g = part.to_job_data("5", {"n1": p}).gpus[0]
    assert (g.mem_util, g.util) == ([None] * 4, [97.5, None, 98.0, 96.0])


def test_a_window_without_a_time_is_left_out_of_every_series():
    doc = _doc()
    doc["gpus"][0]["t"] = [T0 + 30, None, T0 + 150, T0 + 210]
    doc["ranks"][0]["t"] = [None, T0 + 90, T0 + 150, T0 + 210]
    d = part.to_job_data("5", {"n1": part.decode_part(part_codec.encode(doc))})
    g = d.gpus[0]
    assert (g.t, g.util, g.clock, g.mask, g.ecc_unc) == ([T0 + 30, T0 + 150, T0 + 210], [97.5, 98.0, 96.0],
                                                         [1755.0, None, 1755.0], [0, 4, 0], [0, None, 1])
    assert g.array("clock").tolist()[0] == 1755.0 and len(g.array("util")) == 3
    assert [(s.t, s.step_time_s) for s in d.steps] == [(T0 + 90, 1.1), (T0 + 210, 0.9)]
