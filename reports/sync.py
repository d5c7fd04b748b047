"""sacct -> ``sacct_jobs`` cache: idempotent upsert, file import, incremental live sync.

Upsert rules (keyed by ``(cluster, job_id_raw)``):

* a new job is inserted; a known one is replaced by the newer record, so a re-sync turns
  PENDING/RUNNING rows into their final state;
* a stored final state (:data:`~gpuguard.reports.sacct.FINAL_STATES`) is never replaced by
  an active one (importing an old file after a newer sync must not resurrect a finished
  job as RUNNING);
* descriptive fields the incoming record lacks (an import whose ``--format`` had fewer
  fields, a 22.05 ``--json`` record without a trustworthy exit code) keep their stored
  values; the lifecycle fields (state, start, end, elapsed) always come from the record.

Rows are written in batches, each batch one transaction: a failure part-way keeps
every batch already written, and a malformed row is skipped (reported with its line) without
touching the store.
"""

from __future__ import annotations

import io
import json
import operator
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, tzinfo

from gpuguard.inputs import json_loads
from gpuguard.reports.sacct import (
    COLUMNS,
    FINAL_STATES,
    SACCT_FIELDS,
    ParsedRow,
    SacctParseError,
    TimeConverter,
    iter_json,
    iter_pipe,
    resolve_timezone,
    sniff_format,
)
from gpuguard.reports.sacct_fields import headerless_fields
from gpuguard.reports.sync_result import SyncResult, Tally
from gpuguard.store import Store, StoreError

CURSOR = "reports.sacct_sync"
BATCH = 2000
#: Page cache of the syncing connection, KiB (see :func:`upsert_jobs`).
SYNC_CACHE_KIB = 65536
#: Most page cache a bulk load (one transaction) may use, KiB: 256 B per expected job up to this cap (our choice:
#: ``bench/sync_1m.py``, 1 M jobs 46.6 ms CPU per 1k with 64 MiB, 37.4 with 256 MiB; pages are allocated as used).
BULK_CACHE_MAX_KIB = 262144
#: Live sync asks sacct for this field separator: sacct does not escape its delimiter, and
#: ``|`` is common in free-text comments; ASCII unit separator is not.
LIVE_DELIMITER = "\x1f"

_KEEP_IF_NULL = ("job_name", "user", "account", "partition", "qos", "submit_at", "cpus", "alloc_tres",
                 "nnodes", "node_list", "comment", "admin_comment", "template",
                 "array_job_id", "array_task_id", "het_job_id", "het_job_offset")
_FINAL_SQL = ", ".join(f"'{s}'" for s in sorted(FINAL_STATES))


def _upsert_sql(value=None, rows: str | None = None, order: str = "rowid") -> str:
    """The upsert of one job's values. ``value(column)``: the SQL of the incoming value of
    ``column`` (default: the numbered parameter ``?N`` of the column's place in
    :data:`COLUMNS`, for :meth:`executemany` of :func:`_row` tuples). ``rows``: a ``FROM``
    clause to take the values from (an ``INSERT ... SELECT`` of a staged table, in the
    ``order`` of its rows), instead of ``VALUES``."""
    cols = ", ".join(COLUMNS)
    at = {c: i + 1 for i, c in enumerate(COLUMNS)}
    value = value or (lambda c: f"?{at[c]}")
    # attempt_at: the record's submit time; a record without one (a file saved without
    # Submit) is the job's latest stored attempt, or attempt 0 when none is stored
    # (numbered parameters: one row binds each column's value once, in COLUMNS order)
    marks = ", ".join(value(c) if c != "attempt_at" else
                      f"COALESCE({value('submit_at')}, (SELECT MAX(j.attempt_at) FROM main.sacct_jobs AS j "
                      f"WHERE j.cluster = {value('cluster')} AND j.job_id_raw = {value('job_id_raw')}), 0)"
                      for c in COLUMNS)
    values = f"VALUES ({marks})" if rows is None else f"SELECT {marks} FROM {rows} WHERE true ORDER BY {order}"
    sets = []
    for c in COLUMNS:
        if c in ("cluster", "job_id_raw"):
            continue
        if c in _KEEP_IF_NULL:
            sets.append(f"{c} = COALESCE(excluded.{c}, sacct_jobs.{c})")
        elif c in ("gpus", "gpu_type", "gpu_source", "time_limit_s"):
            # a record that cannot count the GPUs (no GPU field) keeps the stored count
            keep = "excluded.gpus IS NULL AND sacct_jobs.gpus IS NOT NULL"
            if c == "time_limit_s":
                keep = "excluded.time_limit_s IS NULL"
            sets.append(f"{c} = CASE WHEN {keep} THEN sacct_jobs.{c} ELSE excluded.{c} END")
        elif c == "attempt_at":
            continue
        elif c in ("exit_code", "exit_signal"):
            sets.append(f"{c} = CASE WHEN excluded.exit_code IS NULL AND excluded.exit_signal IS NULL "
                        f"THEN sacct_jobs.{c} ELSE excluded.{c} END")
        else:
            sets.append(f"{c} = excluded.{c}")
    return (f"INSERT INTO main.sacct_jobs ({cols}) {values} "
            f"ON CONFLICT(cluster, job_id_raw, attempt_at) DO UPDATE SET {', '.join(sets)} "
            f"WHERE NOT (sacct_jobs.state IN ({_FINAL_SQL}) AND excluded.state NOT IN ({_FINAL_SQL}))")


UPSERT_SQL = _upsert_sql()
#: A record with a submit time replaces the job's attempt stored without one (attempt 0:
#: imported from a file without Submit), so the same attempt is never charged twice.
DROP_UNKNOWN_ATTEMPT_SQL = ("DELETE FROM sacct_jobs WHERE cluster = ? AND job_id_raw = ? AND attempt_at = 0 "
                            "AND ? IS NOT NULL")


#: The job fields :data:`UPSERT_SQL` binds, in order (``?1``..``?N``; the stored
#: ``attempt_at`` is derived in SQL from the submit time, so its own value is not read).
_ROW_KEYS = COLUMNS
_ROW_GETTER = operator.itemgetter(*_ROW_KEYS)
#: Where the DROP_UNKNOWN_ATTEMPT_SQL parameters sit in a :func:`_row` tuple.
_DROP_AT = tuple(_ROW_KEYS.index(k) for k in ("cluster", "job_id_raw", "submit_at"))
_SUBMIT_AT = _ROW_KEYS.index("submit_at")


def _row(j: dict) -> tuple:
    """Parameters of :data:`UPSERT_SQL` for one parsed job."""
    return _ROW_GETTER(j)


def upsert_jobs(store: Store, jobs: Iterable[dict], *, synced_at: float | None = None,
                source: str | None = None, expect_rows: int | None = None) -> int:
    """Upsert parsed jobs (dicts with :data:`COLUMNS`) in batches of :data:`BATCH`, one
    transaction per batch. Returns the number of rows offered. Raises :class:`StoreError`.

    ``expect_rows``: about how many jobs ``jobs`` holds (an estimate from the input's
    size). When that is at least :data:`BULK_MIN_ROWS` and at least the number of jobs
    already stored, the import is a bulk load (:func:`_bulk_load`): one transaction that
    sets the table's secondary indexes aside and rebuilds them at the end, with a page
    cache sized to the load (:data:`BULK_CACHE_MAX_KIB`; restored afterwards).
    """
    now = time.time() if synced_at is None else synced_at
    # The table's indexes insert in unrelated key orders: with SQLite's default
    # 2 MiB page cache every batch re-reads index pages from disk once the cache holds a
    # few hundred thousand jobs, and the sync turns super-linear. A larger cache for the
    # sync's connection keeps them resident (our choice: 64 MiB, a sixth of the 1 M-job table).
    conn = store.db.conn
    old_cache = conn.execute("pragma cache_size").fetchone()[0]
    conn.execute(f"pragma cache_size = {-SYNC_CACHE_KIB}")
    counted = [0]
    batches = _batches(jobs, now, source, counted)
    try:
        if _bulk(store, expect_rows):
            conn.execute(f"pragma cache_size = {-bulk_cache_kib(expect_rows)}")
            store._guard("sacct cache bulk load", lambda: _bulk_load(store, batches, now))
        else:
            for batch in batches:
                store._guard("sacct cache upsert", lambda b=batch: _write_one_tx(store, b, now))
    finally:
        conn.execute(f"pragma cache_size = {int(old_cache)}")
    return counted[0]


#: Fewest expected jobs for a bulk load: below it the indexes' upkeep per row costs less
#: than rebuilding them (our choice: rebuilding costs about a third of upkeep per job, so
#: a load the size of the table already pays; small loads keep the plain path).
BULK_MIN_ROWS = 20_000


def bulk_cache_kib(expect_rows: int) -> int:
    """The page cache of a bulk load of about ``expect_rows`` jobs, KiB: 256 B a job,
    at least :data:`SYNC_CACHE_KIB`, at most :data:`BULK_CACHE_MAX_KIB`."""
    return min(BULK_CACHE_MAX_KIB, max(SYNC_CACHE_KIB, expect_rows // 4))


def _bulk(store: Store, expect_rows: int | None) -> bool:
    """Whether an import of about ``expect_rows`` jobs is a bulk load: at least
    :data:`BULK_MIN_ROWS`, and at least as many as the table holds."""
    return expect_rows is not None and expect_rows >= BULK_MIN_ROWS and expect_rows >= _stored_rows(store)


def _stored_rows(store: Store) -> int:
    """About how many jobs ``sacct_jobs`` holds (its largest rowid: no table scan)."""
    return store.db.conn.execute("SELECT COALESCE(MAX(rowid), 0) FROM sacct_jobs").fetchone()[0]


def _batches(jobs: Iterable[dict], now: float, source: str | None, counted: list[int]) -> Iterator[list[tuple]]:
    """:func:`_row` tuples of ``jobs`` (stamped with ``synced_at`` and ``source``) in lists
    of :data:`BATCH`; ``counted[0]`` counts the jobs."""
    batch: list[tuple] = []
    for j in jobs:
        j["synced_at"] = now
        if source is not None:
            j["source"] = source
        batch.append(_ROW_GETTER(j))
        if len(batch) >= BATCH:
            counted[0] += len(batch)
            yield batch
            batch = []
    if batch:
        counted[0] += len(batch)
        yield batch


def _write_batch(store: Store, batch: list[tuple], now: float, *, drop_unknown: bool = True) -> None:
    """One batch of :func:`_row` tuples, in the caller's transaction. ``drop_unknown``
    False: the caller knows the store holds no attempt 0 (:data:`DROP_UNKNOWN_ATTEMPT_SQL`
    would delete nothing)."""
    from gpuguard.reports.admin_summaries import store_admin_summaries

    conn = store.db.conn
    if drop_unknown:
        c, i, sub = _DROP_AT
        conn.executemany(DROP_UNKNOWN_ATTEMPT_SQL, [(r[c], r[i], r[sub]) for r in batch])
    conn.executemany(UPSERT_SQL, batch)
    # gpuguard's AdminComment -> job summaries: efficiency works where sacct does
    store_admin_summaries(store, ((r[_ID_AT], r[_AC_AT]) for r in batch if r[_AC_AT]), now)


_ID_AT, _AC_AT = _ROW_KEYS.index("job_id_raw"), _ROW_KEYS.index("admin_comment")


def _write_one_tx(store: Store, batch: list[tuple], now: float) -> None:
    with store.tx():
        _write_batch(store, batch, now)


def _bulk_load(store: Store, batches: Iterator[list[tuple]], now: float) -> None:
    """Every batch in ONE transaction that drops the secondary indexes of ``sacct_jobs``
    first and re-creates them (from their own stored SQL) last: SQLite builds an index
    from sorted keys far faster than it keeps seven indexes current row by row in
    unrelated key orders (measured by ``bench/sync_1m.py``). The primary key stays: each
    upsert looks its job up. A failure or crash part-way rolls the whole load back, indexes
    included (the journal's guarantee, so no relaxed ``synchronous`` setting is needed);
    readers keep seeing the indexed table until the commit (WAL)."""
    from gpuguard.reports.sync_bulk import rebuild_indexes, set_indexes_aside

    conn = store.db.conn
    with store.tx():
        indexes = set_indexes_aside(conn)
        # Attempt-0 rows (a job stored without a submit time) are rare: look once (a scan
        # no longer than the load itself) and again only after a batch that stored one,
        # instead of a delete per job.
        zero = conn.execute("SELECT EXISTS (SELECT 1 FROM sacct_jobs WHERE attempt_at = 0)").fetchone()[0]
        for batch in batches:
            _write_batch(store, batch, now, drop_unknown=bool(zero))
            zero = zero or any(r[_SUBMIT_AT] is None for r in batch)
        rebuild_indexes(conn, indexes)


def _consume(store: Store, rows: Iterator[ParsedRow], result: SyncResult, synced_at: float,
             gpus_tracked: bool | None = None, expect_rows: int | None = None,
             free_text: dict | None = None) -> None:
    tally = Tally()
    result.jobs = upsert_jobs(store, tally.jobs(rows, gpus_tracked, free_text), synced_at=synced_at,
                              source=result.source, expect_rows=expect_rows)
    tally.finish(store, result)


class _CountingLines:
    """Iterate a text stream's lines, reporting characters read to ``on_progress`` about
    every 1 MB (for click.progressbar on a file's size). Lines are read 1 MB at a time
    (``readlines`` with a size hint: the stream's own line splitting), so the count costs
    one call per megabyte, not one per line."""

    def __init__(self, fh: io.TextIOBase, on_progress: Callable[[int], None]):
        self.fh, self.on_progress = fh, on_progress

    def __iter__(self) -> Iterator[str]:
        while True:
            lines = self.fh.readlines(1 << 20)
            if not lines:
                return
            self.on_progress(sum(map(len, lines)))
            yield from lines


def import_file(store: Store, path: str, *, tz: tzinfo | None = None, cluster: str = "",
                on_progress: Callable[[int], None] | None = None, synced_at: float | None = None) -> SyncResult:
    """Import saved ``sacct -P``/``-p`` output (with its header line, or ``-P -n`` output of
    :data:`~gpuguard.reports.sacct.SACCT_FIELDS`: :func:`~gpuguard.reports.sacct_fields.headerless_fields`)
    or ``sacct --json`` output from ``path``. ``tz``: the zone the ``-P`` times were printed in (default: as
    :func:`~gpuguard.reports.sacct.resolve_timezone`). ``cluster``: for ``-P`` input
    without a Cluster field. ``on_progress(n)``: characters read since the last call.

    Raises :class:`SacctParseError` (the file is unreadable or not sacct output at all;
    one line naming the file and line) and :class:`StoreError`. Malformed rows are
    skipped and listed in :attr:`SyncResult.malformed`.
    """
    result = SyncResult(source=path)
    now = time.time() if synced_at is None else synced_at
    try:
        fh = open(path, encoding="utf-8", errors="replace", newline="\n")
    except OSError as e:
        raise SacctParseError(f"{path}: cannot read: {e.strerror or e}") from None
    with fh:
        head = fh.read(4096)
        fh.seek(0)
        if sniff_format(head) == "json":
            try:
                doc = json_loads(fh.read())
            except json.JSONDecodeError as e:
                raise SacctParseError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
            if on_progress is not None:
                on_progress(len(head))
            _consume(store, iter_json(doc, cluster=cluster, source=path), result, now, expect_rows=_json_jobs(doc))
            return result
        conv = TimeConverter(tz or resolve_timezone())
        lines = fh if on_progress is None else _CountingLines(fh, on_progress)
        first = next((ln for ln in io.StringIO(head, newline="\n") if ln.strip()), "")
        delimiter = sniff_delimiter(first)
        if delimiter == ",":
            raise SacctParseError(f"{path}:1: fields separated by ',' (sacct --delimiter=,): AllocTRES and "
                                  "ReqTRES hold commas, so its rows cannot be split; save with sacct -P")
        # saved with -n: read as the live sync's field list when its rows have that shape
        fields = headerless_fields(first, delimiter)
        rows = iter_pipe(lines, conv=conv, cluster=cluster, fields=fields, delimiter=delimiter, source=path)
        # the file's size over the head's line length: an estimate, enough to choose the load
        size = os.fstat(fh.fileno()).st_size
        expect = size * head.count("\n") // max(1, len(head.encode("utf-8", "replace")))
        from gpuguard.reports import sync_bulk

        if _bulk(store, expect) and sync_bulk.worth_it(size) and os.path.isfile(path):
            tasks = sync_bulk.file_tasks(path, size, conv.tz, cluster, fh.fileno())
            for t in tasks:
                t.delimiter = delimiter
                if fields is not None:  # no header line to put in front of each chunk
                    t.fields, t.header = fields, None
            if sync_bulk.import_parallel(store, tasks, now=now, result=result, on_progress=on_progress):
                return result
        _consume(store, rows, result, now, expect_rows=expect)
    return result


#: Delimiters ``sacct --delimiter`` is commonly given besides ``|`` (TSV, the live sync's
#: unit separator; ``,`` is recognised to be refused: AllocTRES holds commas), in the
#: order tried.
_DELIMITERS = ("|", "\t", ";", LIVE_DELIMITER, ",")


def sniff_delimiter(first_line: str) -> str:
    """The ``--delimiter`` a saved ``-P``/``-p`` file was written with: the first of
    :data:`_DELIMITERS` that splits its header line into a JobID or JobIDRaw and only
    field names, or that splits a header-less row of the live field list
    (:func:`~gpuguard.reports.sacct_fields.headerless_fields`); ``|`` otherwise (the
    parser then names what is wrong)."""
    line = first_line.rstrip("\r\n")
    for d in _DELIMITERS:
        if d not in line:
            continue
        names = [n.strip().lower() for n in line.split(d)]
        if names and names[-1] == "":
            names = names[:-1]  # -p
        if ("jobid" in names or "jobidraw" in names) and all(re.fullmatch(r"[a-z][a-z0-9]*", n) for n in names):
            return d
        if headerless_fields(line, d) is not None:
            return d
    return "|"


def _json_jobs(doc) -> int | None:
    """The number of jobs in a ``sacct --json`` document (None when it has no job list)."""
    jobs = doc.get("jobs") if isinstance(doc, dict) else None
    return len(jobs) if isinstance(jobs, list) else None


def import_text(store: Store, text: str, *, tz: tzinfo | None = None, cluster: str = "", source: str = "<text>",
                fields: list[str] | None = None, delimiter: str = "|", synced_at: float | None = None,
                gpus_tracked: bool | None = None, free_text: dict | None = None) -> SyncResult:
    """Like :func:`import_file` for text in memory (``fields`` for header-less ``-n`` output).
    ``gpus_tracked`` False (the cluster's AccountingStorageTRES has no ``gres/gpu``): a
    job whose TRES hold no GPU has GPU usage unknown, not 0. ``free_text``: ``(job_id_raw,
    submit_at) -> (job_name, comment, admin_comment)`` for ``-P`` text without those
    fields (:mod:`gpuguard.reports.sacct_live`); a job it lacks has them unknown."""
    result = SyncResult(source=source)
    now = time.time() if synced_at is None else synced_at
    if sniff_format(text[:4096]) == "json":
        try:
            doc = json_loads(text)
        except json.JSONDecodeError as e:
            raise SacctParseError(f"{source}:{e.lineno}: invalid JSON: {e.msg}") from None
        _consume(store, iter_json(doc, cluster=cluster, source=source), result, now, gpus_tracked,
                 expect_rows=_json_jobs(doc))
        return result
    conv = TimeConverter(tz or resolve_timezone())
    expect = text.count("\n")
    from gpuguard.reports import sync_bulk

    if free_text is None and _bulk(store, expect) and sync_bulk.worth_it(len(text)):
        tasks = sync_bulk.text_tasks(text, source=source, tz=conv.tz, cluster=cluster, fields=fields,
                                     delimiter=delimiter, gpus_tracked=gpus_tracked)
        if sync_bulk.import_parallel(store, tasks, now=now, result=result, text=text):
            return result
    rows = iter_pipe(io.StringIO(text, newline="\n"), conv=conv, cluster=cluster, fields=fields,
                     delimiter=delimiter, source=source)
    _consume(store, rows, result, now, gpus_tracked, expect_rows=expect, free_text=free_text)
    return result


def last_sync(store: Store) -> float | None:
    """UTC epoch of the last successful live sync (the ``cursors`` table), or None."""
    v = store.get_cursor(CURSOR)
    try:
        return float(v) if v is not None else None
    except ValueError:
        return None


def _local(ts: float, tz: tzinfo) -> str:
    return datetime.fromtimestamp(ts, tz).strftime("%Y-%m-%dT%H:%M:%S")


def gpus_tracked(slurm) -> bool | None:
    """Whether the cluster's accounting records GPUs: ``AccountingStorageTRES`` of
    ``scontrol show config`` names ``gres/gpu`` (slurm.conf man page). None when scontrol
    cannot say (then a TRES without GPUs is taken as 0 GPUs, as before)."""
    from gpuguard.slurm import SlurmError

    try:
        text = slurm.run("scontrol", "show", "config", timeout_s=30)
    except SlurmError:
        return None
    for line in text.splitlines():
        key, sep, val = line.partition("=")
        if sep and key.strip() == "AccountingStorageTRES":
            return any(t.strip() == "gres/gpu" or t.strip().startswith("gres/gpu:") for t in val.split(","))
    return None


def sync_from_slurm(store: Store, slurm, *, since: float | None = None, cluster: str = "",
                    first_sync_days: float = 30.0, overlap_s: float = 300.0,
                    now: float | None = None, timeout_s: float = 300.0) -> SyncResult:
    """Pull ``sacct -a -X -D -P -n`` (every attempt) for every job eligible or running since ``since`` (UTC
    epoch; default: the last sync minus ``overlap_s``, or ``first_sync_days`` back on the
    first sync) up to now, upsert it, and advance the cursor to the sync's start time.

    sacct runs in this process's environment, so its wall-clock times are in this
    process's zone (``$TZ`` or the system zone), which is the zone used to read them.
    ``slurm``: a :class:`gpuguard.slurm.SlurmCli`. Raises
    :class:`gpuguard.slurm.SlurmError` and :class:`StoreError`; the cursor only moves
    after every row is stored.
    """
    started = time.time() if now is None else now
    if since is None:
        prev = last_sync(store)
        since = prev - overlap_s if prev is not None else started - first_sync_days * 86400
    from gpuguard.reports.sacct_live import RECORD_FIELDS, free_text_from_json, one_job_per_line
    from gpuguard.slurm import SlurmError

    tz = resolve_timezone()
    window = {"start": _local(since, tz), "end": _local(started, tz), "delimiter": LIVE_DELIMITER,
              "timeout_s": timeout_s, "duplicates": True}
    out = slurm.sacct(fields=SACCT_FIELDS, **window)
    # asked second: the record list then holds every job the full output can hold
    records = slurm.sacct(fields=RECORD_FIELDS, **window)
    kw = {"tz": tz, "cluster": cluster, "source": "sacct", "delimiter": LIVE_DELIMITER, "synced_at": started,
          "gpus_tracked": gpus_tracked(slurm)}
    why = one_job_per_line(out, records, tz, LIVE_DELIMITER)
    if why is None:
        result = import_text(store, out, fields=list(SACCT_FIELDS), **kw)
    else:
        # forged or split records possible: usage from the record list, free text from JSON
        try:
            free = free_text_from_json(slurm, window["start"], window["end"], timeout_s)
            how = "JobName/Comment/AdminComment taken from sacct --json"
        except (SlurmError, ValueError) as e:
            free, how = {}, f"JobName/Comment/AdminComment unknown (sacct --json: {e})"
        result = import_text(store, records, fields=list(RECORD_FIELDS), free_text=free, **kw)
        result.record_check = f"{why}; jobs read from sacct's record list, {how}"
    result.since, result.until = since, started
    store.set_cursor(CURSOR, repr(started))
    return result


__all__ = ["CURSOR", "SacctParseError", "StoreError", "SyncResult", "Tally", "import_file", "import_text",
           "last_sync", "sync_from_slurm", "upsert_jobs"]
