"""click parameter types shared by gpuguard's commands."""

from __future__ import annotations

from typing import Any

import click

from gpuguard.durations import parse_duration


class Duration(click.ParamType):
    """A duration in ``unit`` (``seconds`` or ``days``) by :func:`gpuguard.durations.parse_duration`:
    finite, >= 0 (> 0 with ``positive``), at most 100 years. A bad value is click's usage
    error: one ``Error: Invalid value for '--opt': ...`` line, exit 2."""

    name = "duration"

    def __init__(self, unit: str, *, positive: bool = False):
        self.unit = unit
        self.positive = positive

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        """``value`` as float; fails (``click.BadParameter``) with the rule's message."""
        try:
            return parse_duration(value, self.unit, positive=self.positive)
        except ValueError as e:
            self.fail(str(e), param, ctx)

    def __repr__(self) -> str:
        return f"Duration({self.unit!r}, positive={self.positive})"


#: The instances the commands use.
SECONDS = Duration("seconds")
POSITIVE_SECONDS = Duration("seconds", positive=True)
DAYS = Duration("days")
