"""Template baselines and node idle baselines, kept in the store.

**Template baselines.** For each template and each metric of
:data:`gpuguard.epilog.metrics.METRICS`: the median and MAD (raw, unscaled) of the
metric over the last ``[baseline] runs`` (N, default 20) runs of the template that

* completed with exit code 0 (``SLURM_JOB_EXIT_CODE``; ``None`` = not known, counted as
  completed: cancelled and timed-out jobs read 0 anyway, SLURM-FACTS.md §4),
* had no critical finding during the job, and
* were not judged anomalous (verdict ``healthy`` or ``learning``),

and were judged after the template's last ``baseline reset`` (and after its GPU model's
own last reset, ``baseline reset --gpu-model``: :func:`reset_baseline`). With fewer than
``[baseline] min_runs`` (default 3) such runs the template is ``learning`` and nothing
is judged against it; a metric with fewer than ``min_runs`` values is not judged either
(e.g. checkpoint time when most runs wrote none). Sources of N = 20 and min = 3: :data:`gpuguard.config.SCHEMA`.

**Per GPU model.** The runs are those on the judged run's GPU model (the NVML product
name, :attr:`gpuguard.epilog.jobdata.JobData.gpu_model`; ``""`` when not known is a
model of its own). A derived template names its GPU type already; a template named by
the user (``--comment=gpuguard:template=NAME``) can follow the job from an H100 partition
to an A100 one, and every hardware metric (step time, SM clock, power, temperature) and
every share of the step time moves with the model: judged against the other model's
history, a healthy A100 run reads as a throttled GPU. A machine-side verdict needs a
like-for-like reference — DCGM's diagnostics compare a GPU only with reference values of
its own SKU, and jobstats-style reports read a job's figures against its own GPU type —
so a run on a model with fewer than ``min_runs`` earlier runs is ``learning``: no metric
is compared with another model's runs (not even the batch size: a job moved to a GPU with
less memory often changes it on purpose), and only the baseline-free causes (hardware
fault, stragglers among the job's own GPUs, hard throttling, memory leak) can be named.
The other models' runs are named in the verdict's evidence (``other_gpu_models``).

Tables (:mod:`gpuguard.epilog.schema`): ``templates`` (one row per template),
``verdicts`` (one row per judged job, with its ``gpu_model``), ``comparisons`` (one row
per job and metric: the run's value, the baseline it was compared with, z, relative
change, flagged), ``baselines`` (template, gpu_model, metric, median, mad, n,
updated_at) — the cached result of :func:`update_baseline`, recomputed from
``verdicts``/``comparisons`` after every eligible run.

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
from gpuguard.epilog.metrics import METRICS, REFERENCE_METRICS
from gpuguard.epilog.peers import SPREAD_METRICS
from gpuguard.checks.idle import idle_history, judge_idle  # noqa: F401  (moved to the core)

LEARNING = "learning"
READY = "ready"
#: ``[baseline] relearn_forgets``: what a re-learn on one GPU model forgets (:mod:`gpuguard.epilog.relearn`).
RELEARN_FORGETS = ("all-models", "gpu-model")
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
    relearn_forgets: str
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
        if s.relearn_forgets not in RELEARN_FORGETS:
            raise ConfigError(f"{cfg.path or '<config>'}: baseline.relearn_forgets must be one of "
                              f"{', '.join(RELEARN_FORGETS)}, got {s.relearn_forgets!r}")
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
    """A template's baseline on one GPU model. ``runs``: eligible runs on ``gpu_model``
    it rests on (at most N); ``state``: ``learning`` below ``min_runs`` runs, else
    ``ready``; ``jobs``: the runs' job ids, newest first; ``since``: the oldest of them
    (epoch s) or ``None``; ``other_models``: eligible runs of the template on its other
    GPU models (model -> runs, at most N each), never compared with."""

    template: str
    state: str
    runs: int
    stats: dict[str, Stat] = field(default_factory=dict)
    jobs: list[str] = field(default_factory=list)
    since: float | None = None
    gpu_model: str = ""
    other_models: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"template": self.template, "gpu_model": self.gpu_model, "state": self.state, "runs": self.runs,
                "jobs": self.jobs, "since": self.since, "other_gpu_models": self.other_models,
                "metrics": {m: {"median": s.median, "mad": s.mad, "n": s.n} for m, s in self.stats.items()}}


def _has_model_resets(store: Any) -> bool:
    """Whether the store has ``baseline_resets`` (step ``baseline_model_resets``); a
    reader may open a store no writer has migrated yet: then no model was reset alone."""
    return bool(store._guard("baseline resets table", lambda: store.conn.execute(
        "select 1 from sqlite_master where type = 'table' and name = 'baseline_resets'").fetchone()))


def since_reset_sql(store: Any) -> str:
    """SQL condition on a ``verdicts`` row: judged after its template's reset and after
    its own GPU model's (:func:`reset_baseline`)."""
    cut = "coalesce((select t.reset_at from templates t where t.name = verdicts.template), 0)"
    if _has_model_resets(store) and _model_col(store) == "gpu_model":
        cut = (f"max({cut}, coalesce((select r.reset_at from baseline_resets r where r.template = "
               "verdicts.template and r.gpu_model = verdicts.gpu_model), 0))")
    return f"verdicts.at > {cut}"


def _model_col(store: Any) -> str:
    """``verdicts.gpu_model``, or ``''`` on a store a reader opened before a writer added
    the column (migration step ``baseline_gpu_model``): every run's model is then not known."""
    cols = store._guard("verdict columns", lambda: {r[1] for r in store.conn.execute("pragma table_info(verdicts)")})
    return "gpu_model" if "gpu_model" in cols else "''"


def eligible_runs(store: Any, template: str, limit: int, gpu_model: str | None = None) -> list[dict[str, Any]]:
    """The last ``limit`` verdict rows of ``template`` fit for its baseline, newest first:
    those on ``gpu_model`` (``None``: on every model)."""
    where, params = ("", []) if gpu_model is None else (f" and {_model_col(store)} = ?", [gpu_model])
    return store.query(
        f"select job_id, at, start_at from verdicts where template = ? and baseline_ok = 1 and {since_reset_sql(store)}"
        f"{where} order by at desc, job_id desc limit ?", [template, *params, limit])


def newest_model(store: Any, template: str) -> str:
    """The GPU model of ``template``'s most recently judged run (``""`` when none or not
    known): what ``baseline show`` and ``template list`` describe by default."""
    rows = store.query(f"select {_model_col(store)} as gpu_model from verdicts where template = ? "
                       "order by at desc, job_id desc limit 1", [template])
    return (rows[0]["gpu_model"] or "") if rows else ""


def model_runs(store: Any, template: str, limit: int) -> dict[str, int]:
    """Eligible runs of ``template`` since its and each model's reset per GPU model (at
    most ``limit`` each)."""
    col = _model_col(store)
    rows = store.query(f"select {col} as gpu_model, count(*) as n from verdicts where template = ? and "
                       f"baseline_ok = 1 and {since_reset_sql(store)} group by {col} order by 1", [template])
    return {r["gpu_model"] or "": min(int(r["n"]), limit) for r in rows}


def compute_baseline(store: Any, template: str, *, cfg: Config | None = None,
                     exclude_job: str | None = None, gpu_model: str | None = None) -> Baseline:
    """The baseline of ``template`` on ``gpu_model`` (default: the model of the template's
    newest run, :func:`newest_model`) from its eligible runs on that model (not from the
    cache table). ``exclude_job`` leaves one job out (re-judging a stored job). Raises
    :class:`gpuguard.store.StoreError`."""
    s = BaselineSettings.from_config(cfg)
    model = newest_model(store, template) if gpu_model is None else gpu_model
    runs = [r for r in eligible_runs(store, template, s.runs + 1, model) if r["job_id"] != exclude_job][: s.runs]
    jobs = [r["job_id"] for r in runs]
    stats: dict[str, Stat] = {}
    if jobs:
        q = ",".join("?" * len(jobs))
        values: dict[str, list[float]] = {}
        for r in store.query(f"select metric, value from comparisons where job_id in ({q}) and value is not null",
                             jobs):
            values.setdefault(r["metric"], []).append(r["value"])
        for m in (*METRICS, *SPREAD_METRICS, *REFERENCE_METRICS):
            vs = values.get(m)
            if vs:
                med = robust.median(vs)
                stats[m] = Stat(med, robust.mad(vs, med), len(vs))  # type: ignore[arg-type]
    since = min((r["start_at"] or r["at"] for r in runs), default=None)
    others = {m: n for m, n in model_runs(store, template, s.runs).items() if m != model}
    return Baseline(template, READY if len(jobs) >= s.min_runs else LEARNING, len(jobs), stats, jobs, since,
                    model, others)


def update_baseline(store: Any, template: str, *, cfg: Config | None = None, gpu_model: str | None = None,
                    now: float | None = None) -> Baseline:
    """Recompute ``template``'s baseline on ``gpu_model`` (default: :func:`newest_model`)
    from its eligible runs and write it to the ``baselines`` table (that model's rows of
    metrics no longer present are removed; other models' rows are left). Returns it.
    Raises :class:`gpuguard.store.StoreError`."""
    b = compute_baseline(store, template, cfg=cfg, gpu_model=gpu_model)
    now = time.time() if now is None else now

    def go() -> None:
        with store.tx():
            store.db.execute("delete from baselines where template = ? and gpu_model = ?", [template, b.gpu_model])
            if b.stats:
                store.db["baselines"].insert_all(
                    [{"template": template, "gpu_model": b.gpu_model, "metric": m, "median": st.median,
                      "mad": st.mad, "n": st.n, "updated_at": now} for m, st in b.stats.items()])
    store._guard("baseline update", go)
    return b


def reset_baseline(store: Any, template: str, *, gpu_model: str | None = None, now: float | None = None) -> int:
    """Forget ``template``'s baseline so that runs judged up to ``now`` (default: now)
    no longer count and it learns again from the next runs.

    * ``gpu_model=None``: on every GPU model (a change to the job holds on every model):
      ``templates.reset_at = now``, every ``baselines`` row of the template removed (and
      its per-model reset times, which this one covers).
    * ``gpu_model="NAME"`` (``""`` = the runs whose model was not known): on that model
      only (a new node image or driver on one partition): ``baseline_resets`` (template,
      NAME) = ``now``, that model's ``baselines`` rows removed. The other models' runs,
      baselines and cached rows are left as they were.

    The verdicts and comparisons themselves are kept (``job show`` still reads them);
    they only stop counting. Returns the number of ``baselines`` rows removed. Raises
    :class:`gpuguard.store.StoreError` (also for ``gpu_model`` on a store without step
    ``baseline_model_resets``: open it for writing, which migrates it)."""
    now = time.time() if now is None else now

    def go() -> int:
        with store.tx():
            if gpu_model is None:
                n = store.db.execute("delete from baselines where template = ?", [template]).rowcount
                store.db.execute("update templates set reset_at = ? where name = ?", [now, template])
                if _has_model_resets(store):
                    store.db.execute("delete from baseline_resets where template = ?", [template])
                return n
            return reset_model_runs(store, template, gpu_model, now)
    return store._guard("baseline reset", go)


def reset_model_runs(store: Any, template: str, gpu_model: str, at: float) -> int:
    """Forget ``template``'s runs on ``gpu_model`` judged up to ``at`` (epoch s): its
    ``baseline_resets`` time set, that model's ``baselines`` rows removed. Call inside a
    transaction (:func:`reset_baseline`, :func:`gpuguard.epilog.relearn.relearn_if_due`).
    Returns the rows removed."""
    n = store.db.execute("delete from baselines where template = ? and gpu_model = ?", [template, gpu_model]).rowcount
    store.db.execute("insert into baseline_resets (template, gpu_model, reset_at) values (?, ?, ?) "
                     "on conflict (template, gpu_model) do update set reset_at = excluded.reset_at",
                     [template, gpu_model, at])
    return n


def template_models(store: Any, template: str) -> list[str]:
    """Every GPU model ``template`` has a judged run on (reset or not), sorted."""
    col = _model_col(store)
    return [r["m"] or "" for r in store.query(f"select distinct {col} as m from verdicts where template = ? "
                                               "order by 1", [template])]


def list_templates(store: Any, *, cfg: Config | None = None) -> list[dict[str, Any]]:
    """Every template: ``name, source, jobs`` (judged runs), ``gpu_model`` (the GPU model
    of its newest run, :func:`newest_model`), ``baseline_runs`` and ``state`` (of the
    baseline on that model), ``anomalous`` (runs with a cause other than
    healthy/learning), ``last_seen``, ``relearned_at`` (when the baseline last re-learned
    by itself, :mod:`gpuguard.epilog.relearn`; ``None`` if never), ``relearned_from``
    (those runs' job ids) and ``gpu_models`` (model -> baseline runs, every model with
    one). Raises :class:`gpuguard.store.StoreError`."""
    s = BaselineSettings.from_config(cfg)
    out = []
    for t in store.query("select * from templates order by name"):
        per_model = model_runs(store, t["name"], s.runs)
        model = newest_model(store, t["name"])
        bad = store.query("select count(*) as n from verdicts where template = ? and cause not in "
                          "('healthy', 'learning')", [t["name"]])[0]["n"]
        runs = per_model.get(model, 0)
        out.append({"name": t["name"], "source": t["source"], "jobs": t["jobs"], "baseline_runs": runs,
                    "anomalous": bad, "state": READY if runs >= s.min_runs else LEARNING,
                    "last_seen": t["last_seen"], "relearned_at": t.get("relearned_at"),
                    "relearned_from": json.loads(t["relearned_jobs"]) if t.get("relearned_jobs") else [],
                    "gpu_model": model, "gpu_models": per_model})
    return out


def cached_baseline(store: Any, template: str, gpu_model: str | None = None) -> list[dict[str, Any]]:
    """Rows of the ``baselines`` table for ``template`` (gpu_model, metric, median, mad,
    n, updated_at): those of ``gpu_model``, or of every model (``None``)."""
    where, params = ("", []) if gpu_model is None else (" and gpu_model = ?", [gpu_model])
    return store.query(f"select gpu_model, metric, median, mad, n, updated_at from baselines where template = ?"
                       f"{where} order by gpu_model, metric", [template, *params])


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
