"""A job's training step records as columns: what the job judge reads them as.

A 64-node x 8-rank day-long job reaches the judge as about 740,000 per-rank window
aggregates (:func:`gpuguard.epilog.part.to_job_data`); one Python object each was most of
the judge's time and memory. :class:`StepTable` holds them as numpy arrays (``float64``,
NaN where a record has no value), sorted by ``t``, and still reads as a sequence of
:class:`~gpuguard.epilog.jobdata.StepRec` (``len``, iteration, indexing, slicing), so code
that walks records keeps working; the hot paths (the compared step metrics, the per-rank
series of the peer checks) use the columns.

Columns, aligned: ``node`` (int32 index into :attr:`StepTable.nodes`, the node names),
``rank`` (float64, NaN = no rank), and :data:`VALUE_COLS` (seconds, counts).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from gpuguard.epilog.jobdata import StepRec

#: The value columns, in :class:`StepRec` field order after ``rank``.
VALUE_COLS = ("t", "step_time_s", "samples", "tokens", "data_wait_s", "fwd_bwd_s", "comm_s", "optim_s")


def _none_for_nan(values: list[float]) -> list[float | None]:
    return [None if v != v else v for v in values]


class StepTable:
    """Step records as aligned columns (module docstring). Slicing gives a view."""

    __slots__ = ("nodes", "node", "rank", *VALUE_COLS, "_series")

    def __init__(self, nodes: Sequence[str | None], node: Any, rank: Any, cols: dict[str, Any]):
        self._series: Any = None
        self.nodes = list(nodes)
        self.node = node
        self.rank = rank
        for c in VALUE_COLS:
            setattr(self, c, cols[c])

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def of(cls, recs: StepTable | Iterable[StepRec]) -> StepTable:
        """``recs`` itself when it is a table, else a table of the records, in their order."""
        if isinstance(recs, StepTable):
            return recs
        recs = list(recs)
        names = list(dict.fromkeys(r.node for r in recs))
        idx = {n: i for i, n in enumerate(names)}
        cols = {c: np.array([np.nan if (v := getattr(r, c)) is None else v for r in recs], dtype=np.float64)
                for c in VALUE_COLS}
        return cls(names, np.array([idx[r.node] for r in recs], dtype=np.int32),
                   np.array([np.nan if r.rank is None else r.rank for r in recs], dtype=np.float64), cols)

    @classmethod
    def concat(cls, tables: Sequence[StepTable]) -> StepTable:
        """One table of ``tables`` in order (node names merged)."""
        idx: dict[str | None, int] = {}
        nodes = []
        for tab in tables:
            remap = np.array([idx.setdefault(n, len(idx)) for n in tab.nodes] or [0], dtype=np.int32)
            nodes.append(remap[tab.node])
        empty = np.zeros(0, dtype=np.float64)
        return cls(list(idx), np.concatenate(nodes) if nodes else np.zeros(0, dtype=np.int32),
                   np.concatenate([t.rank for t in tables]) if tables else empty,
                   {c: np.concatenate([getattr(t, c) for t in tables]) if tables else empty for c in VALUE_COLS})

    def take(self, index: Any) -> StepTable:
        """The rows at ``index`` (an index array or slice), as a new table."""
        return StepTable(self.nodes, self.node[index], self.rank[index],
                         {c: getattr(self, c)[index] for c in VALUE_COLS})

    def sorted_by_t(self) -> StepTable:
        """Rows ordered by ``t``, ties in their present order (as ``list.sort`` does)."""
        return self.take(np.argsort(self.t, kind="stable"))

    # -- sequence of StepRec --------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.t.shape[0])

    def __getitem__(self, k: int | slice) -> Any:
        if isinstance(k, slice):
            return self.take(k)
        return StepRec(self.nodes[int(self.node[k])], None if self.rank[k] != self.rank[k] else int(self.rank[k]),
                       *(None if (v := float(getattr(self, c)[k])) != v else v for c in VALUE_COLS))

    def __iter__(self) -> Iterator[StepRec]:
        names = self.nodes
        ranks = [None if r != r else int(r) for r in self.rank.tolist()]
        cols = [_none_for_nan(getattr(self, c).tolist()) for c in VALUE_COLS]
        for i, n in enumerate(self.node.tolist()):
            yield StepRec(names[n], ranks[i], *(col[i] for col in cols))

    # -- what the verdict reads -----------------------------------------------------------
    def column(self, name: str) -> list[float | None]:
        """One value column as a list (``None`` where the records have no value)."""
        return _none_for_nan(getattr(self, name).tolist())

    def node_names(self) -> set[str]:
        """The (non-empty) node names that have records here."""
        return {n for i, n in enumerate(self.nodes) if n and bool((self.node == i).any())}

    def rank_series(self) -> dict[tuple[str, int], tuple[list[float], list[float | None], list[float | None]]]:
        """``(node or "", int(rank)) -> (t, fwd_bwd_s, comm_s)`` in ``t`` order, over the
        records that have a rank and a ``fwd_bwd_s`` (what the per-rank peer checks read).
        Made once per table (the columns are not changed in place): read-only lists."""
        if self._series is None:
            self._series = self._rank_series()
        return self._series

    def _rank_series(self) -> dict[tuple[str, int], tuple[list[float], list[float | None], list[float | None]]]:
        ok = ~np.isnan(self.rank) & ~np.isnan(self.fwd_bwd_s)
        if not ok.any():
            return {}
        names = [n or "" for n in self.nodes]
        uniq_names = sorted(set(names))
        name_code = np.array([uniq_names.index(n) for n in names], dtype=np.int64)
        node = name_code[self.node[ok]]
        rank = np.trunc(self.rank[ok])
        ranks, rank_code = np.unique(rank, return_inverse=True)
        key = node * len(ranks) + rank_code.reshape(-1)
        order = np.argsort(key, kind="stable")
        key = key[order]
        cuts = np.flatnonzero(np.diff(key)) + 1
        t = np.split(self.t[ok][order], cuts)
        fb = np.split(self.fwd_bwd_s[ok][order], cuts)
        cm = np.split(self.comm_s[ok][order], cuts)
        out = {}
        for k, start in enumerate([0, *cuts.tolist()]):
            kk = int(key[start])
            out[(uniq_names[kk // len(ranks)], int(ranks[kk % len(ranks)]))] = (
                t[k].tolist(), fb[k].tolist(), _none_for_nan(cm[k].tolist()))
        return out
