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
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, tzinfo

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
from gpuguard.reports.jobstats import is_js1, store_readings
from gpuguard.store import Store, StoreError

CURSOR = "reports.sacct_sync"
BATCH = 2000
#: Page cache of the syncing connection, KiB (see :func:`upsert_jobs`).
SYNC_CACHE_KIB = 65536
#: Live sync asks sacct for this field separator: sacct does not escape its delimiter, and
#: ``|`` is common in free-text comments; ASCII unit separator is not.
LIVE_DELIMITER = "\x1f"

_KEEP_IF_NULL = ("job_name", "user", "account", "partition", "qos", "submit_at", "cpus", "alloc_tres",
                 "nnodes", "node_list", "comment", "admin_comment", "template",
                 "array_job_id", "array_task_id", "het_job_id", "het_job_offset")
_FINAL_SQL = ", ".join(f"'{s}'" for s in sorted(FINAL_STATES))


def _upsert_sql() -> str:
    cols = ", ".join(COLUMNS)
    # attempt_at: the record's submit time; a record without one (a file saved without
    # Submit) is the job's latest stored attempt, or attempt 0 when none is stored
    marks = ", ".join("?" if c != "attempt_at" else
                      "COALESCE(?, (SELECT MAX(attempt_at) FROM sacct_jobs WHERE cluster = ? AND job_id_raw = ?), 0)"
                      for c in COLUMNS)
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
    return (f"INSERT INTO sacct_jobs ({cols}) VALUES ({marks}) "
            f"ON CONFLICT(cluster, job_id_raw, attempt_at) DO UPDATE SET {', '.join(sets)} "
            f"WHERE NOT (sacct_jobs.state IN ({_FINAL_SQL}) AND excluded.state NOT IN ({_FINAL_SQL}))")


UPSERT_SQL = _upsert_sql()
#: A record with a submit time replaces the job's attempt stored without one (attempt 0:
#: imported from a file without Submit), so the same attempt is never charged twice.
DROP_UNKNOWN_ATTEMPT_SQL = ("DELETE FROM sacct_jobs WHERE cluster = ? AND job_id_raw = ? AND attempt_at = 0 "
                            "AND ? IS NOT NULL")


def _row(j: dict) -> tuple:
    """Parameters of :data:`UPSERT_SQL` for one parsed job."""
    out: list = []
    for c in COLUMNS:
        if c == "attempt_at":
            out += [j["submit_at"], j["cluster"], j["job_id_raw"]]
        else:
            out.append(j[c])
    return tuple(out)


@dataclass
class SyncResult:
    """What one import or sync did. ``malformed``: ``(line, message)`` of each skipped
    row (line 1-based in the input; for JSON the index in ``jobs``). ``notes``: the same
    for rows stored with something unknown (a ``|`` in JobName or Comment that either
    could hold)."""

    source: str
    jobs: int = 0
    steps_skipped: int = 0
    malformed: list[tuple[int, str]] = field(default_factory=list)
    notes: list[tuple[int, str]] = field(default_factory=list)
    since: float | None = None
    until: float | None = None
    #: ``(line, job id)`` of stored rows no report can count: no Start (so no usage or
    #: wait) and no End (so no outcome), yet not PENDING (the wait report's pending list).
    unreportable: list[tuple[int, str]] = field(default_factory=list)
    #: ``(line, job id)`` of stored rows whose GPU count is unknown (gpucount module).
    gpus_unknown: list[tuple[int, str]] = field(default_factory=list)
    #: Job ids seen more than once in this input with different submit times (requeued
    #: attempts, ``sacct -D``): each attempt is stored and charged.
    attempts: dict[str, int] = field(default_factory=dict)
    #: GPU utilisation readings taken from jobstats ``JS1:`` AdminComments.
    js1_readings: int = 0

    def summary(self) -> str:
        """One line: what was stored and what of it no report (or no GPU figure) can count,
        e.g. ``f.txt: 2 job(s) stored; 2 without Start/End: in no report (lines 2, 3)``."""
        s = f"{self.source}: {self.jobs} job(s) stored"
        requeued = {k: n for k, n in self.attempts.items() if n > 1}
        if requeued:
            s += f" ({sum(requeued.values())} attempts of {len(requeued)} requeued job(s), each charged)"
        if self.notes:
            s += f" ({len(self.notes)} with JobName/Comment unknown)"
        if self.unreportable:
            s += (f"; {len(self.unreportable)} without Start/End: in no report"
                  f" ({_lines(self.unreportable)})")
        if self.js1_readings:
            s += f"; {self.js1_readings} GPU utilisation reading(s) from jobstats AdminComments"
        if self.gpus_unknown:
            s += (f"; {len(self.gpus_unknown)} with GPU usage unknown (no field carries their GPU count:"
                  f" {_lines(self.gpus_unknown)})")
        if self.steps_skipped:
            s += f", {self.steps_skipped} step row(s) ignored"
        if self.malformed:
            s += f", {len(self.malformed)} malformed row(s) skipped"
        return s


def _lines(items: list[tuple[int, str]], n: int = 5) -> str:
    """``lines 2, 3, 9 ...`` naming the first ``n`` rows (with the job id)."""
    shown = ", ".join(f"{line} (job {jid})" for line, jid in items[:n])
    more = f", ... {len(items) - n} more" if len(items) > n else ""
    return f"line{'s' if len(items) > 1 else ''} {shown}{more}"


def in_no_report(job: dict) -> bool:
    """Whether a stored row reaches no report: cost, efficiency and wait need a Start,
    failures an End (and a final state); the wait report lists PENDING jobs."""
    return job["start_at"] is None and job["end_at"] is None and job["state"] != "PENDING"


def upsert_jobs(store: Store, jobs: Iterable[dict], *, synced_at: float | None = None,
                source: str | None = None) -> int:
    """Upsert parsed jobs (dicts with :data:`COLUMNS`) in batches of :data:`BATCH`, one
    transaction per batch. Returns the number of rows offered. Raises :class:`StoreError`."""
    now = time.time() if synced_at is None else synced_at
    n = 0
    batch: list[tuple] = []
    # The table's indexes insert in unrelated key orders: with SQLite's default
    # 2 MiB page cache every batch re-reads index pages from disk once the cache holds a
    # few hundred thousand jobs, and the sync turns super-linear. A larger cache for the
    # sync's connection keeps them resident (our choice: 64 MiB, a sixth of the 1 M-job table).
    conn = store.db.conn
    old_cache = conn.execute("pragma cache_size").fetchone()[0]
    conn.execute(f"pragma cache_size = {-SYNC_CACHE_KIB}")

    ac_at = COLUMNS.index("admin_comment")
    id_at = COLUMNS.index("job_id_raw")

    def flush() -> None:
        from gpuguard.reports.admin_summaries import store_admin_summaries

        def go() -> None:
            with store.tx():
                store.db.conn.executemany(DROP_UNKNOWN_ATTEMPT_SQL, [(j["cluster"], j["job_id_raw"], j["submit_at"])
                                                                     for j in jobs_batch])
                store.db.conn.executemany(UPSERT_SQL, batch)
                # gpuguard's AdminComment -> job summaries: efficiency works where sacct does
                store_admin_summaries(store, ((r[id_at], r[ac_at]) for r in batch if r[ac_at]), now)
        store._guard("sacct cache upsert", go)
        batch.clear()
        jobs_batch.clear()

    jobs_batch: list[dict] = []
    try:
        for j in jobs:
            j["synced_at"] = now
            if source is not None:
                j["source"] = source
            batch.append(_row(j))
            jobs_batch.append({"cluster": j["cluster"], "job_id_raw": j["job_id_raw"], "submit_at": j["submit_at"]})
            n += 1
            if len(batch) >= BATCH:
                flush()
        if batch:
            flush()
    finally:
        conn.execute(f"pragma cache_size = {int(old_cache)}")
    return n


def _consume(store: Store, rows: Iterator[ParsedRow], result: SyncResult, synced_at: float,
             on_progress: Callable[[int], None] | None, gpus_tracked: bool | None = None) -> None:
    seen: dict[str, set] = {}
    js1: list[tuple[int, str]] = []

    def jobs() -> Iterator[dict]:
        for r in rows:
            if r.error is not None:
                result.malformed.append((r.line, r.error))
            elif r.step:
                result.steps_skipped += 1
            elif r.job is not None:
                j = r.job
                if r.note is not None:
                    result.notes.append((r.line, r.note))
                if gpus_tracked is False and j["gpus"] == 0 and str(j["gpu_source"]).startswith("none:"):
                    j["gpus"], j["gpu_source"] = None, "unknown: AccountingStorageTRES has no gres/gpu"
                if in_no_report(j):
                    result.unreportable.append((r.line, j["job_id"]))
                if j["gpus"] is None:
                    result.gpus_unknown.append((r.line, j["job_id"]))
                seen.setdefault(j["job_id"], set()).add(j["submit_at"])
                if is_js1(j["admin_comment"]):
                    js1.append((j["job_id_raw"], j["admin_comment"]))
                yield j
    result.jobs = upsert_jobs(store, jobs(), synced_at=synced_at, source=result.source)
    result.attempts = {k: len(v) for k, v in seen.items() if len(v) > 1}
    result.js1_readings = store_readings(store, js1)


class _CountingLines:
    """Iterate a text stream's lines, reporting characters read to ``on_progress`` every
    ~1 MB (for click.progressbar on a file's size)."""

    def __init__(self, fh: io.TextIOBase, on_progress: Callable[[int], None] | None):
        self.fh, self.on_progress, self.pending = fh, on_progress, 0

    def __iter__(self) -> Iterator[str]:
        for line in self.fh:
            if self.on_progress is not None:
                self.pending += len(line)
                if self.pending >= 1 << 20:
                    self.on_progress(self.pending)
                    self.pending = 0
            yield line
        if self.on_progress is not None and self.pending:
            self.on_progress(self.pending)


def import_file(store: Store, path: str, *, tz: tzinfo | None = None, cluster: str = "",
                on_progress: Callable[[int], None] | None = None, synced_at: float | None = None) -> SyncResult:
    """Import saved ``sacct -P``/``-p`` output (header line required) or ``sacct --json``
    output from ``path``. ``tz``: the zone the ``-P`` times were printed in (default: as
    :func:`~gpuguard.reports.sacct.resolve_timezone`). ``cluster``: for ``-P`` input
    without a Cluster field. ``on_progress(n)``: characters read since the last call.

    Raises :class:`SacctParseError` (the file is unreadable or not sacct output at all;
    one line naming the file and line) and :class:`StoreError`. Malformed rows are
    skipped and listed in :attr:`SyncResult.malformed`.
    """
    result = SyncResult(source=path)
    now = time.time() if synced_at is None else synced_at
    try:
        fh = open(path, encoding="utf-8", errors="replace", newline="")
    except OSError as e:
        raise SacctParseError(f"{path}: cannot read: {e.strerror or e}") from None
    with fh:
        head = fh.read(4096)
        fh.seek(0)
        if sniff_format(head) == "json":
            try:
                doc = json.load(fh)
            except json.JSONDecodeError as e:
                raise SacctParseError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
            if on_progress is not None:
                on_progress(len(head))
            _consume(store, iter_json(doc, cluster=cluster, source=path), result, now, None)
            return result
        conv = TimeConverter(tz or resolve_timezone())
        rows = iter_pipe(_CountingLines(fh, on_progress), conv=conv, cluster=cluster, source=path)
        _consume(store, rows, result, now, on_progress)
    return result


def import_text(store: Store, text: str, *, tz: tzinfo | None = None, cluster: str = "", source: str = "<text>",
                fields: list[str] | None = None, delimiter: str = "|", synced_at: float | None = None,
                gpus_tracked: bool | None = None) -> SyncResult:
    """Like :func:`import_file` for text in memory (``fields`` for header-less ``-n`` output).
    ``gpus_tracked`` False (the cluster's AccountingStorageTRES has no ``gres/gpu``): a
    job whose TRES hold no GPU has GPU usage unknown, not 0."""
    result = SyncResult(source=source)
    now = time.time() if synced_at is None else synced_at
    if sniff_format(text[:4096]) == "json":
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise SacctParseError(f"{source}:{e.lineno}: invalid JSON: {e.msg}") from None
        _consume(store, iter_json(doc, cluster=cluster, source=source), result, now, None, gpus_tracked)
        return result
    conv = TimeConverter(tz or resolve_timezone())
    rows = iter_pipe(io.StringIO(text, newline=""), conv=conv, cluster=cluster, fields=fields,
                     delimiter=delimiter, source=source)
    _consume(store, rows, result, now, None, gpus_tracked)
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
    tz = resolve_timezone()
    out = slurm.sacct(fields=SACCT_FIELDS, start=_local(since, tz), end=_local(started, tz),
                      delimiter=LIVE_DELIMITER, timeout_s=timeout_s, duplicates=True)
    result = import_text(store, out, tz=tz, cluster=cluster, source="sacct", fields=list(SACCT_FIELDS),
                         delimiter=LIVE_DELIMITER, synced_at=started, gpus_tracked=gpus_tracked(slurm))
    result.since, result.until = since, started
    store.set_cursor(CURSOR, repr(started))
    return result


__all__ = ["CURSOR", "SacctParseError", "StoreError", "SyncResult", "import_file", "import_text",
           "last_sync", "sync_from_slurm", "upsert_jobs"]
