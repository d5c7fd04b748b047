"""part_codec._column: a list of plain numbers (numpy's own conversion) and a list with
anything else (value by value) give the same columns as the rule says."""

from __future__ import annotations

import numpy as np

from gpuguard.epilog.part_codec import _column


def test_plain_number_lists_convert_with_none_and_non_finite_as_nan() -> None:
    got = _column([1, 2.5, None, float("inf"), -float("inf"), float("nan")], 7, "f8")
    assert got.dtype == np.float64
    assert got[:2].tolist() == [1.0, 2.5]
    assert np.isnan(got[2:]).all()
    ints = _column([3, 4], 3, "i8")
    assert ints.dtype == np.int64 and ints.tolist() == [3, 4, 0]


def test_lists_with_other_values_keep_the_value_by_value_rule() -> None:
    got = _column([True, 1.0, "2", np.float64(3.5), None], 5, "f8")
    assert np.isnan(got[0]) and got[1] == 1.0 and np.isnan(got[2]) and got[3] == 3.5 and np.isnan(got[4])
    assert _column([True, 5, None, 2.0, np.int64(7)], 5, "i8").tolist() == [0, 5, 0, 0, 0]
    assert _column([1, 2, 3], 2, "f8").tolist() == [1.0, 2.0]  # cut at n
