"""Every command-line duration (seconds, days) is a finite number in range
(gpuguard.durations, gpuguard.clitypes): nan, inf, negative or absurd values are click's
one-line usage error, exit 2, before anything runs."""

from __future__ import annotations

import argparse
from datetime import UTC

import click
import pytest
from conftest import cli_runner

from gpuguard.cli import main

CASES = [  # (argv before the option, option, unit, positive)
    (["node", "show", "n1"], "--since", "days", False),
    (["alert", "send"], "--timeout", "seconds", True),
    (["nccl", "probe"], "--timeout", "seconds", True),
    (["store", "prune"], "--raw-days", "days", False),
    (["store", "prune"], "--minutes-days", "days", False),
    (["store", "prune"], "--summaries-days", "days", False),
    (["store", "prune"], "--events-days", "days", False),
]


def _why(value: str, unit: str, positive: bool) -> str:
    if value in ("nan", "inf", "-inf", "NaN", "ten"):
        return f"{value} is not a number of {unit}"
    if positive and float(value) <= 0:
        return f"{value} is not more than 0 {unit}"
    if float(value) < 0:
        return f"{value} is negative; a number of {unit} is >= 0"
    top = 36500 if unit == "days" else 3153600000
    return f"{value} is more than {top} {unit} (100 years)"


@pytest.mark.parametrize("head,opt,unit,positive", CASES, ids=[f"{c[0][0]}-{c[1]}" for c in CASES])
@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "1e400", "ten", "-1", "0", "1e12"])
def test_a_bad_duration_is_a_one_line_usage_error(head, opt, unit, positive, value):
    if value == "0" and not positive:
        pytest.skip("0 is a valid value here")
    r = cli_runner().invoke(main, ["--config", "/dev/null", *head, f"{opt}={value}"])
    assert (r.exit_code, r.stderr.splitlines()[-1]) == (
        2, f"Error: Invalid value for '{opt}': {_why(value, unit, positive)}"), r.output
    assert r.stdout == ""


def test_the_type_converts_good_values_and_zero_where_allowed():
    from gpuguard.clitypes import DAYS, POSITIVE_SECONDS, SECONDS

    assert (DAYS.convert("0", None, None), DAYS.convert("1.5", None, None), SECONDS.convert(60, None, None)) == (
        0.0, 1.5, 60.0)
    assert POSITIVE_SECONDS.convert(" 0.25 ", None, None) == 0.25
    with pytest.raises(click.BadParameter, match="^0 is not more than 0 seconds$"):
        POSITIVE_SECONDS.convert("0", None, None)


@pytest.mark.parametrize("opt,positive", [("--interval-s", True), ("--flush-s", True), ("--liveness-s", True),
                                          ("--startup-grace-s", False), ("--scontrol-every-s", False),
                                          ("--no-evidence-s", True), ("--max-runtime-s", True)])
def test_the_collectors_durations_follow_the_same_rule(opt, positive, capsys):
    from gpuguard.collector.cli import build_parser

    for value in ("nan", "inf", "-5"):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(["--job-id", "7", f"{opt}={value}"])
        assert e.value.code == 2
        last = capsys.readouterr().err.splitlines()[-1]
        assert last.endswith(f"error: argument {opt}: {_why(value, 'seconds', positive)}"), last
    assert getattr(build_parser().parse_args(["--job-id", "7", f"{opt}=2.5"]), opt[2:].replace("-", "_")) == 2.5
    assert isinstance(build_parser(), argparse.ArgumentParser)


def test_a_relative_report_date_beyond_100_years_is_refused():
    from gpuguard.reports.cli import parse_when

    assert parse_when("-2d", UTC, now=1e9) == 1e9 - 2 * 86400
    huge = "-" + "9" * 400 + "d"  # float() of it is inf
    with pytest.raises(click.BadParameter) as e:
        parse_when(huge, UTC, now=1e9)
    assert e.value.message == f"{huge!r}: {'9' * 400} is more than 36500 days (100 years)"
    with pytest.raises(click.BadParameter, match=r"^'-900000h': 900000 is more than 876000 hours \(100 years\)$"):
        parse_when("-900000h", UTC, now=1e9)
