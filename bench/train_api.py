"""Cost of the training API per call (issue 3: "cheap enough to call every step").

Prints microseconds per ``Recorder.step()`` block with two timed phases, per
``Recorder.log_step()``, per call on a disabled recorder (``GPUGUARD_JOB_DIR`` unset), and
the same record written by a bare ``json.dumps`` + ``os.write`` per step as the
reference. Figures, never a timed assert. Run: ``.venv/bin/python bench/train_api.py``.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

from gpuguard.collector.train import Recorder

N = 100_000


def per_call_us(fn, n: int = N) -> float:
    fn()  # warm up
    t0 = time.perf_counter()
    for i in range(n):
        fn(i)
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        rec = Recorder(d, rank=0)

        def step(i: int = 0) -> None:
            with rec.step(step=i, samples=32, tokens=8192) as s:
                with s.phase("data_wait"):
                    pass
                with s.phase("fwd_bwd"):
                    pass
                s.loss = 2.5
                s.grad_norm = 1.25

        def log_step(i: int = 0) -> None:
            rec.log_step(i, 0.41, samples=32, tokens=8192, loss=2.5, grad_norm=1.25,
                         phases={"data_wait": 0.02, "fwd_bwd": 0.3})

        off = Recorder(None)

        def disabled(i: int = 0) -> None:
            with off.step(step=i, samples=32) as s:
                with s.phase("data_wait"):
                    pass
                s.loss = 2.5

        fd = os.open(os.path.join(d, "bare.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

        def bare(i: int = 0) -> None:
            os.write(fd, (json.dumps({
                "v": 1, "kind": "step", "rank": 0, "t": time.time(), "step": i, "step_time_s": 0.41,
                "samples": 32, "tokens": 8192, "loss": 2.5, "loss_nonfinite": False, "grad_norm": 1.25,
                "phases": {"data_wait_s": 0.02, "fwd_bwd_s": 0.3}}) + "\n").encode())

        res = {
            "step() with 2 phases": per_call_us(step),
            "log_step()": per_call_us(log_step),
            "disabled step() with 1 phase": per_call_us(disabled),
            "bare json.dumps + os.write": per_call_us(bare),
        }
        rec.close()
        os.close(fd)
        lines = sum(1 for _ in open(os.path.join(d, "train.rank0.jsonl")))
    ref = res["bare json.dumps + os.write"]
    print(f"gpuguard.collector.train, {N} calls each ({lines} records written)")
    for name, us in res.items():
        print(f"  {name:32s} {us:7.2f} us/call   {us / ref:5.2f}x bare")


if __name__ == "__main__":
    main()
