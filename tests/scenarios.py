"""Job scenarios for the verdict: GPU time series and training-record streams with
controlled noise, written straight into a store so the real judging path runs.

A :class:`Profile` is a *template*: the run-independent character of a training job
(step time, GPUs, power, clocks, temperatures, memory plateau, data-wait and comm
shares). :func:`generate` draws one run of it, seeded, as a family:

``healthy``
    realistic jitter only: run-to-run step time ±2 % (σ), per-step noise 4 % with rare
    stalls, clocks ±1 %, power ±3 %, temperature ±1.5 °C, a caching allocator that
    climbs in the first minutes after warm-up and then plateaus, a slow warm-up.
``data-pipeline``
    data wait added to every step (30–120 % of the base step time); utilisation and
    power drop with the idle share.
``communication``
    communication time added (30–120 %); power drops a little.
``gpu-throttling``
    every GPU's SM clock cut to 45–75 % with a slowdown reason active (thermal, HW
    slowdown, power brake, or power cap); compute time grows accordingly.
``straggler-gpu``
    one GPU's clock cut to 50–75 % (some with a thermal reason, some with none), its
    power down; every rank waits for it (sync data parallel): step time up, the other
    ranks' comm time up.
``straggler-node``
    multi-node: one node's compute time per step up 30–80 % (half with its GPU clocks
    down, half with clocks normal: a host-side slowdown); the others wait in comm.
``hardware-fault``
    an XID (48, 79, 94, 119 or 63) during the job, or volatile uncorrectable ECC growth
    in the samples, or a critical ``gpu.lost`` finding from the epilog's health run.
``memory-leak``
    GPU memory of one or all GPUs (or the host RSS) rising linearly after warm-up by
    8–30 % of capacity over the run.
``job-changed``
    step time ×0.6–0.8 or ×1.25–1.7 in the compute phase only (a different model or batch
    size), clocks and data/comm as usual; sometimes a different memory peak.

Anomalies start soon after warm-up (within the first quarter of the rest) and last to
the end, so they dominate the job and persist past one long window. The job data is
written to the tables ``samples``, ``host_samples``, ``steps``, ``checkpoints``,
``events``, ``findings`` and ``inventory``; a table that the store does not have yet is
created from the rows (sqlite-utils), one that it has gets only the columns it knows.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from typing import Any

from gpuguard.model import encode_clock_event_reasons

FAMILIES = ("healthy", "data-pipeline", "communication", "gpu-throttling", "straggler-gpu", "straggler-node",
            "hardware-fault", "memory-leak", "job-changed")

#: Scenario time origin: 2026-01-01T00:00:00Z.
T0 = 1767225600.0


@dataclass
class Profile:
    """A job template's character. Times in seconds, memory MiB, power W, clocks MHz."""

    name: str
    nodes: int = 1
    gpus_per_node: int = 4
    step_time_s: float = 2.0
    data_wait_frac: float = 0.02
    comm_frac: float = 0.12
    optim_frac: float = 0.05
    samples_per_step: int = 32
    util_pct: float = 96.0
    power_w: float = 560.0
    clock_mhz: float = 1755.0
    temp_c: float = 64.0
    mem_plateau_mib: float = 52000.0
    mem_total_mib: float = 81559.0
    gpu_name: str = "NVIDIA H100 80GB HBM3"
    host_rss_mib: float = 24000.0
    duration_s: float = 1800.0
    interval_s: float = 10.0
    warmup_s: float = 150.0
    checkpoint_every_s: float = 600.0
    checkpoint_s: float = 25.0
    power_capped: bool = False

    @property
    def node_names(self) -> list[str]:
        return [f"{self.name[:8]}-n{i + 1}" for i in range(self.nodes)]


def random_profile(rng: random.Random, name: str, *, nodes: int | None = None) -> Profile:
    """A plausible template: 1–2 nodes, 2–8 GPUs per node, step time 1–4 s."""
    n = nodes if nodes is not None else rng.choice([1, 1, 1, 2])
    gpn = rng.choice([4, 8]) if n > 1 else rng.choice([2, 4, 4, 8])
    return Profile(
        name=name, nodes=n, gpus_per_node=gpn, step_time_s=rng.uniform(1.0, 4.0),
        data_wait_frac=rng.uniform(0.005, 0.05), comm_frac=rng.uniform(0.05, 0.25) if n * gpn > 1 else 0.0,
        optim_frac=rng.uniform(0.03, 0.08), samples_per_step=rng.choice([8, 16, 32, 64]),
        util_pct=rng.uniform(90, 99), power_w=rng.uniform(380, 650), clock_mhz=rng.uniform(1600, 1980),
        temp_c=rng.uniform(52, 72), mem_plateau_mib=rng.uniform(20000, 64000),
        host_rss_mib=rng.uniform(8000, 60000), duration_s=rng.uniform(1500, 2700),
        power_capped=rng.random() < 0.4,
    )


@dataclass
class JobRows:
    """The rows one scenario run writes, table -> rows; ``family`` is what the verdict
    should say; ``truth`` holds what was injected (the GPU, the node, the XID ...)."""

    job_id: str
    family: str
    start: float
    end: float
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    truth: dict[str, Any] = field(default_factory=dict)


def _gpu_uuid(node: str, i: int) -> str:
    return f"GPU-{node}-{i:02d}"


def generate(p: Profile, family: str, *, seed: int, job_id: str, start: float, strength: float = 1.0) -> JobRows:
    """One run of profile ``p`` as ``family`` (see the module docstring). Deterministic
    in ``seed``. ``start``: epoch seconds of the job start. ``strength`` scales the
    injected deviation (1 = the ranges above, 0.5 = half as far from normal)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}")
    if family == "straggler-node" and p.nodes < 2:
        raise ValueError("straggler-node needs a multi-node profile")
    rng = random.Random(seed)
    nodes = p.node_names
    n_gpus = p.nodes * p.gpus_per_node
    dur = p.duration_s * rng.uniform(0.95, 1.05)
    # run-to-run jitter (healthy variation)
    run_speed = rng.gauss(1.0, 0.02)
    run_temp = rng.gauss(0.0, 1.5)
    run_power = rng.gauss(1.0, 0.02)
    run_clock = rng.gauss(1.0, 0.008)
    run_mem = rng.gauss(1.0, 0.01)
    run_dw = rng.gauss(1.0, 0.15)
    run_comm = rng.gauss(1.0, 0.08)
    gpu_bias = [(rng.gauss(1.0, 0.01), rng.gauss(1.0, 0.02), rng.gauss(0.0, 1.5)) for _ in range(n_gpus)]
    after = p.warmup_s + 180.0 + rng.uniform(0, 0.15) * (dur - p.warmup_s)  # anomaly onset (after our warm-up)
    truth: dict[str, Any] = {"onset": start + after}

    # what the family changes ----------------------------------------------------------
    slow_gpu: int | None = None
    slow_node: int | None = None
    gpu_clock_f = [1.0] * n_gpus
    gpu_power_f = [1.0] * n_gpus
    gpu_reasons: list[list[str]] = [[] for _ in range(n_gpus)]
    compute_f = [1.0] * n_gpus  # per rank (= GPU) compute-time factor after onset
    extra_dw = extra_comm = 0.0
    job_compute = 1.0
    leak: dict[str, Any] | None = None
    mem_f = 1.0
    if family == "data-pipeline":
        extra_dw = rng.uniform(0.3, 1.2) * p.step_time_s * strength
    elif family == "communication":
        extra_comm = rng.uniform(0.3, 1.2) * p.step_time_s * strength
    elif family == "gpu-throttling":
        cut = 1.0 - (1.0 - rng.uniform(0.45, 0.75)) * strength
        reason = rng.choice([["sw_thermal_slowdown"], ["hw_thermal_slowdown", "sw_thermal_slowdown"],
                             ["hw_slowdown"], ["hw_power_brake_slowdown", "hw_slowdown"], ["sw_power_cap"]])
        truth["reasons"] = reason
        for g in range(n_gpus):
            gpu_clock_f[g] = cut * rng.uniform(0.98, 1.02)
            gpu_power_f[g] = 0.6 + 0.4 * cut
            gpu_reasons[g] = reason
            compute_f[g] = 1.0 / cut
    elif family == "straggler-gpu":
        slow_gpu = rng.randrange(n_gpus)
        cut = 1.0 - (1.0 - rng.uniform(0.5, 0.75)) * strength
        gpu_clock_f[slow_gpu] = cut
        gpu_power_f[slow_gpu] = 0.55 + 0.35 * cut
        if rng.random() < 0.5:
            gpu_reasons[slow_gpu] = ["sw_thermal_slowdown"]
        compute_f[slow_gpu] = 1.0 / cut
        truth["gpu"] = (nodes[slow_gpu // p.gpus_per_node], slow_gpu % p.gpus_per_node)
    elif family == "straggler-node":
        slow_node = rng.randrange(p.nodes)
        slower = 1.0 + (rng.uniform(1.3, 1.8) - 1.0) * strength
        clocks_down = rng.random() < 0.5
        for g in range(slow_node * p.gpus_per_node, (slow_node + 1) * p.gpus_per_node):
            compute_f[g] = slower
            if clocks_down:
                gpu_clock_f[g] = 1.0 / slower
                gpu_power_f[g] = 0.8
        truth["node"] = nodes[slow_node]
    elif family == "job-changed":
        job_compute = 1.0 + (rng.choice([rng.uniform(0.6, 0.8), rng.uniform(1.25, 1.7)]) - 1.0) * strength
        if rng.random() < 0.3:
            mem_f = rng.uniform(1.2, 1.35)
        truth["compute"] = job_compute
    elif family == "memory-leak":
        kind = rng.choice(["one_gpu", "all_gpus", "host"])
        room = (p.mem_total_mib - p.mem_plateau_mib * 1.03) / p.mem_total_mib  # stays below capacity
        frac = min(rng.uniform(0.08, 0.3) * strength, 0.9 * room)
        leak = {"kind": kind, "gpu": rng.randrange(n_gpus), "frac": frac}
        truth["leak"] = leak
    fault: dict[str, Any] | None = None
    if family == "hardware-fault":
        fault = {"kind": rng.choice(["xid", "xid", "ecc", "lost"]), "gpu": rng.randrange(n_gpus),
                 "xid": rng.choice([48, 79, 94, 119, 63]), "at": start + rng.uniform(after, dur * 0.9)}
        truth["fault"] = fault

    # steps ------------------------------------------------------------------------------------
    steps: list[dict[str, Any]] = []
    base = p.step_time_s * run_speed
    t = start + rng.uniform(20, 40)  # process start, CUDA init
    n = 0
    ckpt_rows: list[dict[str, Any]] = []
    next_ckpt = start + p.checkpoint_every_s
    end = start + dur
    while t < end:
        rel_t = t - start
        warm = 1.0 + 1.5 * max(0.0, 1.0 - rel_t / p.warmup_s)  # compilation/autotune: slow first steps
        on = rel_t >= after
        noise = max(0.7, rng.gauss(1.0, 0.04))
        if rng.random() < 0.004:
            noise *= rng.uniform(2, 4)  # a rare stall (GC, a slow batch)
        dw0 = base * p.data_wait_frac * run_dw * rng.uniform(0.5, 1.5)
        comm0 = base * p.comm_frac * run_comm * rng.uniform(0.8, 1.2)
        opt0 = base * p.optim_frac
        fb0 = max(0.1 * base, base - dw0 - comm0 - opt0) * noise * warm * (job_compute if on else 1.0)
        fbs = [fb0 * (compute_f[g] if on else 1.0) for g in range(n_gpus)]
        slowest = max(fbs)
        dw = dw0 + (extra_dw * rng.uniform(0.8, 1.2) if on else 0.0)
        step_time = dw + slowest + comm0 + opt0 + (extra_comm * rng.uniform(0.8, 1.2) if on else 0.0)
        t += step_time
        n += 1
        for g in range(n_gpus):
            comm = step_time - dw - fbs[g] - opt0  # everyone waits for the slowest in the all-reduce
            steps.append({
                "job_id": job_id, "node": nodes[g // p.gpus_per_node], "rank": g, "t": round(t, 4), "step": n,
                "step_time_s": round(step_time, 5), "samples": p.samples_per_step, "tokens": None,
                "loss": 2.0 / math.sqrt(n), "loss_nonfinite": False, "grad_norm": 1.0,
                "data_wait_s": round(dw, 5), "fwd_bwd_s": round(fbs[g], 5), "comm_s": round(comm, 5),
                "optim_s": round(opt0, 5)})
        if t >= next_ckpt:
            ck = p.checkpoint_s * rng.uniform(0.9, 1.1)
            ckpt_rows.append({"job_id": job_id, "node": nodes[0], "rank": 0, "t": round(t + ck, 3), "step": n,
                              "duration_s": round(ck, 3), "bytes": None})
            t += ck
            next_ckpt += p.checkpoint_every_s

    # GPU samples -----------------------------------------------------------------------------
    samples: list[dict[str, Any]] = []
    host: list[dict[str, Any]] = []
    ts = start + 5.0
    ecc_from = None
    if fault and fault["kind"] == "ecc":
        ecc_from = fault["at"]
    lost_at = fault["at"] if fault and fault["kind"] == "xid" and fault["xid"] == 79 else None
    dw_share_extra = extra_dw / (base + extra_dw) if extra_dw else 0.0
    while ts < end:
        rel_t = ts - start
        on = rel_t >= after
        warm = rel_t < p.warmup_s
        # allocator: climbs over the first minutes, then a plateau
        ramp = min(1.0, rel_t / (p.warmup_s + 240.0))
        for g in range(n_gpus):
            node = nodes[g // p.gpus_per_node]
            if lost_at is not None and g == fault["gpu"] and ts >= lost_at:  # type: ignore[index]
                continue  # fallen off the bus: no more samples
            cb, pb, tb = gpu_bias[g]
            util = p.util_pct * (0.6 if warm else 1.0)
            if on and family == "data-pipeline":
                util *= 1.0 - dw_share_extra
            if on and family == "communication":
                util *= 0.97
            clock = p.clock_mhz * run_clock * cb * (gpu_clock_f[g] if on else 1.0)
            power = p.power_w * run_power * pb * (gpu_power_f[g] if on else 1.0)
            if on and family == "data-pipeline":
                power *= 1.0 - 0.6 * dw_share_extra
            if on and family == "communication":
                power *= 0.9
            temp = p.temp_c + run_temp + tb + (power - p.power_w) / 40.0
            reasons = list(gpu_reasons[g]) if on else []
            if on and family == "gpu-throttling" and any("thermal" in r for r in reasons):
                temp += rng.uniform(12, 18)
            if p.power_capped and not reasons and rng.random() < 0.7:
                reasons = ["sw_power_cap"]  # GPUs at TDP run capped all the time: normal
            mem = p.mem_plateau_mib * run_mem * mem_f * (0.3 + 0.7 * ramp) + rng.uniform(-40, 40)
            if leak and on and leak["kind"] in ("one_gpu", "all_gpus") and (leak["kind"] == "all_gpus" or g == leak["gpu"]):
                mem += leak["frac"] * p.mem_total_mib * (ts - start - after) / (dur - after)
            samples.append({
                "job_id": job_id, "node": node, "at": round(ts, 3), "gpu_index": g % p.gpus_per_node,
                "gpu_uuid": _gpu_uuid(node, g % p.gpus_per_node),
                "gpu_util_pct": round(min(100.0, util + rng.gauss(0, 1.0)), 1),
                "mem_util_pct": round(util * 0.4, 1), "mem_used_mib": round(min(mem, p.mem_total_mib), 1),
                "power_w": round(power * rng.gauss(1.0, 0.02), 1), "temp_c": round(temp + rng.gauss(0, 0.5), 1),
                "sm_clock_mhz": round(clock * rng.gauss(1.0, 0.005)), "mem_clock_mhz": 2619.0,
                "clock_event_mask": encode_clock_event_reasons(reasons),
                "ecc_volatile_uncorrected": 2 if ecc_from is not None and ts >= ecc_from and g == fault["gpu"] else 0,  # type: ignore[index]
                "pcie_replay_count": 0})
        for node in nodes:
            rss = p.host_rss_mib * (0.5 + 0.5 * ramp) + rng.uniform(-100, 100)
            if leak and on and leak["kind"] == "host":
                rss += leak["frac"] * 2 * p.host_rss_mib * (ts - start - after) / (dur - after)
            host.append({"job_id": job_id, "node": node, "at": round(ts, 3), "cpu_pct": 800.0,
                         "rss_mib": round(rss, 1), "io_read_mib": 0.0, "io_write_mib": 0.0})
        ts += p.interval_s

    tables: dict[str, list[dict[str, Any]]] = {"samples": samples, "host_samples": host, "steps": steps,
                                               "checkpoints": ckpt_rows}
    if fault:
        g = fault["gpu"]
        node = nodes[g // p.gpus_per_node]
        if fault["kind"] == "xid" or fault["kind"] == "ecc":
            code = fault["xid"] if fault["kind"] == "xid" else 48
            action = "alert" if code in (63, 94) else "drain"
            tables["events"] = [{"node": node, "at": fault["at"], "kind": "xid", "code": code,
                                 "gpu_index": g % p.gpus_per_node, "gpu_uuid": _gpu_uuid(node, g % p.gpus_per_node),
                                 "pci_bus_id": None, "pid": 4242, "process": "python", "message": f"Xid {code}",
                                 "action": action, "job_id": job_id, "source": "kernel_log", "raw": ""}]
        else:
            tables["findings"] = [{"run_id": None, "node": node, "at": end + 5.0, "job_id": job_id,
                                   "code": "gpu.lost", "severity": "critical", "action": "drain",
                                   "gpu_index": g % p.gpus_per_node, "gpu_uuid": _gpu_uuid(node, g % p.gpus_per_node),
                                   "message": "GPU is lost", "evidence": "{}"}]
    return JobRows(job_id, family, start, end, tables, truth)


def inventory_rows(p: Profile, at: float) -> list[dict[str, Any]]:
    """Inventory rows for the profile's GPUs (gives the verdict the memory capacity)."""
    return [{"node": node, "uuid": _gpu_uuid(node, i), "gpu_index": i, "serial": None, "name": p.gpu_name,
             "pci_bus_id": None, "driver_version": "535.183.01", "cuda_version": "12.2", "vbios_version": None,
             "inforom_version": None, "first_seen": at, "last_seen": at}
            for node in p.node_names for i in range(p.gpus_per_node)]


def _columns(store: Any, table: str) -> list[str] | None:
    rows = store.query(f"pragma table_info({table})")
    return [r["name"] for r in rows] or None


def write(store: Any, rows: JobRows) -> None:
    """Insert the scenario's rows. Tables the store has get only their own columns
    (``t`` is written as ``at`` where the table has ``at``; flattened phases go into a
    JSON ``phases`` column where the table has one)."""
    for table, rs in rows.tables.items():
        if not rs:
            continue
        cols = _columns(store, table)
        if cols is not None:
            out = []
            for r in rs:
                r = dict(r)
                if "t" in r and "t" not in cols and "at" in cols:
                    r["at"] = r.pop("t")
                if "phases" in cols and "phases" not in r:
                    r["phases"] = json.dumps({k: r.pop(k) for k in ("data_wait_s", "fwd_bwd_s", "comm_s", "optim_s")
                                              if k in r})
                out.append({k: v for k, v in r.items() if k in cols})
            rs = out
        store.insert_many(table, rs)


def write_inventory(store: Any, p: Profile, at: float) -> None:
    """Upsert the profile's inventory rows."""
    with store.tx():
        store.db["inventory"].upsert_all(inventory_rows(p, at), pk=("node", "uuid"))
