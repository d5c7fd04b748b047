"""Training-step records for gpuguard: a dependency-free API for training code.

Standard library only, cheap to import, and a no-op when ``GPUGUARD_JOB_DIR`` is unset
(outside Slurm, or where gpuguard's TaskProlog did not export it)::

    from gpuguard.collector.train import recorder

    rec = recorder()                         # one per process (rank)
    for n, batch in enumerate(loader):
        with rec.step(step=n, samples=32, tokens=8192) as s:
            with s.phase("data_wait"):
                batch = next(it)
            with s.phase("fwd_bwd"):
                loss = model(batch); loss.backward()
            with s.phase("comm"):
                allreduce()
            with s.phase("optim"):
                opt.step()
            s.loss = loss.item()             # or float(loss); NaN/inf is flagged
            s.grad_norm = gn
        if n % 1000 == 0:
            with rec.checkpoint(step=n):
                save()

    # code that times itself:
    rec.log_step(n, step_time_s=0.41, samples=32, loss=2.3, phases={"data_wait": 0.02})
    rec.log_checkpoint(duration_s=12.5, step=n)

Phases: ``data_wait``, ``fwd_bwd``, ``comm``, ``optim`` (an unknown name raises
``ValueError``); a phase entered several times in one step adds up; only phases
measured appear in the record. A step whose ``with`` block raises is not recorded.
``step=None`` numbers steps 0, 1, 2, ... per recorder.

Output: JSON lines appended to ``$GPUGUARD_JOB_DIR/train.rank{R}.jsonl`` (opened
``O_APPEND|O_CREAT|O_NOFOLLOW``, mode 0600), rank from ``RANK``, else ``SLURM_PROCID``,
else 0. Schema version 1 (the epilog's ingest, :mod:`gpuguard.collector.ingest`, relies
on it exactly; keys in this order)::

    {"v":1,"kind":"step","rank":R,"t":<epoch s at step end>,"step":N,"step_time_s":float,
     "samples":int|null,"tokens":int|null,"loss":float|null,"loss_nonfinite":bool,
     "grad_norm":float|null,
     "phases":{"data_wait_s":float,"fwd_bwd_s":float,"comm_s":float,"optim_s":float}}
    {"v":1,"kind":"checkpoint","rank":R,"t":<epoch s at end>,"step":N|null,"duration_s":float}

A NaN/inf loss is written as ``"loss":null,"loss_nonfinite":true``; a NaN/inf grad norm
as ``null``. Times are ``time.perf_counter`` differences in seconds.

Cost: records are buffered and written with one ``write`` every :data:`FLUSH_RECORDS`
records or :data:`FLUSH_INTERVAL_S` seconds, on :meth:`Recorder.flush`/:meth:`close`
and at interpreter exit (``atexit``), so a step costs microseconds (``bench/train_api.py``).
A forked child (e.g. a data-loader worker) never writes its parent's buffer. An I/O
error disables the recorder with one line on stderr: training never fails because of it.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import sys
import threading
import time
import weakref
from typing import Any

SCHEMA_VERSION = 1
PHASES = ("data_wait", "fwd_bwd", "comm", "optim")
FLUSH_RECORDS = 256
FLUSH_INTERVAL_S = 5.0

_perf = time.perf_counter
_now = time.time
_mono = time.monotonic
_dumps = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
_PHASE_KEYS = {p: p + "_s" for p in PHASES}
_live: weakref.WeakSet[Recorder] = weakref.WeakSet()


def _rank_from_env(env: Any = os.environ) -> int:
    for name in ("RANK", "SLURM_PROCID"):
        v = env.get(name)
        if v is not None and v.strip().isdigit():
            return int(v)
    return 0


def _finite_or_none(x: Any) -> float | None:
    if x is None:
        return None
    f = float(x)
    return f if math.isfinite(f) else None


def _int_or_none(x: Any) -> int | None:
    return None if x is None else int(x)


class _Phase:
    __slots__ = ("key", "step", "t0")

    def __init__(self, step: Step, key: str):
        self.step = step
        self.key = key

    def __enter__(self) -> _Phase:
        self.t0 = _perf()
        return self

    def __exit__(self, *exc: object) -> None:
        ph = self.step.phases
        ph[self.key] = ph.get(self.key, 0.0) + (_perf() - self.t0)


class Step:
    """One timed step (from :meth:`Recorder.step`). Set :attr:`loss`,
    :attr:`grad_norm`, :attr:`samples`, :attr:`tokens` inside the block; time parts of it
    with :meth:`phase` or add measured seconds with :meth:`add_phase`."""

    __slots__ = ("_rec", "_t0", "grad_norm", "loss", "phases", "samples", "step", "tokens")

    def __init__(self, rec: Recorder, step: int | None, samples: int | None, tokens: int | None):
        self._rec = rec
        self.step = step
        self.samples = samples
        self.tokens = tokens
        self.loss: Any = None
        self.grad_norm: Any = None
        self.phases: dict[str, float] = {}

    def phase(self, name: str) -> _Phase:
        """Context manager timing phase ``name`` (one of :data:`PHASES`)."""
        key = _PHASE_KEYS.get(name)
        if key is None:
            raise ValueError(f"unknown phase {name!r}; known: {', '.join(PHASES)}")
        return _Phase(self, key)

    def add_phase(self, name: str, seconds: float) -> None:
        """Add ``seconds`` measured elsewhere to phase ``name``."""
        key = _PHASE_KEYS.get(name)
        if key is None:
            raise ValueError(f"unknown phase {name!r}; known: {', '.join(PHASES)}")
        self.phases[key] = self.phases.get(key, 0.0) + float(seconds)

    def __enter__(self) -> Step:
        self._t0 = _perf()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self._rec._emit_step(self.step, _perf() - self._t0, self.samples, self.tokens,
                                 self.loss, self.grad_norm, self.phases)


class _NullPhase:
    __slots__ = ()

    def __enter__(self) -> _NullPhase:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


_NULL_PHASE = _NullPhase()


class _NullStep:
    """What a disabled recorder hands out: accepts everything, records nothing."""

    __slots__ = ("grad_norm", "loss", "samples", "step", "tokens")

    def __init__(self) -> None:
        self.loss = self.grad_norm = self.samples = self.tokens = self.step = None

    def phase(self, name: str) -> _NullPhase:
        if name not in _PHASE_KEYS:
            raise ValueError(f"unknown phase {name!r}; known: {', '.join(PHASES)}")
        return _NULL_PHASE

    def add_phase(self, name: str, seconds: float) -> None:
        if name not in _PHASE_KEYS:
            raise ValueError(f"unknown phase {name!r}; known: {', '.join(PHASES)}")

    def __enter__(self) -> _NullStep:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


_NULL_STEP = _NullStep()


class _Checkpoint:
    __slots__ = ("_rec", "_t0", "step")

    def __init__(self, rec: Recorder, step: int | None):
        self._rec = rec
        self.step = step

    def __enter__(self) -> _Checkpoint:
        self._t0 = _perf()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self._rec.log_checkpoint(_perf() - self._t0, step=self.step)


class Recorder:
    """Writes this rank's step and checkpoint records (see the module docstring).

    ``job_dir``: default ``$GPUGUARD_JOB_DIR``; ``None``/empty -> disabled (every call is
    a no-op). ``rank``: default from ``RANK``/``SLURM_PROCID``/0. ``flush_records`` /
    ``flush_interval_s``: write after this many buffered records or this many seconds.
    """

    def __init__(self, job_dir: str | None = None, rank: int | None = None, *,
                 flush_records: int = FLUSH_RECORDS, flush_interval_s: float = FLUSH_INTERVAL_S):
        if job_dir is None:
            job_dir = os.environ.get("GPUGUARD_JOB_DIR") or None
        self.rank = _rank_from_env() if rank is None else int(rank)
        self.path = os.path.join(job_dir, f"train.rank{self.rank}.jsonl") if job_dir else None
        self.enabled = self.path is not None
        self.flush_records = max(1, int(flush_records))
        self.flush_interval_s = float(flush_interval_s)
        self._buf: list[str] = []
        self._fd: int | None = None
        self._pid = os.getpid()
        self._next_step = 0
        self._deadline = _mono() + self.flush_interval_s
        self._lock = threading.Lock()
        if self.enabled:
            _live.add(self)

    # -- recording --
    def step(self, step: int | None = None, *, samples: int | None = None,
             tokens: int | None = None) -> Step | _NullStep:
        """Context manager timing one step; see :class:`Step`."""
        if not self.enabled:
            return _NULL_STEP
        return Step(self, step, samples, tokens)

    def checkpoint(self, step: int | None = None) -> _Checkpoint | _NullPhase:
        """Context manager timing one checkpoint save."""
        if not self.enabled:
            return _NULL_PHASE
        return _Checkpoint(self, step)

    def log_step(self, step: int | None, step_time_s: float, *, samples: int | None = None,
                 tokens: int | None = None, loss: Any = None, grad_norm: Any = None,
                 phases: dict[str, float] | None = None) -> None:
        """Record a step timed by the caller. ``phases``: ``{"data_wait": s, ...}``
        (names of :data:`PHASES`). Raises ``ValueError`` for an unknown phase name or a
        non-finite time."""
        if not self.enabled:
            if phases:
                for name in phases:
                    if name not in _PHASE_KEYS:
                        raise ValueError(f"unknown phase {name!r}; known: {', '.join(PHASES)}")
            return
        ph: dict[str, float] = {}
        if phases:
            for name, sec in phases.items():
                key = _PHASE_KEYS.get(name)
                if key is None:
                    raise ValueError(f"unknown phase {name!r}; known: {', '.join(PHASES)}")
                ph[key] = float(sec)
        self._emit_step(step, float(step_time_s), samples, tokens, loss, grad_norm, ph)

    def log_checkpoint(self, duration_s: float, *, step: int | None = None) -> None:
        """Record a checkpoint save that took ``duration_s`` seconds."""
        if not self.enabled:
            return
        self._append(_dumps({"v": SCHEMA_VERSION, "kind": "checkpoint", "rank": self.rank, "t": _now(),
                             "step": _int_or_none(step), "duration_s": float(duration_s)}))

    def _emit_step(self, step: int | None, step_time_s: float, samples: Any, tokens: Any,
                   loss: Any, grad_norm: Any, phases: dict[str, float]) -> None:
        if step is None:
            step = self._next_step
        step = int(step)
        self._next_step = step + 1
        lf = None if loss is None else float(loss)
        nonfinite = lf is not None and not math.isfinite(lf)
        if nonfinite:
            lf = None
        ordered = {k: phases[k] for k in ("data_wait_s", "fwd_bwd_s", "comm_s", "optim_s") if k in phases}
        self._append(_dumps({
            "v": SCHEMA_VERSION, "kind": "step", "rank": self.rank, "t": _now(), "step": step,
            "step_time_s": step_time_s, "samples": _int_or_none(samples), "tokens": _int_or_none(tokens),
            "loss": lf, "loss_nonfinite": nonfinite, "grad_norm": _finite_or_none(grad_norm),
            "phases": ordered,
        }))

    def _append(self, line: str) -> None:
        buf = self._buf
        buf.append(line)
        if len(buf) >= self.flush_records or _mono() >= self._deadline:
            self.flush()

    # -- output --
    def flush(self) -> None:
        """Write buffered records now (one ``write``). Never raises."""
        self._deadline = _mono() + self.flush_interval_s
        if not self._buf or not self.enabled:
            return
        if os.getpid() != self._pid:  # a forked child: the parent owns these records
            self._buf = []
            self.enabled = False
            return
        with self._lock:
            buf, self._buf = self._buf, []
            if not buf:
                return
            data = ("\n".join(buf) + "\n").encode()
            try:
                if self._fd is None:
                    assert self.path is not None
                    self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                                       | os.O_CLOEXEC, 0o600)
                view = memoryview(data)
                while view:
                    n = os.write(self._fd, view)
                    view = view[n:]
            except OSError as e:
                self.enabled = False
                try:
                    sys.stderr.write(f"gpuguard.collector.train: records disabled: {self.path}: {e}\n")
                except Exception:  # stderr itself is gone: nothing left to tell
                    pass

    def close(self) -> None:
        """Flush and close the file; later calls are no-ops."""
        self.flush()
        self.enabled = False
        if self._fd is not None and os.getpid() == self._pid:
            try:
                os.close(self._fd)
            except OSError:
                pass  # already closed: nothing was lost, the data went out with the write
        self._fd = None

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_singleton: Recorder | None = None
_singleton_lock = threading.Lock()


def recorder() -> Recorder:
    """The process-wide :class:`Recorder` (created on first call from the environment)."""
    global _singleton
    if _singleton is None:
        with _singleton_lock:
            if _singleton is None:
                _singleton = Recorder()
    return _singleton


@atexit.register
def _flush_all() -> None:
    for rec in list(_live):
        rec.flush()
