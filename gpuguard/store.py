"""The node store: SQLite through sqlite-utils (DESIGN.md, "Storage").

WAL journal, a busy timeout, and named migration sets: each stage owns its tables as a
:class:`MigrationSet` (sqlite-utils ``Migrations``) registered with :func:`register_set`
(:mod:`gpuguard.migrations`; the core's set :data:`CORE` here; ``gpuguard.collector.schema``,
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
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from gpuguard.migrations import (  # MigrationSet, NAMED_SETS_VERSION, register_set(s): re-exported
    NAMED_SETS_VERSION,
    _SETS,  # noqa: F401  (the registry; tests register a set of their own)
    MigrationSet,
    _database,
    _migrate,
    register_set,
    registered_sets,
    sqlite_utils_module,
)

__all__ = ["BUSY_TIMEOUT_MS", "CORE", "NAMED_SETS_VERSION", "MigrationSet", "Store", "StoreError", "ensure_sets",
           "open_store", "register_set", "registered_sets"]

if TYPE_CHECKING:
    import sqlite_utils


def __getattr__(name: str) -> Any:
    """``gpuguard.store.sqlite_utils``: the module, imported on first use
    (:func:`gpuguard.migrations.sqlite_utils_module`: the hooks' recording path runs on
    plain sqlite3)."""
    if name == "sqlite_utils":
        return sqlite_utils_module()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


BUSY_TIMEOUT_MS = 5000
_SCALARS = (type(None), int, float, str)


class StoreError(Exception):
    """The store could not be opened, read or written; ``str()`` is one line."""


# -- named migration sets -----------------------------------------------------------------
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


@CORE(name="health_run_policy")
def _core_health_run_policy(db: sqlite_utils.Database) -> None:
    """``health_runs.policy_decision``: the policy's outcome for the run's findings
    (``proceed``/``drain``/``fail-job``, :attr:`gpuguard.policy.Decision.decided`) beside
    ``decision``, which is what the run did: ``suppressed`` when maintenance kept a drain
    or fail-job from happening, ``dry-run`` when ``[slurm] drain = false`` did, ``drain``
    for a fail-job the Prolog's streak escalated, ``proceed`` for a fail-job found after
    the job (alerted). NULL on runs recorded before this step: read it as ``decision``
    (those runs recorded the policy's outcome there, suppressed or not)."""
    db.conn.execute("alter table health_runs add column policy_decision text")


register_set(CORE)


class Store:
    """A node (or cluster) store. Use :func:`open_store` to get one.

    ``conn`` is the ``sqlite3`` connection (autocommit: ``isolation_level=None``); the
    methods here write and read through it with plain SQL. :attr:`db`, the sqlite-utils
    ``Database`` on the same connection, is made on first use (module docstring of
    :func:`__getattr__`: the hooks' recording path does not import sqlite-utils)."""

    def __init__(self, db: Any, path: str):
        """``db``: a ``sqlite3.Connection`` or a sqlite-utils ``Database``."""
        if isinstance(db, sqlite3.Connection):
            self.conn, self._db = db, None
        else:
            self.conn, self._db = db.conn, db
        self.path = path
        self._series: Any = None  # gpuguard.samples.SeriesCache, made on the first sample write
        #: Results computed from this store and reused while it is open (the job summary's
        #: bucketed sample pass, reused by the verdict); cleared by every sample write.
        self.memo: dict[Any, Any] = {}

    @property
    def db(self) -> Any:
        """The sqlite-utils ``Database`` on :attr:`conn` (imports sqlite-utils once)."""
        if self._db is None:
            self._db = _database(self.conn)
        return self._db

    # -- generic ----------------------------------------------------------------
    @contextlib.contextmanager
    def tx(self) -> Iterator[None]:
        """One write transaction, rolled back on error. Outermost: ``BEGIN IMMEDIATE``, so
        that a writer waits out the busy timeout for the write lock instead of failing on
        a lock upgrade (sqlite-utils' ``db.atomic()`` begins a deferred transaction);
        nested: a savepoint (what ``db.atomic()`` makes inside a transaction)."""
        conn = self.conn
        if conn.in_transaction:
            sp = f"gg_{id(self):x}_{self._depth}"
            self._depth += 1
            conn.execute(f"SAVEPOINT {sp}")
            try:
                yield
            except BaseException:
                if conn.in_transaction:
                    conn.execute(f"ROLLBACK TO {sp}")
                    conn.execute(f"RELEASE {sp}")
                raise
            finally:
                self._depth -= 1
            conn.execute(f"RELEASE {sp}")
            return
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    _depth = 0

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
                if _plain(table, [row]):
                    return self.conn.execute(*_insert_sql(table, row)).lastrowid or 0
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
        batches = {t: r for t, r in batches.items() if t == "samples" or r}
        if not batches:
            return
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
                            samples.write(self.conn, self._series, rows)
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
        if _plain(table, rows) and all(r.keys() == keys for r in rows):
            # same keys, scalar values: one executemany (sqlite-utils' insert_all
            # inspects and converts every value, which the collector pays each flush)
            self.conn.executemany(_insert_sql(table, rows[0])[0], [tuple(r[c] for c in cols) for r in rows])
        elif _plain(table, rows):
            for r in rows:
                self.conn.execute(*_insert_sql(table, r))
        else:
            self.db[table].insert_all(rows, batch_size=500)

    def query(self, sql: str, params: Iterable[Any] | dict[str, Any] = ()) -> list[dict[str, Any]]:
        """Run a parameterised query; rows as dicts. Raises :class:`StoreError`."""
        def go() -> list[dict[str, Any]]:
            cur = self.conn.execute(sql, params)
            cols = [d[0] for d in cur.description or ()]
            return [dict(zip(cols, r, strict=True)) for r in cur]
        return self._guard("query", go)

    def upsert_many(self, table: str, rows: list[dict[str, Any]], pk: tuple[str, ...]) -> None:
        """Insert rows, or update the columns given of the row with the same primary key
        ``pk`` (sqlite-utils ``upsert_all``; rows of scalars with identifier column names
        through one ``INSERT ... ON CONFLICT DO UPDATE``). Call inside :meth:`tx` or alone
        (its own transaction). Raises :class:`StoreError`."""
        if not rows:
            return

        def go() -> None:
            with self.tx():
                if not _plain(table, rows):
                    self.db[table].upsert_all(rows, pk=pk)
                    return
                for r in rows:
                    sql, vals = _insert_sql(table, r)
                    upd = [c for c in r if c not in pk]
                    sql += f" on conflict ({', '.join(pk)}) do " + (
                        f"update set {', '.join(f'{c} = excluded.{c}' for c in upd)}" if upd else "nothing")
                    self.conn.execute(sql, vals)
        self._guard(f"upsert into {table}", go)

    # -- cursors ------------------------------------------------------------------
    def get_cursor(self, name: str) -> str | None:
        rows = self.query("select value from cursors where name = ?", [name])
        return rows[0]["value"] if rows else None

    def set_cursor(self, name: str, value: str) -> None:
        self.upsert_many("cursors", [{"name": name, "value": value, "updated_at": time.time()}], pk=("name",))

    # -- GPU counters (for "rising since the last run") ---------------------------
    def get_counters(self, node: str) -> dict[str, dict[str, Any]]:
        """``uuid -> counters`` last stored for ``node``."""
        rows = self.query("select uuid, counters from gpu_counters where node = ?", [node])
        return {r["uuid"]: json.loads(r["counters"]) for r in rows}

    def set_counters(self, node: str, by_uuid: dict[str, dict[str, Any]]) -> None:
        now = time.time()

        self.upsert_many("gpu_counters", [{"node": node, "uuid": u, "at": now, "counters": json.dumps(c)}
                                          for u, c in by_uuid.items()], pk=("node", "uuid"))

    def close(self) -> None:
        try:
            self.conn.close()
        except sqlite3.Error:
            pass  # closing a broken connection: nothing left to lose


def _plain(table: str, rows: list[dict[str, Any]]) -> bool:
    """Rows plain SQL can insert as they are: scalar values, identifier names."""
    return table.isidentifier() and all(
        all(type(v) in _SCALARS for v in r.values()) and all(c.isidentifier() for c in r) for r in rows)


def _insert_sql(table: str, row: dict[str, Any]) -> tuple[str, tuple[Any, ...]]:
    return (f"insert into [{table}] ({', '.join(row)}) values ({', '.join('?' * len(row))})", tuple(row.values()))


def ensure_sets(store: Store, sets: list[MigrationSet]) -> None:
    """Apply the pending steps of ``sets`` to an already open store: for a stage whose
    package was imported after the store was opened (a ``gpuguard health`` step loaded
    after the run opened its store). One read when nothing is pending. Raises
    :class:`StoreError`."""
    version = store.conn.execute("PRAGMA user_version").fetchone()[0]
    try:
        _migrate(store.conn, version, sets)
    except (sqlite3.Error, ValueError) as e:
        raise StoreError(f"store {store.path}: {e}") from None



def open_readonly(path: str) -> Store:
    """A :class:`Store` on ``path`` opened read-only through SQLite's ``mode=ro`` URI (no
    create, no migration, no WAL switch: a reader never writes; ``immutable=1`` as well
    while no writer has a WAL open, so not even ``-shm``/``-wal`` files are created beside
    it). Every command that only reads a store (``job show``, ``template list``,
    ``baseline show``, ``node list``/``show``, ``nccl baseline``, ``gpuguard-mail``) opens
    it this way, so it works for any user who can read the file and never migrates it.
    A table a writer has not created yet raises :class:`StoreError` on the first query.
    Raises :class:`StoreError` when it cannot be read by this user."""
    import urllib.parse

    if not os.path.exists(path):
        raise StoreError(f"store {path}: does not exist")
    if not os.access(path, os.R_OK):
        raise StoreError(f"store {path}: not readable by this user")
    # No -wal file: no writer has the store open, and SQLite would otherwise create
    # -wal/-shm beside it (a write in the directory; impossible for a user in a
    # read-only one). immutable=1 reads the file as it is, creating nothing. With a
    # -wal present, mode=ro reads through the writer's WAL index as any reader does.
    flags = "mode=ro" if os.path.exists(path + "-wal") else "mode=ro&immutable=1"
    uri = "file:" + urllib.parse.quote(os.path.abspath(path)) + "?" + flags
    try:
        conn = sqlite3.connect(uri, uri=True, timeout=5.0, isolation_level=None)
        conn.execute("select count(*) from sqlite_master").fetchone()
        version = conn.execute("PRAGMA user_version").fetchone()[0]
    except sqlite3.Error as e:
        raise StoreError(f"store {path}: cannot open read-only: {e}") from None
    if version > NAMED_SETS_VERSION:  # its tables may mean something else than this code reads
        conn.close()
        raise StoreError(f"store {path}: schema version {version} is newer than this gpuguard "
                         f"({NAMED_SETS_VERSION})")
    return Store(conn, path)


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
        conn.execute("PRAGMA recursive_triggers = on")  # as sqlite-utils' Database sets it
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
        _migrate(conn, version, list(sets) if sets is not None else registered_sets())
    except (sqlite3.Error, ValueError) as e:
        conn.close()
        raise StoreError(f"store {path}: {e}") from None
    return Store(conn, path)
