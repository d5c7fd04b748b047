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
(e.g. checkpoint time when most runs wrote none). Source of N = 20 and min = 3: issue 4.

Tables (store migration 3, :mod:`gpuguard.store`): ``templates`` (one row per template),
``verdicts`` (one row per judged job), ``comparisons`` (one row per job and metric: the
run's value, the baseline it was compared with, z, relative change, flagged),
``baselines`` (template, metric, median, mad, n, updated_at) — the cached result of
:func:`update_baseline`, recomputed from ``verdicts``/``comparisons`` after every
eligible run.

**Node idle baselines.** The prolog's idle readings per GPU (``node_idle``: temperature,
power, SM clock, by node and GPU UUID). :func:`judge_idle` compares a new reading with
the median/MAD of the GPU's last readings and returns ``baseline.idle_temp_up`` /
``baseline.idle_power_up`` findings; a flagged reading does not enter later baselines.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from gpuguard.config import Config, ConfigError
from gpuguard.config import from_dict as config_from_dict
from gpuguard.epilog import robust
from gpuguard.epilog.metrics import METRICS
from gpuguard.model import Finding, NodeSnapshot

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
        for m in METRICS:
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


# -- node idle baselines -----------------------------------------------------------------
def judge_idle(store: Any, node: str, snapshot: NodeSnapshot, *, cfg: Config | None = None,
               job_id: str | None = None, record: bool = True, now: float | None = None) -> list[Finding]:
    """Compare each idle GPU of ``snapshot`` (the prolog's, before the job) with its own
    idle history on ``node`` and, with ``record``, store the reading.

    A GPU counts as idle when its utilisation is below ``[checks] idle_util_pct`` (or
    unknown). Findings (code, when):

    * ``baseline.idle_temp_up`` (warning): temperature at least ``[baseline]
      idle_temp_rise_c`` above the median of the GPU's last ``idle_readings`` unflagged
      readings and a robust z of at least ``[verdict] z_threshold``;
    * ``baseline.idle_power_up`` (warning): power at least ``idle_power_rise_frac``
      above its median, same z test.

    Needs ``idle_min_readings`` earlier readings of the GPU (by UUID) first. Raises
    :class:`gpuguard.store.StoreError`.
    """
    cfg = cfg if cfg is not None else config_from_dict({})
    s = BaselineSettings.from_config(cfg)
    vs = cfg.values["verdict"]
    z_thr = float(vs["z_threshold"])
    floor = float(vs["mad_floor_frac"])
    idle_pct = float(cfg.values["checks"]["idle_util_pct"])
    now = time.time() if now is None else now
    findings: list[Finding] = []
    rows = []
    for g in snapshot.gpus:
        if not g.uuid or (g.gpu_util_pct is not None and g.gpu_util_pct >= idle_pct):
            continue
        hist = store.query(
            "select temp_c, power_w, sm_clock_mhz from node_idle where node = ? and uuid = ? and flagged = 0 "
            "order by at desc limit ?", [node, g.uuid, s.idle_readings])
        flagged = False
        if len(hist) >= s.idle_min_readings:
            for field_name, code, min_up in (("temp_c", "baseline.idle_temp_up", None),
                                             ("power_w", "baseline.idle_power_up", s.idle_power_rise_frac)):
                x = getattr(g, field_name)
                past = robust.clean(h[field_name] for h in hist)
                if x is None or len(past) < s.idle_min_readings:
                    continue
                med = robust.median(past)
                m = robust.mad(past, med)
                z, _ = robust.robust_z(x, med, m, floor)  # type: ignore[arg-type]
                rise = x - med  # type: ignore[operator]
                enough = rise >= s.idle_temp_rise_c if min_up is None else robust.rel_change(x, med) >= min_up
                if z >= z_thr and enough:
                    flagged = True
                    unit = "°C" if field_name == "temp_c" else "W"
                    findings.append(Finding(
                        code, "warning",
                        f"GPU {g.index} idles at {x:g} {unit}, {rise:+.1f} {unit} above its own median of "
                        f"{med:g} {unit} over {len(past)} earlier idle readings",
                        gpu_index=g.index, gpu_uuid=g.uuid,
                        evidence={"node": node, "value": x, "median": med, "mad": m, "z": round(z, 2),
                                  "readings": len(past), "field": field_name}))
        rows.append({"node": node, "uuid": g.uuid, "gpu_index": g.index, "at": now, "job_id": job_id,
                     "temp_c": g.temp_c, "power_w": g.power_w, "sm_clock_mhz": g.sm_clock_mhz,
                     "flagged": int(flagged)})
    if record and rows:
        store.insert_many("node_idle", rows)
    return findings


def idle_history(store: Any, node: str | None = None) -> list[dict[str, Any]]:
    """Per node and GPU: readings, median idle temperature/power/SM clock (unflagged)."""
    where, params = ("where node = ?", [node]) if node else ("", [])
    rows = store.query(f"select * from node_idle {where} order by node, uuid, at", params)
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["node"], r["uuid"]), []).append(r)
    out = []
    for (n, u), rs in groups.items():
        ok = [r for r in rs if not r["flagged"]]
        out.append({"node": n, "uuid": u, "gpu_index": rs[-1]["gpu_index"], "readings": len(rs),
                    "temp_c": robust.median(r["temp_c"] for r in ok),
                    "power_w": robust.median(r["power_w"] for r in ok),
                    "sm_clock_mhz": robust.median(r["sm_clock_mhz"] for r in ok),
                    "last_at": rs[-1]["at"]})
    return out


def dumps(v: Any) -> str:
    return json.dumps(v, default=str, sort_keys=True)
