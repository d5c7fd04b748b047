"""Template baselines and node idle baselines, kept in the store.

**Template baselines.** For each template and each metric of
:data:`gpuguard.epilog.metrics.METRICS`: the median and MAD (raw, unscaled) of the
metric over the last ``[baseline] runs`` (N, default 20) runs of the template that

* completed with exit code 0 (``SLURM_JOB_EXIT_CODE``; ``None`` = not known, counted as
  completed: cancelled and timed-out jobs read 0 anyway, SLURM-FACTS.md §4),
* had no critical finding during the job, and
* were not judged anomalous (verdict ``healthy`` or ``learning``),

and were judged after the template's last ``baseline reset``. With fewer than
``[baseline] min_runs`` (default 3) such runs the template is ``learning`` and nothing
is judged against it; a metric with fewer than ``min_runs`` values is not judged either
(e.g. checkpoint time when most runs wrote none). Sources of N = 20 and min = 3: :data:`gpuguard.config.SCHEMA`.

Tables (store migration 3, :mod:`gpuguard.store`): ``templates`` (one row per template),
``verdicts`` (one row per judged job), ``comparisons`` (one row per job and metric: the
run's value, the baseline it was compared with, z, relative change, flagged),
``baselines`` (template, metric, median, mad, n, updated_at) — the cached result of
:func:`update_baseline`, recomputed from ``verdicts``/``comparisons`` after every
eligible run.

Node idle baselines are a health check of the core (:mod:`gpuguard.checks.idle`); their
``[baseline] idle_*`` settings are validated here with the rest of ``[baseline]``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from gpuguard.config import Config, ConfigError
from gpuguard.config import from_dict as config_from_dict
from gpuguard import robust
from gpuguard.epilog.metrics import METRICS
from gpuguard.epilog.peers import SPREAD_METRICS
from gpuguard.checks.idle import idle_history, judge_idle  # noqa: F401  (moved to the core)

LEARNING = "learning"
READY = "ready"
#: Verdict causes that let a run into its template's baseline.
BASELINE_CAUSES = ("healthy", "learning")


# -- settings ----------------------------------------------------------------------------
@dataclass(frozen=True)
class BaselineSettings:
    """``[baseline]`` of the config. The defaults and their sources live in one place,
    :data:`gpuguard.config.SCHEMA`; build it with :meth:`from_config`."""

    runs: int
    min_runs: int
    relearn_runs: int
    idle_readings: int
    idle_min_readings: int
    idle_temp_rise_c: float
    idle_power_rise_frac: float

    @classmethod
    def from_config(cls, cfg: Config | None) -> BaselineSettings:
        """Read ``[baseline]``; raises :class:`ConfigError` for values out of range."""
        if cfg is None:
            cfg = config_from_dict({})
        v = cfg.values["baseline"]
        s = cls(**{k: v[k] for k in cls.__dataclass_fields__ if k in v})
        if s.min_runs < 1 or s.runs < s.min_runs:
            raise ConfigError(f"{cfg.path or '<config>'}: baseline.runs must be >= baseline.min_runs >= 1")
        if s.relearn_runs != 0 and s.relearn_runs < s.min_runs:
            raise ConfigError(f"{cfg.path or '<config>'}: baseline.relearn_runs must be 0 or >= baseline.min_runs")
        if s.idle_min_readings < 1 or s.idle_readings < s.idle_min_readings:
            raise ConfigError(f"{cfg.path or '<config>'}: baseline.idle_readings must be >= idle_min_readings >= 1")
        return s


# -- template baselines ---------------------------------------------------------------------
@dataclass(frozen=True)
class Stat:
    """One metric's baseline: ``median`` and raw ``mad`` over ``n`` runs."""

    median: float
    mad: float
    n: int


@dataclass
class Baseline:
    """A template's baseline. ``runs``: eligible runs it rests on (at most N);
    ``state``: ``learning`` below ``min_runs`` runs, else ``ready``; ``jobs``: the runs'
    job ids, newest first; ``since``: the oldest of them (epoch s) or ``None``."""

    template: str
    state: str
    runs: int
    stats: dict[str, Stat] = field(default_factory=dict)
    jobs: list[str] = field(default_factory=list)
    since: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"template": self.template, "state": self.state, "runs": self.runs, "jobs": self.jobs,
                "since": self.since,
                "metrics": {m: {"median": s.median, "mad": s.mad, "n": s.n} for m, s in self.stats.items()}}


def _reset_at(store: Any, template: str) -> float:
    rows = store.query("select reset_at from templates where name = ?", [template])
    return float(rows[0]["reset_at"] or 0.0) if rows else 0.0


def eligible_runs(store: Any, template: str, limit: int) -> list[dict[str, Any]]:
    """The last ``limit`` verdict rows of ``template`` fit for its baseline, newest first."""
    return store.query(
        "select job_id, at, start_at from verdicts where template = ? and baseline_ok = 1 and at > ? "
        "order by at desc, job_id desc limit ?", [template, _reset_at(store, template), limit])


def compute_baseline(store: Any, template: str, *, cfg: Config | None = None,
                     exclude_job: str | None = None) -> Baseline:
    """The baseline of ``template`` from its eligible runs (not from the cache table).
    ``exclude_job`` leaves one job out (re-judging a stored job). Raises
    :class:`gpuguard.store.StoreError`."""
    s = BaselineSettings.from_config(cfg)
    runs = [r for r in eligible_runs(store, template, s.runs + 1) if r["job_id"] != exclude_job][: s.runs]
    jobs = [r["job_id"] for r in runs]
    stats: dict[str, Stat] = {}
    if jobs:
        q = ",".join("?" * len(jobs))
        values: dict[str, list[float]] = {}
        for r in store.query(f"select metric, value from comparisons where job_id in ({q}) and value is not null",
                             jobs):
            values.setdefault(r["metric"], []).append(r["value"])
        for m in (*METRICS, *SPREAD_METRICS):
            vs = values.get(m)
            if vs:
                med = robust.median(vs)
                stats[m] = Stat(med, robust.mad(vs, med), len(vs))  # type: ignore[arg-type]
    since = min((r["start_at"] or r["at"] for r in runs), default=None)
    return Baseline(template, READY if len(jobs) >= s.min_runs else LEARNING, len(jobs), stats, jobs, since)


def update_baseline(store: Any, template: str, *, cfg: Config | None = None,
                    now: float | None = None) -> Baseline:
    """Recompute ``template``'s baseline from its eligible runs and write it to the
    ``baselines`` table (rows of metrics no longer present are removed). Returns it.
    Raises :class:`gpuguard.store.StoreError`."""
    b = compute_baseline(store, template, cfg=cfg)
    now = time.time() if now is None else now

    def go() -> None:
        with store.tx():
            store.db.execute("delete from baselines where template = ?", [template])
            if b.stats:
                store.db["baselines"].insert_all(
                    [{"template": template, "metric": m, "median": st.median, "mad": st.mad, "n": st.n,
                      "updated_at": now} for m, st in b.stats.items()])
    store._guard("baseline update", go)
    return b


def reset_baseline(store: Any, template: str, *, now: float | None = None) -> int:
    """Forget ``template``'s baseline: runs judged before now no longer count, so the
    template learns again. Returns the number of baseline rows removed. Raises
    :class:`gpuguard.store.StoreError`."""
    now = time.time() if now is None else now

    def go() -> int:
        with store.tx():
            n = store.db.execute("delete from baselines where template = ?", [template]).rowcount
            store.db.execute("update templates set reset_at = ? where name = ?", [now, template])
            return n
    return store._guard("baseline reset", go)


def list_templates(store: Any, *, cfg: Config | None = None) -> list[dict[str, Any]]:
    """Every template: ``name, source, jobs`` (judged runs), ``baseline_runs``,
    ``anomalous`` (runs with a cause other than healthy/learning), ``state``,
    ``last_seen``, ``relearned_at`` (when the baseline last re-learned by itself,
    :mod:`gpuguard.epilog.relearn`; ``None`` if never) and ``relearned_from`` (those
    runs' job ids). Raises :class:`gpuguard.store.StoreError`."""
    s = BaselineSettings.from_config(cfg)
    out = []
    for t in store.query("select * from templates order by name"):
        since = t["reset_at"] or 0.0
        ok = store.query("select count(*) as n from verdicts where template = ? and baseline_ok = 1 and at > ?",
                         [t["name"], since])[0]["n"]
        bad = store.query("select count(*) as n from verdicts where template = ? and cause not in "
                          "('healthy', 'learning')", [t["name"]])[0]["n"]
        runs = min(ok, s.runs)
        out.append({"name": t["name"], "source": t["source"], "jobs": t["jobs"], "baseline_runs": runs,
                    "anomalous": bad, "state": READY if runs >= s.min_runs else LEARNING,
                    "last_seen": t["last_seen"], "relearned_at": t.get("relearned_at"),
                    "relearned_from": json.loads(t["relearned_jobs"]) if t.get("relearned_jobs") else []})
    return out


def cached_baseline(store: Any, template: str) -> list[dict[str, Any]]:
    """Rows of the ``baselines`` table for ``template`` (metric, median, mad, n, updated_at)."""
    return store.query("select metric, median, mad, n, updated_at from baselines where template = ? "
                       "order by metric", [template])


def record_verdict(store: Any, row: dict[str, Any], comparisons: list[dict[str, Any]], *,
                   template_source: str, now: float) -> None:
    """Write one verdict row and its comparison rows (replacing an earlier verdict of the
    same job) and touch the template. Raises :class:`gpuguard.store.StoreError`."""
    name = row["template"]

    def go() -> None:
        with store.tx():
            old = store.query("select 1 from verdicts where job_id = ?", [row["job_id"]])
            store.db["verdicts"].upsert(row, pk="job_id")
            store.db.execute("delete from comparisons where job_id = ?", [row["job_id"]])
            if comparisons:
                store.db["comparisons"].insert_all(comparisons)
            t = store.query("select * from templates where name = ?", [name])
            if t:
                store.db.execute("update templates set last_seen = ?, jobs = jobs + ? where name = ?",
                                 [now, 0 if old else 1, name])
            else:
                store.db["templates"].insert({"name": name, "source": template_source, "first_seen": now,
                                              "last_seen": now, "jobs": 1, "reset_at": 0.0})
    store._guard("verdict write", go)


def dumps(v: Any) -> str:
    return json.dumps(v, default=str, sort_keys=True)
