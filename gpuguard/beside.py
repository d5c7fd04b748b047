"""A read of the same store on a second connection, in a thread, beside the caller's work.

SQLite releases Python's interpreter lock while it steps a query, so two connections to
one file read at once: the Epilog reads a job's training steps (one grouped pass, the
step-time percentiles, the part's per-rank windows) beside its GPU series, and a node
with two free cores pays the longer of the two instead of their sum
(``bench/epilog_long.py``). The second connection is read-only
(:func:`gpuguard.store.open_readonly`): it sees what the caller has committed, never
writes, and never migrates.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Beside:
    """``fn(reader)`` started at once in a thread, ``reader`` a read-only
    :class:`gpuguard.store.Store` on ``store.path``; :meth:`result` waits for it and
    returns ``fn``'s value or raises its exception. Where no second connection can be
    opened (no such file, not readable: a :class:`gpuguard.store.StoreError`), ``fn``
    runs at :meth:`result` on ``store`` itself, the same result one after the other.
    Commit what ``fn`` must see before starting it."""

    def __init__(self, store: Any, fn: Callable[[Any], Any]):
        self._store, self._fn = store, fn
        self._value: Any = None
        self._error: BaseException | None = None
        self._inline = False
        self._thread = threading.Thread(target=self._run, name="gpuguard-beside", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from gpuguard.store import StoreError, open_readonly

        try:
            reader = open_readonly(self._store.path)
        except StoreError:
            self._inline = True
            return
        try:
            self._value = self._fn(reader)
        except BaseException as e:  # handed to the caller by result()
            self._error = e
        finally:
            reader.close()

    def result(self) -> Any:
        """``fn``'s value (module docstring); raises what ``fn`` raised."""
        self._thread.join()
        if self._inline:
            return self._fn(self._store)
        if self._error is not None:
            raise self._error
        return self._value
