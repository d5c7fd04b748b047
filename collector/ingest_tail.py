"""Incremental ingest of a job's training records: the collector stores the records written
since its last look during the job, the Epilog only the tail.

Reading every record at the end cost the Epilog ~33 us per record (parse, validate,
store): a week of one rank logging a step a second is 605,000 records, 20 s, the whole
Epilog budget. Here each ``train.rank<N>.jsonl`` is read from the byte offset stored in
``train_offsets`` (the file checks, line rules and caps are
:func:`gpuguard.collector.ingest.read_job_records`'), and the rows and the new offset are
committed in one transaction (``bench/ingest_long.py`` measures a 7-day job).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from gpuguard.collector.ingest import (
    _CHUNK,
    _ranked_files,
    MAX_FILE_BYTES,
    MAX_RECORDS,
    MAX_TOTAL_BYTES,
    IngestResult,
    _Limits,
    _open_job_dir,
    _open_record,
    _parse_line,
    _reject,
)


#: Most lines one job's records may add up to over all incremental calls (our choice:
#: 2,000,000 is 23 days of one rank or 69 hours of 8 ranks at a step a second, ~200 MB
#: of ``steps`` rows; the Epilog's summary reads them in about a second). Reaching it
#: sets ``truncated``. ``[paths] job_dir_max_mib`` counts only what is not stored yet (the
#: stored prefix is released from the disk during the job).
MAX_JOB_RECORDS = 2_000_000

_OFFSET_COLS = ("dev", "ino", "offset", "skipping", "records", "malformed", "nonfinite", "truncated")


@dataclass
class _FileTail:
    """What one incremental read of one record file found."""

    name: str
    dev: int
    ino: int
    start: int
    offset: int
    skipping: bool
    steps: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    lines: int = 0
    malformed: int = 0
    nonfinite: int = 0


def ingest_new_records(store: Any, job_dir: str, job_id: str, node: str, expected_uid: int, *, final: bool,
                       max_file_bytes: int = MAX_FILE_BYTES, max_line_bytes: int = 64 * 1024,
                       max_files: int = 4096, max_total_bytes: int = MAX_TOTAL_BYTES,
                       max_records: int = MAX_RECORDS, max_job_records: int = MAX_JOB_RECORDS,
                       now: float | None = None) -> IngestResult:
    """Store the training records written to ``job_dir`` since the last call into the
    ``steps``/``checkpoints`` rows of (``job_id``, ``node``) of ``store``, continuing each
    ``train.rank<N>.jsonl`` at the byte offset kept in ``train_offsets``.

    The collector calls it during the job (``final=False``: only complete lines; a line
    still being written waits for the next call), the Epilog once at the end
    (``final=True``: a last line without newline counts, and a cap that leaves records
    unread sets ``truncated``), so the Epilog reads only the tail. The file checks and
    line rules are :func:`read_job_records`' and so are the caps, per call
    (``max_records`` lines, ``max_file_bytes`` per file, ``max_total_bytes`` in all; a
    call stopped by a cap during the job continues at the next); ``max_job_records`` caps
    the lines of the whole job. A file replaced by another (new inode) is read from its
    start; one cut shorter than its offset (``[paths] job_dir_max_mib``) from its end.

    Idempotent and safe with two callers: the rows and the offsets are written in one
    transaction, and a call whose offsets moved meanwhile stores nothing. The first call
    of a job attempt (no offsets yet) replaces the job's rows on this node (a requeued job
    keeps the same id); the Epilog forgets the offsets with
    :func:`forget_offsets` once the job directory is gone.

    Returns the :class:`IngestResult` of this call: its ``steps``/``checkpoints`` (the
    records stored now), ``rejected_files`` (this call's), and ``malformed``,
    ``nonfinite_loss``, ``truncated`` over the whole job so far. Raises
    :class:`gpuguard.store.StoreError` when the store cannot be written."""
    from gpuguard.store import StoreError

    for _attempt in range(3):
        res = _ingest_once(store, job_dir, job_id, node, expected_uid, final=final, max_file_bytes=max_file_bytes,
                           max_line_bytes=max_line_bytes, max_files=max_files, max_total_bytes=max_total_bytes,
                           max_records=max_records, max_job_records=max_job_records, now=now)
        if res is not None:
            return res
    raise StoreError(f"store {store.path}: training records of job {job_id} kept changing under this ingest")


def _ingest_once(store: Any, job_dir: str, job_id: str, node: str, expected_uid: int, *, final: bool,
                 max_file_bytes: int, max_line_bytes: int, max_files: int, max_total_bytes: int, max_records: int,
                 max_job_records: int, now: float | None) -> IngestResult | None:
    """One try of :func:`ingest_new_records`; None when another caller moved the offsets."""
    import sqlite3

    from gpuguard.store import StoreError

    res = IngestResult()
    try:
        before = {r[0]: tuple(r[1:]) for r in store.db.conn.execute(
            f"select name, {', '.join(_OFFSET_COLS)} from train_offsets where job_id = ? and node = ?",
            (job_id, node))}
    except sqlite3.Error as e:
        raise StoreError(f"store {store.path}: training-record offsets unreadable: {e}") from None
    done = sum(v[4] for v in before.values())
    capped = any(v[7] for v in before.values())
    room = max(0, max_job_records - done)
    lim = _Limits(time.time() if now is None else now, max_line_bytes, min(max_records, room))
    tails = _read_tails(res, job_dir, expected_uid, before, lim, max_file_bytes=max_file_bytes,
                        max_files=max_files, max_total_bytes=max_total_bytes, final=final)
    job_capped = capped or (room <= max_records and lim.full)
    if not final:
        res.truncated = False  # a per-call cap during the job: the next call continues
    res.truncated = res.truncated or job_capped
    res.malformed = sum(v[5] for v in before.values()) + sum(t.malformed for t in tails)
    res.nonfinite_loss = sum(v[6] for v in before.values()) + sum(t.nonfinite for t in tails)
    changed = [t for t in tails if t.lines or t.malformed or before.get(t.name, (None,) * 4)[:4]
               != (t.dev, t.ino, t.offset, int(t.skipping))]
    if not changed and job_capped == capped:
        return res
    try:
        _store_tails(store, job_id, node, before, changed, fresh=not before, capped=job_capped)
    except _Moved:
        return None
    except sqlite3.Error as e:
        raise StoreError(f"store {store.path}: training records write failed: {e}") from None
    for t in changed:
        res.steps += t.steps
        res.checkpoints += t.checkpoints
    return res


class _Moved(Exception):
    """Another caller stored records of the job since our offsets were read."""


def _store_tails(store: Any, job_id: str, node: str, before: dict[str, tuple], tails: list[_FileTail], *,
                 fresh: bool, capped: bool) -> None:
    from gpuguard.epilog.training_rows import CHECKPOINT_COLUMNS, STEP_COLUMNS, checkpoint_rows, step_rows

    conn = store.db.conn
    with store.tx():
        now_rows = {r[0]: r[1:] for r in conn.execute(
            f"select name, {', '.join(_OFFSET_COLS)} from train_offsets where job_id = ? and node = ?", (job_id, node))}
        if now_rows != before:
            raise _Moved()
        if fresh:
            conn.execute("delete from steps where job_id = ? and node = ?", (job_id, node))
            conn.execute("delete from checkpoints where job_id = ? and node = ?", (job_id, node))
        for t in tails:
            if t.steps:
                conn.executemany(f"insert into steps ({', '.join(STEP_COLUMNS)}) values "
                                 f"({', '.join('?' * len(STEP_COLUMNS))})", step_rows(job_id, node, t.steps))
            if t.checkpoints:
                conn.executemany(f"insert into checkpoints ({', '.join(CHECKPOINT_COLUMNS)}) values "
                                 f"({', '.join('?' * len(CHECKPOINT_COLUMNS))})",
                                 checkpoint_rows(job_id, node, t.checkpoints))
            old = before.get(t.name)
            same = old is not None and old[:2] == (t.dev, t.ino)
            conn.execute(
                f"insert or replace into train_offsets (job_id, node, name, {', '.join(_OFFSET_COLS)}) "
                f"values (?, ?, ?, {', '.join('?' * len(_OFFSET_COLS))})",
                (job_id, node, t.name, t.dev, t.ino, t.offset, int(t.skipping),
                 (old[4] if same else 0) + t.lines, (old[5] if same else 0) + t.malformed,
                 (old[6] if same else 0) + t.nonfinite, int(capped)))
        if capped:
            conn.execute("update train_offsets set truncated = 1 where job_id = ? and node = ?", (job_id, node))


def forget_offsets(store: Any, job_id: str, node: str) -> None:
    """Drop the job's ``train_offsets`` rows on ``node`` (the Epilog, once the job
    directory is removed: a requeued job with the same id starts afresh). Raises
    ``sqlite3.Error``."""
    with store.tx():
        store.db.conn.execute("delete from train_offsets where job_id = ? and node = ?", (job_id, node))


def _read_tails(res: IngestResult, job_dir: str, uid: int, before: dict[str, tuple], lim: _Limits, *,
                max_file_bytes: int, max_files: int, max_total_bytes: int, final: bool) -> list[_FileTail]:
    """Open ``job_dir`` as :func:`read_job_records` does and read each file's new lines."""
    dfd = _open_job_dir(res, job_dir)
    if dfd is None:
        return []
    tails: list[_FileTail] = []
    try:
        ranked = _ranked_files(res, dfd, job_dir, uid, max_files)
        if ranked is None:
            return []
        budget = max_total_bytes
        for _rank, name in ranked:
            if budget <= 0 or lim.full:
                res.truncated = True
                break
            tail = _read_tail(res, dfd, job_dir, name, uid, before.get(name), min(max_file_bytes, budget), lim,
                              final)
            if tail is not None:
                tails.append(tail)
                budget -= tail.offset - tail.start
    finally:
        os.close(dfd)
    return tails


def _read_tail(res: IngestResult, dfd: int, job_dir: str, name: str, uid: int, old: tuple | None, max_bytes: int,
               lim: _Limits, final: bool) -> _FileTail | None:
    """One file's lines after its stored offset (``old``: its ``train_offsets`` values)."""
    opened = _open_record(res, dfd, job_dir, name, uid)
    if opened is None:
        return None
    fd, st = opened
    try:
        same = old is not None and tuple(old[:2]) == (st.st_dev, st.st_ino)
        start, skipping = (int(old[2]), bool(old[3])) if same else (0, False)
        if st.st_size < start:  # cut by the job-directory cap: nothing new before its end
            start, skipping = st.st_size, False
        tail = _FileTail(name, st.st_dev, st.st_ino, start, start, skipping)
        _parse_tail(res, tail, fd, max_bytes, lim, final)
        return tail
    except OSError as e:
        _reject(res, os.path.join(job_dir, name), e.strerror or str(e))
        return None
    finally:
        os.close(fd)


def _parse_tail(res: IngestResult, tail: _FileTail, fd: int, max_bytes: int, lim: _Limits, final: bool) -> None:
    """Parse complete lines from ``tail.start`` (and with ``final`` a last unterminated
    one) into ``tail``, moving ``tail.offset`` past each line consumed."""
    sub = IngestResult()
    pos, read, carry = tail.start, 0, b""
    skipping = tail.skipping
    stopped = False
    while read < max_bytes and not stopped:
        chunk = os.pread(fd, min(_CHUNK, max_bytes - read), tail.start + read)
        if not chunk:
            break
        read += len(chunk)
        lines = chunk.split(b"\n")
        lines[0] = carry + lines[0]
        carry = lines.pop()
        for line in lines:
            if skipping:
                skipping = False  # the rest of an over-long line, already counted
            else:
                n_before = lim.records_left
                if not _parse_line(sub, line, lim):
                    stopped = True  # the record cap: this line stays for the next call
                    carry = b""
                    break
                tail.lines += n_before - lim.records_left
            pos += len(line) + 1
        if not stopped and len(carry) > lim.max_line:
            if not skipping:
                sub.malformed += 1
            skipping = True
            pos += len(carry)
            carry = b""
    if not stopped and read >= max_bytes and os.pread(fd, 1, tail.start + read):
        sub.truncated = True  # this call's byte cap
    elif not stopped and carry and final and not skipping:
        n_before = lim.records_left
        if _parse_line(sub, carry, lim):
            tail.lines += n_before - lim.records_left
            pos += len(carry)
    tail.offset, tail.skipping = pos, skipping
    tail.steps, tail.checkpoints = sub.steps, sub.checkpoints
    tail.malformed, tail.nonfinite = sub.malformed, sub.nonfinite_loss
    res.truncated = res.truncated or sub.truncated
    lim.full = lim.full or stopped


#: Per-call caps of the collector's ingest (our choice: the collector's memory stays a few
#: MB above its ~30 MB; 10,000 lines every 15 s is 660 records a second, far above what
#: 8 ranks log; a backlog is read over the next ticks).
TICK_MAX_RECORDS = 10_000
TICK_MAX_BYTES = 4 * 1024 * 1024


def record_ingest_tick(cfg: Any, job_id: str, node: str, uid: int | None, log: Any) -> Any:
    """The collector's periodic call (every liveness period) of
    :func:`ingest_new_records` for its job, at most :data:`TICK_MAX_RECORDS` lines and
    :data:`TICK_MAX_BYTES` a call, as ``tick(store)``; None without a job user
    uid or ``[paths] job_dir_root``. Registers the Epilog's store tables (``steps``,
    ``train_offsets``) in the collector process, so call it before the store is opened.
    After each call the stored prefix of every record file is given back to the filesystem
    (:func:`gpuguard.collector.jobdir_cap.release_ingested`), so the directory's cap
    counts only what is not stored yet. A failing ingest is logged (first time and every
    100th) and never stops sampling: the Epilog ingests what is left."""
    root = cfg.get("paths", "job_dir_root")
    if uid is None or not root:
        return None
    import gpuguard.epilog.schema  # noqa: F401  (registers the "epilog" set: steps, train_offsets)

    job_dir = os.path.join(root, job_id)
    failures = [0]

    def tick(store: Any) -> None:
        try:
            ingest_new_records(store, job_dir, job_id, node, uid, final=False, max_records=TICK_MAX_RECORDS,
                               max_total_bytes=TICK_MAX_BYTES, max_file_bytes=TICK_MAX_BYTES)
            from gpuguard.collector.jobdir_cap import release_ingested

            release_ingested(job_dir, store.db.conn.execute(
                "select name, dev, ino, offset from train_offsets where job_id = ? and node = ?",
                (job_id, node)).fetchall())
            failures[0] = 0
        except Exception as e:  # the store, a bug: the Epilog still reads the tail
            failures[0] += 1
            if failures[0] == 1 or failures[0] % 100 == 0:
                log.warning("training records: ingest during the job failed (%d time(s)): %s: %s",
                            failures[0], type(e).__name__, e)

    return tick
