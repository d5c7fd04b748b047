"""The fault-injection matrix (tests/fault_cases.py) with the hooks run as slurmd runs
them: 0 false drains, 0 missed drains, 0 hooks past budget. The table is printed."""

from __future__ import annotations

import pytest
from fault_cases import selected
from fault_matrix import run_case, table


def test_fault_matrix(tmp_path, capsys):
    results = [run_case(c, tmp_path) for c in selected()]
    with capsys.disabled():
        print("\n" + table(results))
    bad = [r for r in results if not r.ok]
    assert not bad, "\n".join(f"{r.case}: drains {r.drains}/{r.want}, past budget {r.past_budget}, "
                              f"bad rc {r.bad_rc} ({r.rcs}), {r.check}" for r in bad)
    assert sum(r.drains > r.want for r in results) == 0
    assert sum(r.drains < r.want for r in results) == 0
    assert sum(r.past_budget for r in results) == 0


@pytest.mark.parametrize("word", ["XID 79 behind"])
def test_one_case_alone(tmp_path, word):
    [r] = [run_case(c, tmp_path) for c in selected([word])]
    assert (r.drains, r.want, r.past_budget, r.check) == (1, 1, 0, None)
