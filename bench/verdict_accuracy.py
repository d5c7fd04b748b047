"""Accuracy of the verdict on randomised scenarios (tests/scenarios.py).

For each of ``--templates`` random job templates (every third on 2 nodes, 2-8 GPUs per node, step
time 1-4 s, jobs of 25-45 min) the bench writes ``--baseline-runs`` healthy runs (the
template learns), then judges its share of ``--scenarios`` runs, each a random family:
healthy with probability ``--healthy-share``, else one of the eight causes
(straggler-node only on multi-node templates). Every run goes through the real path:
rows into a temp store, :func:`gpuguard.epilog.verdict.judge_job` with recording on,
so healthy runs join the baseline and anomalous ones stay out.

Prints the confusion matrix (rows: injected family, columns: verdict), accuracy and
the false-alarm rate on healthy runs (a healthy run judged anything but healthy).
Goal (issue 4): >= 95 % right, <= 1 % false alarms. Figures are printed, never asserted.

    .venv/bin/python bench/verdict_accuracy.py [--scenarios 240] [--seed 7]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from collections import Counter, defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import scenarios as S

from gpuguard.epilog.verdict import judge_job
from gpuguard.store import open_store


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", type=int, default=240)
    ap.add_argument("--templates", type=int, default=24)
    ap.add_argument("--baseline-runs", type=int, default=4)
    ap.add_argument("--healthy-share", type=float, default=0.4)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--strength", type=float, default=1.0,
                    help="scale of the injected deviations (1 = the ranges of tests/scenarios.py; 0.5 = half)")
    ap.add_argument("--show-misses", action="store_true", help="print every wrong verdict")
    args = ap.parse_args(argv)
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
    confusion: dict[str, Counter[str]] = defaultdict(Counter)
    misses = []
    judged = 0
    for i in range(args.scenarios):
        p = profiles[i % len(profiles)]
        if rng.random() < args.healthy_share:
            fam = "healthy"
        else:
            fams = [f for f in S.FAMILIES if f != "healthy" and (f != "straggler-node" or p.nodes > 1)]
            fam = rng.choice(fams)
        rows = S.generate(p, fam, seed=rng.randrange(1 << 30), job_id=f"s{i:04d}", start=t, strength=args.strength)
        t = rows.end + 60
        S.write(store, rows)
        v = judge_job(store, rows.job_id, cfg=None, template=p.name, exit_code=0, now=rows.end + 30)
        judged += 1
        confusion[fam][v.cause] += 1
        if v.cause != fam:
            misses.append((rows.job_id, p.name, p.nodes, p.gpus_per_node, fam, v.cause, v.summary))
    elapsed = time.time() - started
    cols = [f for f in S.FAMILIES] + sorted({c for row in confusion.values() for c in row} - set(S.FAMILIES))
    short = {c: c[:9] for c in cols}
    print(f"verdict accuracy: {judged} scenarios over {len(profiles)} templates "
          f"({args.baseline_runs} healthy baseline runs each), seed {args.seed}, "
          f"strength {args.strength:g}, {elapsed:.1f} s")
    print()
    print("injected \\ verdict".ljust(18) + "".join(short[c].rjust(10) for c in cols) + "     total")
    for fam in S.FAMILIES:
        row = confusion.get(fam, Counter())
        print(fam.ljust(18) + "".join(str(row.get(c, 0)).rjust(10) for c in cols) + str(sum(row.values())).rjust(10))
    right = sum(confusion[f][f] for f in confusion)
    healthy = sum(confusion["healthy"].values())
    false_alarms = healthy - confusion["healthy"]["healthy"]
    anomalous = judged - healthy
    missed = sum(row.get("healthy", 0) for f, row in confusion.items() if f != "healthy")
    print()
    print(f"accuracy: {right}/{judged} = {right / judged:.1%}")
    if healthy:
        print(f"false alarms on healthy runs: {false_alarms}/{healthy} = {false_alarms / healthy:.1%}")
    if anomalous:
        print(f"anomalies judged healthy (missed): {missed}/{anomalous} = {missed / anomalous:.1%}")
    if args.show_misses:
        for m in misses:
            print("miss:", *m)
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
