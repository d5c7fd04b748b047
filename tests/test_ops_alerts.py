"""Alerts: spool from hooks, de-duplication with counts, rate limits, retries with
back-off, and the sinks (a real HTTP server on 127.0.0.1, a real UDP syslog socket, a mail
program receiving an argument list)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gpuguard.model import Finding
from gpuguard.ops import alert_send, alert_spool
from gpuguard.ops.alert_spool import Alert
from gpuguard.store import open_store

T0 = 1_790_000_000.0


class Hook:
    """A local webhook: answers with the queued status codes (then 200) and keeps bodies."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.codes: list[int] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                n = int(self.headers.get("Content-Length", "0"))
                outer.bodies.append(json.loads(self.rfile.read(min(n, 1 << 20))))
                code = outer.codes.pop(0) if outer.codes else 200
                self.send_response(code)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.timeout = 2
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/abc"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hook():
    h = Hook()
    yield h
    h.close()


@pytest.fixture
def env(tmp_path, make_config, hook):
    def make(extra="", url=None):
        _, cfg = make_config(f'[alerts]\nsyslog_min_severity = ""\nwebhook_url = "{url or hook.url}"\n' + extra)
        return cfg, open_store(cfg.store_path)
    return make


def xid_alert(at, count=1, gpu=0):
    return Alert(node="n1", code="xid.79", severity="critical", message="XID 79 GPU has fallen off the bus on gpu0",
                 gpu_index=gpu, count=count, action="drain", source="prolog", at=at)


def test_twenty_repeats_make_one_webhook_alert_with_count_20(env, hook):
    cfg, st = env()
    for i in range(20):  # 20 Prolog runs, each queueing the same XID on the same GPU
        alert_spool.enqueue(cfg, xid_alert(T0 + i))
    rep = alert_send.send(cfg, st, now=T0 + 30)
    assert (rep.ingested, rep.notified, rep.sent) == (20, 1, 1)
    assert len(hook.bodies) == 1
    body = hook.bodies[0]
    assert body["gpuguard"]["count"] == 20
    assert body["gpuguard"]["node"] == "n1" and body["gpuguard"]["code"] == "xid.79"
    assert body["gpuguard"]["gpu_index"] == 0
    assert body["text"] == ("[critical] n1 gpu0 xid.79: XID 79 GPU has fallen off the bus on gpu0 "
                            "(x20, first 2026-09-21T14:13:20Z)")
    assert os.path.getsize(alert_spool.spool_path(cfg)) == 0


def test_an_xid_finding_seen_20_times_counts_20(env, hook):
    cfg, st = env()
    f = Finding("xid.79", "critical", "XID 79 ... x20", 0, None, {"xid": 79, "count": 20})
    alert_spool.enqueue_findings(cfg, "n1", [(f, "drain"), (Finding("inventory.changed", "info", "x"), "record")],
                                 source="health")
    alert_send.send(cfg, st)
    assert [b["gpuguard"]["count"] for b in hook.bodies] == [20]


def test_other_gpu_or_code_is_another_alert(env, hook):
    cfg, st = env()
    alert_spool.enqueue_many(cfg, [xid_alert(T0), xid_alert(T0, gpu=1), xid_alert(T0 + 1)])
    alert_send.send(cfg, st, now=T0 + 5)
    assert sorted((b["gpuguard"]["gpu_index"], b["gpuguard"]["count"]) for b in hook.bodies) == [(0, 2), (1, 1)]


def test_repeats_after_the_notification_are_sent_once_when_the_window_closes(env, hook):
    cfg, st = env("dedup_window_s = 600\n")
    alert_spool.enqueue(cfg, xid_alert(T0))
    alert_send.send(cfg, st, now=T0 + 1)
    for i in range(5):
        alert_spool.enqueue(cfg, xid_alert(T0 + 10 + i))
    alert_send.send(cfg, st, now=T0 + 100)  # inside the window: nothing new goes out
    assert len(hook.bodies) == 1
    alert_send.send(cfg, st, now=T0 + 601)
    assert [(b["gpuguard"]["kind"], b["gpuguard"]["count"]) for b in hook.bodies] == [("new", 1), ("repeat", 5)]
    alert_spool.enqueue(cfg, xid_alert(T0 + 700))  # a new window: a new alert
    alert_send.send(cfg, st, now=T0 + 701)
    assert [(b["gpuguard"]["kind"], b["gpuguard"]["count"]) for b in hook.bodies][-1] == ("new", 1)


def test_server_errors_are_retried_with_backoff(env, hook):
    cfg, st = env("retry_base_s = 30\nmax_attempts = 3\n")
    hook.codes = [500, 503]
    alert_spool.enqueue(cfg, xid_alert(T0))
    rep = alert_send.send(cfg, st, now=T0)
    assert (rep.sent, rep.retrying) == (0, 1)
    d = st.query("select attempts, status, next_at, error from alert_deliveries")[0]
    assert d == {"attempts": 1, "status": "pending", "next_at": T0 + 30, "error": "webhook: HTTP 500 Internal Server Error"}
    assert alert_send.send(cfg, st, now=T0 + 29).sent == 0  # not due yet: no request
    assert len(hook.bodies) == 1
    alert_send.send(cfg, st, now=T0 + 30)
    d = st.query("select attempts, status, next_at from alert_deliveries")[0]
    assert d == {"attempts": 2, "status": "pending", "next_at": T0 + 30 + 60}
    rep = alert_send.send(cfg, st, now=T0 + 90)
    assert rep.sent == 1
    assert st.query("select attempts, status from alert_deliveries")[0] == {"attempts": 3, "status": "sent"}


def test_a_client_error_is_given_up_at_once(env, hook):
    cfg, st = env()
    hook.codes = [400]
    alert_spool.enqueue(cfg, xid_alert(T0))
    rep = alert_send.send(cfg, st, now=T0)
    assert rep.given_up == 1
    assert st.query("select status, attempts from alert_deliveries")[0] == {"status": "failed", "attempts": 1}


def test_unreachable_webhook_never_blocks_past_the_deadline(env):
    # a port nobody listens on, and a server that never answers
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    cfg, st = env("webhook_timeout_s = 30\n", url=f"http://127.0.0.1:{silent.getsockname()[1]}/x")
    alert_spool.enqueue(cfg, xid_alert(T0))
    t = time.monotonic()
    rep = alert_send.send(cfg, st, now=T0, deadline=time.monotonic() + 1.5)
    assert time.monotonic() - t < 3.0
    assert rep.retrying == 1
    silent.close()


def test_rate_limit_holds_the_rest(env, hook):
    cfg, st = env("rate_limit_per_hour = 2\n")
    alert_spool.enqueue_many(cfg, [xid_alert(T0, gpu=g) for g in range(4)])
    rep = alert_send.send(cfg, st, now=T0)
    assert (rep.sent, rep.held) == (2, 2)
    assert alert_send.send(cfg, st, now=T0 + 1800).sent == 0
    assert alert_send.send(cfg, st, now=T0 + 3601).sent == 2


def test_severity_floor_per_sink(env, hook):
    cfg, st = env('webhook_min_severity = "critical"\n')
    alert_spool.enqueue_many(cfg, [
        Alert(node="n1", code="pcie.width_degraded", severity="warning", message="x8", gpu_index=1, at=T0),
        xid_alert(T0)])
    alert_send.send(cfg, st, now=T0)
    assert [b["gpuguard"]["code"] for b in hook.bodies] == ["xid.79"]


def test_enqueue_gives_up_when_the_spool_stays_locked(env):
    import fcntl

    cfg, _ = env()
    path = alert_spool.spool_path(cfg)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        t = time.monotonic()
        with pytest.raises(OSError, match="spool locked"):
            alert_spool.enqueue(cfg, xid_alert(T0))
        assert time.monotonic() - t < alert_spool.LOCK_WAIT_S + 0.5
    finally:
        os.close(fd)


def test_spool_cap(env):
    cfg, _ = env("spool_max_bytes = 100\n")
    alert_spool.enqueue(cfg, xid_alert(T0))
    with pytest.raises(alert_spool.SpoolFull):
        alert_spool.enqueue(cfg, xid_alert(T0))


def test_syslog_sink_sends_one_datagram_with_the_priority(tmp_path, make_config):
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.settimeout(2)
    _, cfg = make_config(f'[alerts]\nsyslog_address = "127.0.0.1:{rx.getsockname()[1]}"\nsyslog_facility = "local3"\n')
    st = open_store(cfg.store_path)
    alert_spool.enqueue(cfg, xid_alert(T0))
    assert alert_send.send(cfg, st, now=T0).sent == 1
    data = rx.recv(4096).decode()
    rx.close()
    # <PRI> = facility local3 (19) * 8 + severity crit (2) = 154 (RFC 5424 section 6.2.1)
    assert data.startswith("<154>gpuguard: [critical] n1 gpu0 xid.79: XID 79")


def test_mail_sink_runs_an_argument_list(tmp_path, make_config):
    out = tmp_path / "mail.out"
    prog = tmp_path / "sendmail"
    prog.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {out}\ncat >> {out}\n")
    prog.chmod(0o755)
    _, cfg = make_config(f'[alerts]\nsyslog_min_severity = ""\nmail_to = ["ops@example.org", "x; rm -rf /"]\n'
                         f'mail_program = "{prog}"\n')
    st = open_store(cfg.store_path)
    alert_spool.enqueue(cfg, xid_alert(T0))
    assert alert_send.send(cfg, st, now=T0).sent == 1
    lines = out.read_text().splitlines()
    assert lines[:4] == ["-oi", "--", "ops@example.org", "x; rm -rf /"]
    assert lines[4] == "To: ops@example.org, x; rm -rf /"
    assert lines[5] == "Subject: gpuguard critical: n1 gpu0 xid.79"


def test_mail_style_for_slurm_mailprog(make_config):
    from gpuguard.ops.alert_sinks import mail_command

    _, cfg = make_config('[alerts]\nmail_to = ["a@b"]\n')
    assert mail_command(cfg, "subj", "/usr/bin/mail") == (["/usr/bin/mail", "-s", "subj", "a@b"], False)
    assert mail_command(cfg, "subj", None) == (["/usr/sbin/sendmail", "-oi", "--", "a@b"], True)
