"""Accuracy of the verdict on two independent scenario generators.

``simple`` (tests/scenarios.py): for each of ``--templates`` random templates (every third
on 2 nodes, 2-8 GPUs per node, step time 1-4 s, jobs of 25-45 min) ``--baseline-runs``
healthy runs, then its share of ``--scenarios`` runs, each a random family.

``real`` (tests/scenarios_real.py): synchronous ranks, heavy-tailed step times, eval and
checkpoint pauses, warm-up, NVML-like 10 s readings, per-GPU spread, chunked allocator,
1-16 GPUs on 1-2 nodes, 10 min - 6 h, 5-20 healthy history runs per template, anomaly
magnitudes drawn from below to above the detection limits, and healthy confusers. Its
runs go through the product's path (training-record files -> ingest -> store ->
per-node summary -> one job-level verdict).

Every run is judged with recording on (healthy runs join the baseline, anomalous ones
stay out), as in production. Printed per generator: the confusion matrix (rows: truth,
columns: verdict), accuracy per cause, false alarms on plain healthy runs and on
confusers, and anomalies judged healthy — all of them, and those at or above the
detection limits of :data:`DETECTION_LIMITS` (the README states the same limits).
Figures are printed, never asserted.

**Seed protocol** (fixed before tuning; a seed's misses that were read to change a
detector no longer measure the detector on data it has not seen):

* *tuning seeds* ``1 2 3 4 5`` (240 scenarios each): the only runs whose misses are read
  (``--show-misses``) while changing detectors or thresholds. Seed 7 (read while an
  earlier round tuned the detectors) and seed 11 count as tuning seeds too.
  :data:`DETECTION_LIMITS` were set from the tuning seeds before any blind run.
* *blind seeds* ``101 102 103`` (480 scenarios each): run only to report, after the
  tuning is done; their misses are not read to change a detector. A change made after
  reading them would turn them into tuning seeds, and the next blind seeds would be
  ``104 105 106``.

Every seed run is reported, tuning and blind, each with its own matrix and pooled::

    .venv/bin/python bench/verdict_accuracy.py --generator both --seeds 1,2,3,4,5 --scenarios 240
    .venv/bin/python bench/verdict_accuracy.py --generator both --seeds 101,102,103 --scenarios 480

    .venv/bin/python bench/verdict_accuracy.py [--generator both] [--scenarios 240] [--seed 7]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter, defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import scenarios as S
import scenarios_real as R

from gpuguard.epilog.verdict import judge_job
from gpuguard.store import open_store

#: Smallest magnitude (tests/scenarios_real.MAGNITUDE_UNITS) each cause is promised to be
#: found at; the README's "Detection limits" table states the same numbers.
DETECTION_LIMITS = {
    "hardware-fault": 1.0,
    "straggler-gpu": 0.08,
    "straggler-node": 0.08,
    "gpu-throttling": 0.06,
    "memory-leak": 0.05,
    "data-pipeline": 0.10,
    "communication": 0.10,
    "job-changed": 0.15,
}


class Result:
    """One generator's tallies over one or more seeds (pooled by :meth:`add`)."""

    def __init__(self) -> None:
        self.confusion: dict[str, Counter[str]] = defaultdict(Counter)
        self.confusers: Counter[str] = Counter()
        self.confuser_alarms: Counter[str] = Counter()
        self.above: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # cause -> [missed, total] at/above limit
        self.in_limits = [0, 0]  # right, judged: healthy runs and anomalies at or above the limits
        self.misses: list[tuple] = []
        self.by_bin: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0, 0])  # right, healthy, total

    def to_json(self) -> dict:
        return {"confusion": self.confusion, "confusers": self.confusers, "confuser_alarms": self.confuser_alarms,
                "above": self.above, "in_limits": self.in_limits, "misses": self.misses,
                "by_bin": [[c, k, v] for (c, k), v in self.by_bin.items()]}

    @classmethod
    def from_json(cls, d: dict) -> Result:
        r = cls()
        for k, row in d["confusion"].items():
            r.confusion[k].update(row)
        r.confusers.update(d["confusers"])
        r.confuser_alarms.update(d["confuser_alarms"])
        for k, v in d["above"].items():
            r.above[k] = list(v)
        r.in_limits = list(d["in_limits"])
        r.misses = [tuple(m) for m in d["misses"]]
        for c, k, v in d["by_bin"]:
            r.by_bin[(c, k)] = list(v)
        return r

    def add(self, other: Result) -> None:
        for k, row in other.confusion.items():
            self.confusion[k].update(row)
        self.confusers.update(other.confusers)
        self.confuser_alarms.update(other.confuser_alarms)
        for k, (m, n) in other.above.items():
            self.above[k][0] += m
            self.above[k][1] += n
        self.in_limits[0] += other.in_limits[0]
        self.in_limits[1] += other.in_limits[1]
        self.misses += other.misses
        for k, (a, b, c) in other.by_bin.items():
            v = self.by_bin[k]
            v[0] += a
            v[1] += b
            v[2] += c


#: Magnitude bins (lower edges) of the per-cause table that measures the detection limits.
BINS = (0.0, 0.04, 0.06, 0.08, 0.10, 0.12, 0.15, 0.20, 0.30)


def _bin(m: float) -> int:
    return max(k for k, edge in enumerate(BINS) if m >= edge)


def _print_bins(res: Result, causes: tuple[str, ...]) -> None:
    """Per cause and magnitude bin: right cause / judged healthy / runs."""
    print("right/healthy/runs by magnitude (lower edge of the bin):")
    print("cause".ljust(16) + "".join(f"{e:>10g}" for e in BINS))
    for c in causes:
        if c in ("healthy", "hardware-fault") or not any(k[0] == c for k in res.by_bin):
            continue
        cells = []
        for k in range(len(BINS)):
            v = res.by_bin.get((c, k))
            cells.append(f"{v[0]}/{v[1]}/{v[2]}" if v and v[2] else "-")
        print(c.ljust(16) + "".join(x.rjust(10) for x in cells))


def _print_matrix(confusion: dict[str, Counter[str]], causes: tuple[str, ...]) -> None:
    cols = list(causes) + sorted({c for row in confusion.values() for c in row} - set(causes))
    print("truth \\ verdict".ljust(16) + "".join(c[:9].rjust(10) for c in cols) + "     total")
    for fam in causes:
        row = confusion.get(fam, Counter())
        if not row:
            continue
        print(fam.ljust(16) + "".join(str(row.get(c, 0)).rjust(10) for c in cols) + str(sum(row.values())).rjust(10))


def _rate(label: str, k: int, n: int) -> None:
    if n:
        print(f"{label}: {k}/{n} = {k / n:.1%}")


def run_simple(args: argparse.Namespace) -> Result:
    rng = random.Random(args.seed)
    tmp = tempfile.mkdtemp(prefix="gpuguard-bench-")
    store = open_store(os.path.join(tmp, "bench.db"))
    profiles = [S.random_profile(rng, f"tpl{i:02d}", nodes=2 if i % 3 == 0 else 1) for i in range(args.templates)]
    t = S.T0
    started = time.time()
    for p in profiles:
        S.write_inventory(store, p, t)
        for k in range(args.baseline_runs):
            rows = S.generate(p, "healthy", seed=rng.randrange(1 << 30), job_id=f"{p.name}-b{k}", start=t)
            S.write(store, rows)
            judge_job(store, rows.job_id, cfg=None, template=p.name, exit_code=0, now=rows.end + 30)
            t = rows.end + 60
    res = Result()
    for i in range(args.scenarios):
        p = profiles[i % len(profiles)]
        if rng.random() < args.healthy_share:
            fam = "healthy"
        else:
            fam = rng.choice([f for f in S.FAMILIES if f != "healthy" and (f != "straggler-node" or p.nodes > 1)])
        rows = S.generate(p, fam, seed=rng.randrange(1 << 30), job_id=f"s{i:04d}", start=t, strength=args.strength)
        t = rows.end + 60
        S.write(store, rows)
        v = judge_job(store, rows.job_id, cfg=None, template=p.name, exit_code=0, now=rows.end + 30)
        res.confusion[fam][v.cause] += 1
        res.in_limits[0] += v.cause == fam
        res.in_limits[1] += 1
        if v.cause != fam:
            res.misses.append((args.seed, rows.job_id, p.name, p.nodes, p.gpus_per_node, fam, v.cause, v.summary))
    print(f"== generator simple (tests/scenarios.py): {args.scenarios} scenarios over {len(profiles)} templates "
          f"({args.baseline_runs} healthy baseline runs each), seed {args.seed}, strength {args.strength:g}, "
          f"{time.time() - started:.1f} s")
    _summary(res, tuple(S.FAMILIES), args.show_misses, limits=False)
    store.close()
    return res


def run_real(args: argparse.Namespace) -> Result:
    rng = random.Random(args.seed)
    tmp = tempfile.mkdtemp(prefix="gpuguard-bench-real-")
    store = open_store(os.path.join(tmp, "bench.db"))
    works = [R.make_workload(rng, f"w{i:02d}") for i in range(args.templates)]
    t = R.T_BASE
    started = time.time()
    history = 0
    for w in works:
        R.write_inventory(store, w, t)
        for k in range(rng.randint(5, 20) if args.history is None else args.history):
            run = R.run_job(store, w, R.Case(), f"{w.name}-h{k}", t, rng.randrange(1 << 30), tmp)
            judge_job(store, run.job_id, cfg=None, template=w.name, exit_code=0, now=run.end + 30)
            t = run.end + 120
            history += 1
    res = Result()
    for i in range(args.scenarios):
        w = works[i % len(works)]
        if rng.random() < args.healthy_share:
            cause = "healthy"
        else:
            cause = rng.choice([c for c in R.CAUSES if c != "healthy"
                                and (c != "straggler-node" or len(w.nodes) > 1)
                                and (c not in ("straggler-gpu", "communication") or w.n_gpus > 1)])
        case = R.draw_case(rng, w, cause)
        if cause != "healthy":
            case.magnitude *= args.strength
        run = R.run_job(store, w, case, f"r{i:04d}", t, rng.randrange(1 << 30), tmp)
        t = run.end + 120
        v = judge_job(store, run.job_id, cfg=None, template=w.name, exit_code=0, now=run.end + 30)
        res.confusion[cause][v.cause] += 1
        if case.confuser:
            res.confusers[case.confuser] += 1
            res.confuser_alarms[case.confuser] += v.cause != "healthy"
        if cause != "healthy" and case.magnitude >= DETECTION_LIMITS[cause]:
            res.above[cause][1] += 1
            res.above[cause][0] += v.cause == "healthy"
        if cause != "healthy":
            b = res.by_bin[(cause, _bin(case.magnitude))]
            b[0] += v.cause == cause
            b[1] += v.cause == "healthy"
            b[2] += 1
        if cause == "healthy" or case.magnitude >= DETECTION_LIMITS[cause]:
            res.in_limits[0] += v.cause == cause
            res.in_limits[1] += 1
        if v.cause != cause:
            res.misses.append((args.seed, run.job_id, w.name, len(w.nodes), w.gpus_per_node, round(w.duration_s),
                               cause, round(case.magnitude, 3), case.confuser, case.detail, v.cause, v.summary))
    print(f"== generator real (tests/scenarios_real.py): {args.scenarios} scenarios over {len(works)} templates "
          f"({history} healthy history runs), seed {args.seed}, strength {args.strength:g}, "
          f"{time.time() - started:.1f} s")
    _summary(res, R.CAUSES, args.show_misses)
    store.close()
    return res


def _summary(res: Result, causes: tuple[str, ...], show: bool, limits: bool = True) -> None:
    confusion = res.confusion
    print()
    _print_matrix(confusion, causes)
    print()
    judged = sum(sum(r.values()) for r in confusion.values())
    right = sum(confusion[c][c] for c in confusion)
    _rate("right cause (all runs, all magnitudes)", right, judged)
    if limits:
        _rate("right cause (healthy runs and anomalies at or above the detection limits)", *res.in_limits)
    anomalous = [c for c in causes if c != "healthy" and confusion.get(c)]
    print("right cause per cause: " + ", ".join(
        f"{c} {confusion[c][c]}/{sum(confusion[c].values())}" for c in anomalous))
    healthy = sum(confusion["healthy"].values())
    n_conf = sum(res.confusers.values())
    plain = healthy - n_conf
    plain_alarms = (healthy - confusion["healthy"]["healthy"]) - sum(res.confuser_alarms.values())
    _rate("false alarms on plain healthy runs", plain_alarms, plain)
    if n_conf:
        _rate("false alarms on confusers", sum(res.confuser_alarms.values()), n_conf)
        print("  per confuser: " + ", ".join(f"{k} {res.confuser_alarms[k]}/{n}"
                                             for k, n in sorted(res.confusers.items())))
    n_anom = judged - healthy
    _rate("anomalies judged healthy (all magnitudes)", sum(confusion[c]["healthy"] for c in anomalous), n_anom)
    if limits:
        _rate("anomalies judged healthy (at or above the detection limits)",
              sum(v[0] for v in res.above.values()), sum(v[1] for v in res.above.values()))
        print("  per cause (missed/at-or-above-limit): " + ", ".join(
            f"{c} {res.above[c][0]}/{res.above[c][1]}" for c in causes if c in res.above))
        _print_bins(res, causes)
    if show:
        for m in res.misses:
            print("miss:", *m)
    print()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--generator", choices=("simple", "real", "both"), default="both")
    ap.add_argument("--scenarios", type=int, default=240)
    ap.add_argument("--templates", type=int, default=None, help="default: 24 (simple), 12 (real)")
    ap.add_argument("--baseline-runs", type=int, default=4, help="simple: healthy runs per template first")
    ap.add_argument("--history", type=int, default=None, help="real: healthy runs per template (default 5-20)")
    ap.add_argument("--healthy-share", type=float, default=0.4)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--seeds", default=None,
                    help="comma-separated seeds, each run and reported, then pooled (module docstring: protocol)")
    ap.add_argument("--strength", type=float, default=1.0,
                    help="scale of the injected deviations (1 = the generators' ranges; 0.5 = half)")
    ap.add_argument("--show-misses", action="store_true", help="print every wrong verdict")
    ap.add_argument("--json-out", default=None, help="write each generator's pooled tallies to PATH.<generator>.json")
    ap.add_argument("--pool", nargs="+", default=None, metavar="PATH",
                    help="print the pooled figures of --json-out files of one generator (runs nothing)")
    args = ap.parse_args(argv)
    if args.pool:
        pooled = Result()
        for path in args.pool:
            with open(path, encoding="utf-8") as fh:
                pooled.add(Result.from_json(json.load(fh)))
        real = all(".real." in p for p in args.pool)
        print(f"== pooled: {' '.join(args.pool)}")
        _summary(pooled, R.CAUSES if real else tuple(S.FAMILIES), args.show_misses, limits=real)
        return 0
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [args.seed]
    gens = [("simple", run_simple, 24, tuple(S.FAMILIES)), ("real", run_real, 12, R.CAUSES)]
    for name, fn, templates, causes in gens:
        if args.generator not in (name, "both"):
            continue
        pooled = Result()
        for seed in seeds:
            pooled.add(fn(argparse.Namespace(**{**vars(args), "templates": args.templates or templates,
                                                "seed": seed})))
        if args.json_out:
            with open(f"{args.json_out}.{name}.json", "w", encoding="utf-8") as fh:
                json.dump(pooled.to_json(), fh, default=str)
        if len(seeds) > 1:
            print(f"== generator {name}: pooled over seeds {','.join(map(str, seeds))} "
                  f"({args.scenarios} scenarios each)")
            _summary(pooled, causes, False, limits=name == "real")
    return 0


if __name__ == "__main__":
    sys.exit(main())
