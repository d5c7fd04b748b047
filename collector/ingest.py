"""Read a job's training records (:mod:`gpuguard.collector.train`) for the epilog.

The epilog runs as root and the files were written by the job's user, who may have put
anything there: symlinks to ``/etc/shadow``, FIFOs that block a reader forever, device
nodes, files of other users, gigabyte lines, non-JSON. So :func:`read_job_records`

* opens the directory with ``O_NOFOLLOW|O_DIRECTORY`` and checks with ``fstat`` that it is
  a directory owned by ``expected_uid``;
* considers only names ``train.rank<N>.jsonl`` (at most ``max_files``, by rank);
* ``lstat``s each name relative to the directory fd and skips anything but a regular file
  without opening it, then opens it with ``O_RDONLY|O_NOFOLLOW|O_NONBLOCK`` (a FIFO or
  device swapped in between neither blocks nor is followed) and checks again with
  ``fstat``: regular file, owned by ``expected_uid``;
* reads at most ``max_file_bytes`` per file and ``max_total_bytes`` in all (``truncated``
  is then set), and counts a line longer than ``max_line_bytes`` as malformed without
  holding it in memory;
* validates each line against schema version 1 (see :mod:`gpuguard.collector.train`);
  a line that fails is counted in ``malformed`` and skipped. Required keys: ``v`` (== 1),
  ``kind`` (``step``/``checkpoint``), ``rank`` (int >= 0), ``t`` (finite number), and for a
  step ``step`` (int >= 0) and ``step_time_s`` (finite >= 0); for a checkpoint
  ``duration_s`` (finite >= 0). Optional keys default to the writer's null values;
  unknown keys are dropped. Booleans are not accepted as numbers.

A NaN/inf loss (``NaN``/``Infinity`` literals, which Python's JSON reader accepts) or
``loss_nonfinite: true`` becomes ``loss: None, loss_nonfinite: True`` and is counted in
``nonfinite_loss``. Records come back normalised to exactly the schema's keys, steps and
checkpoints each in file order, files in rank order.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Any

MIB = 1024 * 1024
_NAME_RE = re.compile(r"^train\.rank(\d{1,9})\.jsonl$")
_PHASE_KEYS = ("data_wait_s", "fwd_bwd_s", "comm_s", "optim_s")
_CHUNK = 1024 * 1024


@dataclass
class IngestResult:
    """What :func:`read_job_records` found.

    ``steps`` / ``checkpoints``: normalised records (dicts with the schema's keys).
    ``malformed``: lines skipped (bad JSON, wrong types, unknown kind, ``v != 1``, too long).
    ``rejected_files``: ``(path, reason)`` for the directory or files not read at all.
    ``nonfinite_loss``: steps with a NaN/inf loss. ``truncated``: a size or file-count cap
    cut the input short.
    """

    steps: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    malformed: int = 0
    rejected_files: list[tuple[str, str]] = field(default_factory=list)
    nonfinite_loss: int = 0
    truncated: bool = False


class _Bad(Exception):
    pass


def _num(d: dict[str, Any], key: str, *, required: bool = True, minimum: float | None = None,
         allow_nonfinite: bool = False) -> float | None:
    if key not in d or d[key] is None:
        if required:
            raise _Bad(key)
        return None
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _Bad(key)
    f = float(v)
    if not math.isfinite(f):
        if allow_nonfinite:
            return f
        raise _Bad(key)
    if minimum is not None and f < minimum:
        raise _Bad(key)
    return f


def _int(d: dict[str, Any], key: str, *, required: bool = True) -> int | None:
    if key not in d or d[key] is None:
        if required:
            raise _Bad(key)
        return None
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise _Bad(key)
    return v


def validate_record(obj: Any) -> dict[str, Any]:
    """Normalise one parsed line to a schema-v1 record. Raises ``ValueError``."""
    try:
        if not isinstance(obj, dict) or obj.get("v") != 1 or isinstance(obj.get("v"), bool):
            raise _Bad("v")
        kind = obj.get("kind")
        rank = _int(obj, "rank")
        t = _num(obj, "t")
        if kind == "step":
            loss = _num(obj, "loss", required=False, allow_nonfinite=True)
            flag = obj.get("loss_nonfinite", False)
            if not isinstance(flag, bool):
                raise _Bad("loss_nonfinite")
            if loss is not None and not math.isfinite(loss):
                loss, flag = None, True
            if flag:
                loss = None
            gn = _num(obj, "grad_norm", required=False, allow_nonfinite=True)
            phases_in = obj.get("phases", {})
            if phases_in is None:
                phases_in = {}
            if not isinstance(phases_in, dict):
                raise _Bad("phases")
            phases = {}
            for k in _PHASE_KEYS:
                v = _num(phases_in, k, required=False, minimum=0.0)
                if v is not None:
                    phases[k] = v
            return {
                "v": 1, "kind": "step", "rank": rank, "t": t, "step": _int(obj, "step"),
                "step_time_s": _num(obj, "step_time_s", minimum=0.0),
                "samples": _int(obj, "samples", required=False), "tokens": _int(obj, "tokens", required=False),
                "loss": loss, "loss_nonfinite": flag,
                "grad_norm": gn if gn is not None and math.isfinite(gn) else None,
                "phases": phases,
            }
        if kind == "checkpoint":
            return {"v": 1, "kind": "checkpoint", "rank": rank, "t": t, "step": _int(obj, "step", required=False),
                    "duration_s": _num(obj, "duration_s", minimum=0.0)}
        raise _Bad("kind")
    except _Bad as e:
        raise ValueError(f"bad or missing {e}") from None


def _reject(res: IngestResult, path: str, reason: str) -> None:
    res.rejected_files.append((path, reason))


def read_job_records(job_dir: str, expected_uid: int, *, max_file_bytes: int = 256 * MIB,
                     max_line_bytes: int = 64 * 1024, max_files: int = 4096,
                     max_total_bytes: int = 1024 * MIB) -> IngestResult:
    """Read every ``train.rank<N>.jsonl`` in ``job_dir`` (see the module docstring).

    A missing directory gives an empty result (the job did not use the API). A directory
    that is a symlink, not a directory, or owned by another uid is listed in
    ``rejected_files`` and nothing is read. Never raises ``OSError``; never follows a
    symlink; never opens a FIFO or device node for reading.
    """
    res = IngestResult()
    try:
        dfd = os.open(job_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return res
    except OSError as e:
        reason = e.strerror or str(e)
        if e.errno in (errno.ELOOP, errno.ENOTDIR):  # O_DIRECTORY|O_NOFOLLOW on a symlink: ENOTDIR
            try:
                reason = "symlink" if stat.S_ISLNK(os.lstat(job_dir).st_mode) else "not a directory"
            except OSError:
                reason = "not a directory"
        _reject(res, job_dir, reason)
        return res
    try:
        st = os.fstat(dfd)
        if not stat.S_ISDIR(st.st_mode):
            _reject(res, job_dir, "not a directory")
            return res
        if st.st_uid != expected_uid:
            _reject(res, job_dir, f"owned by uid {st.st_uid}, expected {expected_uid}")
            return res
        try:
            names = os.listdir(dfd)
        except OSError as e:
            _reject(res, job_dir, e.strerror or str(e))
            return res
        ranked = sorted((int(m.group(1)), n) for n in names if (m := _NAME_RE.match(n)))
        if len(ranked) > max_files:
            res.truncated = True
            ranked = ranked[:max_files]
        budget = max_total_bytes
        for _rank, name in ranked:
            if budget <= 0:
                res.truncated = True
                break
            budget -= _read_file(res, dfd, job_dir, name, expected_uid, min(max_file_bytes, budget),
                                 max_line_bytes)
    finally:
        os.close(dfd)
    return res


def _read_file(res: IngestResult, dfd: int, job_dir: str, name: str, uid: int, max_bytes: int,
               max_line: int) -> int:
    """Read one file into ``res``; returns the bytes read."""
    path = os.path.join(job_dir, name)
    try:
        lst = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError as e:
        _reject(res, path, e.strerror or str(e))
        return 0
    if stat.S_ISLNK(lst.st_mode):
        _reject(res, path, "symlink")
        return 0
    if not stat.S_ISREG(lst.st_mode):
        _reject(res, path, "not a regular file")
        return 0
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OSError as e:
        _reject(res, path, "symlink" if e.errno == errno.ELOOP else (e.strerror or str(e)))
        return 0
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            _reject(res, path, "not a regular file")
            return 0
        if st.st_uid != uid:
            _reject(res, path, f"owned by uid {st.st_uid}, expected {uid}")
            return 0
        return _parse_stream(res, fd, max_bytes, max_line)
    except OSError as e:
        _reject(res, path, e.strerror or str(e))
        return 0
    finally:
        os.close(fd)


def _parse_stream(res: IngestResult, fd: int, max_bytes: int, max_line: int) -> int:
    total = 0
    carry = b""
    skipping = False  # inside an over-long line: drop bytes up to its newline
    while total < max_bytes:
        chunk = os.read(fd, min(_CHUNK, max_bytes - total))
        if not chunk:
            break
        total += len(chunk)
        lines = chunk.split(b"\n")
        lines[0] = carry + lines[0]
        carry = lines.pop()
        for line in lines:
            if skipping:
                skipping = False  # this piece ends the long line, already counted
                continue
            _parse_line(res, line, max_line)
        if len(carry) > max_line:
            if not skipping:
                res.malformed += 1
            skipping = True
            carry = b""
    else:
        if os.read(fd, 1):
            res.truncated = True
            carry = b""  # cut by our cap, not by the writer: not the writer's error
    if carry and not skipping:
        _parse_line(res, carry, max_line)  # a last line without newline (job killed mid-write)
    return total


def _parse_line(res: IngestResult, line: bytes, max_line: int) -> None:
    if not line.strip():
        return
    if len(line) > max_line:
        res.malformed += 1
        return
    try:
        rec = validate_record(json.loads(line))
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        res.malformed += 1
        return
    if rec["kind"] == "step":
        res.steps.append(rec)
        if rec["loss_nonfinite"]:
            res.nonfinite_loss += 1
    else:
        res.checkpoints.append(rec)
