"""The CLI output layer: one time format in every JSON output, human numbers in text,
exact numbers in JSON/CSV, --json as an alias, tables fitted to the terminal."""

from __future__ import annotations

import json
import re

import click
import pytest
from click.testing import CliRunner
from reports_helpers import HANDMADE
from test_epilog_cli import db  # noqa: F401  (fixture)

from gpuguard.cli import main
from gpuguard.output import human_number, iso_time, output_options, table, to_csv
from gpuguard.reports.queries import REPORTS

#: The one time format: ISO 8601, seconds, with the UTC offset.
ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d$")


def _times(doc, key=None):
    """Every value under a time key (``at``, ``*_at``, ``since``, ``until``, ``generated_at``)."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _times(v, k)
    elif isinstance(doc, list):
        for v in doc:
            yield from _times(v, key)
    elif key is not None and (key in ("at", "since", "until") or key.endswith("_at")) and doc is not None:
        yield key, doc


def test_iso_time_and_zone():
    from zoneinfo import ZoneInfo

    assert iso_time(1740873909.9) == "2025-03-02T00:05:09+00:00"
    assert iso_time(1740873909, ZoneInfo("Europe/Berlin")) == "2025-03-02T01:05:09+01:00"
    assert iso_time(None) is None


@pytest.mark.parametrize("v, text", [(27070.4, "27070"), (4.60312, "4.603"), (152.25, "152.2"), (0.001234, "0.00123"),
                                     (2.0, "2"), (0.0, "0"), (1e-9, "0.000000001"), (12, "12"), (True, "yes")])
def test_human_number_never_exponent(v, text):
    assert human_number(v) == text


def test_csv_exact_and_formula_safe():
    assert to_csv([{"a": 27070.4123, "b": "=cmd()", "c": None}], ["a", "b", "c"]) == "a,b,c\n27070.4123,'=cmd(),\n"


def test_table_fits_width_by_wrapping_text():
    rows = [["n1", 3, "x" * 80]]
    out = table(rows, ["NODE", "N", "MESSAGE"], width=40)
    assert max(len(line) for line in out.splitlines()) <= 40
    assert out.splitlines()[2].split()[:2] == ["n1", "3"]
    assert len(table(rows, ["NODE", "N", "MESSAGE"], width=None).splitlines()) == 3


def test_json_alias_and_conflict():
    @click.command()
    @output_options()
    def cmd(fmt):
        click.echo(fmt)

    r = CliRunner()
    assert r.invoke(cmd, ["--json"]).output == "json\n"
    assert r.invoke(cmd, ["--format", "csv"]).output == "csv\n"
    bad = r.invoke(cmd, ["--json", "--format", "csv"])
    assert bad.exit_code == 2 and "--json and --format csv contradict each other" in bad.output


def test_job_show_json_times_in_display_zone(db, tmp_path):  # noqa: F811
    cfg = tmp_path / "g.toml"
    cfg.write_text(f'[paths]\nstore = "{db}"\n[display]\ntimezone = "Asia/Kolkata"\n')
    r = CliRunner().invoke(main, ["--config", str(cfg), "job", "show", "7", "--format", "json"])
    assert r.exit_code == 0, r.output
    times = list(_times(json.loads(r.output)))
    assert len(times) >= 8
    assert all(ISO.match(v) and v.endswith("+05:30") for _k, v in times), times
    assert ("started_at", "1970-01-01T05:46:35+05:30") in times


def test_job_show_csv_rows(db):  # noqa: F811
    r = CliRunner().invoke(main, ["job", "show", "7", "--store", db, "--format", "csv"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0] == "node,metric,value,unit"
    assert "n1,step_time_p95_s,1.9,s" in lines


@pytest.mark.parametrize("name", sorted(REPORTS))
def test_every_report_json_has_one_time_format(tmp_path, name):
    p = tmp_path / "gpuguard.toml"
    p.write_text(f'[paths]\nstore = "{tmp_path}/node.db"\n[reports]\ntimezone = "UTC"\n'
                 '[display]\ntimezone = "America/New_York"\n')
    env = {"GPUGUARD_CONFIG": str(p)}
    assert CliRunner().invoke(main, ["report", "sync", "--from-file", str(HANDMADE)], env=env).exit_code == 0
    r = CliRunner().invoke(main, ["report", name, "--since", "2025-03-01", "--until", "2025-04-01", "--json"],
                           env=env)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    times = list(_times(doc))
    assert {k for k, _ in times} >= {"generated_at", "since", "until"}
    assert all(ISO.match(v) for _k, v in times), times
    assert doc["reports"][0]["since"] == "2025-03-01T00:00:00-05:00"  # --since read in the display zone


#: Commands that print no data (they write a file, change state or print a config file;
#: ``cluster ingest`` judges the spooled jobs and says how many),
#: or print a format of their own (Prometheus/OpenMetrics text).
NO_DATA = {"gpu snapshot", "config example", "baseline reset", "report sync", "metrics show", "metrics write",
           "cluster ingest"}


def _leaf_commands(cmd, path=()):
    if isinstance(cmd, click.Group):
        for name, sub in cmd.commands.items():
            yield from _leaf_commands(sub, (*path, name))
    else:
        yield " ".join(path), cmd


def test_every_data_command_has_format_and_json():
    """One output convention: a new command that prints data takes --format and --json
    (gpuguard.output.output_options), or is listed in NO_DATA with its reason."""
    missing = [name for name, cmd in _leaf_commands(main) if name not in NO_DATA
               and not {"--format", "--json"} <= {o for p in cmd.params for o in getattr(p, "opts", [])}]
    assert missing == []


def test_too_wide_table_splits_into_parts_repeating_the_label_columns():
    headers = ["ACCOUNT", "USER", *[f"METRIC_{i}" for i in range(8)]]
    rows = [["physics", "ann", *[1000.5 + i for i in range(8)]], ["bio", "bob", *range(8)]]
    out = table(rows, headers, width=50, total=["TOTAL", "", *range(8)])
    parts = out.split("\n\n")
    assert len(parts) == 3 and all(len(line) <= 50 for line in out.splitlines())
    for p in parts:
        lines = p.splitlines()
        assert lines[0].split()[:2] == ["ACCOUNT", "USER"] and lines[2].split()[:2] == ["physics", "ann"]
        assert lines[-1].split()[0] == "TOTAL" and set(lines[-2].replace(" ", "")) == {"-"}
    assert [h for p in parts for h in p.splitlines()[0].split()[2:]] == headers[2:]
    assert table(rows, headers, width=None).count("\n") == 3  # piped: one table, no split
