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
* reads at most ``max_file_bytes`` per file and ``max_total_bytes`` in all, and parses at
  most ``max_records`` non-blank lines in all (records kept plus malformed lines: a junk
  line costs more than a good one); a cap that cuts the input short sets ``truncated``,
  which the epilog logs and the job summary carries as ``records_truncated``. A line
  longer than ``max_line_bytes`` is counted as malformed without being held in memory.

  The defaults (:data:`MAX_RECORDS` 100,000 lines, :data:`MAX_TOTAL_BYTES` =
  :data:`MAX_FILE_BYTES` = 32 MiB) keep ingest + store write + summary + verdict well
  inside the Epilog's default 20 s budget on a 2-core node, next to the collector stop
  (at most 5 s) and the post-job checks (at most 40 % of the budget). Measured on a
  2-core node, whole ``epilog.hook.run`` with 8 ranks of real-looking step records
  (~250 bytes each; the cost is ~33 µs per record, about linear): 8 MiB 1.1 s,
  16 MiB 2.4 s, 32 MiB 6.1 s, 65 MiB 9.3 s, 117 MiB 17.2 s (peak RSS 1.06 GiB; with
  the collector stop and the checks added, over the 20 s budget). Minimal records (~80 bytes):
  8 MiB 3.3 s, 17 MiB 6.6 s. With these defaults: 117 MiB of real-looking records
  -> 100,000 kept, 3.9-4.1 s, 242 MiB RSS; 123 MiB of minimal records -> 3.1-3.3 s;
  32 MiB of one-byte junk lines -> 0.3 s for ingest (56 s without the line cap); 32 MiB of blank lines
  -> 1.9 s. 100,000 records is about 3.5 hours of 8 ranks logging a step a second; a
  job that writes more keeps its first records, in rank order;
* validates each line against schema version 1 (see :mod:`gpuguard.collector.train`);
  a line that fails is counted in ``malformed`` and skipped. Required keys: ``v`` (== 1),
  ``kind`` (``step``/``checkpoint``), ``rank`` (int >= 0), ``t`` (finite number), and for a
  step ``step`` (int >= 0) and ``step_time_s``; for a checkpoint ``duration_s``
  (durations, phases included: finite, 0 .. :data:`MAX_DURATION_S`; ``samples`` and
  ``tokens``: 0 .. :data:`MAX_COUNT`). Optional keys
  default to the writer's null values;
  unknown keys are dropped. Booleans are not accepted as numbers.

  Range rules (valid JSON is not enough: the values go into SQLite and into the
  verdict's arithmetic): every integer (``rank``, ``step``, ``samples``, ``tokens``) must
  fit SQLite's signed 64-bit INTEGER, i.e. be at most :data:`INT_MAX` (``2**63 - 1``);
  a number too large for a float (``1e400`` written as an integer) fails; and ``t`` must
  lie in ``[T_MIN, now + T_FUTURE_S]``: not before 2000-01-01T00:00:00Z
  (:data:`T_MIN` = 946684800) and not more than a day (:data:`T_FUTURE_S`) ahead of the
  epilog's clock, which allows for clock skew between nodes but not for ``t = 1.0``,
  ``1e12`` or ``1e300``, values that stretch a job's time axis over centuries. Each such
  line is one ``malformed`` line; the rest of the job's records are kept.

During the job the collector reads the same files incrementally and the Epilog only the
tail (:mod:`gpuguard.collector.ingest_tail`); the caps above then apply per call.

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
import time
from dataclasses import dataclass, field
from typing import Any

MIB = 1024 * 1024
#: Largest integer accepted: SQLite's INTEGER is a signed 64-bit value.
INT_MAX = 2**63 - 1
#: Longest step, phase or checkpoint duration accepted, seconds (366 days). Our choice: no
#: step outlasts a job, and Slurm time limits are far below a year; the bound keeps the
#: summary's sums over the record cap finite (``1e308 + 1e308`` is inf, inf/inf is NaN).
MAX_DURATION_S = 366 * 86400.0
#: Largest ``samples``/``tokens`` of one step (2**40, about 1.1e12). Our choice: real steps
#: are below 2**30 tokens; the bound keeps SQLite's integer ``sum()`` over the record cap
#: (:data:`MAX_RECORDS` * 2**40 < 2**63) from raising "integer overflow", which lost the
#: whole job summary.
MAX_COUNT = 2**40
#: Earliest accepted ``t``: 2000-01-01T00:00:00Z.
T_MIN = 946684800.0
#: How far ahead of the reader's clock a ``t`` may be (clock skew between nodes).
T_FUTURE_S = 86400.0
#: Default caps of :func:`read_job_records` (see the module docstring for the measurement).
MAX_TOTAL_BYTES = 32 * MIB
MAX_FILE_BYTES = 32 * MIB
MAX_RECORDS = 100_000
_NAME_RE = re.compile(r"^train\.rank(\d{1,9})\.jsonl$")
_PHASE_KEYS = ("data_wait_s", "fwd_bwd_s", "comm_s", "optim_s")
_CHUNK = 1024 * 1024


@dataclass
class IngestResult:
    """What :func:`read_job_records` found.

    ``steps`` / ``checkpoints``: normalised records (dicts with the schema's keys).
    ``malformed``: lines skipped (bad JSON, wrong types, unknown kind, ``v != 1``, too long).
    ``rejected_files``: ``(path, reason)`` for the directory or files not read at all.
    ``nonfinite_loss``: steps with a NaN/inf loss. ``truncated``: a size, line-count or
    file-count cap cut the input short.
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
         maximum: float | None = None, allow_nonfinite: bool = False) -> float | None:
    if key not in d or d[key] is None:
        if required:
            raise _Bad(key)
        return None
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _Bad(key)
    try:
        f = float(v)
    except OverflowError:  # an integer literal beyond the float range
        raise _Bad(key) from None
    if not math.isfinite(f):
        if allow_nonfinite:
            return f
        raise _Bad(key)
    if (minimum is not None and f < minimum) or (maximum is not None and f > maximum):
        raise _Bad(key)
    return f


def _int(d: dict[str, Any], key: str, *, required: bool = True, maximum: int = INT_MAX) -> int | None:
    if key not in d or d[key] is None:
        if required:
            raise _Bad(key)
        return None
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= maximum:
        raise _Bad(key)
    return v


def validate_record(obj: Any, *, now: float | None = None) -> dict[str, Any]:
    """Normalise one parsed line to a schema-v1 record. Raises ``ValueError``.

    ``now``: the clock ``t`` is checked against (``t`` must be in
    ``[T_MIN, now + T_FUTURE_S]``); default ``time.time()``."""
    try:
        if not isinstance(obj, dict) or obj.get("v") != 1 or isinstance(obj.get("v"), bool):
            raise _Bad("v")
        kind = obj.get("kind")
        rank = _int(obj, "rank")
        t = _num(obj, "t")
        if not T_MIN <= t <= (time.time() if now is None else now) + T_FUTURE_S:
            raise _Bad("t")
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
                v = _num(phases_in, k, required=False, minimum=0.0, maximum=MAX_DURATION_S)
                if v is not None:
                    phases[k] = v
            return {
                "v": 1, "kind": "step", "rank": rank, "t": t, "step": _int(obj, "step"),
                "step_time_s": _num(obj, "step_time_s", minimum=0.0, maximum=MAX_DURATION_S),
                "samples": _int(obj, "samples", required=False, maximum=MAX_COUNT),
                "tokens": _int(obj, "tokens", required=False, maximum=MAX_COUNT),
                "loss": loss, "loss_nonfinite": flag,
                "grad_norm": gn if gn is not None and math.isfinite(gn) else None,
                "phases": phases,
            }
        if kind == "checkpoint":
            return {"v": 1, "kind": "checkpoint", "rank": rank, "t": t, "step": _int(obj, "step", required=False),
                    "duration_s": _num(obj, "duration_s", minimum=0.0, maximum=MAX_DURATION_S)}
        raise _Bad("kind")
    except _Bad as e:
        raise ValueError(f"bad or missing {e}") from None


def _reject(res: IngestResult, path: str, reason: str) -> None:
    res.rejected_files.append((path, reason))


class _Limits:
    """Per-call state of :func:`read_job_records`: the clock for ``t``, the line cap, and
    how many more lines may be parsed (``full``: one was refused)."""

    __slots__ = ("full", "max_line", "now", "records_left")

    def __init__(self, now: float, max_line: int, max_records: int):
        self.now = now
        self.max_line = max_line
        self.records_left = max_records
        self.full = False


def _open_job_dir(res: Any, job_dir: str) -> int | None:
    """The job directory opened (``O_DIRECTORY|O_NOFOLLOW``: never through a symlink), or
    None: a missing directory silently (no records), anything else with ``res`` told why."""
    try:
        return os.open(job_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        reason = e.strerror or str(e)
        if e.errno in (errno.ELOOP, errno.ENOTDIR):  # O_DIRECTORY|O_NOFOLLOW on a symlink: ENOTDIR
            try:
                reason = "symlink" if stat.S_ISLNK(os.lstat(job_dir).st_mode) else "not a directory"
            except OSError:
                reason = "not a directory"
        _reject(res, job_dir, reason)
        return None


def _ranked_files(res: Any, dfd: int, job_dir: str, uid: int, max_files: int) -> list[tuple[int, str]] | None:
    """The ``(rank, name)`` record files of the open job directory ``dfd``, by rank, at
    most ``max_files`` (``res.truncated`` set when more). None (and ``res`` told why) when
    the directory is not a directory owned by ``uid`` or cannot be listed."""
    st = os.fstat(dfd)
    if not stat.S_ISDIR(st.st_mode):
        _reject(res, job_dir, "not a directory")
        return None
    if st.st_uid != uid:
        _reject(res, job_dir, f"owned by uid {st.st_uid}, expected {uid}")
        return None
    try:
        names = os.listdir(dfd)
    except OSError as e:
        _reject(res, job_dir, e.strerror or str(e))
        return None
    ranked = sorted((int(m.group(1)), n) for n in names if (m := _NAME_RE.match(n)))
    if len(ranked) > max_files:
        res.truncated = True
        ranked = ranked[:max_files]
    return ranked


def read_job_records(job_dir: str, expected_uid: int, *, max_file_bytes: int = MAX_FILE_BYTES,
                     max_line_bytes: int = 64 * 1024, max_files: int = 4096,
                     max_total_bytes: int = MAX_TOTAL_BYTES, max_records: int = MAX_RECORDS,
                     now: float | None = None) -> IngestResult:
    """Read every ``train.rank<N>.jsonl`` in ``job_dir`` (see the module docstring).

    A missing directory gives an empty result (the job did not use the API). A directory
    that is a symlink, not a directory, or owned by another uid is listed in
    ``rejected_files`` and nothing is read. Never raises ``OSError``; never follows a
    symlink; never opens a FIFO or device node for reading. ``now``: the clock the
    records' ``t`` is checked against (default ``time.time()``, read once).
    """
    res = IngestResult()
    lim = _Limits(time.time() if now is None else now, max_line_bytes, max_records)
    dfd = _open_job_dir(res, job_dir)
    if dfd is None:
        return res
    try:
        ranked = _ranked_files(res, dfd, job_dir, expected_uid, max_files)
        if ranked is None:
            return res
        budget = max_total_bytes
        for _rank, name in ranked:
            if budget <= 0 or lim.full:
                res.truncated = True
                break
            budget -= _read_file(res, dfd, job_dir, name, expected_uid, min(max_file_bytes, budget), lim)
    finally:
        os.close(dfd)
    return res


def _open_record(res: IngestResult, dfd: int, job_dir: str, name: str, uid: int) -> tuple[int, Any] | None:
    """Open record file ``name`` of the open job directory ``dfd`` for reading: a regular
    file (checked before opening, so a FIFO is never opened, and again on the open file)
    owned by ``uid``, never through a symlink. Returns ``(fd, fstat result)``; None (and
    ``res`` told why) when it is not such a file or cannot be opened. The caller closes
    ``fd``."""
    path = os.path.join(job_dir, name)
    try:
        lst = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError as e:
        _reject(res, path, e.strerror or str(e))
        return None
    if not stat.S_ISREG(lst.st_mode):
        _reject(res, path, "symlink" if stat.S_ISLNK(lst.st_mode) else "not a regular file")
        return None
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OSError as e:
        _reject(res, path, "symlink" if e.errno == errno.ELOOP else (e.strerror or str(e)))
        return None
    why = None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            why = "not a regular file"
        elif st.st_uid != uid:
            why = f"owned by uid {st.st_uid}, expected {uid}"
    except OSError as e:
        why = e.strerror or str(e)
    if why is not None:
        os.close(fd)
        _reject(res, path, why)
        return None
    return fd, st


def _read_file(res: IngestResult, dfd: int, job_dir: str, name: str, uid: int, max_bytes: int,
               lim: _Limits) -> int:
    """Read one file into ``res``; returns the bytes read."""
    opened = _open_record(res, dfd, job_dir, name, uid)
    if opened is None:
        return 0
    fd, _st = opened
    try:
        return _parse_stream(res, fd, max_bytes, lim)
    except OSError as e:
        _reject(res, os.path.join(job_dir, name), e.strerror or str(e))
        return 0
    finally:
        os.close(fd)


def _parse_stream(res: IngestResult, fd: int, max_bytes: int, lim: _Limits) -> int:
    max_line = lim.max_line
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
            if not _parse_line(res, line, lim):
                return total  # the record cap: stop reading (truncated is set)
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
        _parse_line(res, carry, lim)  # a last line without newline (job killed mid-write)
    return total


def _parse_line(res: IngestResult, line: bytes, lim: _Limits) -> bool:
    """Parse one line into ``res``; ``False`` when the record cap is reached."""
    if not line.strip():
        return True
    if lim.records_left <= 0:
        lim.full = res.truncated = True
        return False
    lim.records_left -= 1  # malformed lines count too: a bad line costs more than a good one
    if len(line) > lim.max_line:
        res.malformed += 1
        return True
    try:
        rec = validate_record(json.loads(line), now=lim.now)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        res.malformed += 1
        return True
    if rec["kind"] == "step":
        res.steps.append(rec)
        if rec["loss_nonfinite"]:
            res.nonfinite_loss += 1
    else:
        res.checkpoints.append(rec)
    return True

