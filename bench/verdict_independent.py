"""Verdict accuracy when the judged run's conditions differ from its template's history.

``bench/verdict_accuracy.py`` judges runs made under the same conditions as their history
(same GPUs, same count, similar length, 5-20 earlier runs). Real templates break those
assumptions; this bench draws each scenario from one *shift* and one true cause:

* ``few-history``: only 1-4 healthy earlier runs;
* ``short-run``: the judged run lasts 5-35 % of the history's length (cancelled, time limit);
* ``other-gpu-model``: history on one GPU model, the run on another (a partition change):
  the step time follows the SM clock ratio, the truth is *not the machine's fault*;
* ``other-gpu-count``: history on one GPU count, the run on half or twice as many GPUs
  per node with the same per-rank batch: *not the machine's fault*;
* ``none``: same conditions (control).

A fault's magnitude is drawn at or above the detection limits of
``bench/verdict_accuracy.DETECTION_LIMITS`` (1.2-3x), so a miss is the shift's doing.
Runs go through the product's path (tests/scenarios_real.run_job: training-record files ->
ingest -> store -> summary -> :func:`gpuguard.epilog.verdict.judge_job`).

A verdict is *right* when it names the true cause; for a healthy run under a hardware
shift, ``healthy``, ``job-changed`` and ``learning`` (no comparable baseline) are right,
any machine cause is wrong. Printed: the confusion matrix per shift and the accuracy;
nothing is asserted::

    .venv/bin/python bench/verdict_independent.py [--scenarios 120] [--seed 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys
import tempfile
from collections import Counter, defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import scenarios_real as R
from verdict_accuracy import DETECTION_LIMITS

from gpuguard.epilog.verdict import judge_job
from gpuguard.store import open_store

SHIFTS = ("none", "few-history", "short-run", "other-gpu-model", "other-gpu-count")
#: Causes that blame the machine (the rest blame the job or nobody).
MACHINE = {"hardware-fault", "straggler-node", "straggler-gpu", "gpu-throttling"}
NOT_MACHINE_OK = {"healthy", "job-changed", "learning"}


def _shifted(rng: random.Random, w: R.Workload, shift: str) -> R.Workload:
    """The workload the judged run sees under ``shift`` (``w`` is the history's)."""
    if shift == "short-run":
        return dataclasses.replace(w, duration_s=max(300.0, w.duration_s * rng.uniform(0.05, 0.35)))
    if shift == "other-gpu-model":
        other = rng.choice([g for g in R.GPU_MODELS if g[0] != w.gpu[0]])
        return dataclasses.replace(w, gpu=other, step_s=w.step_s * w.gpu[2] / other[2],
                                   mem_mib=min(w.mem_mib, other[1] * 0.85),
                                   nodes=[f"{n}-x" for n in w.nodes])
    if shift == "other-gpu-count":
        gpn = w.gpus_per_node // 2 if w.gpus_per_node > 1 and rng.random() < 0.5 else w.gpus_per_node * 2
        n = len(w.nodes) * gpn
        return dataclasses.replace(w, gpus_per_node=gpn, nodes=[f"{x}-c" for x in w.nodes],
                                   gpu_clock_f=[rng.gauss(1.0, 0.012) for _ in range(n)],
                                   gpu_power_f=[rng.gauss(1.0, 0.035) for _ in range(n)])
    return w


def _cause(rng: random.Random, w: R.Workload, shift: str) -> str:
    if shift in ("other-gpu-model", "other-gpu-count") or rng.random() < 0.4:
        return "healthy"
    return rng.choice([c for c in R.CAUSES if c not in ("healthy", "job-changed")
                       and (c != "straggler-node" or len(w.nodes) > 1)
                       and (c not in ("straggler-gpu", "communication") or w.n_gpus > 1)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", type=int, default=120)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--show-misses", action="store_true")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    tmp = tempfile.mkdtemp(prefix="gpuguard-bench-indep-")
    store = open_store(os.path.join(tmp, "bench.db"))
    t = R.T_BASE
    confusion: dict[str, dict[str, Counter[str]]] = defaultdict(lambda: defaultdict(Counter))
    right = Counter()
    total = Counter()
    learning = Counter()  # misses that are "learning": fewer than [baseline] min_runs earlier runs
    misses = []
    for i in range(args.scenarios):
        shift = SHIFTS[i % len(SHIFTS)]
        w = R.make_workload(rng, f"t{i:03d}")
        w = dataclasses.replace(w, duration_s=min(w.duration_s, 5400.0))  # keep the bench short
        R.write_inventory(store, w, t)
        for k in range(rng.randint(1, 4) if shift == "few-history" else rng.randint(5, 12)):
            run = R.run_job(store, w, R.Case(), f"{w.name}-h{k}", t, rng.randrange(1 << 30), tmp)
            judge_job(store, run.job_id, cfg=None, template=w.name, exit_code=0, now=run.end + 30)
            t = run.end + 120
        wj = _shifted(rng, w, shift)
        if wj is not w:
            R.write_inventory(store, wj, t)
        cause = _cause(rng, wj, shift)
        case = R.draw_case(rng, wj, cause)
        if cause != "healthy":
            case.magnitude = max(case.magnitude, DETECTION_LIMITS[cause] * rng.uniform(1.2, 3.0))
        run = R.run_job(store, wj, case, f"{w.name}-j", t, rng.randrange(1 << 30), tmp)
        t = run.end + 120
        v = judge_job(store, run.job_id, cfg=None, template=w.name, exit_code=0, now=run.end + 30)
        confusion[shift][cause][v.cause] += 1
        hw_shift = shift in ("other-gpu-model", "other-gpu-count")
        ok = v.cause in NOT_MACHINE_OK if hw_shift else v.cause == cause
        right[shift] += ok
        total[shift] += 1
        if not ok:
            learning[shift] += v.cause == "learning"
            misses.append((shift, w.name, len(w.nodes), w.gpus_per_node, wj.gpus_per_node, w.gpu[0][7:],
                           wj.gpu[0][7:], cause, round(case.magnitude, 3), case.detail, v.cause, v.summary))
    for shift in SHIFTS:
        rows = confusion[shift]
        if not rows:
            continue
        cols = sorted({c for r in rows.values() for c in r})
        print(f"== shift {shift}: {right[shift]}/{total[shift]} right"
              + (f" ({learning[shift]} of the misses 'learning': too few earlier runs, by design)"
                 if learning[shift] else ""))
        print("truth \\ verdict".ljust(16) + "".join(c[:11].rjust(12) for c in cols))
        for truth, row in sorted(rows.items()):
            print(truth[:15].ljust(16) + "".join(str(row.get(c, 0)).rjust(12) for c in cols))
    n = sum(total.values())
    print(f"accuracy: {sum(right.values())}/{n} = {sum(right.values()) / n:.1%} (seed {args.seed})")
    if args.show_misses:
        for m in misses:
            print("MISS", *m)
    store.close()


if __name__ == "__main__":
    main()
