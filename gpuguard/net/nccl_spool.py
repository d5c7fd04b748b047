"""NCCL probes carried from each node's store to the cluster store, through the spool.

The fleet median of a GPU model (:func:`gpuguard.net.nccl_baseline.fleet_reference`) needs
the probes of many nodes in one store. With one store per node, each node's probes stay
in its own file; so after recording a probe, a node also leaves it in the shared spool
(``[paths] spool_dir``), one small JSON file per probe::

    {spool_dir}/nccl/{node}.{at_us}.{config_key}.json

and ``gpuguard cluster ingest`` (SlurmUser, on the controller) copies each file into the
cluster store's ``nccl_probes``/``nccl_busbw`` and removes it (:func:`ingest_probes`).
A file is written atomically (temp file + fsync + rename, as the job parts of
:mod:`gpuguard.epilog.part`; written here because the core does not import a stage) and
is separate from the job parts: probes run in the Prolog and in ``gpuguard health``
whether or not a job follows.

Carrying is idempotent: a probe already in the cluster store (same node, time and probe
configuration) is not inserted twice, so a crash between the insert and the removal
only leaves a file the next pass removes. A file that is not a probe of this format is
renamed ``NAME.bad.EPOCH`` (kept for a look, never read again) and reported, one line each.
On a single host (the cluster store is the node store) nothing is spooled.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

from gpuguard.inputs import json_loads
from gpuguard.ops.files import atomic_write

#: The spool's sub-directory of probe files (not a job id, so the job ingest skips it).
SUBDIR = "nccl"
FORMAT, VERSION = "gpuguard-nccl-probe", 1
SUFFIX = ".json"
#: Largest probe file read: a probe has one row per message size (nccl-tests prints a
#: few dozen); 64 KiB is far above any real one (our choice).
MAX_FILE_BYTES = 64 * 1024
#: Most message sizes taken from one file (nccl-tests' -b 8 -e 16G -f 2 gives 32).
MAX_SIZES = 256
#: Probe states a node records (:mod:`gpuguard.net.schema`).
STATES = frozenset({"ok", "low", "low_unconfirmed", "errors", "failed"})
_PROBE_TEXT = ("node", "hook", "job_id", "gpu_model", "config_key", "state", "detail")
_PROBE_NUM = ("at", "duration_s", "ratio")


def spool_probe(cfg: Any, row: dict[str, Any], reading: dict[int, float], algbw: dict[int, float]) -> str | None:
    """Leave one recorded probe (``row`` as inserted into ``nccl_probes``, ``reading``
    ``size_b -> busbw_gbs``, ``algbw`` likewise) in the spool for the cluster store.
    Returns the file's path; None when there is nothing to carry it to (no
    ``[paths] spool_dir``, or the cluster store is the node store). Raises ``OSError``,
    and ``ValueError`` for a node name or probe key unsafe in a file name."""
    spool = cfg.get("paths", "spool_dir")
    if not spool or cfg.cluster_store_path == cfg.store_path:
        return None
    node, key = str(row["node"]), str(row["config_key"])
    if not _SAFE.match(node) or not _SAFE.match(key):
        raise ValueError(f"unsafe node name or probe key for a spool path: {node!r}, {key!r}")
    doc = {"format": FORMAT, "v": VERSION, "probe": {k: row.get(k) for k in (*_PROBE_TEXT, *_PROBE_NUM, "gpus")},
           "busbw": [[int(s), float(b), algbw.get(s)] for s, b in sorted(reading.items())]}
    d = _probe_dir(spool)
    final = os.path.join(d, f"{node}.{int(row['at'] * 1e6)}.{key}{SUFFIX}")
    # temp file + fsync + rename: the ingest never reads half a file (names not ending
    # in .json are not read)
    atomic_write(final, json.dumps(doc, separators=(",", ":")), 0o644, fsync=True)
    return final


#: A node name or probe key that is safe as part of one file name (as the spool's job parts).
_SAFE = re.compile(r"^[A-Za-z0-9_+-][A-Za-z0-9._+-]{0,127}$")


def _probe_dir(spool: str) -> str:
    """``{spool}/nccl``, made mode 0755 and, when we are root, owned like the spool
    (SlurmUser must be able to remove what it carried)."""
    from gpuguard.epilog.spool import SpoolError, check_job_dir

    d = os.path.join(spool, SUBDIR)
    if not os.path.lexists(d):
        os.makedirs(d, mode=0o755, exist_ok=True)
        st = os.stat(spool)
        if os.geteuid() == 0 and st.st_uid != 0:
            try:
                os.chown(d, st.st_uid, st.st_gid, follow_symlinks=False)
            except OSError:
                pass  # the ingest then cannot remove files; it still never inserts one twice
    try:
        check_job_dir(spool, d)  # never a symlink planted in the spool: root writes here
    except SpoolError as e:
        raise OSError(str(e)) from None
    return d


class ProbeFileError(ValueError):
    """A spooled probe file that is not a probe of this format; one line."""


def _num(v: Any, what: str, *, optional: bool = False) -> float | None:
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ProbeFileError(f"{what} {v!r} is not a finite number")
    return float(v)


def parse_probe_file(blob: bytes) -> tuple[dict[str, Any], list[tuple[int, float, float | None]]]:
    """A spooled probe -> ``(nccl_probes row, [(size_b, busbw_gbs, algbw_gbs)])``.
    Raises :class:`ProbeFileError` naming what is wrong."""
    try:
        doc = json_loads(blob)
    except ValueError as e:
        raise ProbeFileError(f"not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ProbeFileError(f"not a {FORMAT} file")
    if doc.get("v") != VERSION:
        raise ProbeFileError(f"version {doc.get('v')!r}, this code reads {VERSION}")
    p, sizes = doc.get("probe"), doc.get("busbw")
    if not isinstance(p, dict) or not isinstance(sizes, list) or len(sizes) > MAX_SIZES:
        raise ProbeFileError(f"no probe object or busbw list (at most {MAX_SIZES} sizes)")
    row: dict[str, Any] = {}
    for k in _PROBE_TEXT:
        v = p.get(k)
        if v is not None and not isinstance(v, str):
            raise ProbeFileError(f"probe {k} {v!r} is not text")
        row[k] = v
    if not row["node"] or not row["config_key"] or row["state"] not in STATES:
        raise ProbeFileError(f"probe needs a node, a config_key and a state in {sorted(STATES)}")
    row["at"] = _num(p.get("at"), "probe at")
    row["duration_s"] = _num(p.get("duration_s"), "probe duration_s", optional=True)
    row["ratio"] = _num(p.get("ratio"), "probe ratio", optional=True)
    gpus = p.get("gpus")
    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or not 0 <= gpus <= 1_000_000):
        raise ProbeFileError(f"probe gpus {gpus!r} is not a GPU count")
    row["gpus"] = gpus
    out = []
    for item in sizes:
        if not isinstance(item, list) or len(item) != 3 or isinstance(item[0], bool) or not isinstance(item[0], int) \
                or not 0 < item[0] < 1 << 62:
            raise ProbeFileError(f"busbw entry {item!r} is not [size_b, busbw_gbs, algbw_gbs]")
        busbw = _num(item[1], "busbw_gbs")
        if busbw < 0:
            raise ProbeFileError(f"busbw_gbs {busbw!r} is negative")
        out.append((item[0], busbw, _num(item[2], "algbw_gbs", optional=True)))
    return row, out


@dataclass
class CarryResult:
    """What one pass of :func:`ingest_probes` did: probes inserted, probes the store
    already held (file removed), and one line per file that could not be carried."""

    carried: int = 0
    known: int = 0
    errors: list[str] = field(default_factory=list)


def ingest_probes(store: Any, spool_dir: str, *, log: Any = None, max_files: int = 0) -> CarryResult:
    """Copy every spooled probe into ``store`` (the cluster store) and remove its file;
    see the module docstring. ``max_files`` > 0 bounds the files read in one pass.
    Raises :class:`gpuguard.store.StoreError` when the store cannot be written (the
    files stay for the next pass)."""
    from gpuguard.inputs import InputError, read_input
    from gpuguard.net.schema import ensure

    res = CarryResult()
    d = os.path.join(spool_dir, SUBDIR)
    try:
        names = sorted(n for n in os.listdir(d) if n.endswith(SUFFIX) and not n.startswith("."))
    except FileNotFoundError:
        return res
    except OSError as e:
        res.errors.append(f"spool {d}: {e.strerror or e}")
        return res
    if max_files:
        names = names[:max_files]
    if names:
        ensure(store)
    for name in names:
        path = os.path.join(d, name)
        try:
            if os.path.islink(path):
                raise ProbeFileError("a symbolic link")
            row, sizes = parse_probe_file(read_input(path, MAX_FILE_BYTES))
        except (ProbeFileError, InputError) as e:
            res.errors.append(f"{path}: {e}")
            if log is not None:
                log.error("tool error: nccl probe file %s: %s", path, e)
            _set_aside(path, log)
            continue
        if _insert(store, row, sizes):
            res.carried += 1
        else:
            res.known += 1
        try:
            os.unlink(path)
        except OSError as e:
            if log is not None:
                log.warning("spool: cannot remove %s: %s", path, e)
    return res


def _insert(store: Any, row: dict[str, Any], sizes: list[tuple[int, float, float | None]]) -> bool:
    """Insert one probe and its sizes in one transaction unless the store holds it
    already (same node, time and configuration); returns whether it was inserted."""
    def go() -> bool:
        with store.tx():
            if store.db.conn.execute("SELECT 1 FROM nccl_probes WHERE node = ? AND config_key = ? AND at = ?",
                                     [row["node"], row["config_key"], row["at"]]).fetchone():
                return False
            pid = store.db["nccl_probes"].insert(row).last_rowid
            store.db["nccl_busbw"].insert_all(
                [{"probe_id": pid, "node": row["node"], "at": row["at"], "size_b": s, "busbw_gbs": b, "algbw_gbs": a}
                 for s, b, a in sizes])
            return True
    return store._guard("carry nccl probe", go)


def _set_aside(path: str, log: Any) -> None:
    """Rename a bad probe file ``*.bad`` (out of the next pass, kept for a look)."""
    try:
        os.replace(path, f"{path}.bad.{int(time.time())}")
    except OSError as e:
        if log is not None:
            log.warning("spool: cannot set aside %s: %s", path, e)
