"""Print the fault-injection matrix: every case of tests/fault_cases.py with the hooks
run as slurmd runs them (empty environment, config beside SLURM_CONF, fake scontrol that
logs every call). Root is needed for the read-only / full / hung-filesystem cases (they
are skipped otherwise).

    python bench/fault_matrix.py [WORD ...]     # only cases whose name contains a WORD

Exit status 1 when any case fails (a false or missed drain, a hook past its budget, a
wrong exit code or a failed check)."""

from __future__ import annotations

import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))

from fault_cases import selected
from fault_matrix import run_case, table


def main() -> int:
    t = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpuguard-fault-matrix-") as d:
        results = [run_case(c, pathlib.Path(d)) for c in selected(sys.argv[1:] or None)]
    print(table(results))
    print(f"wall time {time.monotonic() - t:.1f} s")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
