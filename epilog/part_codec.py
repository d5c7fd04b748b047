"""The spool part's file format: encode, decode, versions.

**Version 2** (``{node}.part.npz``, written by this gpuguard): a numpy ``.npz`` archive
(a zip of ``.npy`` arrays, deflate-compressed; ``numpy.load(path)`` reads it). Members:

* ``meta``: ``uint8``, UTF-8 JSON of everything that is not a series: ``format``
  (``"gpuguard-part"``), ``v`` (2), ``job_id``, ``node``, ``written_at``, ``window_s``,
  ``job``, ``summary``, ``checkpoints_s``, ``hw_events``, ``hw_findings``, and per GPU
  (``gpus``: ``index``, ``uuid``, ``name``, ``mem_total_mib``, ``n``), per rank
  (``ranks``: ``rank``, ``n``) and for the host (``host``: ``n``) the number of windows;
* the series, each GPU's (rank's) windows one after the other in ``meta``'s order:
  ``gpu_t``, ``gpu_mem``, ``gpu_ecc`` (``float64``), ``gpu_mask`` (``int64``) and one
  ``float64`` column per compared GPU series of the metric table (:func:`gpu_cols`:
  ``gpu_util``, ``gpu_mem_util``, ``gpu_power``, ``gpu_temp``, ``gpu_clock``); ``rank_t``, ``rank_n``,
  ``rank_p50``, ``rank_p95``, ``rank_sum_s``, ``rank_samples``, ``rank_tokens``,
  ``rank_data_wait``, ``rank_fwd_bwd``, ``rank_comm``, ``rank_optim`` (``float64``) and
  ``rank_q`` (``float64``, one row of :data:`Q_WIDTH` quantiles per window); ``host_t``,
  ``host_rss`` (``float64``). NaN is "no value".

Values are the same ``float64`` numbers version 1 carried as JSON text, so both versions
give the judge identical series. Reading one costs a decompression and a ``frombuffer``
per member, where version 1 cost a JSON parse into millions of Python objects (a 64-node
day-long job: seconds). Read with::

    python -c "import json,numpy,sys; z=numpy.load(sys.argv[1]); print(json.dumps(json.loads(bytes(z['meta'])), indent=1)); print({k: z[k].shape for k in z.files})" FILE

**Version 1** (``{node}.part.json.gz``, gzip JSON, the previous release) is still read,
into the same arrays: during a rolling upgrade nodes not yet upgraded keep writing it,
and refusing it would judge every job of those days with nodes missing. It is to be
dropped with the next format change. Any other version is refused (:class:`SpoolError`,
logged once per file by the reader): an older controller skips a newer node's part, so
the controller (and the host running ``gpuguard cluster ingest``) is upgraded first.

**Bounds.** The encoded part is at most ``max_bytes`` (the caller's: 1 MB); decoding
refuses more than :data:`MAX_RAW_BYTES` of decompressed data, more than
:data:`MAX_MEMBERS` members, and any member whose declared shape and type do not match
what is expected, before allocating it.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import re
import zipfile
import zlib
from collections.abc import Mapping
from typing import Any

from gpuguard.epilog.spool import SpoolError
from gpuguard.inputs import json_loads

FORMAT = "gpuguard-part"
VERSION = 2
SUFFIX = ".part.npz"
#: The previous release's file name and version (read, never written).
V1_SUFFIX, V1 = ".part.json.gz", 1
#: Decompressed size cap when reading (a 24 h part is about 3 MB; a zip bomb is not ours).
MAX_RAW_BYTES = 64 * 1024 * 1024
MAX_MEMBERS = 64
#: Step-time quantiles kept per rank and window (:data:`gpuguard.epilog.part.QUANTILES`).
Q_WIDTH = 5

#: GPU columns every part has; besides them, one ``gpu_<attr>`` column per compared GPU
#: series of the metric table (:data:`gpuguard.epilog.jobdata.SERIES_ATTR`: ``util``,
#: ``mem_util``, ``power``, ``temp``, ``clock``...). A series a part lacks reads as no
#: values, one the reader's table does not know is carried and not read: nodes and
#: controller may run metric tables of different releases.
GPU_CORE = ("t", "mem", "ecc", "mask")
RANK_COLS = ("t", "n", "p50", "p95", "sum_s", "samples", "tokens", "data_wait", "fwd_bwd", "comm", "optim", "q")
HOST_COLS = ("t", "rss")
_MEMBER = re.compile(r"^(meta|(gpu|rank|host)_[a-z][a-z0-9_]{0,39})$")


def gpu_cols(extra: Any = ()) -> tuple[str, ...]:
    """The GPU columns: :data:`GPU_CORE`, the metric table's series, then ``extra``."""
    from gpuguard.epilog.jobdata import SERIES_ATTR

    cols = (*GPU_CORE, *SERIES_ATTR.values())
    return (*cols, *(c for c in extra if c not in cols))


def _groups(gpu: tuple[str, ...]) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    return (("gpu", "gpus", gpu), ("rank", "ranks", RANK_COLS))


def _dtype(member: str) -> str:
    return {"meta": "u1", "gpu_mask": "i8"}.get(member, "f8")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


#: Element types a list converts by ``numpy.array`` alone to what :func:`_column` makes of it.
_INT = frozenset({int})
_NUM = frozenset({int, float, type(None)})


def _column(values: Any, n: int, kind: str) -> Any:
    """``values`` (a list of numbers/None, or an array) as an array of ``n`` rows of
    ``kind``: ``"f8"`` (non-numbers and non-finite values -> NaN), ``"i8"`` (non-integers
    -> 0: clock-event masks) or ``"q"`` (rows of :data:`Q_WIDTH`, NaN-padded)."""
    import numpy as np

    if kind == "q":
        out = np.full((n, Q_WIDTH), np.nan)
        if isinstance(values, np.ndarray) and values.ndim == 2:
            k, w = min(n, values.shape[0]), min(Q_WIDTH, values.shape[1])
            out[:k, :w] = values[:k, :w]
        elif isinstance(values, list):
            for i, row in enumerate(values[:n]):
                if isinstance(row, list):
                    vals = [float(x) if _number(x) else np.nan for x in row[:Q_WIDTH]]
                    out[i, : len(vals)] = vals
        out[~np.isfinite(out)] = np.nan
        return out
    dt = np.int64 if kind == "i8" else np.float64
    if isinstance(values, np.ndarray):
        a = values[:n].astype(dt)
    elif isinstance(values, list):
        types = set(map(type, values[:n]))
        if types <= (_INT if kind == "i8" else _NUM):  # the usual case, converted by numpy (None -> NaN)
            a = np.array(values[:n], dt)
        elif kind == "i8":
            a = np.array([int(x) if isinstance(x, int) and not isinstance(x, bool) else 0 for x in values[:n]], dt)
        else:
            a = np.array([float(x) if _number(x) else np.nan for x in values[:n]], dt)
    else:
        a = np.zeros(0, dt)
    if kind == "f8":
        a[~np.isfinite(a)] = np.nan
    if a.shape[0] < n:
        a = np.concatenate([a, np.full(n - a.shape[0], 0 if kind == "i8" else np.nan, dt)])
    return a


def _split(doc: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A part dict (series as lists or arrays) -> ``(meta, arrays)`` of version 2."""
    import numpy as np

    meta = {k: v for k, v in doc.items() if k not in ("gpus", "ranks", "host")}
    meta["format"], meta["v"] = FORMAT, VERSION
    arrays: dict[str, Any] = {}
    for prefix, key, cols in _groups(gpu_cols()):
        items = [x for x in doc.get(key) or [] if isinstance(x, Mapping)]
        ns = [len(x.get("t")) if isinstance(x.get("t"), (list, np.ndarray)) else 0 for x in items]
        meta[key] = [{**{k: v for k, v in x.items() if k not in cols}, "n": n} for x, n in zip(items, ns, strict=True)]
        for c in cols:
            kind = "q" if c == "q" else _dtype(f"{prefix}_{c}")
            parts = [_column(x.get(c), n, kind) for x, n in zip(items, ns, strict=True)]
            arrays[f"{prefix}_{c}"] = np.concatenate(parts) if parts else _column(None, 0, kind)
    host = doc.get("host") if isinstance(doc.get("host"), Mapping) else {}
    n = len(host.get("t")) if isinstance(host.get("t"), (list, np.ndarray)) else 0
    meta["host"] = {"n": n}
    for c in HOST_COLS:
        arrays[f"host_{c}"] = _column(host.get(c), n, "f8")
    return meta, arrays


def _assemble(meta: dict[str, Any], arrays: Mapping[str, Any]) -> dict[str, Any]:
    """``(meta, arrays)`` -> the decoded part: ``meta`` with each GPU's, rank's and the
    host's series put back as array views. Raises :class:`SpoolError` when the counts in
    ``meta`` do not match the arrays."""
    import numpy as np

    doc = dict(meta)
    for prefix, key, cols in _groups(gpu_cols(k[4:] for k in arrays if k.startswith("gpu_"))):
        items = meta.get(key)
        if not isinstance(items, list) or not all(isinstance(x, dict) and type(x.get("n")) is int
                                                  and x["n"] >= 0 for x in items):
            raise SpoolError(f"part {key} list is malformed")
        total = sum(x["n"] for x in items)
        cols_of: dict[str, Any] = {}
        for c in cols:
            a = arrays.get(f"{prefix}_{c}")
            if a is None and prefix == "gpu" and c not in GPU_CORE:  # a series this part lacks
                a = np.full(total, np.nan)
            if a is None:
                raise SpoolError(f"part member {prefix}_{c} is missing")
            if a.shape[0] != total or (c == "q") != (a.ndim == 2) or (a.ndim == 2 and a.shape[1] != Q_WIDTH):
                raise SpoolError(f"part member {prefix}_{c} has shape {a.shape}, not {total} rows")
            cols_of[c] = a
        out, at = [], 0
        for x in items:
            entry = {k: v for k, v in x.items() if k != "n"}
            for c, a in cols_of.items():
                entry[c] = a[at: at + x["n"]]
            out.append(entry)
            at += x["n"]
        doc[key] = out
    h = meta.get("host")
    n = h.get("n") if isinstance(h, dict) else None
    if type(n) is not int or any(arrays[f"host_{c}"].shape != (n,) for c in HOST_COLS):
        raise SpoolError("part host series are malformed")
    doc["host"] = {c: arrays[f"host_{c}"] for c in HOST_COLS}
    return doc


def encode(doc: Mapping[str, Any]) -> bytes:
    """Version 2 bytes of a part dict (:func:`gpuguard.epilog.part.build_part`'s, series
    as lists, or a decoded part's, series as arrays). Raises ``ValueError`` for a value
    JSON cannot carry."""
    import numpy as np

    meta, arrays = _split(doc)
    raw = json.dumps(meta, separators=(",", ":"), allow_nan=False, default=str).encode()
    buf = io.BytesIO()
    np.savez_compressed(buf, meta=np.frombuffer(raw, dtype=np.uint8), **arrays)
    return buf.getvalue()


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number gpuguard writes")


def _members(blob: bytes) -> dict[str, Any]:
    """The arrays of an ``.npz`` blob, each checked against its expected type and against
    the bounds (module docstring) before it is read."""
    import numpy as np
    from numpy.lib import format as npf

    zf = zipfile.ZipFile(io.BytesIO(blob))
    infos = zf.infolist()
    if len(infos) > MAX_MEMBERS or sum(i.file_size for i in infos) > MAX_RAW_BYTES:
        raise SpoolError(f"part has {len(infos)} members or decompresses to more than 64 MiB")
    out: dict[str, Any] = {}
    for info in infos:
        name = info.filename[:-4] if info.filename.endswith(".npy") else ""
        if not _MEMBER.match(name) or name in out:
            raise SpoolError(f"unexpected part member {info.filename!r}")
        # what numpy writes: deflate (or stored), unencrypted; other methods are not bounded
        # per read by zipfile, an encrypted member cannot be read at all
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED) or info.flag_bits & 0x1:
            raise SpoolError(f"member {name}: compression {info.compress_type} / flags {info.flag_bits:#x}")
        with zf.open(info) as fh:
            version = npf.read_magic(fh)
            if version not in ((1, 0), (2, 0)):
                raise SpoolError(f"member {name}: .npy version {version}")
            reader = npf.read_array_header_1_0 if version == (1, 0) else npf.read_array_header_2_0
            shape, fortran, dtype = reader(fh)
            want = _dtype(name)
            if dtype.hasobject or dtype.str[1:] != want or fortran or len(shape) not in (1, 2):
                raise SpoolError(f"member {name}: {dtype.str} {shape}, expected {want}")
            nbytes = math.prod(shape) * dtype.itemsize
            if nbytes > info.file_size:
                raise SpoolError(f"member {name}: shape {shape} larger than its data")
            data = fh.read(nbytes + 1)  # one more: reaching the end checks the CRC
        if len(data) != nbytes:
            raise SpoolError(f"member {name}: {len(data)} bytes of data, header says {nbytes}")
        a = np.frombuffer(data, dtype=dtype).reshape(shape)
        if want == "f8" and not np.isfinite(a).all():
            a = np.where(np.isfinite(a), a, np.nan)
        out[name] = a
    return out


def _decode_v2(blob: bytes) -> dict[str, Any]:
    try:
        arrays = _members(blob)
        meta = json.loads(bytes(arrays.pop("meta")), parse_constant=_no_constant) if "meta" in arrays else None
    except (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, OSError, EOFError, ValueError,
            NotImplementedError, KeyError, RuntimeError) as e:
        raise SpoolError(f"not a readable part archive: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise SpoolError("not a gpuguard part")
    if meta.get("v") != VERSION:
        raise SpoolError(f"part version {meta.get('v')!r} is not {VERSION} (or {V1})")
    odd = sorted(k for k in arrays if not k.startswith("gpu_")
                 and k not in {f"rank_{c}" for c in RANK_COLS} | {f"host_{c}" for c in HOST_COLS})
    if odd:
        raise SpoolError(f"part members unknown to version {VERSION}: {odd[:4]}")
    return _assemble(meta, arrays)


def _decode_v1(blob: bytes) -> dict[str, Any]:
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(blob)) as gz:
            raw = gz.read(MAX_RAW_BYTES + 1)
        if len(raw) > MAX_RAW_BYTES:
            raise SpoolError("part decompresses to more than 64 MiB")
        doc = json_loads(raw, parse_constant=_no_constant)
    except (OSError, EOFError, ValueError) as e:
        raise SpoolError(f"not a gzip JSON part: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise SpoolError("not a gpuguard part")
    if doc.get("v") != V1:
        raise SpoolError(f"part version {doc.get('v')!r} in gzip JSON is not {V1}")
    meta, arrays = _split(doc)
    meta["v"] = V1
    return _assemble(meta, arrays)


def decode(blob: bytes) -> dict[str, Any]:
    """The part in ``blob`` (version 2, or version 1 from a node not yet upgraded): its
    ``meta`` fields, with ``gpus``/``ranks``/``host`` series as numpy arrays (module
    docstring; ``v`` says which version it was). Raises :class:`SpoolError` for anything
    else."""
    if blob[:4] == b"PK\x03\x04":
        return _decode_v2(blob)
    if blob[:2] == b"\x1f\x8b":
        return _decode_v1(blob)
    raise SpoolError("not a gpuguard part (neither .npz nor gzip)")
