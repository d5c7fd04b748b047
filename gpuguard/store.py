"""The node store: SQLite through sqlite-utils (DESIGN.md, "Storage").

WAL journal, a busy timeout, and named migration sets: each stage owns its tables as a
:class:`MigrationSet` (sqlite-utils ``Migrations``) registered with :func:`register_set`
(the core's set :data:`CORE` here; ``gpuguard.collector.schema``,
``gpuguard.epilog.schema``, ``gpuguard.reports.schema``), applied by :func:`open_store`. The file is
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
from datetime import UTC, datetime
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
        import sqlite_utils.migrations  # MigrationSet's base class
    finally:
        for m in blocked:
            del sys.modules[m]
    return mod


sqlite_utils = _import_sqlite_utils()

BUSY_TIMEOUT_MS = 5000
_SCALARS = (type(None), int, float, str)


class StoreError(Exception):
    """The store could not be opened, read or written; ``str()`` is one line."""


# -- named migration sets -----------------------------------------------------------------
class MigrationSet(sqlite_utils.migrations.Migrations):
    """A stage's named, ordered store migrations (sqlite-utils ``Migrations``: each step
    recorded by (set name, step name) in ``_sqlite_migrations``; append steps, never edit
    a released one).

    ``requires``: sets whose tables this one needs (applied first). ``legacy``: step name
    -> the ``PRAGMA user_version`` of the numbered migration that created the same schema
    before named sets existed; a store at that version or later gets the step recorded
    as applied without running it.
    """

    def __init__(self, name: str, *, requires: tuple[str, ...] = (), legacy: dict[str, int] | None = None):
        super().__init__(name)
        self.requires = requires
        self.legacy = dict(legacy or {})

    @property
    def names(self) -> list[str]:
        """The step names, in order."""
        return [m.name for m in self._migrations]

    def record(self, db: sqlite_utils.Database, step: str) -> None:
        """Record ``step`` as applied without running it (adopting a numbered-era store)."""
        db[self.migrations_table].insert({"migration_set": self.name, "name": step,
                                          "applied_at": str(datetime.now(UTC))})


#: Registered sets by name, in registration order (:func:`register_set`).
_SETS: dict[str, MigrationSet] = {}

#: ``user_version`` of a store migrated by named sets. Stores at 1..5 were migrated by
#: the numbered list that came before; they are adopted (see ``MigrationSet.legacy``).
NAMED_SETS_VERSION = 6


def register_set(ms: MigrationSet) -> MigrationSet:
    """Register a stage's migration set; :func:`open_store` applies every registered set.
    A stage registers its set when its package is imported, so a process that uses a
    stage's tables has that stage's set; the core never imports a stage."""
    if _SETS.get(ms.name, ms) is not ms:
        raise ValueError(f"migration set {ms.name!r} registered twice")
    _SETS[ms.name] = ms
    return ms


def registered_sets() -> list[MigrationSet]:
    """The registered sets in dependency order (``requires`` first, else registration
    order). Raises ValueError for a set requiring one that is not registered."""
    out: list[MigrationSet] = []

    def visit(ms: MigrationSet, path: tuple[str, ...]) -> None:
        if ms in out:
            return
        for dep in ms.requires:
            if dep not in _SETS:
                raise ValueError(f"migration set {ms.name!r} requires {dep!r}, which is not registered")
            if dep in path:
                raise ValueError(f"migration sets {' -> '.join((*path, dep))} form a cycle")
            visit(_SETS[dep], (*path, dep))
        out.append(ms)

    for ms in list(_SETS.values()):
        visit(ms, (ms.name,))
    return out


CORE = MigrationSet("core", legacy={"health_tables": 1, "job_indexes": 2, "node_idle": 3})


@CORE(name="health_tables")
def _core_health_tables(db: sqlite_utils.Database) -> None:
    """GPU inventory, health runs, findings, events (XIDs, collector deaths), kernel-log
    cursors and the counters kept between runs ("rising since the last run")."""
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
    db["events"].create_index(["node", "at"])
    db["findings"].create_index(["node", "code", "at"])


@CORE(name="job_indexes")
def _core_job_indexes(db: sqlite_utils.Database) -> None:
    """Per-job lookups of events and findings (``gpuguard job show``)."""
    db["events"].create_index(["job_id"])
    db["findings"].create_index(["job_id"])


@CORE(name="node_idle")
def _core_node_idle(db: sqlite_utils.Database) -> None:
    """The idle-baseline check's readings per GPU (:mod:`gpuguard.checks.idle`)."""
    db["node_idle"].create(
        {"id": int, "node": str, "uuid": str, "gpu_index": int, "at": float, "job_id": str,
         "temp_c": float, "power_w": float, "sm_clock_mhz": float, "flagged": int},
        pk="id",
    )
    db["node_idle"].create_index(["node", "uuid", "at"])


register_set(CORE)


class Store:
    """A node (or cluster) store. Use :func:`open_store` to get one."""

    def __init__(self, db: sqlite_utils.Database, path: str):
        self.db = db
        self.path = path
        self._series: Any = None  # gpuguard.samples.SeriesCache, made on the first sample write
        #: Results computed from this store and reused while it is open (the job summary's
        #: bucketed sample pass, reused by the verdict); cleared by every sample write.
        self.memo: dict[Any, Any] = {}

    # -- generic ----------------------------------------------------------------
    @contextlib.contextmanager
    def tx(self) -> Iterator[None]:
        """One write transaction, rolled back on error. Outermost: ``BEGIN IMMEDIATE``, so
        that a writer waits out the busy timeout for the write lock instead of failing on
        a lock upgrade (sqlite-utils' ``db.atomic()`` begins a deferred transaction);
        nested: ``db.atomic()``'s savepoint."""
        if self.db.conn.in_transaction:
            with self.db.atomic():
                yield
            return
        self.db.conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            if self.db.conn.in_transaction:
                self.db.conn.execute("ROLLBACK")
            raise
        self.db.conn.execute("COMMIT")

    def _guard(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except sqlite3.Error as e:
            raise StoreError(f"store {self.path}: {what} failed: {e}") from None

    def insert(self, table: str, row: dict[str, Any]) -> int:
        """Insert one row; returns its rowid (0 for ``samples``). Raises :class:`StoreError`."""
        if table == "samples":
            self.insert_many(table, [row])
            return 0

        def go() -> int:
            with self.tx():
                return self.db[table].insert(row).last_rowid
        return self._guard(f"insert into {table}", go)

    def insert_many(self, table: str, rows: Iterable[dict[str, Any]]) -> None:
        """Insert rows in one transaction. ``samples`` rows (real units: the old dict row
        shape, or the collector's tuples) go to the compact tables through
        :func:`gpuguard.samples.write`. Raises :class:`StoreError`."""
        self.insert_tables({table: rows})

    def insert_tables(self, batches: dict[str, Iterable[Any]]) -> None:
        """Insert the rows of several tables (table -> rows, as :meth:`insert_many` takes
        them) in ONE transaction, so a writer that flushes several tables at once (the
        collector, every few seconds) pays one commit. All or nothing. Raises
        :class:`StoreError`."""
        batches = {t: (r if t == "samples" else list(r)) for t, r in batches.items()}
        if "samples" in batches:
            from gpuguard import samples

            if self._series is None:
                self._series = samples.SeriesCache()
            self.memo.clear()

        def go() -> None:
            try:
                with self.tx():
                    for table, rows in batches.items():
                        if table == "samples":
                            samples.write(self.db.conn, self._series, rows)
                        elif rows:
                            self._insert_rows(table, rows)
            except BaseException:
                if "samples" in batches:
                    self._series = samples.SeriesCache()  # ids of a rolled-back series are void
                raise
        self._guard(f"insert into {', '.join(batches)}", go)

    def _insert_rows(self, table: str, rows: list[dict[str, Any]]) -> None:
        cols = list(rows[0])
        keys = set(cols)
        plain = all(r.keys() == keys and all(type(v) in _SCALARS for v in r.values()) for r in rows)
        if plain and all(c.isidentifier() for c in cols):
            # same keys, scalar values: one executemany (sqlite-utils' insert_all
            # inspects and converts every value, which the collector pays each flush)
            self.db.conn.executemany(
                f"insert into [{table}] ({', '.join(cols)}) values ({', '.join('?' * len(cols))})",
                [tuple(r[c] for c in cols) for r in rows])
        else:
            self.db[table].insert_all(rows, batch_size=500)

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


def _applied(db: sqlite_utils.Database) -> set[tuple[str, str]]:
    if not db.conn.execute("select 1 from sqlite_master where type = 'table' and name = '_sqlite_migrations'"
                           ).fetchone():
        return set()
    return {(r[0], r[1]) for r in db.conn.execute("select migration_set, name from _sqlite_migrations")}


def _migrate(db: sqlite_utils.Database, version: int, sets: list[MigrationSet]) -> None:
    """Apply the pending steps of ``sets`` under one write lock. Raises ValueError for a
    store newer than this code, sqlite3.Error when a step fails (all rolled back)."""
    if version > NAMED_SETS_VERSION:
        raise ValueError(f"schema version {version} is newer than this gpuguard ({NAMED_SETS_VERSION})")
    # The common case (every hook run): one read, no write lock.
    applied = _applied(db)
    _refuse_newer(applied, sets)
    if version == NAMED_SETS_VERSION and all((ms.name, n) in applied for ms in sets for n in ms.names):
        return
    conn = db.conn
    # BEGIN IMMEDIATE takes the write lock up front: the prolog and the collector may
    # open a new store at the same moment, and whoever waits must re-read what the other
    # applied (a deferred BEGIN, as db.atomic() uses, would fail on the lock upgrade
    # instead of waiting out the busy timeout). The steps run in savepoints inside it.
    conn.execute("BEGIN IMMEDIATE")
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        applied = _applied(db)
        for ms in sets:
            ms.ensure_migrations_table(db)
            for step, since in ms.legacy.items():
                if 0 < since <= version < NAMED_SETS_VERSION and (ms.name, step) not in applied:
                    ms.record(db, step)  # its tables were created by the numbered migration `since`
            ms.apply(db)
        conn.execute(f"PRAGMA user_version = {NAMED_SETS_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def _refuse_newer(applied: set[tuple[str, str]], sets: list[MigrationSet]) -> None:
    """A step of a known set that this code lacks was written by a newer gpuguard."""
    for ms in sets:
        newer = {n for s, n in applied if s == ms.name} - set(ms.names)
        if newer:
            raise ValueError(f"migration set {ms.name!r} has step(s) {', '.join(sorted(newer))} "
                             "unknown to this gpuguard (written by a newer version)")


def ensure_sets(store: Store, sets: list[MigrationSet]) -> None:
    """Apply the pending steps of ``sets`` to an already open store: for a stage whose
    package was imported after the store was opened (a ``gpuguard health`` step loaded
    after the run opened its store). One read when nothing is pending. Raises
    :class:`StoreError`."""
    version = store.db.conn.execute("PRAGMA user_version").fetchone()[0]
    try:
        _migrate(store.db, version, sets)
    except (sqlite3.Error, ValueError) as e:
        raise StoreError(f"store {store.path}: {e}") from None


def open_store(path: str, *, create: bool = True, mode: int = 0o640,
               sets: list[MigrationSet] | None = None) -> Store:
    """Open (and on first use create, mode ``mode``) the store at ``path``, switch on WAL
    and the busy timeout, and apply the pending steps of ``sets`` (default: every
    registered set, :func:`registered_sets`).

    Raises :class:`StoreError` when the file or its directory cannot be created, the file
    is not a database (corrupt), or a migration fails. A database newer than this code
    (``user_version`` above :data:`NAMED_SETS_VERSION`, or a step of a known set this code
    does not have) is refused rather than written to.
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
    try:
        _migrate(db, version, list(sets) if sets is not None else registered_sets())
    except (sqlite3.Error, ValueError) as e:
        conn.close()
        raise StoreError(f"store {path}: {e}") from None
    return Store(db, path)
