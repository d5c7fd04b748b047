"""The spool *part*: what one node's Epilog hands to the job judge on the controller.

One file per (job, node): ``{spool_dir}/{job_id}/{node}.part.npz``, written atomically
(temp file in the same directory + ``rename``), versioned and bounded: at most
:data:`MAX_PART_BYTES`. The file format (a numpy ``.npz`` of columns, version 2; the
previous release's gzip JSON, version 1, still read) is :mod:`gpuguard.epilog.part_codec`.
:func:`build_part` gives the part as a dict of lists (``None`` = no value)::

    {"format": "gpuguard-part", "v": 2, "job_id": "42", "node": "n1", "written_at": epoch s,
     "window_s": 60.0,                     # width of one window of the series below
     "job": {"user", "uid", "account", "partition", "comment", "num_nodes", "nodelist",
             "exit_code_raw",              # what the node Epilog's environment said
             "gpus", "gpu_name"},          # GPUs allocated here (SLURM_JOB_GPUS), inventory GPU name
     "summary": JobSummary.to_dict(),      # the node summary (gpuguard.epilog.summary)
     "gpus": [{"index", "uuid", "name", "mem_total_mib",
               "t": [...], "util": [...], "mem_util": [...], "power": [...], "temp": [...],
               "clock": [...],             # one per compared GPU series (jobdata.SERIES_ATTR)
               "mem": [...], "mask": [...], "ecc": [...]}],
     "ranks": [{"rank", "t": [...], "n": [...], "p50": [...], "p95": [...], "q": [[p10, p30, p50,
                p70, p90], ...], "sum_s": [...],
                "samples": [...], "tokens": [...], "data_wait": [...], "fwd_bwd": [...],
                "comm": [...], "optim": [...]}],
     "host": {"t": [...], "rss": [...]},
     "checkpoints_s": [...], "hw_events": [...], "hw_findings": [...]}

:func:`decode_part` gives the same shape with each series a numpy array (NaN = no value,
``q`` one row of five per window).

**Windows.** Series are cut into windows of ``[verdict] short_window_s`` aligned on the
epoch (``floor(t / window_s)``), so every node's windows line up. Per GPU and window: ``t``
the mean sample time, the *median* of each compared series (utilisation, memory
utilisation, power, temperature, SM clock), the
*largest* memory used and volatile uncorrectable ECC count, and ``mask`` the clock-event
reasons active in at least half of the window's samples. Per rank and window: ``n`` step
records, their median (``p50``) and 95th percentile step time, and the sums of step time,
samples, tokens and phases, and ``q`` the step-time quantiles. One window of 8 GPUs and
8 ranks is ~210 numbers, so a 24 h job
at 60 s windows is ~300 k numbers, ~440 kB compressed (``bench/cluster_judge.py``). When a
part would exceed :data:`MAX_PART_BYTES` the window doubles until it fits (``window_s``
says which was used).

**What the judge sees** (:func:`to_job_data`): one GPU sample per GPU and window (lists, and
the part's arrays behind :meth:`GpuSeries.array`), and per rank and window up to five step
records (a :class:`~gpuguard.epilog.steptable.StepTable` of columns) at the window's
step-time quantiles ``q`` (:data:`QUANTILES`: p10, p30, p50, p70, p90; fewer for windows with fewer steps, and one,
the median, when a job would exceed :data:`MAX_STEP_RECORDS`), with samples, tokens and
phase times scaled so that throughput and phase shares over any span of windows equal the
exact sums. One median per window made the p95 of a short job the largest of a handful
of window medians: a healthy run on the testbed read +14 %. Every run of a template goes through
the same reduction (single host included), so a run is always compared like with like.
"""

from __future__ import annotations

import math
import os
import stat
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from gpuguard.epilog.jobdata import SERIES_ATTR, GpuSeries, JobData, StepRec
from gpuguard.epilog.part_codec import FORMAT, SUFFIX, V1_SUFFIX, VERSION
from gpuguard.epilog.spool import SpoolError, check_job_dir, check_name

#: Size cap of one encoded part (the issue's bound for a 24 h job on one node: 1 MB).
MAX_PART_BYTES = 1_000_000
#: At most this many checkpoint durations and hardware events/findings are carried.
MAX_LIST = 200

_PHASES = ("data_wait", "fwd_bwd", "comm", "optim")
#: ``events`` kinds that are gpuguard's own trouble, not the hardware's: never carried as
#: hardware events (a dead collector would otherwise read as ``hardware-fault``).
OWN_EVENT_KINDS = ("collector_died",)
#: Step-time quantiles (nearest rank) kept per rank and window: the midpoints of five
#: equal-mass bins, so that the union over windows has about the right median and tail.
QUANTILES = (10, 30, 50, 70, 90)
#: At most this many synthetic step records for the judge (a row of the step table; the
#: per-rank checks' medians walk them): a 64-node x 8-rank x 24 h job at 60 s windows has
#: 737 k rank-windows and gets one record per rank-window, a single node gets all five
#: (bench/cluster_judge.py measures both). Raising it changes what such jobs are judged on.
MAX_STEP_RECORDS = 400_000


def _r(x: float | None, nd: int = 4) -> float | None:
    """Round to ``nd`` significant digits (None and non-finite stay None)."""
    if x is None or not math.isfinite(x):
        return None
    if x == 0:
        return 0.0
    return round(x, max(0, nd - 1 - math.floor(math.log10(abs(x)))))


def _median(vals: list[float]) -> float | None:
    v = sorted(x for x in vals if x is not None)
    if not v:
        return None
    m = len(v) // 2
    return v[m] if len(v) % 2 else (v[m - 1] + v[m]) / 2


def _nearest_rank(sorted_vals: list[float], p: float) -> float | None:
    if not sorted_vals:
        return None
    return sorted_vals[max(1, math.ceil(p / 100 * len(sorted_vals))) - 1]


def _majority_mask(masks: list[int]) -> int:
    out, half = 0, len(masks) / 2
    bits = 0
    for m in masks:
        bits |= m
    b = 1
    while b <= bits:
        if bits & b and sum(1 for m in masks if m & b) >= half:
            out |= b
        b <<= 1
    return out


def _gpu_windows(g: GpuSeries, ws: float) -> dict[str, list[Any]]:
    series = tuple(SERIES_ATTR.values())  # util, mem_util, power, temp, clock: the compared GPU series
    out: dict[str, list[Any]] = {k: [] for k in ("t", *series, "mem", "mask", "ecc")}
    i, n = 0, len(g.t)
    while i < n:
        w = math.floor(g.t[i] / ws)
        j = i
        while j < n and math.floor(g.t[j] / ws) == w:
            j += 1
        sl = slice(i, j)
        out["t"].append(round(sum(g.t[sl]) / (j - i), 1))
        for a in series:
            out[a].append(_r(_median(getattr(g, a)[sl])))
        mem = [x for x in g.mem[sl] if x is not None]
        out["mem"].append(_r(max(mem), 6) if mem else None)
        out["mask"].append(_majority_mask(g.mask[sl]))
        ecc = [x for x in g.ecc_unc[sl] if x is not None]
        out["ecc"].append(max(ecc) if ecc else None)
        i = j
    return out


def _rank_windows(steps: list[StepRec], ws: float) -> list[dict[str, Any]]:
    by: dict[tuple[Any, Any], dict[int, list[StepRec]]] = {}
    for s in steps:
        by.setdefault((s.node, s.rank), {}).setdefault(math.floor(s.t / ws), []).append(s)
    ranks = []
    for (_node, rank), wins in sorted(by.items(), key=lambda kv: (kv[0][1] is None, kv[0][1] or 0)):
        r: dict[str, Any] = {"rank": rank, **{k: [] for k in ("t", "n", "p50", "p95", "q", "sum_s", "samples",
                                                                "tokens", *_PHASES)}}
        for w in sorted(wins):
            recs = wins[w]
            times = sorted(x.step_time_s for x in recs if x.step_time_s)
            r["t"].append(round(sum(x.t for x in recs) / len(recs), 1))
            r["n"].append(len(times))
            r["p50"].append(_r(_median(times)))
            r["p95"].append(_r(_nearest_rank(times, 95)))
            r["q"].append([_r(x) for x in (times if len(times) <= len(QUANTILES) else
                                            [_nearest_rank(times, q) for q in QUANTILES])])
            r["sum_s"].append(_r(sum(times), 6))
            for k, attr in (("samples", "samples"), ("tokens", "tokens"), *((p, p + "_s") for p in _PHASES)):
                vals = [getattr(x, attr) for x in recs if getattr(x, attr) is not None and x.step_time_s]
                r[k].append(_r(sum(vals), 6) if vals else None)
        ranks.append(r)
    return ranks


def _host_windows(host: Mapping[str, tuple[list[float], list[float | None]]], node: str,
                  ws: float) -> dict[str, list[Any]]:
    ts, vs = host.get(node, ([], []))
    out: dict[str, list[Any]] = {"t": [], "rss": []}
    i = 0
    while i < len(ts):
        w = math.floor(ts[i] / ws)
        j = i
        while j < len(ts) and math.floor(ts[j] / ws) == w:
            j += 1
        out["t"].append(round(sum(ts[i:j]) / (j - i), 1))
        out["rss"].append(_r(_median(vs[i:j])))
        i = j
    return out


def _clean(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> list[dict[str, Any]]:
    return [{k: r.get(k) for k in keys} for r in rows[:MAX_LIST]]


def build_part(data: JobData, node: str, *, window_s: float, job: Mapping[str, Any],
               summary: Mapping[str, Any] | None, gpu_names: Mapping[str, str] | None = None,
               now: float | None = None) -> dict[str, Any]:
    """The part of ``node`` for the job in ``data`` (:func:`gpuguard.epilog.jobdata.load_job`
    restricted to this node) at windows of ``window_s`` seconds. ``job``: the Epilog's view
    of the job (module docstring); ``summary``: the node's ``JobSummary.to_dict()``;
    ``gpu_names``: GPU UUID -> NVML product name (for the judge's template and memory
    capacity). Returns a JSON-ready dict; see :func:`encode_part` for the size bound."""
    names = gpu_names or {}
    gpus = []
    for g in data.gpus:
        if g.node != node:
            continue
        gpus.append({"index": g.gpu_index, "uuid": g.gpu_uuid, "name": names.get(g.gpu_uuid or ""),
                     "mem_total_mib": data.mem_total_mib.get(g.key), **_gpu_windows(g, window_s)})
    ev_keys = ("at", "node", "kind", "code", "gpu_index", "gpu_uuid", "action", "message", "job_id")
    fi_keys = ("at", "node", "code", "severity", "action", "gpu_index", "gpu_uuid", "message", "job_id")
    return {
        "format": FORMAT, "v": VERSION, "job_id": str(data.job_id), "node": node,
        "written_at": round(time.time() if now is None else now, 3), "window_s": float(window_s),
        "job": dict(job), "summary": dict(summary) if summary else None, "gpus": gpus,
        "ranks": _rank_windows([s for s in data.steps if s.node in (node, None)], window_s),
        "host": _host_windows(data.host, node, window_s),
        "checkpoints_s": [_r(x, 6) for x in data.checkpoint_s[:MAX_LIST]],
        "hw_events": _clean([e for e in data.hw_events if e.get("kind") not in OWN_EVENT_KINDS], ev_keys),
        "hw_findings": _clean(data.hw_findings, fi_keys),
    }


def encode_part(build: Any, window_s: float, max_bytes: int = MAX_PART_BYTES) -> tuple[bytes, float]:
    """The part ``build(window_s)`` (a function returning the part dict) encoded
    (:func:`gpuguard.epilog.part_codec.encode`, version 2), doubling the window until it
    is at most ``max_bytes``. Returns ``(bytes, window_s)``. Raises :class:`SpoolError`
    when even a window of a whole day does not fit."""
    from gpuguard.epilog import part_codec

    ws = float(window_s)
    while True:
        doc = build(ws)
        blob = part_codec.encode(doc)
        if len(blob) <= max_bytes:
            return blob, ws
        if ws >= 86400:
            raise SpoolError(f"part of job {doc.get('job_id')} on {doc.get('node')} is {len(blob)} bytes "
                             f"even at {ws:g} s windows (limit {max_bytes})")
        ws *= 2


def spool_owner(spool_dir: str) -> tuple[int, int] | None:
    """uid/gid of the spool directory: the job directories and parts are handed to it so
    that the controller's worker (SlurmUser) can add its manifest and remove judged jobs."""
    try:
        st = os.stat(spool_dir)
    except OSError:
        return None
    return st.st_uid, st.st_gid


def job_dir(spool_dir: str, job_id: str, *, create: bool = False) -> str:
    """``{spool_dir}/{job_id}``; with ``create`` made mode 0755 and, when we are root,
    owned like ``spool_dir``. Raises :class:`SpoolError` for an unsafe job id, and when
    the path is there but is a symlink, not a directory, or owned by another user than
    root, the spool's owner or us (:func:`gpuguard.epilog.spool.check_job_dir`)."""
    d = os.path.join(spool_dir, check_name("job id", str(job_id)))
    if create and not os.path.lexists(d):
        os.makedirs(d, mode=0o755, exist_ok=True)
        owner = spool_owner(spool_dir)
        if owner and os.geteuid() == 0 and owner[0] != 0:
            try:
                os.chown(d, *owner, follow_symlinks=False)
            except OSError:
                pass  # the controller then cannot clean up; the part itself is still readable
    check_job_dir(spool_dir, d)
    return d


def write_file_atomic(d: str, name: str, blob: bytes) -> str:
    """Write ``blob`` as ``d/name`` (temp file + fsync + rename, mode 0644); returns the path."""
    fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{name}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(blob)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, os.path.join(d, name))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass  # already gone: nothing to clean up
        raise
    return os.path.join(d, name)


def write_part(spool_dir: str, job_id: str, node: str, blob: bytes) -> str:
    """Store an encoded part as ``{spool_dir}/{job_id}/{node}.part.npz``; returns the
    path. Raises :class:`SpoolError` (unsafe names) and ``OSError``."""
    d = job_dir(spool_dir, job_id, create=True)
    return write_file_atomic(d, check_name("node name", node) + SUFFIX, blob)


def _read_bounded(path: str, max_bytes: int) -> bytes | None:
    """The file's bytes, or None for a symlink, FIFO, non-regular or oversized file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
            return None
        with os.fdopen(fd, "rb") as fh:
            fd = -1
            return fh.read(max_bytes + 1)
    except OSError:
        return None
    finally:
        if fd >= 0:
            os.close(fd)


def decode_part(blob: bytes) -> dict[str, Any]:
    """The part in ``blob``, series as numpy arrays (:func:`gpuguard.epilog.part_codec.decode`:
    version 2, or version 1 from a node not yet upgraded). Raises :class:`SpoolError` for
    anything else."""
    from gpuguard.epilog import part_codec

    try:
        return part_codec.decode(blob)
    except (TypeError, ValueError, AttributeError, KeyError, IndexError) as e:
        # a version-1 JSON part is free-form: a field of another type than written fails
        # in the conversion; one line like every other unreadable part, never a crash
        raise SpoolError(f"malformed part: {type(e).__name__}: {e}") from None


def part_node(name: str) -> str | None:
    """The node a spool file name is the part of (``n1.part.npz``, or a version-1
    ``n1.part.json.gz``), or None for any other name (temp files start with ``.``)."""
    if name.startswith("."):
        return None
    for suffix in (SUFFIX, V1_SUFFIX):
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return None


def read_parts(spool_dir: str, job_id: str, log: Any = None) -> dict[str, dict[str, Any]]:
    """``node -> part`` for every readable part of the job now in the spool (a node's
    version-2 part wins over a version-1 one). Unreadable, foreign, oversized or
    mismatched files, and parts whose fields are not what build_part writes
    (:func:`gpuguard.epilog.part_check.check_part`), are skipped (one line each in
    ``log`` when given)."""
    from gpuguard.epilog.part_check import check_part

    d = job_dir(spool_dir, job_id)
    out: dict[str, dict[str, Any]] = {}
    try:
        names = sorted(os.listdir(d), key=lambda n: n.endswith(SUFFIX))  # version 1 first
    except OSError:
        return out
    for n in names:
        node = part_node(n)
        if node is None:
            continue
        blob = _read_bounded(os.path.join(d, n), MAX_PART_BYTES)
        try:
            if blob is None:
                raise SpoolError("not a regular file, a symlink, or over the size bound")
            doc = decode_part(blob)
            check_part(doc, str(job_id), node)
        except SpoolError as e:
            if log is not None:
                log.warning("spool: %s skipped: %s", os.path.join(d, n), e)
            continue
        out[node] = doc
    return out


# -- the judge's view ------------------------------------------------------------------------
def _number(v: Any) -> float | None:
    """A number of a part's JSON fields, else None (``bool`` is not a number)."""
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _values(a: Any) -> list[float | None]:
    """An array's values as a list, NaN as None."""
    vals = a.tolist()
    return [None if x != x else x for x in vals] if vals and bool((a != a).any()) else vals


def _gpu_series(node: str, g: Mapping[str, Any]) -> GpuSeries:
    """One GPU's windows (one sample each) from its decoded part entry."""
    import numpy as np

    index = g.get("index")
    s = GpuSeries(node, int(index) if _number(index) is not None else -1, g.get("uuid"))
    keep = ~np.isnan(g["t"])
    whole = bool(keep.all())

    def col(k: str) -> Any:
        return g[k] if whole else g[k][keep]
    n = g["t"].shape[0]
    for attr, key in (("t", "t"), ("mem", "mem"), ("mask", "mask"), ("ecc_unc", "ecc"),
                      *((a, a) for a in SERIES_ATTR.values())):
        a = col(key) if key in g else np.full(int(keep.sum()) if not whole else n, np.nan)
        if attr in ("t", "mask"):
            setattr(s, attr, a.tolist())
        else:
            setattr(s, attr, [None if x != x else int(x) for x in a.tolist()] if attr == "ecc_unc" else _values(a))
        s.keep_array(attr, a)  # the checks that read arrays (GpuSeries.array) get these as they are
    return s


def _rank_steps(node: str, r: Mapping[str, Any], per_window: int) -> Any:
    """One rank's step records, ``per_window`` at most per window (module docstring), as
    a :class:`~gpuguard.epilog.steptable.StepTable` in window order: a window's
    step-time quantiles ``q`` that are numbers other than 0 (else its ``p50``), evenly
    spaced when more than ``per_window`` (the middle one when only one is kept), each
    carrying the window's totals scaled by its share of the window's step time."""
    import numpy as np

    from gpuguard.epilog.steptable import StepTable

    q = r["q"]
    valid = ~np.isnan(q) & (q != 0)
    p50 = r["p50"]
    fallback = ~valid.any(axis=1) & ~np.isnan(p50) & (p50 != 0)
    if fallback.any():
        q = q.copy()
        q[fallback, 0] = p50[fallback]
        valid[fallback, 0] = True
    count = valid.sum(axis=1)[:, None]
    compact = np.take_along_axis(q, np.argsort(~valid, axis=1, kind="stable"), axis=1)  # numbers first, in order
    k = np.arange(q.shape[1])
    pick = np.where(count <= per_window, k, (2 * k + 1) * count // (2 * per_window))
    take = (k < np.minimum(count, per_window)) & ~np.isnan(r["t"])[:, None]
    st = np.take_along_axis(compact, np.minimum(pick, q.shape[1] - 1), axis=1)[take]
    win = np.nonzero(take)[0]
    tot = r["sum_s"][win]
    has_tot = ~np.isnan(tot) & (tot != 0)
    # totals scaled by st / sum: throughput and phase shares over any span of windows stay
    # the exact sums' ratios
    sc = st / np.where(has_tot, tot, 1.0)
    sc[~has_tot] = np.nan
    rank = _number(r.get("rank"))
    cols = {"t": r["t"][win], "step_time_s": st,
            **{c: r[k][win] * sc for c, k in (("samples", "samples"), ("tokens", "tokens"),
                                               *((p + "_s", p) for p in _PHASES))}}
    return StepTable([node], np.zeros(st.shape[0], dtype=np.int32),
                     np.full(st.shape[0], np.nan if rank is None else float(rank)), cols)


def to_job_data(job_id: str, parts: Mapping[str, Mapping[str, Any]], nodes: list[str] | None = None) -> JobData:
    """A :class:`~gpuguard.epilog.jobdata.JobData` for the judge from every node's decoded
    part (:func:`decode_part`; module docstring: one GPU sample per GPU and window, up to
    five step records per rank and window). Its ``steps`` are a
    :class:`~gpuguard.epilog.steptable.StepTable` (columns, sorted by time; it reads as a
    sequence of :class:`StepRec`). ``nodes``: the job's node list (default: the parts' nodes)."""
    import numpy as np

    from gpuguard.epilog.jobdata import capacity_from_name
    from gpuguard.epilog.steptable import StepTable

    gpus: list[GpuSeries] = []
    tables = []
    host: dict[str, tuple[list[float], list[float | None]]] = {}
    ckpt: list[float] = []
    hw_events: list[dict[str, Any]] = []
    hw_findings: list[dict[str, Any]] = []
    caps: dict[str, float] = {}
    names: dict[str, str] = {}
    rank_windows = sum(r["t"].shape[0] for p in parts.values() for r in p.get("ranks") or [])
    per_window = max(1, min(len(QUANTILES), MAX_STEP_RECORDS // max(1, rank_windows)))
    for node in sorted(parts):
        p = parts[node]
        for g in p.get("gpus") or []:
            s = _gpu_series(node, g)
            gpus.append(s)
            cap = _number(g.get("mem_total_mib")) or capacity_from_name(g.get("name"))
            if cap:
                caps[s.key] = cap
            if isinstance(g.get("name"), str) and g["name"].strip():
                names[s.key] = g["name"]
        tables += [_rank_steps(node, r, per_window) for r in p.get("ranks") or []]
        h = p.get("host") or {}
        if h.get("t") is not None and h["t"].shape[0]:
            keep = ~np.isnan(h["t"])
            host[node] = (h["t"][keep].tolist(), _values(h["rss"][keep]))
        ckpt += [x for x in (_number(v) for v in p.get("checkpoints_s") or []) if x is not None]
        hw_events += [e for e in p.get("hw_events") or [] if isinstance(e, dict)]
        hw_findings += [f for f in p.get("hw_findings") or [] if isinstance(f, dict)]
    steps = StepTable.concat(tables).sorted_by_t()
    gpus.sort(key=lambda g: (g.node, g.gpu_index))
    times = [g.t[0] for g in gpus if g.t] + [g.t[-1] for g in gpus if g.t]
    if len(steps):
        first = steps[0]
        times += [first.t - (first.step_time_s or 0.0), steps[-1].t]
    seen = sorted(set(parts))
    return JobData(str(job_id), list(nodes) if nodes else seen, min(times) if times else None,
                   max(times) if times else None, gpus, steps, steps.t, host, ckpt,  # type: ignore[arg-type]
                   sorted(hw_events, key=lambda e: e.get("at") or 0),
                   sorted(hw_findings, key=lambda f: f.get("at") or 0), caps, gpu_names=names)
