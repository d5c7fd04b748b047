"""Parse cost of one long line in each text reader that takes pasted or saved output
(nccl-tests logs, kernel logs, dcgmi diag tables): a reader must stay linear in a line's
length (a minified JSON report cut short, binary junk, a line without white space).
Prints CPU seconds for a line of 20 000 and 80 000 characters of each shape and their
ratio (about 4 when linear, about 16 when quadratic).

    .venv/bin/python bench/long_lines.py
"""

from __future__ import annotations

import time

from gpuguard.net import dcgm_diag
from gpuguard.net.nccl_parse import parse as parse_nccl
from gpuguard.xid.parse import parse_lines

HEAD = ("# nThread 1 nGpus 1 minBytes 8 maxBytes 8 step: 2(factor) warmup iters: 5 iters: 20 "
        "agg iters: 1 validation: 1 graph: 0\n")
SHAPES = {"no white space": "x", "colons": ":", "digits": "1", "pipes": "|", "brackets": "[",
          "'host: ' repeated": "host: ", "'NVRM: ' repeated": "NVRM: ", "'+-' rule": "+-"}
READERS = {"nccl-tests log": lambda t: parse_nccl(HEAD + t),
           "kernel log": lambda t: parse_lines([t]),
           "dcgmi diag": lambda t: dcgm_diag.parse(t)}


def cpu(fn, text: str) -> float:
    t = time.process_time()
    try:
        fn(text)
    except Exception:  # a reader's refusal is an answer too
        pass
    return time.process_time() - t


def main() -> None:
    print(f"{'reader':16} {'line':20} {'20k s':>8} {'80k s':>8} {'ratio':>6}")
    for rname, fn in READERS.items():
        for sname, unit in SHAPES.items():
            a = cpu(fn, unit * (20_000 // len(unit)))
            b = cpu(fn, unit * (80_000 // len(unit)))
            print(f"{rname:16} {sname:20} {a:8.4f} {b:8.4f} {b / max(a, 1e-6):6.1f}")


if __name__ == "__main__":
    main()
