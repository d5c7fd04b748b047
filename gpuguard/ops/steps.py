"""Registered node-check steps of ``gpuguard health``, beyond the GPU checks of
:mod:`gpuguard.checks` (which every health run runs too).

A step is ``fn(ctx: StepContext) -> list[Finding]`` registered by name with :func:`step`,
optionally rate-limited with ``every_s`` (seconds, or a callable taking the config): an
expensive probe (an NCCL all-reduce, an InfiniBand sweep) runs at most that often, and in
the runs between, its last findings are reported again (evidence ``cached_at``), so a
fault found by the probe keeps the node from counting as clean until the probe itself
passes. A step that could not look this time (busy GPUs) raises :class:`Skip`: its last
findings are reported again and it runs again next time. A step that raises anything
else is a tool error, never a finding. Steps are switched off by
name in ``[health] disabled_steps``.

Another module adds its steps by decorating them and appending its module name to
:data:`STEP_MODULES` (one line), which :func:`load_steps` imports.
"""

from __future__ import annotations

import importlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpuguard.model import Finding
from gpuguard.ops import schema as _schema  # noqa: F401  (registers the "ops" store migration set)

#: Modules whose import registers health steps (each adds its own name here).
STEP_MODULES: list[str] = ["gpuguard.net.health_step"]


@dataclass
class StepContext:
    """What a step may use: ``cfg``, the open ``store`` (or None), the ``node`` name, the
    GPU ``snapshot`` of this run (None when the GPU source failed), a monotonic
    ``deadline`` and the ``log``."""

    cfg: Any
    store: Any
    node: str
    snapshot: Any
    deadline: float
    log: Any = None

    def time_left_s(self) -> float:
        """Seconds left before the run's deadline (a step must finish inside it)."""
        return self.deadline - time.monotonic()


StepFn = Callable[[StepContext], list[Finding]]


class Skip(Exception):
    """Raised by a step that could not look this time (its GPUs are busy, a tool is
    missing): the last result stands and is reported again; nothing is saved, so the
    step runs again at the next run."""


@dataclass(frozen=True)
class Step:
    """A registered step: ``every_s`` None = every run; a number or ``fn(cfg) -> s``."""

    name: str
    fn: StepFn
    every_s: float | Callable[[Any], float] | None = None

    def interval_s(self, cfg: Any) -> float | None:
        return self.every_s(cfg) if callable(self.every_s) else self.every_s


STEPS: dict[str, Step] = {}


def step(name: str, *, every_s: float | Callable[[Any], float] | None = None) -> Callable[[StepFn], StepFn]:
    """Register ``fn`` as health step ``name`` (unique), run at most every ``every_s``."""
    def deco(fn: StepFn) -> StepFn:
        if name in STEPS:
            raise ValueError(f"health step {name!r} registered twice")
        STEPS[name] = Step(name, fn, every_s)
        return fn
    return deco


def load_steps() -> dict[str, Step]:
    """Import :data:`STEP_MODULES` (registering their steps); return the registry."""
    for mod in STEP_MODULES:
        importlib.import_module(mod)
    return STEPS


def _cached(store: Any, node: str, name: str) -> dict[str, Any] | None:
    rows = store.query("select at, findings, error from health_steps where node = ? and name = ?", [node, name])
    return rows[0] if rows else None


def _save(store: Any, node: str, name: str, at: float, findings: list[Finding], error: str | None) -> None:
    def go() -> None:
        with store.tx():
            store.db["health_steps"].upsert({"node": node, "name": name, "at": at, "error": error,
                                             "findings": json.dumps([f.to_dict() for f in findings], default=str)},
                                            pk=("node", "name"))
    store._guard("health step update", go)


def _replay(last: dict[str, Any]) -> list[Finding]:
    out = []
    for d in json.loads(last["findings"] or "[]"):
        d["evidence"] = dict(d.get("evidence") or {}, cached_at=last["at"])
        out.append(Finding(**d))
    return out


def run_steps(ctx: StepContext, disabled: list[str] | None = None, now: float | None = None) -> tuple[list[Finding], list[str]]:
    """Run every enabled, due step. Returns ``(findings, tool_errors)``."""
    now = time.time() if now is None else now
    findings: list[Finding] = []
    errors: list[str] = []
    off = set(disabled or [])
    for name, st in load_steps().items():
        if name in off:
            continue
        every = st.interval_s(ctx.cfg)
        if every and ctx.store is not None:
            try:
                last = _cached(ctx.store, ctx.node, name)
            except Exception as e:  # store trouble: run the step rather than skip it
                errors.append(f"health step {name}: store: {e}")
                last = None
            if last is not None and now - last["at"] < every:
                findings += _replay(last)
                continue
        else:
            last = None
        if ctx.time_left_s() <= 0:
            errors.append(f"health step {name}: skipped, no time left in the budget")
            if last is not None:
                findings += _replay(last)
            continue
        error = None
        try:
            got = list(st.fn(ctx))
        except Skip:
            if last is not None:
                findings += _replay(last)
            continue
        except Exception as e:  # a bug or a broken tool in a step is our fault
            got, error = [], f"{type(e).__name__}: {e}"
            errors.append(f"health step {name} crashed: {error}")
        findings += got
        if every and ctx.store is not None and error is None:
            try:
                _save(ctx.store, ctx.node, name, now, got, error)
            except Exception as e:
                errors.append(f"health step {name}: store: {e}")
    return findings, errors
