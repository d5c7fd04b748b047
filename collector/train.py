"""Training-step records for gpuguard: a dependency-free API for training code.

Size: one module on purpose. It is the whole API training code imports (alone: it
imports nothing of gpuguard), and its docstring is the record-format contract the
epilog's ingest checks exactly; the real and null recorders, steps and phases mirror each
other and the value checks mirror the ingest's bounds, so they are read and changed
together. Most of the length is that contract and the per-value checks that keep a bad
value from ever raising into a training loop.

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

Values are checked before they are written, with the rules the epilog's ingest applies,
so a record this module writes is never dropped there and a bad value never raises into
training code. ``loss``/``grad_norm`` are anything ``float()`` takes (a Python or NumPy
number, a one-element tensor); anything else (a list, ``"nan?"``, a bool) is written as
``null``. ``samples``/``tokens`` must be integers in ``0 .. 2**40`` (an integral float
or numeric string is converted; ``inf``, ``-1``, ``3.5``, ``"many"`` become ``null``). A
phase time outside ``0 .. MAX_DURATION_S`` is left out. A record whose *required* value
is unusable is not written: ``step`` not an integer in ``0 .. 2**63-1`` (``"epoch1"``,
``-1``), or a ``log_step`` ``step_time_s`` / ``log_checkpoint`` ``duration_s`` that is not a
number in ``0 .. 366 days`` (:data:`MAX_DURATION_S`). Each kind of problem is reported
once per recorder with one line on stderr. Only an unknown phase *name* raises (``ValueError``): that is a typo in the
code, found on the first call whether the recorder is enabled or not.

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
import operator
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
_PHASE_ORDER = tuple(_PHASE_KEYS.values())
_live: weakref.WeakSet[Recorder] = weakref.WeakSet()


#: Largest integer the ingest (and SQLite's INTEGER) accepts.
INT_MAX = 2**63 - 1
#: Largest ``samples``/``tokens`` and duration (seconds) the ingest accepts (the same
#: bounds as ``gpuguard.collector.ingest.MAX_COUNT`` / ``MAX_DURATION_S``; this module
#: imports nothing of gpuguard, so training code loads it alone).
MAX_COUNT = 2**40
MAX_DURATION_S = 366 * 86400.0
_INF = math.inf
_BAD: Any = object()  # "this value is unusable" (distinct from None, "not given")


def _rank_from_env(env: Any = os.environ) -> int:
    for name in ("RANK", "SLURM_PROCID"):
        v = env.get(name)
        if v is not None and v.strip().isascii() and v.strip().isdigit() and int(v) <= INT_MAX:
            return int(v)
    return 0


def _count(x: Any) -> Any:
    """``x`` as an int in ``0..INT_MAX``, ``None`` for ``None``, else :data:`_BAD`."""
    if type(x) is int:
        return x if 0 <= x <= INT_MAX else _BAD
    if x is None or isinstance(x, bool):
        return _BAD if x is not None else None
    try:
        v = operator.index(x)  # int subclasses, NumPy/torch integers: exact
    except TypeError:
        try:
            f = float(x)  # an integral float, "32", a one-element tensor
        except Exception:
            return _BAD
        if not f.is_integer():  # inf, nan, 3.5: not a count
            return _BAD
        v = int(f)
    except Exception:
        return _BAD
    return v if 0 <= v <= INT_MAX else _BAD


def _real(x: Any) -> Any:
    """``float(x)`` (may be NaN/inf), ``None`` for ``None``, :data:`_BAD` when ``float()``
    refuses it or it is a bool."""
    if type(x) is float:
        return x
    if x is None:
        return None
    if isinstance(x, bool):
        return _BAD
    try:
        return float(x)
    except Exception:
        return _BAD


def _seconds(x: Any) -> Any:
    """``x`` as a float in ``0 .. MAX_DURATION_S``, else :data:`_BAD` (``None`` included)."""
    f = x if type(x) is float else _real(x)
    if f is None or f is _BAD or not 0.0 <= f <= MAX_DURATION_S:
        return _BAD
    return f


def _safe_repr(x: Any) -> str:
    try:
        r = repr(x)
    except Exception:
        r = f"<{type(x).__name__}>"
    return r if len(r) <= 60 else r[:57] + "..."


def _stderr(msg: str) -> None:
    try:
        sys.stderr.write(f"gpuguard.collector.train: {msg}\n")
    except Exception:  # stderr itself is gone: nothing left to tell
        pass


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
        sec = _seconds(seconds)
        if sec is _BAD:
            self._rec._problem(f"phase {name}", f"add_phase({name!r}, {_safe_repr(seconds)}) ignored: "
                               "not a number of seconds in 0..366 days")
            return
        self.phases[key] = self.phases.get(key, 0.0) + sec

    def __enter__(self) -> Step:
        self._t0 = _perf()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self._rec._emit_step_safe(self.step, _perf() - self._t0, self.samples, self.tokens,
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
        self._reported: set[str] = set()
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
        (names of :data:`PHASES`). Raises ``ValueError`` for an unknown phase name only;
        an unusable ``step``/``step_time_s`` skips the record (module docstring)."""
        if phases and isinstance(phases, dict):
            for name in phases:
                if name not in _PHASE_KEYS:
                    raise ValueError(f"unknown phase {name!r}; known: {', '.join(PHASES)}")
        if not self.enabled:
            return
        try:
            ph: dict[str, Any] = {}
            if phases and isinstance(phases, dict):
                for name, sec in phases.items():
                    ph[_PHASE_KEYS[name]] = sec
            elif phases:
                self._problem("phases", f"phases {_safe_repr(phases)} left out: not a dict")
            st = _seconds(step_time_s)
            if st is _BAD:
                self._problem("step_time_s", f"step {_safe_repr(step)} not recorded: step_time_s "
                              f"{_safe_repr(step_time_s)} is not a number of seconds in 0..366 days")
                return
            self._emit_step(step, st, samples, tokens, loss, grad_norm, ph)
        except Exception as e:  # a bug of ours: never into the training loop
            self._problem("internal", f"step not recorded: {type(e).__name__}: {e}")

    def log_checkpoint(self, duration_s: float, *, step: int | None = None) -> None:
        """Record a checkpoint save that took ``duration_s`` seconds. An unusable
        ``duration_s`` skips the record; an unusable ``step`` is written as ``null``."""
        if not self.enabled:
            return
        try:
            d = _seconds(duration_s)
            if d is _BAD:
                self._problem("duration_s", f"checkpoint not recorded: duration_s {_safe_repr(duration_s)} "
                              "is not a number of seconds in 0..366 days")
                return
            n = _count(step)
            if n is _BAD:
                self._problem("checkpoint step", f"checkpoint step {_safe_repr(step)} written as null: "
                              f"not an integer in 0..{INT_MAX}")
                n = None
            self._append(_dumps({"v": SCHEMA_VERSION, "kind": "checkpoint", "rank": self.rank, "t": _now(),
                                 "step": n, "duration_s": d}))
        except Exception as e:  # a bug of ours: never into the training loop
            self._problem("internal", f"checkpoint not recorded: {type(e).__name__}: {e}")

    def _problem(self, what: str, msg: str) -> None:
        """One stderr line per kind of problem per recorder."""
        if what not in self._reported:
            self._reported.add(what)
            _stderr(f"{msg} (reported once per recorder)")

    def _emit_step_safe(self, step: Any, step_time_s: float, samples: Any, tokens: Any,
                        loss: Any, grad_norm: Any, phases: dict[str, Any]) -> None:
        try:
            self._emit_step(step, step_time_s, samples, tokens, loss, grad_norm, phases)
        except Exception as e:  # a bug of ours: never into the training loop
            self._problem("internal", f"step not recorded: {type(e).__name__}: {e}")

    def _emit_step(self, step: Any, step_time_s: float, samples: Any, tokens: Any,
                   loss: Any, grad_norm: Any, phases: dict[str, Any]) -> None:
        # step_time_s: a finite float >= 0 (checked by the callers)
        if step is None:
            step = self._next_step
        else:
            n = _count(step)
            if n is _BAD or n is None:
                self._problem("step", f"step {_safe_repr(step)} not recorded: not an integer in 0..{INT_MAX}")
                return
            step = n
        self._next_step = step + 1
        nonfinite = False
        lf = loss if type(loss) is float else _real(loss)
        if lf is _BAD:
            self._problem("loss", f"loss {_safe_repr(loss)} written as null: not a number")
            lf = None
        elif lf is not None and not -_INF < lf < _INF:
            lf, nonfinite = None, True
        gn = grad_norm if type(grad_norm) is float else _real(grad_norm)
        if gn is _BAD:
            self._problem("grad_norm", f"grad_norm {_safe_repr(grad_norm)} written as null: not a number")
            gn = None
        elif gn is not None and not -_INF < gn < _INF:
            gn = None
        ns = _count(samples)
        if ns is _BAD or (ns is not None and ns > MAX_COUNT):
            self._problem("samples", f"samples {_safe_repr(samples)} written as null: not an integer in 0..{MAX_COUNT}")
            ns = None
        nt = _count(tokens)
        if nt is _BAD or (nt is not None and nt > MAX_COUNT):
            self._problem("tokens", f"tokens {_safe_repr(tokens)} written as null: not an integer in 0..{MAX_COUNT}")
            nt = None
        ordered = {}
        for k in _PHASE_ORDER:
            if k in phases:
                v = phases[k]
                if type(v) is not float or not 0.0 <= v <= MAX_DURATION_S:
                    v = _seconds(v)
                    if v is _BAD:
                        self._problem("phase " + k, f"phase {k} {_safe_repr(phases[k])} left out: "
                                      "not a number of seconds in 0..366 days")
                        continue
                ordered[k] = v
        self._append(_dumps({
            "v": SCHEMA_VERSION, "kind": "step", "rank": self.rank, "t": _now(), "step": step,
            "step_time_s": step_time_s, "samples": ns, "tokens": nt,
            "loss": lf, "loss_nonfinite": nonfinite, "grad_norm": gn,
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
