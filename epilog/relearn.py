"""When a template's baseline re-learns by itself.

Runs judged anomalous never enter the baseline, so without this a user who permanently
doubles the batch gets ``job-changed`` forever, and a template whose first runs were slow
keeps slow as normal. The baseline re-learns when the template's last ``[baseline]
relearn_runs`` (K, default 5) judged runs on one GPU model (the newest run's: the
baseline is kept per model, :mod:`gpuguard.epilog.baseline`), after its last reset,

* were all judged ``job-changed`` — the cause the table gives only when no machine-side
  cause (hardware fault, straggler, throttling, leak) showed — and none of them had a
  critical finding or a non-zero exit;
* agree with each other: for each of ``step_time_p50_s``, ``throughput_per_s``,
  ``samples_per_step`` and ``mem_peak_mib`` that all K runs have, the K values lie within
  ``[verdict] min_rel_change`` of their median (max - min <= min_rel_change x median);
  at least one of the first three must be there. Ten unrelated odd runs do not agree;
  a new normal does.

Then those K runs become the baseline: the template's ``reset_at`` moves to just before
the first of them, they are marked fit for the baseline, ``templates.relearned_at`` /
``relearned_jobs`` record it (shown by ``gpuguard template list``), and the baseline is
recomputed from them (K >= ``min_runs``, so it is ready at once). The K-th run's verdict
stays ``job-changed`` (it was, against the old baseline) and its evidence says
``relearned``. What else is forgotten is ``[baseline] relearn_forgets``:

* ``all-models`` (default): moving ``reset_at`` forgets the runs on the template's other
  GPU models from before the first of them too: the job changed, on every model it runs
  on;
* ``gpu-model``: only this model's earlier runs are forgotten (its ``baseline_resets``
  time moves to just before the first of them, ``templates.reset_at`` stays): the other
  models keep their baselines and re-learn from their own runs when the change reaches
  them (a change seen on one partition only, a new node image there, is not taken for a
  change of the job everywhere).
"""

from __future__ import annotations

import json
from typing import Any

from gpuguard.config import Config
from gpuguard.epilog import robust
from gpuguard.epilog.baseline import BaselineSettings, reset_model_runs, since_reset_sql

#: Metrics whose agreement makes K runs one new normal.
AGREE_METRICS = ("step_time_p50_s", "throughput_per_s", "samples_per_step", "mem_peak_mib")
_PERF = AGREE_METRICS[:3]


def _agree(values: dict[str, list[float]], k: int, tol: float) -> bool:
    seen = [m for m in AGREE_METRICS if len(values.get(m, [])) == k]
    if not any(m in seen for m in _PERF):
        return False
    for m in seen:
        vs = values[m]
        med = robust.median(vs)
        if med is None or (max(vs) - min(vs)) > tol * abs(med):
            return False
    return True


def relearn_if_due(store: Any, template: str, *, cfg: Config | None, now: float,
                   gpu_model: str = "") -> dict[str, Any] | None:
    """Re-learn ``template``'s baseline when its last K runs on ``gpu_model`` (the newest
    run's) call for it (module docstring). Returns ``{"jobs": [...], "at": now}`` when it
    did, else ``None``. Call after the newest verdict is stored. Raises
    :class:`gpuguard.store.StoreError`."""
    from gpuguard.config import from_dict

    cfg = cfg if cfg is not None else from_dict({})
    settings = BaselineSettings.from_config(cfg)
    k = settings.relearn_runs
    if k <= 0:
        return None
    tol = float(cfg.values["verdict"]["min_rel_change"])
    rows = store.query(
        "select job_id, at, cause, critical, exit_code from verdicts where template = ? and gpu_model = ? "
        f"and {since_reset_sql(store)} order by at desc, job_id desc limit ?", [template, gpu_model, k])
    if len(rows) < k or any(r["cause"] != "job-changed" or r["critical"] or r["exit_code"] not in (None, 0)
                            for r in rows):
        return None
    jobs = [r["job_id"] for r in rows]
    q = ",".join("?" * k)
    values: dict[str, list[float]] = {}
    for c in store.query(f"select metric, value from comparisons where job_id in ({q}) and value is not null "
                         f"and metric in ({','.join('?' * len(AGREE_METRICS))})", [*jobs, *AGREE_METRICS]):
        values.setdefault(c["metric"], []).append(float(c["value"]))
    if not _agree(values, k, tol):
        return None
    first = min(r["at"] for r in rows)
    info = {"jobs": list(reversed(jobs)), "at": now}

    def go() -> None:
        with store.tx():
            store.db.execute(f"update verdicts set baseline_ok = 1 where job_id in ({q})", jobs)
            if settings.relearn_forgets == "gpu-model":  # this model's earlier runs only
                reset_model_runs(store, template, gpu_model, first - 1e-3)
                store.db.execute("update templates set relearned_at = ?, relearned_jobs = ? where name = ?",
                                 [now, json.dumps(info["jobs"]), template])
            else:
                store.db.execute("update templates set reset_at = ?, relearned_at = ?, relearned_jobs = ? "
                                 "where name = ?", [first - 1e-3, now, json.dumps(info["jobs"]), template])
            ev = store.query("select evidence from verdicts where job_id = ?", [jobs[0]])
            d = json.loads(ev[0]["evidence"] or "{}") if ev else {}
            d["relearned"] = info
            store.db.execute("update verdicts set evidence = ? where job_id = ?",
                             [json.dumps(d, default=str, sort_keys=True), jobs[0]])
    store._guard("baseline relearn", go)
    return info
