"""gpuguard node list|show|drain|resume, and health leaving a by-hand drain alone."""

from __future__ import annotations

import json
import logging

import pytest
from click.testing import CliRunner
from conftest import node_snapshot
from ops_fake_slurm import FakeSlurm

from gpuguard.cli import main
from gpuguard.ops import healthcheck

XID79 = "[  912.345678] NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"


@pytest.fixture
def env(tmp_path, make_config, write_replay, monkeypatch):
    fake = FakeSlurm(tmp_path)
    path, cfg = make_config("[health]\nsend_alerts = false\nresume_after_clean_runs = 1\n"
                            f'[alerts]\nsyslog_address = "{tmp_path}/no-such-socket"\n',  # an absent syslog
                            replay=write_replay(node_snapshot(4)))
    monkeypatch.setenv("SUDO_USER", "alice")

    def gg(*args):
        return CliRunner().invoke(main, ["--config", path, *args])
    return fake, cfg, gg


def test_drain_by_hand_is_recorded_and_never_auto_resumed(env):
    fake, cfg, gg = env
    r = gg("node", "drain", "n1", "--reason", 'fan "noisy"\nrack 4')
    assert (r.exit_code, r.output) == (0, "drain n1: done\n")
    assert fake.node("n1")["reason"] == "gpuguard: manual: fan 'noisy' rack 4 (by alice)"
    for _ in range(3):
        healthcheck.main_run(cfg, logging.getLogger("t"))  # clean runs
    assert fake.node("n1")["state"] == "IDLE+DRAIN"
    r = gg("node", "show", "n1", "--format", "json")
    doc = json.loads(r.output)
    assert doc["drain"]["by"] == "hand" and doc["drain"]["recovery"] == "manual"
    assert [(h["kind"], h["what"]) for h in doc["history"]] == [("drain", "by hand (alice)")]
    text = gg("node", "show", "n1").output
    assert "drained by hand at " in text and "needs a look and a resume by hand" in text


def test_resume_by_hand_only_ours_unless_forced(env):
    fake, _cfg, gg = env
    fake.admin_drain("n2", "admin: PSU")
    r = gg("node", "resume", "n2")
    assert r.exit_code == 1
    assert r.output == "resume n2: refused (its reason 'admin: PSU [admin@2026-11-30T19:00:01]' is not gpuguard's)\n"
    assert fake.node("n2")["reason"] == "admin: PSU"
    r = gg("node", "resume", "n2", "--force")
    assert r.exit_code == 0
    assert r.output.splitlines() == [
        "--force: resuming n2 although its reason is not gpuguard's: admin: PSU [admin@2026-11-30T19:00:01]",
        "resume n2: done"]
    assert fake.node("n2")["state"] == "IDLE"
    doc = json.loads(gg("node", "show", "n2", "--json").output)
    assert [(h["kind"], h["detail"]) for h in doc["history"]] == [("resume", "admin: PSU [admin@2026-11-30T19:00:01]"),
                                                                ("resume", "refused: its reason 'admin: PSU "
                                                                 "[admin@2026-11-30T19:00:01]' is not gpuguard's "
                                                                 "(admin: PSU [admin@2026-11-30T19:00:01])")]


def test_resume_by_hand_of_an_xid79_drain(env, tmp_path):
    fake, cfg, gg = env
    (tmp_path / "kern.log").write_text(XID79)
    healthcheck.main_run(cfg, logging.getLogger("t"))
    assert fake.node("n1")["state"] == "IDLE+DRAIN"
    r = gg("node", "list", "--format", "json")
    rows = json.loads(r.output)
    assert [(x["node"], x["by"], x["recovery"]) for x in rows] == [
        ("n1", "health", "needs a node reboot, then a resume by hand")]
    assert rows[0]["reason"] == "gpuguard: xid.79 XID 79 GPU has fallen off the bus on gpu0 (0000:18:00)"
    assert gg("node", "resume", "n1").output == "resume n1: done\n"
    assert fake.node("n1")["state"] == "IDLE"


def test_list_all_and_csv(env):
    fake, _cfg, gg = env
    fake.admin_drain("n2", "admin: PSU")
    gg("node", "drain", "n1", "--reason", "test")
    assert [r["node"] for r in json.loads(gg("node", "list", "--json").output)] == ["n1"]
    lines = gg("node", "list", "--all", "--format", "csv").output.splitlines()
    assert lines[0] == "node,since,by,reason,recovery,ours"
    assert [ln.split(",")[0] for ln in lines[1:]] == ["n1", "n2"]


def test_bad_reason_is_refused(env):
    _, _, gg = env
    r = gg("node", "drain", "n1", "--reason", "  ")
    assert r.exit_code == 2 and "--reason" in r.output


def test_shell_completion_as_documented():
    import os
    import subprocess
    import sys

    exe = os.path.join(os.path.dirname(sys.executable), "gpuguard")
    env = dict(os.environ, COMP_WORDS="gpuguard node re", COMP_CWORD="2", _GPUGUARD_COMPLETE="bash_complete")
    out = subprocess.run([exe], env=env, capture_output=True, text=True, timeout=60).stdout
    assert out.split() == ["plain,resume"]
    script = subprocess.run([exe], env=dict(os.environ, _GPUGUARD_COMPLETE="bash_source"), capture_output=True,
                            text=True, timeout=60).stdout
    assert "complete -o nosort -F _gpuguard_completion gpuguard" in script


def test_alert_list_and_health_list(env, utc):
    from gpuguard.ops import alert_spool
    from gpuguard.ops.alert_spool import Alert

    _fake, cfg, gg = env
    alert_spool.enqueue_many(cfg, [Alert(node="n1", code="xid.63", severity="warning", message="remap", gpu_index=2,
                                         at=1_790_000_000.0)] * 2)
    r = gg("alert", "send")
    assert r.output == "ingested 2, notified 1, sent 0, retrying 1, given up 0, held 0\n"
    rows = json.loads(gg("alert", "list", "--json").output)
    assert [(x["code"], x["gpu"], x["count"], x["notified"], x["first_at"]) for x in rows] == [
        ("xid.63", 2, 2, 2, "2026-09-21T14:13:20+00:00")]
    assert rows[0]["deliveries"] == "syslog:pending"
    assert gg("health", "--list").exit_code == 0


def test_node_list_and_show_read_the_store_read_only(env, tmp_path):
    """The listings never migrate or write a node store: not a byte changes, no -wal/-shm
    appear beside it (as for job show, template list, baseline show)."""
    import os

    _fake, cfg, gg = env
    (tmp_path / "kern.log").write_text(XID79)
    healthcheck.main_run(cfg, logging.getLogger("t"))
    db = cfg.store_path
    import sqlite3
    con = sqlite3.connect(db)  # the writer is gone: fold its WAL in, as a clean shutdown leaves it
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.execute("PRAGMA journal_mode = delete")
    con.close()
    before = open(db, "rb").read()
    r = gg("node", "list", "--format", "json")
    assert [x["by"] for x in json.loads(r.output)] == ["health"]
    r = gg("node", "show", "n1", "--format", "json")
    assert r.exit_code == 0 and json.loads(r.output)["drain"]["by"] == "health"
    assert open(db, "rb").read() == before
    assert not os.path.exists(db + "-wal") and not os.path.exists(db + "-shm")


def test_node_show_on_a_store_without_history_tables_is_one_line(env, tmp_path):
    import sqlite3

    _fake, cfg, gg = env
    sqlite3.connect(cfg.store_path).execute("create table other (x)").connection.close()
    r = gg("node", "show", "n1")
    assert r.exit_code == 2
    assert r.output.startswith(f"Error: store {cfg.store_path}: ") and "(no gpuguard history for n1 yet?)" in r.output
    assert [t for (t,) in sqlite3.connect(cfg.store_path).execute("select name from sqlite_master")] == ["other"]
