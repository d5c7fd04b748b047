"""The published shape of a stored job summary: the JSON paths of ``job_summaries.summary``
that other stages may read (the reports' ``job_gpu_util`` triggers, cluster tools).

The summary document itself (``gpuguard.epilog.summary.JobSummary.to_dict``) is the
epilog's to change; these paths are its contract. A test
(``tests/test_store_sets.py``) reads each path out of a real stored summary, so renaming
a field breaks that test instead of silently emptying a report. Changing a path here is
a store migration for every reader (a new step of their set).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuguard.metrics import BY_NAME, PER_GPU_STATS, METRICS


@dataclass(frozen=True)
class SummaryField:
    """One published value: ``path`` (SQLite JSON path, relative to the document or, for
    per-GPU fields, to one element of :data:`GPUS`), ``kind`` (``REAL``/``INTEGER``/
    ``TEXT``), ``unit`` and what it means."""

    path: str
    kind: str
    unit: str
    doc: str


#: Per-GPU entries (a JSON array; each element is read with the ``GPU_*`` fields).
GPUS = "$.gpus"

#: Mean GPU utilisation of the node over the job, all its GPUs together.
NODE_GPU_UTIL_MEAN = SummaryField("$.gpu_util_mean_pct", "REAL", "%",
                                  "mean GPU utilisation over the job's samples on this node")
#: Per GPU: its index and its mean utilisation over the job.
GPU_INDEX = SummaryField("$.gpu_index", "INTEGER", "", "GPU index on the node (nvidia-smi order)")
GPU_UTIL_MEAN = SummaryField("$.gpu_util_mean_pct", "REAL", "%", "this GPU's mean utilisation over the job")



def _kind(metric: str) -> str:
    return "INTEGER" if BY_NAME[metric].integer else "REAL"


#: Every statistic of the metric table (``gpuguard.metrics``), published: the node's at
#: ``$.<field>`` (``$.power_mean_w``, ``$.energy_increase_j``), keyed ``node.<field>``; a
#: GPU's at ``$.<field>`` of an element of :data:`GPUS`, keyed ``gpu.<field>``. Field
#: names follow the table's rule (``gpuguard.metrics`` docstring), so a report can name
#: a metric's statistic without reading the epilog's code.
METRIC_FIELDS: dict[str, SummaryField] = {
    **{f"node.{m.field(st)}": SummaryField(f"$.{m.field(st)}", _kind(m.name), m.unit, f"{m.description}: {st} "
                                           "over the job, all the node's GPUs") for m in METRICS for st in m.stats},
    **{f"gpu.{m.field(st)}": SummaryField(f"$.{m.field(st)}", _kind(m.name), m.unit, f"{m.description}: {st} "
                                          "over the job, this GPU")
       for m in METRICS if m.scope in ("gpu", "gpu_slow") for st in m.stats if st in PER_GPU_STATS},
}

#: Every published field, for documentation and the contract test.
PUBLISHED: dict[str, SummaryField] = {
    "node_gpu_util_mean": NODE_GPU_UTIL_MEAN,
    "gpu_index": GPU_INDEX,
    "gpu_util_mean": GPU_UTIL_MEAN,
    **METRIC_FIELDS,
}
