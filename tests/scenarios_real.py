"""A second, independent scenario generator for the verdict, built to look like real jobs.

It shares no code or modelling choice with ``tests/scenarios.py``. What it models:

* **Synchronous data-parallel ranks.** Every rank computes its share of a step; the
  step ends when the slowest rank is done, so a slow rank shows as the *others'* wait in
  ``comm`` (their ``comm_s`` = all-reduce time + the wait for the slowest); the slow rank
  itself has the longest ``fwd_bwd_s`` and the shortest ``comm_s``.
* **Heavy-tailed step times**: a log-normal per-step factor plus rare 3-10x spikes
  (garbage collection, a slow batch) on one rank.
* **Pauses**: an evaluation every K steps (GPUs partly busy, no step records) and a
  checkpoint every few minutes (GPUs idle, a checkpoint record from rank 0).
* **Warm-up**: compilation / autotuning makes the first minutes slower.
* **NVML-like readings** every ``sample_interval_s`` (10 s), each the average over the last
  second: a reading that lands in a data wait or a pause shows a dip in utilisation and
  power, idle clock-event reasons, lower clocks.
* **Per-GPU spread**: each physical GPU keeps its own clock/power offsets across runs, and
  its rank's compute time follows its clock (``clock ** -0.7``: part of the kernels is
  memory-bound), so ranks' median compute times differ by about a per cent, run after run.
* **A caching allocator** that grows in chunks during the first minutes, then plateaus.
* 1-16 GPUs on 1-2 nodes, jobs of 10 min to 6 h, 5-20 healthy history runs per template.
* **Subtle strengths and confusers**: each anomaly has a magnitude drawn down to below the
  detection limits, and healthy runs include slow starts (first ~20 % slow), a long final
  checkpoint, one long evaluation, heavier step-time tails, one more allocator chunk,
  one GPU drawing less power at normal clocks, a lowered batch with the same per-sample cost
  is *not* healthy (it is ``job-changed``).

Every run goes through the product's own path: training records are written as
``train.rank<R>.jsonl`` files in schema v1 and read back with
:func:`gpuguard.collector.ingest.read_job_records`, stored with
:func:`gpuguard.epilog.hook.save_training_records`; readings become ``samples`` rows with
:func:`gpuguard.collector.run.gpu_row`; each node's summary is computed and saved
(:mod:`gpuguard.epilog.summary`); then the job is judged once, with all nodes' data, by
:func:`gpuguard.epilog.verdict.judge_job` (the job-level path of cluster mode).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
from dataclasses import dataclass, field
from typing import Any

from gpuguard.collector.ingest import read_job_records
from gpuguard.collector.run import gpu_row
from gpuguard.epilog.hook import save_training_records
from gpuguard.epilog.summary import save_summary, summarize_job
from gpuguard.model import GpuState
from gpuguard.xid.catalog import lookup

#: Truth labels: the verdict's causes.
CAUSES = ("healthy", "hardware-fault", "straggler-node", "straggler-gpu", "gpu-throttling", "memory-leak",
          "data-pipeline", "communication", "job-changed")
#: Healthy runs that look like something else.
CONFUSERS = ("slow-start", "long-final-checkpoint", "long-eval", "heavy-tail", "wider-tail", "allocator-chunk",
             "low-power-gpu", "job-wide-jitter")
T_BASE = 1_767_000_000.0  # 2025-12-29: a past time the ingest's range rules accept

GPU_MODELS = (
    # name, memory MiB, busy SM clock MHz, busy power W, power limit W, idle power W
    ("NVIDIA H100 80GB HBM3", 81559, 1755.0, 560.0, 700.0, 75.0),
    ("NVIDIA A100-SXM4-80GB", 81920, 1410.0, 330.0, 400.0, 60.0),
    ("NVIDIA A100-SXM4-40GB", 40960, 1410.0, 300.0, 400.0, 55.0),
    ("NVIDIA L40S", 46068, 2520.0, 290.0, 350.0, 35.0),
)


@dataclass
class Workload:
    """A job template: the same code on the same kind of machines, run again and again."""

    name: str
    nodes: list[str]
    gpus_per_node: int
    gpu: tuple[str, int, float, float, float, float]
    duration_s: float
    step_s: float
    samples_per_rank: int
    seq_len: int
    data_frac: float
    comm_frac: float
    optim_frac: float
    step_sigma: float
    spike_p: float
    eval_every: int
    eval_s: float
    ckpt_every_s: float
    ckpt_s: float
    warmup_s: float
    mem_mib: float
    chunk_mib: float
    rss_mib: float
    cap_share: float  # share of busy readings with sw_power_cap active in a healthy run
    gpu_clock_f: list[float] = field(default_factory=list)
    gpu_power_f: list[float] = field(default_factory=list)
    sample_interval_s: float = 10.0

    @property
    def n_gpus(self) -> int:
        return len(self.nodes) * self.gpus_per_node


def make_workload(rng: random.Random, name: str) -> Workload:
    """A random template: 1-2 nodes, 1-8 GPUs per node, 10 min - 6 h (log-uniform)."""
    n_nodes = 2 if rng.random() < 0.3 else 1
    gpn = rng.choice((1, 2, 4, 8) if n_nodes == 1 else (2, 4, 8))
    gpu = rng.choice(GPU_MODELS)
    n = n_nodes * gpn
    comm = 0.0 if n == 1 else rng.uniform(0.06, 0.22)
    spread_c = [rng.gauss(1.0, 0.012) for _ in range(n)]
    spread_p = [rng.gauss(1.0, 0.035) for _ in range(n)]
    return Workload(
        name=name, nodes=[f"{name}-n{k}" for k in range(n_nodes)], gpus_per_node=gpn, gpu=gpu,
        duration_s=math.exp(rng.uniform(math.log(600), math.log(6 * 3600))),
        step_s=rng.uniform(0.25, 3.0), samples_per_rank=rng.choice((4, 8, 16, 32, 64)),
        seq_len=rng.choice((1024, 2048, 4096)), data_frac=rng.uniform(0.01, 0.07), comm_frac=comm,
        optim_frac=rng.uniform(0.02, 0.06), step_sigma=rng.uniform(0.03, 0.10), spike_p=rng.uniform(0.001, 0.006),
        eval_every=rng.choice((500, 1000, 2000)), eval_s=rng.uniform(20, 120),
        ckpt_every_s=rng.uniform(900, 3600), ckpt_s=rng.uniform(10, 90), warmup_s=rng.uniform(40, 240),
        mem_mib=gpu[1] * rng.uniform(0.35, 0.85), chunk_mib=rng.choice((1024.0, 2048.0, 4096.0)),
        rss_mib=rng.uniform(8000, 60000), cap_share=rng.choice((0.0, 0.0, 0.0, rng.uniform(0.1, 0.5))),
        gpu_clock_f=spread_c, gpu_power_f=spread_p)


@dataclass
class Case:
    """What one run is: ``cause`` (truth), ``magnitude`` (in the cause's own unit, see
    :data:`MAGNITUDE_UNITS`), ``confuser`` for a healthy run that looks like something
    else, ``detail`` (which GPU / node / variant)."""

    cause: str = "healthy"
    magnitude: float = 0.0
    confuser: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)


#: What ``Case.magnitude`` measures per cause.
MAGNITUDE_UNITS = {
    "straggler-gpu": "extra compute time of the slow GPU (0.2 = +20 %)",
    "straggler-node": "extra compute time of every GPU of the slow node",
    "gpu-throttling": "SM clock reduction of every GPU (0.15 = 15 % lower)",
    "memory-leak": "rise over the run, fraction of GPU capacity (GPU) or of the starting RSS (host)",
    "data-pipeline": "extra data wait per step, fraction of the healthy step time",
    "communication": "extra all-reduce time per step, fraction of the healthy step time",
    "job-changed": "|relative change| of the per-sample compute time, or of samples per step",
    "healthy": "0 (confuser 'rank-role': one rank 25 % slower in every run of the template, by role)",
    "hardware-fault": "1 (an XID / ECC / lost GPU)",
}


def draw_case(rng: random.Random, w: Workload, cause: str) -> Case:
    """A random case of ``cause`` for ``w``, magnitudes spread from well below to well
    above the detection limits (the bench reports both sides)."""
    n = w.n_gpus
    if cause == "healthy":
        conf = rng.choice((None, None, *CONFUSERS))
        return Case("healthy", 0.0, conf, {"gpu": rng.randrange(n)})
    if cause == "straggler-gpu":
        return Case(cause, rng.uniform(0.04, 0.45), None,
                    {"gpu": rng.randrange(n), "clock_too": rng.random() < 0.5})
    if cause == "straggler-node":
        return Case(cause, rng.uniform(0.04, 0.45), None,
                    {"node": rng.randrange(len(w.nodes)), "clock_too": rng.random() < 0.4})
    if cause == "gpu-throttling":
        return Case(cause, rng.uniform(0.04, 0.3), None,
                    {"reason": rng.choice(("sw_power_cap", "sw_power_cap", "sw_thermal_slowdown", "hw_slowdown"))})
    if cause == "memory-leak":
        return Case(cause, rng.uniform(0.01, 0.25), None,
                    {"kind": rng.choice(("one_gpu", "all_gpus", "host")), "gpu": rng.randrange(n)})
    if cause == "data-pipeline":
        return Case(cause, rng.uniform(0.03, 0.6), None, {"stalls": rng.random() < 0.5})
    if cause == "communication":
        return Case(cause, rng.uniform(0.02, 0.4), None, {})
    if cause == "job-changed":
        if rng.random() < 0.4:
            f = rng.choice((0.5, 2.0))
            return Case(cause, abs(f - 1.0), None, {"batch_f": f})
        f = rng.choice((rng.uniform(0.55, 0.95), rng.uniform(1.05, 1.6)))
        return Case(cause, abs(f - 1.0), None, {"compute_f": f})
    if cause == "hardware-fault":
        return Case(cause, 1.0, None, {"xid": rng.choice((79, 48, 94, 119, 63, 74)), "gpu": rng.randrange(n)})
    raise ValueError(f"unknown cause {cause!r}")


@dataclass
class Run:
    """One generated run: ids, time span, truth."""

    job_id: str
    workload: Workload
    case: Case
    start: float
    end: float


class _Sim:
    """Simulates one run: records per rank, pauses, then NVML-like readings."""

    def __init__(self, w: Workload, case: Case, rng: random.Random, start: float):
        self.w, self.c, self.rng, self.start = w, case, rng, start
        self.dur = w.duration_s * rng.uniform(0.85, 1.15)
        self.end = start + self.dur
        n = w.n_gpus
        self.run_f = math.exp(rng.gauss(0.0, 0.015))  # run-to-run: node placement, data order
        self.speed = [1.0] * n  # compute time multiplier per rank (the injected cause)
        self.rank_f = [f ** -0.7 for f in w.gpu_clock_f]  # the GPU's own clock offset
        self.clock_f = [1.0] * n
        self.reasons: list[tuple[str, ...]] = [()] * n
        self.extra_dw = 0.0
        self.extra_comm = 0.0
        self.stall_share = 0.0
        self.batch_f = 1.0
        self.onset = start + (0.0 if rng.random() < 0.6 else rng.uniform(0.1, 0.3) * self.dur)
        self.records: list[list[dict[str, Any]]] = [[] for _ in range(n)]
        self.ckpts: list[dict[str, Any]] = []
        self.pauses: list[tuple[float, float, str]] = []
        self._inject()

    # -- the injected cause -------------------------------------------------------------------
    def _inject(self) -> None:
        c, w, m = self.c, self.w, self.c.magnitude
        if c.cause == "straggler-gpu":
            g = c.detail["gpu"]
            self.speed[g] = 1.0 + m
            if c.detail["clock_too"]:
                self.clock_f[g] = 1.0 / (1.0 + m)
                self.reasons[g] = ("hw_slowdown",)
        elif c.cause == "straggler-node":
            k = c.detail["node"]
            for g in range(k * w.gpus_per_node, (k + 1) * w.gpus_per_node):
                self.speed[g] = 1.0 + m
                if c.detail["clock_too"]:
                    self.clock_f[g] = 1.0 / (1.0 + m)
        elif c.cause == "gpu-throttling":
            for g in range(w.n_gpus):
                self.clock_f[g] = c.detail.get("clock_f", 1.0 - m)
                self.speed[g] = 1.0 / (1.0 - m * 0.85)  # memory-bound kernels feel less of it
                self.reasons[g] = (c.detail["reason"],)
        elif c.cause == "data-pipeline":
            if c.detail["stalls"]:
                self.stall_share = m / (1.0 + m)
            else:
                self.extra_dw = m
        elif c.cause == "communication":
            self.extra_comm = m
        elif c.confuser == "rank-role":  # a role that costs more in every run: part of normal
            self.speed[c.detail["gpu"]] = 1.25
            self.onset = self.start
        elif c.cause == "job-changed":
            if "batch_f" in c.detail:
                self.batch_f = c.detail["batch_f"]
                # per-sample cost: fixed overheads make a smaller batch cheaper per step, not per sample
                self.speed = [0.15 + 0.85 * self.batch_f] * w.n_gpus
            else:
                self.speed = [c.detail["compute_f"]] * w.n_gpus

    def _on(self, t: float) -> bool:
        return t >= self.onset

    # -- steps ------------------------------------------------------------------------------
    def steps(self) -> None:
        w, rng, c = self.w, self.rng, self.c
        n = w.n_gpus
        base = w.step_s * self.run_f
        compute0 = base * (1.0 - w.data_frac - w.comm_frac - w.optim_frac)
        n_steps = self.dur / base
        log_every = max(1, round(n_steps / 400))
        slow_start_s = 0.2 * self.dur if c.confuser == "slow-start" else 0.0
        slow_start_f = rng.uniform(1.3, 2.0)
        spike_p = w.spike_p * (4.0 if c.confuser == "heavy-tail" else 1.0)
        jitter = 0.05 if c.confuser == "job-wide-jitter" else 0.0
        long_eval_at = rng.randrange(1, 4)
        t = self.start + rng.uniform(15, 45)  # CUDA/NCCL init before the first step
        step = 0
        next_ckpt = self.start + w.ckpt_every_s
        evals = 0
        while t < self.end:
            on = self._on(t)
            rel = t - self.start
            warm = 1.0 + 2.0 * math.exp(-rel / (w.warmup_s / 3.0))
            if rel < slow_start_s:
                warm *= slow_start_f
            sigma = min(0.3, 3.0 * w.step_sigma) if c.confuser == "wider-tail" else w.step_sigma
            f = math.exp(rng.gauss(0.0, sigma)) * warm * (1.0 + jitter * math.sin(rel / 97.0))
            bf = self.batch_f if on else 1.0
            comp = []
            for r in range(n):
                sp = self.speed[r] if on else 1.0
                comp.append(compute0 * f * sp * self.rank_f[r] * math.exp(rng.gauss(0.0, 0.01)))
            if rng.random() < spike_p:
                comp[rng.randrange(n)] *= rng.uniform(3.0, 10.0)
            dw = [base * w.data_frac * rng.uniform(0.4, 1.6) for _ in range(n)]
            if on and self.extra_dw:
                extra = base * self.extra_dw * rng.uniform(0.7, 1.3)
                dw = [d + extra for d in dw]
            if on and self.stall_share and rng.random() < 0.25:
                stall = base * self.stall_share / (1 - self.stall_share) * 4.0 * rng.uniform(0.5, 1.5)
                dw = [d + stall for d in dw]
            ready = [dw[r] + comp[r] for r in range(n)]
            slowest = max(ready)
            allreduce = base * w.comm_frac * bf * rng.uniform(0.85, 1.15)
            if on and self.extra_comm:
                allreduce += base * self.extra_comm * rng.uniform(0.8, 1.2)
            optim = base * w.optim_frac
            step_time = slowest + allreduce + optim
            t += step_time + (log_every - 1) * base * warm * (self.speed[0] if on else 1.0)
            step += log_every
            if t >= self.end:
                break
            for r in range(n):
                self.records[r].append({
                    "v": 1, "kind": "step", "rank": r, "t": round(t, 3), "step": step,
                    "step_time_s": round(step_time, 5), "samples": round(w.samples_per_rank * bf),
                    "tokens": round(w.samples_per_rank * bf) * w.seq_len, "loss": round(3.0 / math.sqrt(step), 4),
                    "loss_nonfinite": False, "grad_norm": 1.0,
                    "phases": {"data_wait_s": round(dw[r], 5), "fwd_bwd_s": round(comp[r], 5),
                               "comm_s": round(allreduce + slowest - ready[r], 5), "optim_s": round(optim, 5)}})
            if step // w.eval_every > evals:
                evals = step // w.eval_every
                e = w.eval_s * rng.uniform(0.9, 1.1) * (8.0 if c.confuser == "long-eval" and evals == long_eval_at else 1.0)
                self.pauses.append((t, t + e, "eval"))
                t += e
            if t >= next_ckpt:
                k = w.ckpt_s * rng.uniform(0.85, 1.2)
                self.pauses.append((t, t + k, "ckpt"))
                self.ckpts.append({"v": 1, "kind": "checkpoint", "rank": 0, "t": round(t + k, 3), "step": step,
                                   "duration_s": round(k, 3)})
                t += k
                next_ckpt = t + w.ckpt_every_s
        if c.confuser == "long-final-checkpoint":
            k = min(w.ckpt_s * rng.uniform(4, 10), 0.15 * self.dur)  # a long save, not most of the job
            self.pauses.append((self.end - k, self.end, "ckpt"))
            self.ckpts.append({"v": 1, "kind": "checkpoint", "rank": 0, "t": round(self.end, 3), "step": step,
                               "duration_s": round(k, 3)})

    # -- NVML-like readings -------------------------------------------------------------------
    def _pause_at(self, ts: float) -> str | None:
        for a, b, kind in self.pauses:
            if a <= ts - 0.5 < b:
                return kind
        return None

    def readings(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        w, rng, c = self.w, self.rng, self.c
        name, mem_total, clock0, power0, limit, idle_w = w.gpu
        chunks = sorted(self.start + rng.uniform(20, 300) for _ in range(int(w.mem_mib // w.chunk_mib)))
        late_chunk = self.start + rng.uniform(0.3, 0.7) * self.dur if c.confuser == "allocator-chunk" else None
        leak = c.detail if c.cause == "memory-leak" else None
        fault_at = self.start + rng.uniform(0.3, 0.9) * self.dur if c.cause == "hardware-fault" else None
        lost = fault_at is not None and c.detail["xid"] == 79
        samples, host = [], []
        ts = self.start + rng.uniform(1, w.sample_interval_s)
        while ts < self.end:
            on = self._on(ts)
            pause = self._pause_at(ts)
            job_stall = on and self.stall_share and rng.random() < self.stall_share
            mem_base = min(w.mem_mib, w.chunk_mib * sum(1 for a in chunks if a <= ts)) + 600.0
            if late_chunk is not None and ts >= late_chunk:
                mem_base += 0.03 * mem_total
            for g in range(w.n_gpus):
                node = w.nodes[g // w.gpus_per_node]
                idx = g % w.gpus_per_node
                if lost and g == c.detail["gpu"] and ts >= fault_at:  # type: ignore[operator]
                    continue
                dw_share = w.data_frac + (self.extra_dw if on else 0.0)
                busy = pause is None and not job_stall and rng.random() >= min(0.9, dw_share)
                if pause == "eval":
                    busy = rng.random() < 0.6
                util = rng.uniform(93, 100) if busy else rng.uniform(0, 12)
                cf = self.clock_f[g] if on else 1.0
                clock = clock0 * w.gpu_clock_f[g] * cf * rng.gauss(1.0, 0.004) if busy else clock0 * rng.uniform(0.6, 0.9)
                pw = power0 * w.gpu_power_f[g] * (0.9 + 0.1 * cf) * rng.gauss(1.0, 0.03) if busy else idle_w * rng.uniform(1.0, 1.6)
                if c.confuser == "low-power-gpu" and g == c.detail["gpu"] and busy:
                    pw *= 0.89
                reasons = []
                if not busy:
                    reasons.append("gpu_idle")
                elif on and self.reasons[g]:
                    if rng.random() < 0.85:
                        reasons.extend(self.reasons[g])
                    if "sw_power_cap" in self.reasons[g]:
                        pw = min(pw, limit * (1.0 - self.c.magnitude) * rng.uniform(0.97, 1.0))
                elif rng.random() < w.cap_share:
                    reasons.append("sw_power_cap")
                temp = 35.0 + pw / 12.0 + rng.gauss(0.0, 0.7)
                if on and "sw_thermal_slowdown" in self.reasons[g]:
                    temp += 14.0
                mem = mem_base + rng.uniform(-30, 30)
                if leak and on and leak["kind"] != "host" and (leak["kind"] == "all_gpus" or g == leak["gpu"]):
                    mem += self.c.magnitude * mem_total * (ts - self.onset) / (self.end - self.onset)
                ecc = 0
                if fault_at is not None and c.detail["xid"] == 48 and g == c.detail["gpu"] and ts >= fault_at:
                    ecc = 1
                st = GpuState(index=idx, uuid=f"GPU-{node}-{idx:02d}", name=name, temp_c=round(temp, 1),
                              power_w=round(pw, 1), power_limit_w=limit, sm_clock_mhz=round(clock),
                              mem_clock_mhz=2619.0, clock_event_reasons=reasons, gpu_util_pct=round(util),
                              mem_util_pct=round(util * 0.45), mem_used_mib=round(min(mem, mem_total), 1),
                              mem_total_mib=mem_total, ecc_volatile_uncorrected=ecc)
                samples.append(gpu_row(st, self.job_id, node, round(ts, 3)))
            for node in w.nodes:
                rss = w.rss_mib * min(1.0, 0.4 + (ts - self.start) / 400.0) * rng.gauss(1.0, 0.004)
                if leak and on and leak["kind"] == "host":
                    rss += self.c.magnitude * w.rss_mib * (ts - self.onset) / (self.end - self.onset)
                host.append({"job_id": self.job_id, "node": node, "at": round(ts, 3), "cpu_pct": 900.0,
                             "rss_mib": round(rss, 1), "io_read_mib": 0.0, "io_write_mib": 0.0})
            ts += w.sample_interval_s
        self.fault_at = fault_at
        return samples, host


def _write_records(job_dir: str, by_rank: dict[int, list[dict[str, Any]]], ckpts: list[dict[str, Any]]) -> None:
    """One ``train.rank<R>.jsonl`` per rank of this node, as the training API writes them."""
    os.makedirs(job_dir, mode=0o700, exist_ok=True)
    first = min(by_rank)
    for r, recs in by_rank.items():
        lines = recs + (ckpts if r == first else [])
        with open(os.path.join(job_dir, f"train.rank{r}.jsonl"), "w", encoding="ascii") as fh:
            fh.write("".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines))


def write_inventory(store: Any, w: Workload, at: float) -> None:
    """The prolog's inventory rows for the workload's GPUs (memory capacity by name)."""
    rows = [{"node": node, "uuid": f"GPU-{node}-{i:02d}", "gpu_index": i, "name": w.gpu[0], "serial": None,
             "pci_bus_id": None, "driver_version": "550.90.07", "cuda_version": "12.4", "vbios_version": None,
             "inforom_version": None, "first_seen": at, "last_seen": at}
            for node in w.nodes for i in range(w.gpus_per_node)]
    with store.tx():
        store.db["inventory"].upsert_all(rows, pk=("node", "uuid"))


def run_job(store: Any, w: Workload, case: Case, job_id: str, start: float, seed: int, tmp: str) -> Run:
    """Simulate one run and put it into ``store`` through the product's path (module
    docstring). Returns the :class:`Run`; the caller judges it."""
    rng = random.Random(seed)
    sim = _Sim(w, case, rng, start)
    sim.job_id = job_id  # type: ignore[attr-defined]
    sim.steps()
    samples, host = sim.readings()
    store.insert_many("samples", samples)
    store.insert_many("host_samples", host)
    for k, node in enumerate(w.nodes):
        ranks = range(k * w.gpus_per_node, (k + 1) * w.gpus_per_node)
        job_dir = os.path.join(tmp, f"{job_id}-{node}")
        _write_records(job_dir, {r: sim.records[r] for r in ranks}, sim.ckpts if k == 0 else [])
        ing = read_job_records(job_dir, os.getuid())
        save_training_records(store, job_id, node, ing)
        shutil.rmtree(job_dir)
        s = summarize_job(store, job_id, node, exit_status_raw=0, collector_status="ok", ingest=ing,
                          started_at=start - 1.0, ended_at=sim.end + 1.0)
        save_summary(store, s)
    if case.cause == "hardware-fault":
        g = case.detail["gpu"]
        node = w.nodes[g // w.gpus_per_node]
        code = case.detail["xid"]
        row = lookup(code)
        store.insert("events", {"node": node, "at": sim.fault_at, "kind": "xid", "code": code,
                                "gpu_index": g % w.gpus_per_node, "gpu_uuid": f"GPU-{node}-{g % w.gpus_per_node:02d}",
                                "pci_bus_id": None, "pid": 31337, "process": "python3",
                                "message": f"NVRM: Xid {code}", "action": row.action if row else "alert",
                                "job_id": job_id, "source": "kernel_log", "raw": ""})
    return Run(job_id, w, case, start, sim.end)
