"""The job page (`gpuguard job show`): one screen for a 2-node, 16-GPU job, its header from
the sacct cache, bars, advice as data, times in the viewer's zone; the HTML page with its
plots seen by headless Chromium."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from gpuguard.cli import main
from gpuguard.epilog.advice import AdviceError, load_advice
from gpuguard.epilog.cli import job
from gpuguard.epilog.jobpage import bar
from gpuguard.epilog.summary import save_summary, summarize_job
from gpuguard.reports.sync import import_text
from gpuguard.store import open_store

if "job" not in main.commands:
    main.add_command(job)

T0 = 1_764_496_800.0  # 2025-11-30T10:00:00Z
NODES = ("gpu-a01", "gpu-a02")


def _samples(node: str, gpu: int) -> list[dict]:
    rows = []
    for i in range(120):  # 20 min at 10 s
        # gpu-a02 gpu7 idles; the others work at 60 + gpu %, memory rises 40 -> 60 GiB
        util = 0.5 if (node, gpu) == ("gpu-a02", 7) else 60.0 + gpu
        rows.append({"job_id": "4242", "node": node, "at": T0 + 10 * i, "gpu_index": gpu, "gpu_uuid": f"GPU-{node}-{gpu}",
                     "gpu_util_pct": util, "mem_util_pct": 10.0, "mem_used_mib": 40960.0 + 170.0 * i,
                     "power_w": 80.0 if util < 1 else 300.0 + gpu, "temp_c": 60.0, "sm_clock_mhz": 1980.0 - gpu,
                     "mem_clock_mhz": 2619.0, "clock_event_mask": 0, "ecc_volatile_uncorrected": 0,
                     "pcie_replay_count": 0})
    return rows


@pytest.fixture
def big(tmp_path):
    """A 2-node, 8-GPU-per-node job with samples, steps of 16 ranks, summaries, a
    data-pipeline verdict with flagged comparisons, and its sacct record."""
    path = str(tmp_path / "cluster.db")
    s = open_store(path)
    for node in NODES:
        for g in range(8):
            s.insert_many("samples", _samples(node, g))
    steps = [{"job_id": "4242", "node": NODES[r // 8], "rank": r, "step": k, "t": T0 + 5 * k,
              "step_time_s": 1.2 + 0.01 * r, "samples": 32, "tokens": 32 * 2048, "data_wait_s": 0.5}
             for r in range(16) for k in range(1, 200)]
    s.insert_many("steps", steps)
    for node in NODES:
        save_summary(s, summarize_job(s, "4242", node, exit_status_raw=0, collector_status="ok",
                                      ended_at=T0 + 1200.0))
    s.insert("verdicts", {"job_id": "4242", "template": "llm-7b", "at": T0 + 1300, "state": "judged",
                          "cause": "data-pipeline", "summary": "steps waited for data: data wait share 41 % "
                          "(baseline 6 %), step time +34 %",
                          "evidence": json.dumps({"baseline_runs": 12}), "also": "[]", "context": "[]",
                          "exit_code": 0, "critical": 0, "baseline_ok": 1, "nodes": json.dumps(list(NODES)),
                          "start_at": T0, "end_at": T0 + 1200})
    for metric, value, median, rel, flagged in (("step_time_p50_s", 1.28, 0.955, 0.34, 1),
                                                ("data_wait_share_pct", 41.0, 6.0, 5.83, 1),
                                                ("gpu_util_mean_pct", 60.0, 88.0, -0.32, 1),
                                                ("power_mean_w", 290.0, 300.0, -0.03, 0)):
        s.insert("comparisons", {"job_id": "4242", "template": "llm-7b", "metric": metric, "value": value,
                                 "median": median, "mad": 0.01, "n": 12, "z": 9.0, "rel_change": rel,
                                 "flagged": flagged, "sustained_s": 600.0, "at": T0 + 1300})
    head = "JobIDRaw|JobID|JobName|User|Account|Partition|State|ExitCode|Submit|Start|End|ElapsedRaw|TimelimitRaw|AllocTRES\n"
    import_text(s, head + "4242|4242|llm-7b-pretrain|alice|nlp|gpu|COMPLETED|0:0|1764496700|1764496800|1764498000|"
                "1200|240|billing=16,cpu=64,gres/gpu=16,node=2\n")
    s.close()
    return path


def show(*args, env=None):
    return CliRunner().invoke(main, ["job", "show", *args], env=env or {"TZ": "Europe/Berlin"})


def test_default_page_fits_one_screen_for_2_nodes_16_gpus(big):
    r = show("4242", "--store", big)
    assert r.exit_code == 0, r.output
    lines = r.output.rstrip("\n").splitlines()
    assert len(lines) <= 40, "\n".join(lines)
    # header from the sacct cache; times in the viewer's zone (TZ=Europe/Berlin: CET)
    assert lines[0] == 'Job 4242 "llm-7b-pretrain"   user alice  account nlp  partition gpu'
    assert lines[1] == "State COMPLETED   exit 0:0   elapsed 20m00s of 4h00m limit (8 %)"
    assert lines[2] == "Start 2025-11-30 11:00 CET   end 2025-11-30 11:20 CET"
    assert lines[3] == "Nodes 2 (gpu-a01, gpu-a02)   GPUs 16"
    assert lines[5].startswith("Verdict: data-pipeline — steps waited for data")
    assert lines[6] == "  template llm-7b (judged, 12 baseline runs)"
    assert lines[7] == "  step_time_p50_s: 1.28 s vs baseline 0.955 (+34%)"
    # one line per GPU, in node/GPU order, the idle one marked
    gpu_lines = [x for x in lines if x.startswith(("gpu-a01 gpu", "gpu-a02 gpu"))]
    assert len(gpu_lines) == 16
    assert gpu_lines[0].startswith("gpu-a01 gpu0  [██████████······]  60%")
    assert gpu_lines[-1].startswith("gpu-a02 gpu7  [················]   0%") and gpu_lines[-1].endswith("idle")
    # advice for the cause, then for the idle GPU, from the shipped data file
    i = lines.index("What to check (data-pipeline: you can fix this):")
    assert lines[i + 1].startswith("  - steps waited for data: raise DataLoader num_workers")
    assert "  more: https://pytorch.org/docs/stable/data.html#multi-process-data-loading" in lines
    assert "What to check (idle-gpus: you can fix this):" in lines
    assert lines[-1] == "0 finding(s), 0 event(s); every metric, finding and event: --full"


def test_full_adds_every_table_and_utc_zone_option(big):
    r = show("4242", "--store", big, "--full", "--timezone", "UTC")
    assert r.exit_code == 0, r.output
    out = r.output.splitlines()
    assert out[2] == "Start 2025-11-30 10:00 UTC   end 2025-11-30 10:20 UTC"
    assert "job 4242 on gpu-a01, gpu-a02" in out and "Per GPU (gpu-a02)" in out
    assert len(out) > 100


def test_site_advice_file_overrides_a_cause(big, tmp_path):
    site = tmp_path / "advice.toml"
    site.write_text('[data-pipeline]\nwho = "you"\ncheck = ["use /scratch, not $HOME"]\n'
                    'docs = "https://hpc.example.edu/data"\n')
    cfg = tmp_path / "g.toml"
    cfg.write_text(f'[job_page]\nadvice_file = "{site}"\n')
    r = show("4242", "--store", big, env={"GPUGUARD_CONFIG": str(cfg), "TZ": "UTC"})
    assert r.exit_code == 0, r.output
    assert "  - use /scratch, not $HOME" in r.output and "  more: https://hpc.example.edu/data" in r.output
    assert "DataLoader" not in r.output
    site.write_text('[data-pipeline]\ncheck = "not a list"\n')
    r = show("4242", "--store", big, env={"GPUGUARD_CONFIG": str(cfg), "TZ": "UTC"})
    assert (r.exit_code, r.output.strip()) == (2, f"Error: {site}: [data-pipeline] check must be a list of strings")


def test_shipped_advice_covers_every_user_fixable_cause():
    from gpuguard.epilog.verdict import CAUSES

    adv = load_advice()
    assert set(CAUSES) - {"healthy"} <= set(adv)
    assert {c for c, a in adv.items() if a["who"] == "you"} == {"data-pipeline", "memory-leak", "communication",
                                                                 "job-changed", "idle-gpus"}
    assert all(a["docs"].startswith("https://") and a["check"] for a in adv.values())
    with pytest.raises(AdviceError, match="nope.toml: cannot read"):
        load_advice("/nonexistent/nope.toml")


@pytest.mark.parametrize("body, msg", [
    ('[x]\ndocs = "javascript:alert(1)"\n', r"\[x\] docs must be an http\(s\) link"),
    ('[x]\nwho = "everyone"\n', r'\[x\] who must be "you" or "admins"'),
    ('[x]\nwhen = 1\n', r"\[x\] unknown key\(s\) when"),
    ('x = 1\n', r"\[x\] must be a table"),
    ('[x\n', "bad TOML"),
])
def test_bad_advice_files(tmp_path, body, msg):
    f = tmp_path / "a.toml"
    f.write_text(body)
    with pytest.raises(AdviceError, match=msg):
        load_advice(str(f))


def test_bar():
    assert bar(0.5, 10) == "[█████·····]"
    assert bar(1.7, 4) == "[████]" and bar(None, 3) == "[   ]" and bar(-1, 2) == "[··]"


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def test_html_page_is_self_contained_and_escaped(big, tmp_path):
    s = open_store(big)
    s.db.execute("UPDATE sacct_jobs SET job_name = '<script>alert(1)</script>'")
    s.db.conn.commit()
    s.close()
    out = tmp_path / "job.html"
    r = show("4242", "--store", big, "--format", "html", "-o", str(out))
    assert r.exit_code == 0, r.output
    html = out.read_text()
    assert "<script>alert" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert html.count("<svg") == 2 and 'id="plot-gpus"' in html and 'id="plot-ranks"' in html
    # legends name every GPU and rank; no external resource
    assert "gpu-a02 gpu7" in html and "rank 15" in html
    assert "http://" not in html.replace("http://www.w3.org", "")


@pytest.mark.skipif(_chromium() is None and not os.environ.get("CI"),
                    reason="headless Chromium not installed (Debian package `chromium`; .ci/run installs it)")
def test_html_job_page_renders_in_headless_chromium(big, tmp_path):
    exe = _chromium()
    assert exe, "CI is set but chromium is not installed: .ci/run must apt-get install chromium"
    page = tmp_path / "job.html"
    r = show("4242", "--store", big, "--format", "html", "-o", str(page))
    assert r.exit_code == 0, r.output
    flags = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
             f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    # the browser parsed both figures: 3 GPU panels + 1 rank panel, 16 lines each at least
    assert dom.stdout.count("<svg") == 2
    assert dom.stdout.count("<path") > 4 * 16
    shot = tmp_path / "shot.png"
    cp = subprocess.run([*flags, f"--screenshot={shot}", "--window-size=1200,3000", page.as_uri()],
                        capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0 and shot.exists(), cp.stderr[-2000:]
    from PIL import Image

    img = Image.open(shot).convert("RGB")
    present = {rgb for _n, rgb in (img.getcolors(maxcolors=1 << 20) or [])}
    assert len(present) > 50
    assert (0x1F, 0x77, 0xB4) in present  # matplotlib's first line colour (tab:blue): the plots are drawn
    assert (0x1E, 0x88, 0xE5) in present  # the utilisation bars
    if os.environ.get("GPUGUARD_KEEP_SHOT"):
        shutil.copy(shot, os.environ["GPUGUARD_KEEP_SHOT"])


# --- MailProg wrapper -------------------------------------------------------------------------
def test_mailprog_parsing():
    from gpuguard.epilog.mailprog import end_of_job_id, parse_args

    assert parse_args(["-s", "Slurm Job_id=7 Name=x Ended", "alice@example.edu"]) == (
        "Slurm Job_id=7 Name=x Ended", ["alice@example.edu"])
    assert end_of_job_id("Slurm Job_id=4242 Name=llm Ended, Run time 00:20:00, COMPLETED, ExitCode 0") == "4242"
    assert end_of_job_id("Slurm Job_id=4242 Name=llm Failed, Run time 00:20:00, FAILED, ExitCode 1") == "4242"
    assert end_of_job_id("Slurm Array Task Job_id=300_2 (302) Name=a Ended, Run time 00:01:00, COMPLETED, "
                         "ExitCode 0") == "302"
    assert end_of_job_id("Slurm Job_id=4242 Name=llm Began, Queued time 00:00:01") is None


def _fake_mailer(tmp_path):
    log = tmp_path / "mail.log"
    exe = tmp_path / "mail"
    exe.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {log}.argv\ncat > {log}.body\nexit 3\n")
    exe.chmod(0o755)
    return exe, log


def test_mailprog_appends_the_job_page_and_runs_the_real_mailer(big, tmp_path):
    exe, _log = _fake_mailer(tmp_path)
    cfg = tmp_path / "g.toml"
    cfg.write_text(f'[mail]\nmailer = "{exe}"\nstore = "{big}"\n[display]\ntimezone = "UTC"\n')
    env = {**os.environ, "GPUGUARD_CONFIG": str(cfg)}
    subject = "Slurm Job_id=4242 Name=llm-7b-pretrain Ended, Run time 00:20:00, COMPLETED, ExitCode 0"
    gm = os.path.join(os.path.dirname(sys.executable), "gpuguard-mail")
    cp = subprocess.run([gm, "-s", subject, "alice@example.edu"], input="", text=True, env=env, capture_output=True)
    assert cp.returncode == 3, cp.stderr  # the real mailer's status
    assert (tmp_path / "mail.log.argv").read_text().splitlines() == ["-s", subject, "alice@example.edu"]
    body = (tmp_path / "mail.log.body").read_text()
    assert body.startswith('Job 4242 "llm-7b-pretrain"   user alice  account nlp  partition gpu\n')
    assert "Verdict: data-pipeline" in body and "What to check (data-pipeline: you can fix this):" in body


def test_mailprog_fails_open(tmp_path):
    exe, _log = _fake_mailer(tmp_path)
    cfg = tmp_path / "g.toml"
    cfg.write_text(f'[mail]\nmailer = "{exe}"\nstore = "{tmp_path}/missing.db"\n')
    env = {**os.environ, "GPUGUARD_CONFIG": str(cfg)}
    gm = os.path.join(os.path.dirname(sys.executable), "gpuguard-mail")
    cp = subprocess.run([gm, "-s", "Slurm Job_id=9 Name=x Failed, Run time 00:00:01, FAILED, ExitCode 1", "bob"],
                        input="slurm body\n", text=True, env=env, capture_output=True)
    assert cp.returncode == 3
    assert cp.stderr.startswith("gpuguard-mail: job 9: no job page added: ")
    assert (tmp_path / "mail.log.body").read_text() == "slurm body\n"


def test_csv_to_stdout_and_to_a_file_agree(big, tmp_path):
    r = show("4242", "--store", big, "--format", "csv")
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[0] == "node,metric,value,unit"
    out = tmp_path / "m.csv"
    r2 = show("4242", "--store", big, "--format", "csv", "-o", str(out))
    assert r2.exit_code == 0 and out.read_text() == r.output


def _rep(nodes: int, gpus: int, also: list[str], flagged: int) -> dict:
    sums = [{"node": f"n{n}", "exit_text": "exit 0", "started_at": T0, "ended_at": T0 + 600,
             "gpus": [{"gpu_index": g, "gpu_util_mean_pct": 0.0 if (n, g) == (0, 1) else 70.0,
                       "mem_used_peak_mib": 1024.0 * (g + 1), "power_mean_w": 200.0 + g, "sm_clock_mean_mhz": 1900.0,
                       "temp_max_c": 60.0} for g in range(gpus)]} for n in range(nodes)]
    comps = [{"metric": f"m{i}", "unit": "s", "value": 2.0, "median": 1.0, "rel_change": 1.0, "flagged": True}
             for i in range(flagged)]
    verdict = {"cause": "data-pipeline", "summary": "slow input", "template": "t", "state": "judged",
               "baseline_runs": 5, "also": also, "evidence": {}, "comparisons": comps}
    return {"job_id": "9", "nodes": [s["node"] for s in sums], "verdict": verdict, "summaries": sums,
            "findings": [], "events": [], "job": {"job_id": "9", "nodes": [s["node"] for s in sums], "gpus": nodes * gpus}}


def test_worst_case_16_gpus_still_fits_and_names_the_advice_left_out():
    from zoneinfo import ZoneInfo

    from gpuguard.epilog.jobpage import format_page

    page = format_page(_rep(2, 8, ["memory-leak", "communication", "job-changed"], 9), tz=ZoneInfo("UTC"),
                       advice=load_advice())
    lines = page.splitlines()
    assert len(lines) <= 40, page
    assert "  ... 6 more (--full)" in lines
    assert lines[-3].startswith("More advice (") and lines[-3].endswith("): --format html")
    assert "What to check (data-pipeline: you can fix this):" in lines


def test_big_jobs_get_one_line_per_node_plus_idle_gpus():
    from zoneinfo import ZoneInfo

    from gpuguard.epilog.jobpage import format_page

    lines = format_page(_rep(4, 8, [], 1), tz=ZoneInfo("UTC"), advice=load_advice()).splitlines()
    assert len(lines) <= 40
    i = next(k for k, x in enumerate(lines) if x.startswith("node (mean of its GPUs)"))
    assert [x.split("  ")[0] for x in lines[i + 1:i + 6]] == ["n0 (8 GPUs)", "n1 (8 GPUs)", "n2 (8 GPUs)",
                                                            "n3 (8 GPUs)", "n0 gpu1"]
    assert lines[i + 1].split("]")[1].strip().startswith("61%")  # (7 x 70 + 0) / 8
    assert lines[i + 5].endswith("idle")


def test_mailprog_reads_the_store_read_only(big, tmp_path):
    """gpuguard-mail (run by slurmctld as SlurmUser) only reads the store: not a byte of
    it changes and nothing is created beside it."""
    import sqlite3

    con = sqlite3.connect(big)
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.execute("PRAGMA journal_mode = delete")
    con.close()
    before = open(big, "rb").read()
    exe, _log = _fake_mailer(tmp_path)
    cfg = tmp_path / "g.toml"
    cfg.write_text(f'[mail]\nmailer = "{exe}"\nstore = "{big}"\n[display]\ntimezone = "UTC"\n')
    env = {**os.environ, "GPUGUARD_CONFIG": str(cfg)}
    gm = os.path.join(os.path.dirname(sys.executable), "gpuguard-mail")
    cp = subprocess.run([gm, "-s", "Slurm Job_id=4242 Name=x Ended, Run time 00:20:00, COMPLETED, ExitCode 0", "a"],
                        input="", text=True, env=env, capture_output=True)
    assert cp.returncode == 3, cp.stderr
    assert "Verdict: data-pipeline" in (tmp_path / "mail.log.body").read_text()
    assert open(big, "rb").read() == before
    assert not os.path.exists(big + "-wal") and not os.path.exists(big + "-shm")


@pytest.mark.parametrize("rcpt", ["-Ssendmail=/tmp/x.sh", "--help", "-"])
def test_mailprog_never_passes_an_option_as_the_recipient(tmp_path, rcpt):
    """Slurm 22.05 keeps `--mail-user=-Ssendmail=/path` as it is (measured on the testbed)
    and passes it as the recipient: the mailer is not run at all."""
    exe, log = _fake_mailer(tmp_path)
    cfg = tmp_path / "g.toml"
    cfg.write_text(f'[mail]\nmailer = "{exe}"\nstore = "{tmp_path}/missing.db"\n')
    env = {**os.environ, "GPUGUARD_CONFIG": str(cfg)}
    gm = os.path.join(os.path.dirname(sys.executable), "gpuguard-mail")
    cp = subprocess.run([gm, "-s", "Slurm Job_id=9 Name=x Ended, Run time 00:00:01, COMPLETED, ExitCode 0", rcpt],
                        input="body\n", text=True, env=env, capture_output=True)
    assert cp.returncode == 2
    assert cp.stderr == (f"gpuguard-mail: not sent: recipient {rcpt!r} starts with '-' (it would be read as a "
                         "mailer option)\n")
    assert not os.path.exists(f"{log}.argv")


def test_o_keeps_an_existing_file_unless_forced(big, tmp_path):
    out = tmp_path / "passwd"
    out.write_text("root:x:0:0\n")
    r = show("4242", "--store", big, "--format", "html", "-o", str(out))
    assert (r.exit_code, r.output) == (2, f"Error: {out}: already exists; not replaced (--force replaces it)\n")
    assert out.read_text() == "root:x:0:0\n"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    r = show("4242", "--store", big, "--format", "csv", "-o", str(fifo), "--force")
    assert (r.exit_code, r.output) == (2, f"Error: {fifo}: not a regular file; refusing to write to it\n")
    r = show("4242", "--store", big, "--format", "csv", "-o", str(out), "--force")
    assert (r.exit_code, r.output) == (0, f"wrote {out}\n")
    assert out.read_text().splitlines()[0] == "node,metric,value,unit"
