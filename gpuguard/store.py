"""The node store: SQLite through sqlite-utils (DESIGN.md, "Storage").

WAL journal, a busy timeout, schema version in ``PRAGMA user_version`` with forward
migrations (:data:`MIGRATIONS`, applied in order, each in one transaction). The file is
created on first use with mode 0640. Times are UTC epoch seconds (REAL); column names
carry units.

Every failure of the database (locked past the busy timeout, corrupt, read-only, disk
full, unwritable directory) surfaces as :class:`StoreError` with a one-line message, so a
hook can log it as a tool error and carry on deciding from live checks.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any


def _import_sqlite_utils():  # type: ignore[no-untyped-def]
    """Import sqlite-utils without letting it pull in pandas and numpy: it imports both at
    import time when they are installed, only to accept DataFrames and numpy scalars,
    which gpuguard never passes. In a venv with pandas (the dev extra) that tripled the
    Prolog's wall time (bench/prolog_healthy.py: 128 ms -> 363 ms), and the hooks run
    around every job."""
    blocked = [m for m in ("pandas", "numpy") if m not in sys.modules]
    for m in blocked:
        sys.modules[m] = None  # type: ignore[assignment]  # import raises ImportError
    try:
        import sqlite_utils as mod
    finally:
        for m in blocked:
            del sys.modules[m]
    return mod


sqlite_utils = _import_sqlite_utils()

BUSY_TIMEOUT_MS = 5000


class StoreError(Exception):
    """The store could not be opened, read or written; ``str()`` is one line."""


def _m1(db: sqlite_utils.Database) -> None:
    db["inventory"].create(
        {
            "node": str, "uuid": str, "gpu_index": int, "serial": str, "name": str,
            "pci_bus_id": str, "driver_version": str, "cuda_version": str,
            "vbios_version": str, "inforom_version": str,
            "first_seen": float, "last_seen": float,
        },
        pk=("node", "uuid"),
    )
    db["inventory_changes"].create(
        {"id": int, "at": float, "node": str, "uuid": str, "gpu_index": int,
         "field": str, "old": str, "new": str},
        pk="id",
    )
    db["health_runs"].create(
        {"id": int, "node": str, "hook": str, "job_id": str, "started_at": float,
         "finished_at": float, "decision": str, "reason": str, "tool_errors": str,
         "gpu_count": int, "source": str},
        pk="id",
    )
    db["findings"].create(
        {"id": int, "run_id": int, "node": str, "at": float, "job_id": str, "code": str,
         "severity": str, "action": str, "gpu_index": int, "gpu_uuid": str,
         "message": str, "evidence": str},
        pk="id",
        foreign_keys=[("run_id", "health_runs", "id")],
    )
    db["events"].create(
        {"id": int, "node": str, "at": float, "kind": str, "code": int, "gpu_index": int,
         "gpu_uuid": str, "pci_bus_id": str, "pid": int, "process": str, "message": str,
         "action": str, "job_id": str, "source": str, "raw": str},
        pk="id",
    )
    db["cursors"].create({"name": str, "value": str, "updated_at": float}, pk="name")
    db["gpu_counters"].create(
        {"node": str, "uuid": str, "at": float, "counters": str}, pk=("node", "uuid")
    )
    db["samples"].create(
        {"job_id": str, "node": str, "at": float, "gpu_index": int, "gpu_uuid": str,
         "gpu_util_pct": float, "mem_util_pct": float, "mem_used_mib": float,
         "power_w": float, "temp_c": float, "sm_clock_mhz": float, "mem_clock_mhz": float,
         "clock_event_mask": int, "ecc_volatile_uncorrected": int,
         "pcie_replay_count": int},
    )
    db["samples"].create_index(["job_id", "at"])
    db["host_samples"].create(
        {"job_id": str, "node": str, "at": float, "cpu_pct": float, "rss_mib": float,
         "io_read_mib": float, "io_write_mib": float},
    )
    db["host_samples"].create_index(["job_id", "at"])
    db["events"].create_index(["node", "at"])
    db["findings"].create_index(["node", "code", "at"])


def _m2(db: sqlite_utils.Database) -> None:
    """Epilog tables: training steps and checkpoints ingested from the job directory, and
    one summary per (job, node). ``summary`` holds :meth:`JobSummary.to_dict` as JSON
    (``gpuguard.epilog.summary``); the scalar columns beside it are for SQL filters."""
    db["steps"].create(
        {"job_id": str, "node": str, "rank": int, "step": int, "t": float, "step_time_s": float,
         "samples": int, "tokens": int, "loss": float, "loss_nonfinite": int, "grad_norm": float,
         "data_wait_s": float, "fwd_bwd_s": float, "comm_s": float, "optim_s": float},
    )
    db["steps"].create_index(["job_id", "node", "rank", "step"])
    db["checkpoints"].create(
        {"job_id": str, "node": str, "rank": int, "step": int, "t": float, "duration_s": float},
    )
    db["checkpoints"].create_index(["job_id", "node"])
    db["job_summaries"].create(
        {"job_id": str, "node": str, "created_at": float, "started_at": float, "ended_at": float,
         "exit_status_raw": int, "exit_code": int, "exit_signal": int, "collector_status": str,
         "sample_count": int, "step_records": int, "summary_version": int, "summary": str},
        pk=("job_id", "node"),
    )
    db["job_summaries"].create_index(["created_at"])
    db["samples"].create_index(["job_id", "node", "gpu_index", "at"])
    db["events"].create_index(["job_id"])
    db["findings"].create_index(["job_id"])


def _m3(db: sqlite_utils.Database) -> None:
    """Template baselines and verdicts (``gpuguard.epilog.baseline``/``verdict``): one row
    per template, the cached baseline per (template, metric), one verdict per job, one
    comparison per (job, metric), and the prolog's idle readings per GPU (node idle
    baselines). Raw MAD (unscaled); z and relative change as computed at judging time."""
    db["templates"].create(
        {"name": str, "source": str, "first_seen": float, "last_seen": float, "jobs": int, "reset_at": float},
        pk="name",
    )
    db["baselines"].create(
        {"template": str, "metric": str, "median": float, "mad": float, "n": int, "updated_at": float},
        pk=("template", "metric"),
    )
    db["verdicts"].create(
        {"job_id": str, "template": str, "at": float, "state": str, "cause": str, "summary": str,
         "evidence": str, "also": str, "context": str, "exit_code": int, "critical": int,
         "baseline_ok": int, "nodes": str, "start_at": float, "end_at": float},
        pk="job_id",
    )
    db["verdicts"].create_index(["template", "at"])
    db["comparisons"].create(
        {"job_id": str, "template": str, "metric": str, "value": float, "median": float, "mad": float,
         "n": int, "z": float, "rel_change": float, "flagged": int, "sustained_s": float, "at": float},
        pk=("job_id", "metric"),
    )
    db["comparisons"].create_index(["template", "metric"])
    db["node_idle"].create(
        {"id": int, "node": str, "uuid": str, "gpu_index": int, "at": float, "job_id": str,
         "temp_c": float, "power_w": float, "sm_clock_mhz": float, "flagged": int},
        pk="id",
    )
    db["node_idle"].create_index(["node", "uuid", "at"])


def _m4(db: sqlite_utils.Database) -> None:
    """Reports: the ``sacct_jobs`` cache of Slurm accounting (``gpuguard.reports.schema``)."""
    from gpuguard.reports.schema import create_sacct_cache

    create_sacct_cache(db)


def _m5(db: sqlite_utils.Database) -> None:
    """Reports: ``job_gpu_util``, the per-GPU utilisation readings of ``job_summaries``
    kept in step by triggers, so the efficiency report parses no JSON
    (``gpuguard.reports.util_schema``)."""
    from gpuguard.reports.util_schema import create_job_gpu_util

    create_job_gpu_util(db)


def _m6(db: sqlite_utils.Database) -> None:
    """Cluster store (``gpuguard.epilog.judge``): one row per judged job (who, where, which
    nodes' parts were judged, the AdminComment written) and the drains the job judge made
    from the controller (so a re-judge never drains twice)."""
    db["cluster_jobs"].create(
        {"job_id": str, "user": str, "uid": int, "account": str, "partition": str, "job_name": str,
         "nodes": str, "parts": str, "missing": str, "gpus": int, "exit_code_raw": int, "state": str,
         "first_judged_at": float, "judged_at": float, "window_s": float, "cause": str,
         "admin_comment": str, "admin_comment_at": float},
        pk="job_id",
    )
    db["cluster_jobs"].create_index(["judged_at"])
    db["cluster_drains"].create(
        {"id": int, "job_id": str, "node": str, "at": float, "reason": str, "done": int},
        pk="id",
    )
    db["cluster_drains"].create_index(["job_id", "node"], unique=True)


#: Forward migrations; ``user_version`` = number applied. Append, never edit.
MIGRATIONS: list[Callable[[sqlite_utils.Database], None]] = [_m1, _m2, _m3, _m4, _m5, _m6]


class Store:
    """A node (or cluster) store. Use :func:`open_store` to get one."""

    def __init__(self, db: sqlite_utils.Database, path: str):
        self.db = db
        self.path = path

    # -- generic ----------------------------------------------------------------
    @contextlib.contextmanager
    def tx(self) -> Iterator[None]:
        """One write transaction (``BEGIN IMMEDIATE`` ... ``COMMIT``, rolled back on error)."""
        self.db.conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.db.conn.execute("ROLLBACK")
            raise
        self.db.conn.execute("COMMIT")

    def _guard(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except sqlite3.Error as e:
            raise StoreError(f"store {self.path}: {what} failed: {e}") from None

    def insert(self, table: str, row: dict[str, Any]) -> int:
        """Insert one row; returns its rowid. Raises :class:`StoreError`."""
        def go() -> int:
            with self.tx():
                return self.db[table].insert(row).last_rowid
        return self._guard(f"insert into {table}", go)

    def insert_many(self, table: str, rows: Iterable[dict[str, Any]]) -> None:
        """Insert rows in one transaction. Raises :class:`StoreError`."""
        def go() -> None:
            with self.tx():
                self.db[table].insert_all(rows, batch_size=500)
        self._guard(f"insert into {table}", go)

    def query(self, sql: str, params: Iterable[Any] | dict[str, Any] = ()) -> list[dict[str, Any]]:
        """Run a parameterised query; rows as dicts. Raises :class:`StoreError`."""
        return self._guard("query", lambda: list(self.db.query(sql, params)))

    # -- cursors ------------------------------------------------------------------
    def get_cursor(self, name: str) -> str | None:
        rows = self.query("select value from cursors where name = ?", [name])
        return rows[0]["value"] if rows else None

    def set_cursor(self, name: str, value: str) -> None:
        def go() -> None:
            with self.tx():
                self.db["cursors"].upsert({"name": name, "value": value, "updated_at": time.time()}, pk="name")
        self._guard("cursor update", go)

    # -- GPU counters (for "rising since the last run") ---------------------------
    def get_counters(self, node: str) -> dict[str, dict[str, Any]]:
        """``uuid -> counters`` last stored for ``node``."""
        rows = self.query("select uuid, counters from gpu_counters where node = ?", [node])
        return {r["uuid"]: json.loads(r["counters"]) for r in rows}

    def set_counters(self, node: str, by_uuid: dict[str, dict[str, Any]]) -> None:
        now = time.time()

        def go() -> None:
            with self.tx():
                self.db["gpu_counters"].upsert_all(
                    [{"node": node, "uuid": u, "at": now, "counters": json.dumps(c)} for u, c in by_uuid.items()],
                    pk=("node", "uuid"),
                )
        self._guard("counter update", go)

    def close(self) -> None:
        try:
            self.db.conn.close()
        except sqlite3.Error:
            pass  # closing a broken connection: nothing left to lose


def open_store(path: str, *, create: bool = True, mode: int = 0o640) -> Store:
    """Open (and on first use create, mode ``mode``) the store at ``path``, switch on WAL
    and the busy timeout, and apply pending migrations.

    Raises :class:`StoreError` when the file or its directory cannot be created, the file
    is not a database (corrupt), or a migration fails. A database newer than this code
    (``user_version`` above ``len(MIGRATIONS)``) is refused rather than written to.
    """
    try:
        if create and not os.path.exists(path):
            os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o755, exist_ok=True)
            fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW, mode)
            os.close(fd)
        elif not os.path.exists(path):
            raise StoreError(f"store {path}: does not exist")
    except OSError as e:
        raise StoreError(f"store {path}: cannot create: {e.strerror or e}") from None
    try:
        conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        db = sqlite_utils.Database(conn)
        mode_now = conn.execute("PRAGMA journal_mode").fetchone()[0]
        if mode_now != "wal":
            try:
                conn.execute("PRAGMA journal_mode = wal")
            except sqlite3.OperationalError:
                pass  # read-only media: WAL unavailable; reads still work, writes raise later
        conn.execute("PRAGMA foreign_keys = ON")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
    except sqlite3.Error as e:
        raise StoreError(f"store {path}: cannot open: {e}") from None
    if version > len(MIGRATIONS):
        conn.close()
        raise StoreError(
            f"store {path}: schema version {version} is newer than this gpuguard ({len(MIGRATIONS)})"
        )
    for n in range(version, len(MIGRATIONS)):
        try:
            conn.execute("BEGIN IMMEDIATE")
            # Another process (prolog and collector start together) may have migrated
            # while we waited for the write lock: re-read inside the transaction.
            if conn.execute("PRAGMA user_version").fetchone()[0] > n:
                conn.execute("COMMIT")
                continue
            MIGRATIONS[n](db)
            conn.execute(f"PRAGMA user_version = {n + 1}")
            conn.execute("COMMIT")
        except sqlite3.Error as e:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass  # no transaction left to roll back
            conn.close()
            raise StoreError(f"store {path}: migration {n + 1} failed: {e}") from None
    return Store(db, path)
