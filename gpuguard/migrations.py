"""Named store migration sets: each stage owns its tables as a :class:`MigrationSet`
(sqlite-utils ``Migrations``) registered with :func:`register_set` and applied by
``gpuguard.store.open_store`` (:func:`_migrate`). Checking that a store has every step is
one query on plain ``sqlite3``; sqlite-utils is imported only to run a step
(:func:`sqlite_utils_module`).
"""

from __future__ import annotations

import sqlite3
import sys
from collections.abc import Callable
from datetime import UTC, datetime
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
        import sqlite_utils.migrations  # MigrationSet's steps run through it
    finally:
        for m in blocked:
            del sys.modules[m]
    return mod


_MODULE: list[Any] = []


def sqlite_utils_module() -> Any:
    """The sqlite-utils module, imported on the first call. Importing it costs about 86 ms
    (half the Prolog's import time, bench/prolog_healthy.py), and the hooks' recording path
    (inserts, queries, cursors, counters, upserts: ``gpuguard.store.Store``) and an
    up-to-date store's migration check run on plain ``sqlite3``; sqlite-utils is imported
    when a migration step runs or code asks for ``Store.db``. This is the one place the
    core defers an import for the Prolog's budget."""
    if not _MODULE:
        _MODULE.append(_import_sqlite_utils())
    return _MODULE[0]


class MigrationSet:
    """A stage's named, ordered store migrations, applied through sqlite-utils
    ``Migrations`` (each step recorded by (set name, step name) in ``_sqlite_migrations``;
    append steps, never edit a released one). Registering steps (``@SET(name=...)``) and
    checking that a store has them all need no sqlite-utils; applying them imports it.

    ``requires``: sets whose tables this one needs (applied first). ``legacy``: step name
    -> the ``PRAGMA user_version`` of the numbered migration that created the same schema
    before named sets existed; a store at that version or later gets the step recorded
    as applied without running it.
    """

    migrations_table = "_sqlite_migrations"

    def __init__(self, name: str, *, requires: tuple[str, ...] = (), legacy: dict[str, int] | None = None):
        self.name = name
        self.requires = requires
        self.legacy = dict(legacy or {})
        self._steps: list[tuple[str, Callable[[Any], None], bool]] = []

    def __call__(self, *, name: str | None = None, transactional: bool = True
                 ) -> Callable[[Callable[[Any], None]], Callable[[Any], None]]:
        """Decorator registering a step (sqlite-utils ``Migrations.__call__``); ValueError
        for a name already registered in this set."""
        def inner(fn: Callable[[Any], None]) -> Callable[[Any], None]:
            step = name or fn.__name__
            if step in self.names:
                raise ValueError(f"Migration '{step}' is already registered in set '{self.name}'")
            self._steps.append((step, fn, transactional))
            return fn
        return inner

    @property
    def names(self) -> list[str]:
        """The step names, in order."""
        return [n for n, _fn, _t in self._steps]

    def _migrations(self) -> Any:
        ms = sqlite_utils_module().migrations.Migrations(self.name)
        for step, fn, transactional in self._steps:
            ms(name=step, transactional=transactional)(fn)
        return ms

    def ensure_migrations_table(self, db: Any) -> None:
        self._migrations().ensure_migrations_table(db)

    def apply(self, db: Any) -> None:
        """Apply the pending steps (sqlite-utils ``Migrations.apply``)."""
        self._migrations().apply(db)

    def applied(self, db: Any) -> list[Any]:
        """The applied steps, in order (sqlite-utils ``Migrations.applied``)."""
        return self._migrations().applied(db)

    def pending(self, db: Any) -> list[Any]:
        """The steps not applied yet (sqlite-utils ``Migrations.pending``)."""
        return self._migrations().pending(db)

    def record(self, db: Any, step: str) -> None:
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


def _database(conn: sqlite3.Connection) -> Any:
    """A sqlite-utils ``Database`` on ``conn`` (no plugin hooks: gpuguard uses none)."""
    return sqlite_utils_module().Database(conn, execute_plugins=False)


def _applied(conn: sqlite3.Connection) -> set[tuple[str, str]]:
    if not conn.execute("select 1 from sqlite_master where type = 'table' and name = '_sqlite_migrations'"
                        ).fetchone():
        return set()
    return {(r[0], r[1]) for r in conn.execute("select migration_set, name from _sqlite_migrations")}


def _migrate(conn: sqlite3.Connection, version: int, sets: list[MigrationSet]) -> None:
    """Apply the pending steps of ``sets`` under one write lock. Raises ValueError for a
    store newer than this code, sqlite3.Error when a step fails (all rolled back)."""
    if version > NAMED_SETS_VERSION:
        raise ValueError(f"schema version {version} is newer than this gpuguard ({NAMED_SETS_VERSION})")
    # The common case (every hook run): one read, no write lock, no sqlite-utils.
    applied = _applied(conn)
    _refuse_newer(applied, sets)
    if version == NAMED_SETS_VERSION and all((ms.name, n) in applied for ms in sets for n in ms.names):
        return
    db = _database(conn)
    # BEGIN IMMEDIATE takes the write lock up front: the prolog and the collector may
    # open a new store at the same moment, and whoever waits must re-read what the other
    # applied (a deferred BEGIN, as db.atomic() uses, would fail on the lock upgrade
    # instead of waiting out the busy timeout). The steps run in savepoints inside it.
    conn.execute("BEGIN IMMEDIATE")
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        applied = _applied(conn)
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
