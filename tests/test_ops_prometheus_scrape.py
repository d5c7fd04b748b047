"""A real Prometheus (Debian's ``prometheus`` package) scrapes gpuguard's textfile output
served over HTTP and answers a query with the running job's labels. Skipped when the
binary is not installed (``.ci/run`` installs it)."""

from __future__ import annotations

import json
import logging
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gpuguard.ops import jobmap, metrics
from gpuguard.store import open_store
from conftest import node_snapshot

PROM = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(PROM is None, reason="prometheus binary not installed (apt-get install prometheus)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_prometheus_scrapes_the_textfile_and_sees_job_labels(tmp_path, make_config):
    _, cfg = make_config(f'[metrics]\ntextfile_dir = "{tmp_path}/textfile"\n')
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_GPUS": "1", "SLURM_JOB_USER": "gg_alice", "SLURM_JOB_UID": "1001",
           "SLURM_JOB_ACCOUNT": "acct_a"}
    jobmap.job_started(cfg, env, logging.getLogger("t"), snapshot=node_snapshot(4))
    st = open_store(cfg.store_path)
    st.insert("samples", {"job_id": "42", "node": "n1", "at": time.time(), "gpu_index": 1, "gpu_uuid": "GPU-1",
                          "gpu_util_pct": 87.0, "mem_used_mib": 1.0, "power_w": 300.0, "temp_c": 60.0,
                          "sm_clock_mhz": 1980.0})
    assert metrics.write_textfile(cfg, st) == []
    body = (tmp_path / "textfile" / "gpuguard_n1.prom").read_bytes()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    port = _free_port()
    (tmp_path / "prom.yml").write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n"
        f"  - job_name: gpuguard\n    static_configs:\n      - targets: ['127.0.0.1:{srv.server_address[1]}']\n")
    proc = subprocess.Popen([PROM, f"--config.file={tmp_path}/prom.yml", f"--storage.tsdb.path={tmp_path}/tsdb",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prom.log", "w"))
    try:
        q = urllib.parse.quote('gpuguard_job_gpu_utilization_ratio{job_id="42"}')
        deadline = time.monotonic() + 60
        result = []
        while time.monotonic() < deadline and not result:
            time.sleep(0.5)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/query?query={q}", timeout=2) as r:
                    result = json.load(r)["data"]["result"]
            except OSError:
                continue
        assert result, (tmp_path / "prom.log").read_text()[-2000:]
        labels = result[0]["metric"]
        assert {k: labels[k] for k in ("job_id", "user", "account", "gpu", "uuid", "node")} == {
            "job_id": "42", "user": "gg_alice", "account": "acct_a", "gpu": "1", "uuid": "GPU-1", "node": "n1"}
        assert float(result[0]["value"][1]) == pytest.approx(0.87)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/targets", timeout=2) as r:
            target = json.load(r)["data"]["activeTargets"][0]
        assert (target["health"], target["lastError"]) == ("up", "")
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        srv.shutdown()
        srv.server_close()
