"""The verdict: did this run go the way runs of its template go, and if not, why?

The judge is a pure function, :func:`judge`, over the job's series (a
:class:`~gpuguard.epilog.jobdata.JobData`) and its template's baseline (a
:class:`~gpuguard.epilog.baseline.Baseline`): it computes the summary metrics
(:mod:`gpuguard.epilog.metrics`), compares each with the baseline
(:mod:`gpuguard.epilog.compare`), runs the cause detectors (:mod:`gpuguard.epilog.causes`)
and names **one** primary cause with its evidence through the cause table
(:mod:`gpuguard.epilog.decide`); other causes that also showed are listed in ``also``.

Where it runs and where it stores are separate: :func:`judge_job` reads the job and the
baseline from a store, judges, and (``record``) stores the verdict
(:mod:`gpuguard.epilog.record`) and refreshes the baseline; :func:`run_verdict` is the
Epilog's one call (template, judge, findings and policy through
:mod:`gpuguard.epilog.act`). :mod:`gpuguard.epilog.show` prints a stored verdict.

Causes (precedence and masking: :data:`gpuguard.epilog.decide.CAUSE_TABLE`):
``hardware-fault``, ``straggler-node``, ``straggler-gpu``, ``gpu-throttling``,
``memory-leak``, ``data-pipeline``, ``communication``, ``job-changed``, ``healthy``.
Below ``[baseline] min_runs`` baseline runs the template is ``learning``: no metric is
judged against the baseline; the baseline-free causes are still named, otherwise the
cause is ``learning``. The baseline is the template's runs on the judged run's GPU model
(:mod:`gpuguard.epilog.baseline`, "Per GPU model"): a run on a model the template has
fewer than ``min_runs`` runs on is ``learning``, and its evidence names the runs on the
other models (``other_gpu_models``) that were not compared with.

Node change-log context: ``inventory_changes`` on the job's nodes since the oldest run
of the baseline (driver, CUDA, VBIOS, InfoROM ... changed) go into ``context``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuguard import policy as policy_mod
from gpuguard.config import Config
from gpuguard.epilog import baseline as baseline_mod
from gpuguard.epilog.act import act_on_verdict, escalation, verdict_findings
from gpuguard.epilog.causes import Context
from gpuguard.epilog.compare import Comparison, Settings, Windows, compare
from gpuguard.epilog.decide import CAUSES, FINDING_SEVERITY, LEARNING, decide
from gpuguard.epilog.jobdata import JobData, load_job
from gpuguard.epilog.metrics import job_metrics
from gpuguard.epilog.record import load_verdict, node_context, save_verdict
from gpuguard.epilog.show import format_verdict
from gpuguard.epilog.template import Template, inventory_gpu_name, job_template

__all__ = ["CAUSES", "FINDING_SEVERITY", "LEARNING", "Comparison", "Settings", "Verdict", "act_on_verdict",
           "escalation", "exit_code_from_env", "format_verdict", "judge", "judge_job", "load_verdict",
           "run_verdict", "verdict_findings"]


@dataclass
class Verdict:
    """The verdict on one job.

    ``cause``: one of :data:`CAUSES` or ``learning``; ``state``: ``learning`` or
    ``judged``; ``summary``: one line; ``evidence``: the numbers behind the cause
    (JSON-ready); ``also``: other causes that showed; ``comparisons``: every metric;
    ``context``: node change-log rows since the baseline's runs; ``baseline_runs``: how
    many runs the baseline rests on; ``gpu_model``: the run's GPU model
    (:attr:`JobData.gpu_model`, ``""`` when not known), the model those runs ran on.
    """

    job_id: str
    template: str
    cause: str
    state: str
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)
    comparisons: list[Comparison] = field(default_factory=list)
    also: list[str] = field(default_factory=list)
    context: list[dict[str, Any]] = field(default_factory=list)
    baseline_runs: int = 0
    template_source: str = "derived"
    nodes: list[str] = field(default_factory=list)
    start: float | None = None
    end: float | None = None
    gpu_model: str = ""

    @property
    def anomalous(self) -> bool:
        """True for every cause but ``healthy`` and ``learning``."""
        return self.cause not in baseline_mod.BASELINE_CAUSES

    def comparison(self, metric: str) -> Comparison | None:
        return next((c for c in self.comparisons if c.metric == metric), None)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``gpuguard job show --json``)."""
        return {
            "job_id": self.job_id, "template": self.template, "template_source": self.template_source,
            "state": self.state, "cause": self.cause, "summary": self.summary, "evidence": self.evidence,
            "also": self.also, "baseline_runs": self.baseline_runs, "context": self.context,
            "nodes": self.nodes, "start": self.start, "end": self.end, "gpu_model": self.gpu_model,
            "comparisons": [c.to_dict() for c in self.comparisons],
        }


def judge(data: JobData, base: baseline_mod.Baseline, s: Settings, *, min_runs: int,
          template: Template | str = "", job_id: str | None = None) -> Verdict:
    """Judge one job: ``data`` (every node's series of the job), ``base`` (its template's
    baseline, computed without this job), ``s`` (``[verdict]``), ``min_runs`` (``[baseline]
    min_runs``: a metric with fewer baseline values is not judged). Pure: reads and writes
    no store; ``context`` is left empty (:func:`judge_job` fills it)."""
    tmpl = template if isinstance(template, Template) else Template(str(template), "derived")
    wins = Windows(data, s)
    metrics = job_metrics(data, wins.warmup_s)
    comps = compare(metrics, base, wins, s, min_runs)
    judged = base.state == baseline_mod.READY
    ctx = Context(data, {c.metric: c for c in comps}, base, wins, s)
    cause, summary, evidence, also = decide(ctx)
    if data.start is None:
        evidence["no_data"] = "no samples or step records for this job"
    evidence["baseline_runs"] = base.runs
    if base.other_models and not judged:
        evidence["other_gpu_models"] = dict(base.other_models)
        if cause == LEARNING:
            summary = _other_model_summary(base, min_runs)
    if wins.warmup_s != s.warmup_s:  # still settling after [verdict] warmup_s, or a short run settled before it
        evidence["warmup_s"] = round(wins.warmup_s, 1)
    return Verdict(job_id=str(job_id if job_id is not None else data.job_id), template=tmpl.name, cause=cause,
                   state="judged" if judged else LEARNING, summary=summary, evidence=evidence, comparisons=comps,
                   also=also, baseline_runs=base.runs, template_source=tmpl.source, nodes=data.nodes,
                   start=data.start, end=data.end, gpu_model=data.gpu_model)


def _other_model_summary(base: baseline_mod.Baseline, min_runs: int) -> str:
    """The one line of a run learning on its GPU model while the template has runs on others."""
    others = ", ".join(f"{n} on {m or 'an unknown GPU model'}" for m, n in sorted(base.other_models.items()))
    return (f"template still learning on {base.gpu_model or 'an unknown GPU model'}: {base.runs} of {min_runs} "
            f"runs on it; runs on another GPU model are not compared with ({others})")


def judge_job(store: Any, job_id: str, *, cfg: Config | None, template: Template | str,
              nodes: list[str] | None = None, exit_code: int | None = None, record: bool = True,
              now: float | None = None, data: JobData | None = None) -> Verdict:
    """Judge job ``job_id`` against ``template``'s baseline and (``record``) store the
    verdict and comparisons, then refresh the baseline when the run is fit for it.

    ``store``: an open :class:`gpuguard.store.Store` holding the job's samples/steps and
    the baselines (a node store, or the cluster store with every node's rows).
    ``template``: a :class:`~gpuguard.epilog.template.Template` or a name (source
    ``derived`` assumed). ``nodes``: restrict to these nodes' data (default: every node
    the job has data on). ``exit_code``: the job's exit status (``SLURM_JOB_EXIT_CODE``);
    non-zero keeps the run out of the baseline, ``None`` = unknown (counted as completed).
    ``data``: the job's series when they do not come from ``store`` (the cluster judge
    builds them from the nodes' spool parts: :func:`gpuguard.epilog.part.to_job_data`).

    Raises :class:`gpuguard.store.StoreError` (store unreadable/unwritable) and
    :class:`gpuguard.config.ConfigError` (bad ``[verdict]``/``[baseline]`` values).
    """
    s = Settings.from_config(cfg)
    bs = baseline_mod.BaselineSettings.from_config(cfg)
    tmpl = template if isinstance(template, Template) else Template(str(template), "derived")
    now = time.time() if now is None else now
    data = load_job(store, job_id, nodes) if data is None else data
    base = baseline_mod.compute_baseline(store, tmpl.name, cfg=cfg, exclude_job=job_id, gpu_model=data.gpu_model)
    v = judge(data, base, s, min_runs=bs.min_runs, template=tmpl, job_id=job_id)
    v.context = node_context(store, data.nodes, base.since if base.since is not None else data.start, data.end)
    if record:
        critical = any(f["severity"] == "critical" for f in data.hw_findings)
        save_verdict(store, v, cfg=cfg, exit_code=exit_code, critical=critical, now=now)
    return v


def exit_code_from_env(env: Mapping[str, str]) -> int | None:
    """``SLURM_JOB_EXIT_CODE`` (raw wait status, SLURM-FACTS.md §4; Slurm keeps it as
    uint32) as an int, or None: the hook-environment reader's check
    (:func:`gpuguard.hookenv.parse_uint`)."""
    from gpuguard.hookenv import UINT32_MAX, parse_uint

    return parse_uint(env.get("SLURM_JOB_EXIT_CODE"), UINT32_MAX)


def run_verdict(store: Any, job_id: str, *, cfg: Config, env: Mapping[str, str] | None = None,
                slurm: Any = None, node: str | None = None,
                now: float | None = None) -> tuple[Verdict, policy_mod.Decision]:
    """The Epilog's one call, after the job summary is stored: resolve the template
    (``SLURM_JOB_COMMENT``, else derived with ``slurm.show_job``), judge the job, store
    the verdict and comparisons, refresh the baseline, and map the verdict's findings
    through the policy table with escalation. Returns ``(verdict, decision)``; when
    ``decision.outcome == "drain"`` the caller drains ``node`` with ``decision.reason``
    (it starts with ``gpuguard:``).

    ``env``: the hook environment (default ``os.environ``); ``node``: this node (default
    ``cfg.node_name``). Raises :class:`gpuguard.store.StoreError` and
    :class:`gpuguard.config.ConfigError`; the Epilog logs them as tool errors.
    """
    env = os.environ if env is None else env
    node = node or cfg.node_name
    tmpl = job_template(env, slurm=slurm, gpu_name=inventory_gpu_name(store, node))
    v = judge_job(store, job_id, cfg=cfg, template=tmpl, exit_code=exit_code_from_env(env), now=now)
    return v, act_on_verdict(store, v, cfg=cfg, node=node, now=now)
