"""gpuguard health as the testbed's real HealthCheckProgram (slurmd runs it every
HealthCheckInterval = 5 s as root, with only SLURMD_NODENAME set), no job involved:
drain on an XID injected into an idle node's kernel log, resume after N clean runs for a
fault that clears, an admin's drain left alone, a MAINT reservation suppressing drain
and alert, and one webhook alert with count 20 for 20 repeats of one XID."""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import node_snapshot

from gpuguard.gpu.replay import dump_snapshot
from gpuguard.store import open_store

pytestmark = pytest.mark.slurm

XID79 = "[  912.345678] NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"
REASON79 = "gpuguard: xid.79 XID 79 GPU has fallen off the bus on gpu0 (0000:18:00) x20"


class Hook:
    def __init__(self):
        self.bodies: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                n = int(self.headers.get("Content-Length", "0"))
                outer.bodies.append(json.loads(self.rfile.read(min(n, 1 << 20))))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hc(slurm):
    tb = slurm
    root = tb.root / "gg"
    hook = Hook()
    tb.install_gpuguard(root, dump_snapshot(node_snapshot(4), t0=time.time()), extra=f"""
[health]
resume_after_clean_runs = 2
[alerts]
syslog_min_severity = ""
webhook_url = "{hook.url}"
webhook_min_severity = "warning"
""")
    flag = tb.root / "etc" / "healthcheck.on"
    flag.touch()
    yield tb, root, hook
    flag.unlink(missing_ok=True)
    tb.run(["scontrol", "delete", "reservation=ggmaint"], check=False)
    hook.close()
    time.sleep(1)  # let a run in flight finish before the next test rewrites the config


def wait_for(pred, what, timeout=40, tb=None, root=None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.25)
    log = (root / "gpuguard.log").read_text()[-3000:] if root and (root / "gpuguard.log").exists() else ""
    raise AssertionError(f"timed out waiting for {what}\n{log}")


def actions(root, node):
    """The node's actions; [] while the health run is still creating its store."""
    from gpuguard.ops import schema  # noqa: F401  (the "ops" tables)
    from gpuguard.store import StoreError

    try:
        st = open_store(str(root / node / "node.db"), create=False)
    except StoreError:
        return []
    try:
        return [(r["action"], r["by"], r["outcome"], r["recovery"])
                for r in st.query("select * from node_actions where node = ? order by id", [node])]
    except StoreError:
        return []
    finally:
        st.close()


def test_xid_on_idle_node_drains_at_next_health_run_with_one_alert_count_20(hc):
    tb, root, hook = hc
    (root / "n1" / "kern.log").write_text(XID79 * 20)
    wait_for(lambda: tb.drain_reason("n1"), "n1 drained", root=root)
    assert tb.drain_reason("n1") == REASON79
    assert tb.run(["squeue", "-h"]).stdout == ""  # no job was involved
    wait_for(lambda: hook.bodies, "the webhook alert", root=root)
    time.sleep(6)  # one more health run: still exactly one alert
    assert [(b["gpuguard"]["code"], b["gpuguard"]["node"], b["gpuguard"]["count"]) for b in hook.bodies] == [
        ("xid.79", "n1", 20)]
    time.sleep(6)
    assert tb.drain_reason("n1") == REASON79  # XID 79 needs a reboot: never resumed
    assert actions(root, "n1") == [("drain", "health", "done", "reboot")]
    assert tb.drain_reason("n2") is None


def test_cleared_fault_resumes_after_n_clean_runs_admin_drain_stays(hc):
    tb, root, _hook = hc
    hot = node_snapshot(4, gpu1={"clock_event_reasons": ["hw_slowdown"]})
    (root / "n1" / "gpus.json").write_text(dump_snapshot(hot, t0=time.time()))
    tb.drain_node("n2", "admin: fan replacement")
    (root / "n2" / "gpus.json").write_text(dump_snapshot(hot, t0=time.time()))
    reason = wait_for(lambda: tb.drain_reason("n1"), "n1 drained", root=root)
    assert reason.startswith("gpuguard: throttle.hw_slowdown_idle ")
    # n2's run must have seen its fault too before it clears (the two runs race under load)
    wait_for(lambda: actions(root, "n2"), "n2's drain refused", root=root)
    (root / "n1" / "gpus.json").write_text(dump_snapshot(node_snapshot(4), t0=time.time()))
    (root / "n2" / "gpus.json").write_text(dump_snapshot(node_snapshot(4), t0=time.time()))
    t = time.monotonic()
    wait_for(lambda: tb.drain_reason("n1") is None, "n1 resumed", root=root)
    assert time.monotonic() - t >= 5  # two clean runs, 5 s apart
    assert actions(root, "n1") == [("drain", "health", "done", "auto"), ("resume", "health", "done", "auto")]
    time.sleep(6)
    assert tb.drain_reason("n2") == "admin: fan replacement"
    assert [a[:3] for a in actions(root, "n2")] == [("drain", "health", "refused")]


def test_maint_reservation_no_drain_no_alert(hc):
    tb, root, hook = hc
    tb.run(["scontrol", "create", "reservation", "ReservationName=ggmaint", "StartTime=now", "Duration=10",
            "Nodes=n1", "Flags=MAINT", "Users=root"])
    (root / "n1" / "kern.log").write_text(XID79)
    st_path = root / "n1" / "node.db"
    wait_for(lambda: st_path.exists() and ("suppressed", "health", "refused", "reboot") in actions(root, "n1"),
             "a suppressed drain", root=root)
    time.sleep(6)
    assert tb.drain_reason("n1") is None
    assert hook.bodies == []
    st = open_store(str(st_path), create=False)
    codes = [r["code"] for r in st.query("select code from findings where node = 'n1'")]
    st.close()
    assert "xid.79" in codes  # the finding is still recorded
    out = gg_cli(tb, "node", "show", "n1")
    assert "maintenance: in maintenance (reservation ggmaint: Slurm MAINT reservation) until " in out
    assert "suppressed" in out and "would drain: in maintenance (reservation ggmaint" in out


def gg_cli(tb, *args):
    """``gpuguard --config <testbed toml> ARGS`` with the testbed's SLURM_CONF."""
    import os
    import subprocess
    import sys

    exe = os.path.join(os.path.dirname(sys.executable), "gpuguard")
    cp = subprocess.run([exe, "--config", str(tb.gpuguard_toml), *args], capture_output=True, text=True,
                        env=tb.env, timeout=60)
    assert cp.returncode == 0, cp.stderr
    return cp.stdout


def test_prometheus_text_carries_the_running_jobs_labels(slurm):
    from prometheus_client.parser import text_string_to_metric_families

    tb = slurm
    root = tb.root / "gg"
    tb.install_gpuguard(root, dump_snapshot(node_snapshot(4), t0=time.time()), extra=f"""
[alerts]
syslog_min_severity = ""
[metrics]
textfile_dir = "{root}/textfile"
dcgm_job_map_dir = "{root}/{{node}}/dcgm"
""")
    flag = tb.root / "etc" / "healthcheck.on"
    flag.touch()
    try:
        jid = tb.submit(wrap="sleep 60", gres="gpu:2", nodelist="n1", user="gg_alice", account="acct_b")
        tb.wait_state(jid, "RUNNING")
        prom = root / "textfile" / "gpuguard_n1.prom"

        def job_samples():
            if not prom.exists():
                return None
            fams = {f.name: f for f in text_string_to_metric_families(prom.read_text())}
            util = fams.get("gpuguard_job_gpu_utilization_ratio")
            return (fams, util.samples) if util and util.samples else None

        fams, util = wait_for(job_samples, "job samples in the textfile", root=root)
        info = sorted((s.labels["gpu"], s.labels) for s in fams["gpuguard_job_gpu_info"].samples)
        assert [g for g, _ in info] == ["0", "1"]
        assert info[0][1] == {"node": "n1", "job_id": str(jid), "user": "gg_alice", "account": "acct_b", "gpu": "0",
                              "uuid": "GPU-00000000-0000-0000-0000-000000000000"}
        assert {s.labels["job_id"] for s in util} == {str(jid)}
        assert (root / "n1" / "dcgm" / "0").read_text() == f"{jid}\n"
        assert (root / "n1" / "dcgm" / "1").read_text() == f"{jid}\n"
        tb.cancel(jid)
        wait_for(lambda: not tb.run(["squeue", "-h", "-j", str(jid)], check=False).stdout.strip(), "job gone")
        assert sorted(os.listdir(root / "n1" / "dcgm")) == []
    finally:
        flag.unlink(missing_ok=True)
        time.sleep(1)


def test_auto_fault_refused_by_an_admin_drain_never_fires_after_the_resume(hc):
    """An auto fault (a state every run re-reads) seen while an administrator holds the
    node is not kept to drain it after the resume on stale evidence; an XID (an event)
    seen then is, and drains once the administrator resumes the node."""
    tb, root, _hook = hc
    hot = node_snapshot(4, gpu1={"clock_event_reasons": ["hw_slowdown"]})
    tb.drain_node("n2", "admin: fan replacement")
    (root / "n2" / "gpus.json").write_text(dump_snapshot(hot, t0=time.time()))
    wait_for(lambda: actions(root, "n2"), "n2's drain refused", root=root)
    assert [a[:3] for a in actions(root, "n2")] == [("drain", "health", "refused")]
    (root / "n2" / "gpus.json").write_text(dump_snapshot(node_snapshot(4), t0=time.time()))
    time.sleep(6)  # a clean run while still held
    tb.resume_node("n2")
    time.sleep(11)  # two health runs after the resume
    assert tb.drain_reason("n2") is None
    assert not (root / "n2" / "state" / "pending_drains.json").exists() or \
        '"n2"' not in (root / "n2" / "state" / "pending_drains.json").read_text()
    # an event seen while held waits for the resume, then drains
    tb.drain_node("n2", "admin: fan replacement")
    (root / "n2" / "kern.log").write_text(XID79.replace("0000:18:00", "0000:29:00"))
    wait_for(lambda: len(actions(root, "n2")) > 1, "n2's XID drain refused", root=root)
    tb.resume_node("n2")
    reason = wait_for(lambda: tb.drain_reason("n2"), "n2 drained after the resume", root=root)
    assert reason.startswith("gpuguard: xid.79 XID 79 GPU has fallen off the bus on gpu1 (0000:29:00)")
