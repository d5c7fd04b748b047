"""Cluster mode: per-(job, node) summaries in a shared spool directory.

Node epilogs (root) write ``{spool_dir}/{job_id}/{node}.json``; the controller's
``gpuguard-epilog-slurmctld`` (SlurmUser) merges them into the job's AdminComment, and
``gpuguard ingest`` (root, periodic) merges them into the cluster store. This is the way
Slurm's own HDF5 profiling shares per-node data: a shared filesystem, no daemon of ours.

Files are written atomically (temp file + rename) with mode 0644 in directories 0755 so
SlurmUser can read them; a site that wants them private sets the spool directory's group
to SlurmUser's and mode 0750.
"""

from __future__ import annotations

import base64
import json
import os
import re
import stat
import tempfile
import time
import zlib
from typing import Any

_SAFE = re.compile(r"^[A-Za-z0-9._+-]{1,128}$")

#: A node summary is a few KiB; anything far larger in the spool is not one of ours.
MAX_SUMMARY_BYTES = 4 * 1024 * 1024

#: slurmdbd stores AdminComment in a TEXT column: 65,535 bytes (SLURM-FACTS §6c).
ADMIN_COMMENT_MAX = 65535
PREFIX = "gpuguard:v1:"
PREFIX_Z = "gpuguard:v1z:"


class SpoolError(Exception):
    """A spool path or file that cannot be used; one line."""


def check_name(kind: str, value: str) -> str:
    """``value`` when it is safe as one path component (``[A-Za-z0-9._+-]{1,128}``, not
    ``.``/``..``); raises :class:`SpoolError` otherwise."""
    if not _SAFE.match(value) or value in (".", ".."):
        raise SpoolError(f"unsafe {kind} for a spool path: {value!r}")
    return value


def write_node_summary(spool_dir: str, job_id: str, node: str, summary: dict[str, Any]) -> str:
    """Write ``summary`` (JSON-ready) as ``{spool_dir}/{job_id}/{node}.json``; returns the
    path. Raises :class:`SpoolError` for unsafe names and ``OSError`` for I/O errors."""
    d = os.path.join(spool_dir, check_name("job id", str(job_id)))
    os.makedirs(d, mode=0o755, exist_ok=True)
    name = check_name("node name", node) + ".json"
    fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{name}.")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(summary, fh, separators=(",", ":"), default=str)
        os.chmod(tmp, 0o644)
        os.replace(tmp, os.path.join(d, name))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass  # already gone: nothing to clean up
        raise
    return os.path.join(d, name)


def read_job(spool_dir: str, job_id: str) -> dict[str, dict[str, Any]]:
    """``node -> summary`` for every node file of the job present now. Unreadable or
    malformed files are skipped (their node is simply missing)."""
    d = os.path.join(spool_dir, check_name("job id", str(job_id)))
    out: dict[str, dict[str, Any]] = {}
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return out
    for n in sorted(names):
        if not n.endswith(".json") or n.startswith("."):
            continue
        try:
            fd = os.open(os.path.join(d, n), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SUMMARY_BYTES:
                continue  # a FIFO would block the controller's hook; a huge file is not ours
            with os.fdopen(fd) as fh:
                fd = -1
                doc = json.load(fh)
        except (OSError, ValueError):
            continue
        finally:
            if fd >= 0:
                os.close(fd)
        if isinstance(doc, dict):
            out[n[:-5]] = doc
    return out


def wait_for_nodes(spool_dir: str, job_id: str, nodes: list[str], timeout_s: float,
                   poll_s: float = 0.5) -> dict[str, dict[str, Any]]:
    """Poll until every node in ``nodes`` has written its summary or ``timeout_s`` passes
    (EpilogSlurmctld starts together with, or before, the node epilogs: SLURM-FACTS §3).
    Returns what is there."""
    deadline = time.monotonic() + timeout_s
    while True:
        have = read_job(spool_dir, job_id)
        if all(n in have for n in nodes) or time.monotonic() >= deadline:
            return have
        time.sleep(poll_s)


def encode_admin_comment(job_id: str, nodes: dict[str, dict[str, Any]], missing: list[str]) -> str:
    """The AdminComment text: ``gpuguard:v1z:`` + unpadded lower-case base32 of the
    zlib-compressed JSON (the jobstats ``JS1:`` idea). What survives ``sacctmgr modify job``
    in Slurm 22.05 decides the encoding (seen on the testbed): plain JSON cannot be stored,
    every ``"`` becomes a backtick; base64 cannot either, the value is lower-cased. Base32
    is case-insensitive and needs no ``=`` padding. If the result exceeds
    :data:`ADMIN_COMMENT_MAX` bytes, per-GPU details are dropped; decode with
    :func:`decode_admin_comment` or ``gpuguard job show``."""
    doc = {"job": str(job_id), "nodes": nodes, "missing_nodes": missing}
    for trimmed in (doc, _trim(doc)):
        raw = json.dumps(trimmed, separators=(",", ":"), sort_keys=True, default=str).encode()
        z = PREFIX_Z + base64.b32encode(zlib.compress(raw, 9)).decode().rstrip("=").lower()
        if len(z) <= ADMIN_COMMENT_MAX:
            return z
    return PREFIX + json.dumps({"job": str(job_id), "error": "summary too large", "nodes": sorted(nodes)})


def decode_admin_comment(text: str) -> dict[str, Any] | None:
    """Inverse of :func:`encode_admin_comment`; None when ``text`` is not ours."""
    try:
        if text.startswith(PREFIX_Z):
            body = text[len(PREFIX_Z):].strip().upper()
            body += "=" * (-len(body) % 8)
            return json.loads(zlib.decompress(base64.b32decode(body)))
        if text.startswith(PREFIX):
            return json.loads(text[len(PREFIX):])
    except (ValueError, zlib.error, base64.binascii.Error):
        return None
    return None


def _trim(doc: dict[str, Any]) -> dict[str, Any]:
    nodes = {n: {k: v for k, v in s.items() if k not in ("per_gpu", "gpus")} for n, s in doc["nodes"].items()}
    return dict(doc, nodes=nodes, trimmed=True)
