"""The rule for a duration given on a command line (seconds, days): a finite number, not
negative (or above 0), at most :data:`MAX_YEARS`.

A plain ``float`` option takes ``nan``, ``inf`` and negative values, and click's
``FloatRange`` lets ``nan`` through (every comparison with it is false): a ``--since nan``
window selects nothing, a ``--timeout inf`` never ends (or overflows a lock's wait), a
negative one ends at once. Click commands use :class:`gpuguard.clitypes.Duration`;
argparse ones (the collector's, which must not import click) :func:`argparse_type`; both
apply :func:`parse_duration`.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

#: Longest duration accepted (our choice: 100 years. Nothing gpuguard waits for or looks
#: back over is longer, so a larger value is a typo; it also stays under
#: ``threading.TIMEOUT_MAX``, about 292 years on Linux, so every wait accepts it).
MAX_YEARS = 100
#: Seconds per unit.
UNIT_S = {"seconds": 1.0, "hours": 3600.0, "days": 86400.0}


def parse_duration(value: Any, unit: str, *, positive: bool = False) -> float:
    """``value`` (text or number) as a float number of ``unit`` (a key of
    :data:`UNIT_S`). Raises ValueError with one line naming the value and what is wrong:
    not a number (``nan``, ``inf`` included), negative, 0 when ``positive``, or more than
    :data:`MAX_YEARS`."""
    text = str(value).strip()
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{text} is not a number of {unit}") from None
    top = MAX_YEARS * 365 * 86400.0 / UNIT_S[unit]
    if math.isnan(v) or (math.isinf(v) and not any(c.isdigit() for c in text)):
        raise ValueError(f"{text} is not a number of {unit}")
    if positive and v <= 0:
        raise ValueError(f"{text} is not more than 0 {unit}")
    if v < 0:
        raise ValueError(f"{text} is negative; a number of {unit} is >= 0")
    if v > top:  # 400 digits read as inf, too
        raise ValueError(f"{text} is more than {top:.0f} {unit} ({MAX_YEARS} years)")
    return v


def argparse_type(unit: str, *, positive: bool = False) -> Callable[[str], float]:
    """:func:`parse_duration` as an argparse ``type=`` (its message is argparse's error)."""
    def convert(text: str) -> float:
        try:
            return parse_duration(text, unit, positive=positive)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = f"number of {unit}"
    return convert
