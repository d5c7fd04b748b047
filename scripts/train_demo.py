"""A small real training loop (pure Python, no GPU needed) that reports through
gpuguard's training API: linear regression by mini-batch SGD.

Used by the Slurm end-to-end tests and the demo. ``--data-sleep-s`` injects a slow data
loader (the ``data-pipeline`` verdict); ``--steps`` sets the length and ``--compute-s`` the simulated GPU time per step.

    python scripts/train_demo.py --steps 40 [--data-sleep-s 0.05] [--checkpoint-every 20]
"""

from __future__ import annotations

import argparse
import math
import random
import time

from gpuguard.collector.train import recorder


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--data-sleep-s", type=float, default=0.0)
    ap.add_argument("--compute-s", type=float, default=0.1, help="simulated GPU kernel time per step")
    ap.add_argument("--checkpoint-every", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    true_w = [rng.uniform(-1, 1) for _ in range(a.dim)]
    w = [0.0] * a.dim
    lr = 0.05
    rec = recorder()
    for step in range(a.steps):
        with rec.step(step=step, samples=a.batch, tokens=a.batch * a.dim) as s:
            with s.phase("data_wait"):
                if a.data_sleep_s:
                    time.sleep(a.data_sleep_s)
                xs = [[rng.gauss(0, 1) for _ in range(a.dim)] for _ in range(a.batch)]
                ys = [sum(x * t for x, t in zip(row, true_w, strict=True)) + rng.gauss(0, 0.01) for row in xs]
            with s.phase("fwd_bwd"):
                grad = [0.0] * a.dim
                loss = 0.0
                for row, y in zip(xs, ys, strict=True):
                    err = sum(x * wi for x, wi in zip(row, w, strict=True)) - y
                    loss += err * err
                    for i, x in enumerate(row):
                        grad[i] += 2 * err * x / a.batch
                loss /= a.batch
                time.sleep(a.compute_s)
            with s.phase("optim"):
                w = [wi - lr * g for wi, g in zip(w, grad, strict=True)]
            s.loss = loss
            s.grad_norm = math.sqrt(sum(g * g for g in grad))
        if a.checkpoint_every and step and step % a.checkpoint_every == 0:
            with rec.checkpoint(step=step):
                time.sleep(0.01)
    rec.flush()
    print(f"done: {a.steps} steps, final loss {loss:.5f}")


if __name__ == "__main__":
    main()
