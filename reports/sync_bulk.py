"""A bulk import of a large ``sacct -P`` input, parsed in worker processes.

Parsing a ``-P`` row is Python work (about 15 µs a job on the 2-CPU test VM) and binding
its values to SQLite is more (about 5 µs); the store's own work for a bulk load is C (an
``INSERT ... SELECT``, the index builds, the commit). So the input (a saved file, or a live
sync's text) is cut into chunks at line ends (:data:`CHUNK_BYTES`); worker processes (one
per usable CPU) each parse a chunk with the same parser as the one-process path
(:func:`~gpuguard.reports.sacct.iter_pipe`, the header line put in front) into an
in-memory SQLite table, and hand it back serialized. The importing process takes the
chunks in input order, each into an attached in-memory schema (``sqlite3_deserialize``),
and upserts them with the same upsert as the one-process path
(:func:`gpuguard.reports.sync._upsert_sql`, from a ``SELECT`` in the staged rows' order):
while it stores one chunk the workers parse the next ones.

The load is one transaction, as :func:`gpuguard.reports.sync._bulk_load`: the secondary
indexes are set aside and rebuilt at the end (:func:`rebuild_indexes`), and a failure
anywhere, a worker's included, rolls all of it back. Line numbers, notes and attempts are
counted per chunk (:class:`~gpuguard.reports.sync_result.Tally`) and merged in input
order, so the result says what the one-process path says (``tests/test_reports_sync.py``
imports every corpus file both ways, cut every 40 bytes).

Measured by ``bench/sync_1m.py`` (the README gives the figures).
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import logging
import multiprocessing
import operator
import os
import sqlite3
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import tzinfo
from typing import TYPE_CHECKING

from gpuguard.reports.sacct_fields import COLUMNS

if TYPE_CHECKING:
    from gpuguard.reports.sync_result import Tally

log = logging.getLogger("gpuguard.reports.sync")

#: Bytes of ``-P`` text a worker parses at a time (our choice: about 55,000 jobs, 14 MB
#: staged; small enough that the importing process starts storing early and the workers
#: finish together, large enough that a chunk's fixed costs do not show).
CHUNK_BYTES = 16 << 20
#: Most worker processes (our choice: the importing process stores while they parse, and
#: beyond four the store's single writer is the limit).
MAX_WORKERS = 4
#: Worker processes to use; None: one per usable CPU up to :data:`MAX_WORKERS`. A parallel
#: import needs two (with one CPU the workers would only add their own cost).
WORKERS: int | None = None
#: The attached in-memory schema the chunks are deserialized into.
STAGE = "gg_sync_stage"
#: Columns most jobs have empty (array and het job ids, AdminComment): a worker stages them
#: in a side table (``staged_rare``, keyed by the staged row's rowid) for the jobs that have
#: one, as binding a None costs several times a number.
RARE_COLUMNS = ("array_job_id", "array_task_id", "het_job_id", "het_job_offset", "admin_comment")
#: The columns a worker stages in table ``staged``: those of a parsed job, but ``synced_at``
#: and ``source`` (one value for the whole import), ``attempt_at`` (derived in the upsert)
#: and :data:`RARE_COLUMNS`.
STAGE_COLUMNS = tuple(c for c in COLUMNS if c not in ("synced_at", "source", "attempt_at", *RARE_COLUMNS))
_NO_RARE = (None,) * len(RARE_COLUMNS)
#: Rows a worker binds per ``executemany``.
_STAGE_BATCH = 4000
#: Page cache of the importing process while it stores the chunks, KiB (our choice,
#: measured on ``bench/sync_1m.py``'s 1 M jobs on a loaded 2-CPU VM: a 256 MiB cache, the
#: one-process bulk load's, was the slowest in every run, 42.5-42.7 s against 35.7-37.3 s
#: with 32 MiB in alternating runs, 8-64 MiB 25.9-33.0 s later, and held 240 MB more: with
#: a smaller cache the rows' pages reach the WAL while the workers parse, not all at once
#: when the index builds shrink the cache).
STORE_CACHE_KIB = 65536
#: Page cache while an index is built, KiB (our choice: SQLite's sorter then sorts runs that
#: fit the CPU's caches and merges them, on the usable CPUs (``PRAGMA threads``), instead of
#: sorting all keys in one list; on 1 M jobs a single-column index builds in 0.9 s instead
#: of 1.6 s and the 13-column one in 2.2 s instead of 3.4 s, on 2 CPUs).
INDEX_CACHE_KIB = 8192


def workers() -> int:
    """Worker processes for a parallel import (0: none, the import stays in this process)."""
    if WORKERS is not None:
        return WORKERS
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return min(MAX_WORKERS, n) if n >= 2 else 0


#: Secondary indexes a bulk load keeps current row by row instead of setting them aside:
#: sacct prints jobs in job id order, so the raw-id index (16 bytes an entry, a 1 M-job
#: cache's whole index fits the load's page cache) is appended to in key order, for about
#: what its rebuild's extra table scan and sort would cost, and that rebuild would come
#: after the last chunk, when nothing else runs (measured on 1 M jobs: the upserts took the
#: same 3.8 s with it kept, the rebuilds 0.4 s less).
KEPT_INDEXES = ("sacct_jobs_raw",)


def set_indexes_aside(conn: sqlite3.Connection) -> list[tuple[str, str]]:
    """Drop the secondary indexes of ``sacct_jobs`` but :data:`KEPT_INDEXES` (in the
    caller's transaction); returns ``(name, sql)`` of each, for :func:`rebuild_indexes`."""
    indexes = conn.execute("SELECT name, sql FROM main.sqlite_master WHERE type = 'index' "
                           "AND tbl_name = 'sacct_jobs' AND sql IS NOT NULL").fetchall()
    indexes = [(name, sql) for name, sql in indexes if name not in KEPT_INDEXES]
    for name, _sql in indexes:
        conn.execute(f'DROP INDEX main."{name}"')
    return indexes


def rebuild_indexes(conn: sqlite3.Connection, indexes: list[tuple[str, str]]) -> None:
    """Re-create the indexes :func:`set_indexes_aside` dropped, from their own SQL, with the
    page cache at :data:`INDEX_CACHE_KIB` and the sorter's threads at the usable CPUs (both
    restored)."""
    cache = conn.execute("PRAGMA cache_size").fetchone()[0]
    threads = conn.execute("PRAGMA threads").fetchone()[0]
    conn.execute(f"PRAGMA cache_size = {-INDEX_CACHE_KIB}")
    conn.execute(f"PRAGMA threads = {max(1, min(MAX_WORKERS, os.cpu_count() or 1))}")
    try:
        for _name, sql in indexes:
            conn.execute(sql)
    finally:
        conn.execute(f"PRAGMA cache_size = {int(cache)}")
        conn.execute(f"PRAGMA threads = {int(threads)}")


def chunk_ranges(path: str, start: int, size: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Byte ranges ``[lo, hi)`` covering ``start..size`` of ``path``, each ending just after
    a ``\\n`` (or at the end of the file), about ``chunk_bytes`` long. A line never spans
    two ranges, and UTF-8 never has ``\\n`` inside a character, so each range decodes alone."""
    ranges, lo = [], start
    with open(path, "rb") as fh:
        while lo < size:
            hi = lo + chunk_bytes
            if hi >= size:
                hi = size
            else:
                fh.seek(hi)
                while True:
                    block = fh.read(1 << 16)
                    if not block:
                        hi = size
                        break
                    nl = block.find(b"\n")
                    if nl >= 0:
                        hi += nl + 1
                        break
                    hi += len(block)
            ranges.append((lo, hi))
            lo = hi
    return ranges


@dataclass
class Chunk:
    """What a worker hands back for one :class:`ChunkTask`: its staged rows (a serialized SQLite
    database with table ``staged`` of :data:`STAGE_COLUMNS` and ``staged_rare`` of
    :data:`RARE_COLUMNS`), its line count, its tally
    (lines numbered from the chunk's first line), the ``(job_id, node, summary JSON)`` node
    summaries its jobs' gpuguard AdminComments carry (decoded here, in the worker:
    :func:`gpuguard.reports.admin_summaries.summaries_of`), whether a job had no submit
    time (so attempt 0), and its size."""

    data: bytes
    lines: int
    jobs: int
    tally: Tally
    admin: list[tuple[str, str, str]] = field(default_factory=list)
    no_submit: bool = False
    nbytes: int = 0


def _bind_null_fast() -> None:
    """Worker processes only: hand None to SQLite through an adapter. The sqlite3 module
    looks up ``__adapt__``/``__conform__`` for a None parameter when no adapter is
    registered, which costs about four times the binding of a number; a staged job binds
    several None values."""
    sqlite3.register_adapter(type(None), _same)


def _same(value):
    return value


@dataclass
class ChunkTask:
    """One chunk for a worker: bytes ``lo..hi`` of the file ``path`` (read through the
    inherited descriptor ``fd`` when there is one), or ``text`` itself
    (characters ``lo..hi`` of an input in memory, cut by :class:`ChunkPool`);
    ``header``: the input's header line, put in front of a chunk that does not start the
    input (None: the chunk starts it, or the input has none and ``fields`` names its
    columns); the rest as :func:`~gpuguard.reports.sync.import_text` takes them."""

    source: str
    tz: tzinfo
    cluster: str = ""
    path: str | None = None
    fd: int | None = None
    lo: int = 0
    hi: int = 0
    text: str | None = None
    header: str | None = None
    fields: list[str] | None = None
    delimiter: str = "|"
    gpus_tracked: bool | None = None


def parse_chunk(task: ChunkTask) -> Chunk:
    """Worker: parse one :class:`ChunkTask` into a :class:`Chunk`."""
    from gpuguard.reports.admin_summaries import summaries_of
    from gpuguard.reports.sacct import TimeConverter, iter_pipe
    from gpuguard.reports.sync_result import Tally

    text = task.text
    if text is None and task.fd is not None:
        data = os.pread(task.fd, task.hi - task.lo, task.lo)
        while len(data) < task.hi - task.lo:  # a short read (a signal, a network filesystem)
            more = os.pread(task.fd, task.hi - task.lo - len(data), task.lo + len(data))
            if not more:
                break
            data += more
        text = data.decode("utf-8", errors="replace")
    elif text is None:
        with open(task.path, "rb") as fh:
            fh.seek(task.lo)
            text = fh.read(task.hi - task.lo).decode("utf-8", errors="replace")
    nbytes = len(text) if task.text is not None else task.hi - task.lo
    lines = list(io.StringIO(text, newline="\n"))  # split as the batched path's file object splits
    del text
    header = task.header
    rows = iter_pipe(lines if header is None else itertools.chain([header], lines), conv=TimeConverter(task.tz),
                     cluster=task.cluster, fields=task.fields, delimiter=task.delimiter, source=task.source)
    tally = Tally()
    db = sqlite3.connect(":memory:", isolation_level=None)
    db.execute(f"CREATE TABLE staged ({', '.join(STAGE_COLUMNS)})")
    db.execute(f"CREATE TABLE staged_rare (row INTEGER PRIMARY KEY, {', '.join(RARE_COLUMNS)})")
    insert = f"INSERT INTO staged VALUES ({', '.join('?' * len(STAGE_COLUMNS))})"
    pick, pick_rare = operator.itemgetter(*STAGE_COLUMNS), operator.itemgetter(*RARE_COLUMNS)
    admin: list[tuple[str, str, str]] = []
    rare: list[tuple] = []
    no_submit = False
    batch: list[tuple] = []
    jobs = 0
    db.execute("BEGIN")
    for j in tally.jobs(rows, task.gpus_tracked):
        batch.append(pick(j))
        extra = pick_rare(j)
        if extra != _NO_RARE:
            rare.append((jobs + len(batch), *extra))  # the staged row's rowid: rows are numbered from 1
            if j["admin_comment"]:  # decoded just now for its template: one decode a job
                admin.extend(summaries_of(j["job_id_raw"], j["admin_comment"]))
        if j["submit_at"] is None:
            no_submit = True
        if len(batch) >= _STAGE_BATCH:
            db.executemany(insert, batch)
            jobs += len(batch)
            batch = []
    if batch:
        db.executemany(insert, batch)
        jobs += len(batch)
    db.executemany(f"INSERT INTO staged_rare VALUES ({', '.join('?' * (1 + len(RARE_COLUMNS)))})", rare)
    db.execute("COMMIT")
    data = db.serialize()
    db.close()
    if header is not None:  # number the tally's lines from the chunk's own first line
        own = Tally()
        own.merge(tally, -1)
        tally = own
    return Chunk(data=data, lines=len(lines), jobs=jobs, tally=tally, admin=admin, no_submit=no_submit,
                 nbytes=nbytes)


def _parse(task: ChunkTask) -> Chunk:
    return parse_chunk(task)  # looked up when called, so a test can replace it


def header_line(path: str) -> tuple[str, int]:
    """The first non-blank line of ``path`` (the header; as a text file read with
    ``newline="\\n"``: its terminator kept, a lone ``\\r`` left in the text as sacct
    prints it) and the byte offset of the line after it."""
    at = 0
    with open(path, encoding="utf-8", errors="replace", newline="\n") as fh:
        for first in fh:
            at += len(first.encode("utf-8", errors="replace"))
            if first.strip():
                return first, at
    return "", at


def text_ranges(text: str, chunk_chars: int) -> list[tuple[int, int]]:
    """:func:`chunk_ranges` of a string: ``[lo, hi)`` character ranges, each ending just
    after a ``\n`` (or at the end)."""
    ranges, lo, n = [], 0, len(text)
    while lo < n:
        nl = text.find("\n", lo + chunk_chars - 1) if lo + chunk_chars < n else -1
        hi = n if nl < 0 else nl + 1
        ranges.append((lo, hi))
        lo = hi
    return ranges


def file_tasks(path: str, size: int, tz: tzinfo, cluster: str, fd: int | None = None) -> list[ChunkTask]:
    """The chunks of the ``-P`` file ``path`` (``size`` bytes; header line required).
    ``fd``: the caller's open descriptor of it; forked workers read through it (the file
    the caller opened, even if the path is replaced meanwhile), others by the path."""
    header, body_at = header_line(path)
    if _start_method() != "fork":
        fd = None
    return [ChunkTask(source=path, tz=tz, cluster=cluster, path=path, fd=fd, lo=lo, hi=hi,
                      header=None if lo == 0 else header)
            for lo, hi in chunk_ranges(path, 0, size, max(CHUNK_BYTES, body_at + 1))]


def _start_method() -> str:
    """``fork`` where the platform has it (workers start with the parser loaded and the
    caller's descriptors open), else ``spawn``."""
    return "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"


def text_tasks(text: str, *, source: str, tz: tzinfo, cluster: str = "", fields: list[str] | None = None,
               delimiter: str = "|", gpus_tracked: bool | None = None) -> list[ChunkTask]:
    """The chunks of ``-P`` text in memory (its first line the header unless ``fields``
    names the columns), as character ranges ``lo..hi`` of ``text``: :class:`ChunkPool`
    cuts each one out as it hands the chunk to a worker (so the text is not held twice)."""
    header = None if fields is not None else io.StringIO(text, newline="\n").readline()
    return [ChunkTask(source=source, tz=tz, cluster=cluster, lo=lo, hi=hi, fields=fields, delimiter=delimiter,
                      header=None if lo == 0 else header, gpus_tracked=gpus_tracked)
            for lo, hi in text_ranges(text, max(CHUNK_BYTES, len(header or "") + 1))]


class ChunkPool:
    """The worker processes of one parallel import (a context manager): :meth:`chunks`
    yields the :class:`Chunk` of every task in input order (``text``: the input the tasks
    of :func:`text_tasks` cut), parsed by ``n_workers``
    processes (forked where the platform can, so they start with the parser loaded;
    started before the import's transaction begins). A worker's exception is raised by
    :meth:`chunks`."""

    def __init__(self, tasks: list[ChunkTask], n_workers: int, text: str | None = None):
        self.tasks, self.text = tasks, text
        ctx = multiprocessing.get_context(_start_method())
        self.pool = ctx.Pool(max(1, min(n_workers, len(tasks))), initializer=_bind_null_fast)

    def chunks(self) -> Iterator[Chunk]:
        tasks: Iterable[ChunkTask] = self.tasks
        if self.text is not None:  # text tasks: each one's slice, made when the pool's feeder takes it
            tasks = (dataclasses.replace(t, text=self.text[t.lo:t.hi]) for t in self.tasks)
        return self.pool.imap(_parse, tasks)

    def __enter__(self) -> ChunkPool:
        return self

    def __exit__(self, *exc) -> None:
        self.pool.terminate()
        self.pool.join()


def staged_upsert_sql() -> str:
    """The batched path's upsert (:func:`gpuguard.reports.sync._upsert_sql`) taking its
    values from the staged table, ``synced_at`` and ``source`` as the named parameters
    ``:synced_at`` and ``:source``."""
    from gpuguard.reports.sync import _upsert_sql

    consts = {"synced_at": ":synced_at", "source": ":source"}

    def value(c: str) -> str:
        return consts.get(c) or (f"r.{c}" if c in RARE_COLUMNS else f"s.{c}")
    return _upsert_sql(value, rows=f"{STAGE}.staged AS s LEFT JOIN {STAGE}.staged_rare AS r ON r.row = s.rowid",
                       order="s.rowid")


#: A staged job with a submit time replaces the job's attempt stored without one, as
#: :data:`gpuguard.reports.sync.DROP_UNKNOWN_ATTEMPT_SQL` does row by row.
DROP_UNKNOWN_STAGED_SQL = (f"DELETE FROM main.sacct_jobs WHERE attempt_at = 0 AND (cluster, job_id_raw) IN "
                           f"(SELECT cluster, job_id_raw FROM {STAGE}.staged WHERE submit_at IS NOT NULL)")


def load_chunks(store, chunks: Iterator[Chunk], now: float, source: str, tally,
                on_progress: Callable[[int], None] | None = None) -> int:
    """Upsert every chunk into ``sacct_jobs`` in ONE transaction with the secondary indexes
    set aside (:func:`set_indexes_aside`, :func:`rebuild_indexes`); merge each chunk's tally
    into ``tally`` with its line offset. Returns the jobs offered. Raises what the chunks'
    iterator raises, and :class:`sqlite3.Error`; either rolls the whole load back."""
    from gpuguard.reports.admin_summaries import store_summaries

    conn = store.db.conn
    conn.execute(f"ATTACH DATABASE ':memory:' AS {STAGE}")
    jobs, line_offset = 0, 0
    try:
        with store.tx():
            indexes = set_indexes_aside(conn)
            zero = conn.execute("SELECT EXISTS (SELECT 1 FROM main.sacct_jobs WHERE attempt_at = 0)").fetchone()[0]
            upsert = staged_upsert_sql()
            for n, chunk in enumerate(chunks):
                conn.deserialize(chunk.data, name=STAGE)
                # Statements prepared on the last chunk's schema would read its root pages
                # (the new one's schema cookie can be the same): each chunk's are prepared
                # anew, their text made unique so the sqlite3 module's statement cache misses.
                fresh = f" /* chunk {n} */"
                if zero:
                    conn.execute(DROP_UNKNOWN_STAGED_SQL + fresh)
                conn.execute(upsert + fresh, {"synced_at": now, "source": source})
                store_summaries(store, chunk.admin, now)
                zero = zero or chunk.no_submit
                tally.merge(chunk.tally, line_offset)
                line_offset += chunk.lines
                jobs += chunk.jobs
                if on_progress is not None:
                    on_progress(chunk.nbytes)
            rebuild_indexes(conn, indexes)
    finally:
        conn.execute(f"DETACH DATABASE {STAGE}")
    return jobs


def worth_it(size: int) -> bool:
    """Whether an input of ``size`` bytes (or characters) is parsed in workers: two or more
    of them, and at least two chunks of it (the pool's start-up, about 50 ms, is then a
    small share)."""
    return workers() >= 2 and size >= 2 * CHUNK_BYTES


def import_parallel(store, tasks: list[ChunkTask], *, now: float, result, text: str | None = None,
                    on_progress: Callable[[int], None] | None = None, cache_kib: int = STORE_CACHE_KIB) -> bool:
    """Import the chunks ``tasks`` (:func:`file_tasks`, or :func:`text_tasks` of ``text``)
    of one input into ``sacct_jobs``: a :class:`ChunkPool` into :func:`load_chunks`; fills ``result`` (a
    :class:`~gpuguard.reports.sync.SyncResult`) as the batched path does. ``cache_kib``:
    the page cache while it stores (restored after). Returns False, having written nothing,
    when no worker process can be started (the caller then imports in its own process).
    Raises :class:`~gpuguard.reports.sacct.SacctParseError` for the input's header (before
    any worker starts) and :class:`~gpuguard.store.StoreError`."""
    from gpuguard.reports.sacct import TimeConverter, iter_pipe
    from gpuguard.reports.sync_result import Tally

    first = tasks[0]
    head = text[:65536] if text is not None else header_line(first.path)[0]
    line = io.StringIO(head, newline="\n").readline()
    # the header's errors, here (a header-less input has none to find)
    list(iter_pipe([line] if first.fields is None else [], conv=TimeConverter(first.tz), cluster=first.cluster,
                   fields=first.fields, delimiter=first.delimiter, source=first.source))
    try:
        pool = ChunkPool(tasks, workers(), text)
    except (OSError, AssertionError, ValueError) as e:
        # no processes to be had (a process limit; a daemonic caller, which multiprocessing
        # refuses children): the caller imports in this process instead, nothing written yet
        log.warning("sacct import: no worker processes (%s); parsing in this process", e)
        return False
    tally = Tally()
    conn = store.db.conn
    old_cache = conn.execute("PRAGMA cache_size").fetchone()[0]
    conn.execute(f"PRAGMA cache_size = {-int(cache_kib)}")
    try:
        with pool:
            result.jobs = store._guard("sacct cache bulk load", lambda: load_chunks(
                store, pool.chunks(), now, result.source, tally, on_progress))
    finally:
        conn.execute(f"PRAGMA cache_size = {int(old_cache)}")
    tally.finish(store, result)
    return True


__all__ = ["CHUNK_BYTES", "STAGE_COLUMNS", "Chunk", "ChunkPool", "ChunkTask", "chunk_ranges", "file_tasks",
           "import_parallel", "load_chunks", "parse_chunk", "rebuild_indexes", "set_indexes_aside", "text_ranges",
           "text_tasks", "workers", "worth_it"]
