"""A forged XID in a kernel-log file any user can write to (`logger -t kernel` in
/var/log/syslog) alerts the operator but is never evidence: not a drain, not a critical
finding, and not the hardware fault a job's verdict blames the machine for."""

from __future__ import annotations

import json

from conftest import node_snapshot

FORGED = ("Nov 30 03:40:01 n1 kernel: NVRM: Xid (PCI:0000:29:00): 79, pid=1, name=x, "
          "GPU has fallen off the bus.\n")


def test_forged_xid_in_a_syslog_file_alerts_but_is_no_hardware_evidence(tmp_path, make_config, write_replay):
    import gpuguard.epilog.schema  # noqa: F401  (registers the job tables)
    from gpuguard.epilog import jobdata
    from gpuguard.health import run_health
    from gpuguard.store import open_store

    syslog = tmp_path / "syslog"
    syslog.write_text(FORGED)
    _, cfg = make_config(replay=write_replay(node_snapshot(2)), kernel_log=str(syslog))
    cfg.values["xid"]["kernel_log_kernel_only"] = False  # a syslog file of all facilities
    store = open_store(cfg.store_path)
    try:
        res = run_health(cfg, hook="prolog", store=store, job_id="7")
        assert res.decision.outcome == "proceed"
        [(f, action)] = res.decision.actions
        assert (f.code, f.severity, action, f.gpu_index) == ("xid.79", "warning", "alert", 1)
        assert f.message == (f"XID 79 GPU has fallen off the bus on gpu1 (0000:29:00) (read from {syslog}, "
                             "which can hold user messages: alert only)")
        events = store.query("select code, action, source, gpu_index, job_id from events")
        assert events == [{"code": 79, "action": "record", "source": "kernel_log_untrusted", "gpu_index": 1,
                           "job_id": "7"}]
        [row] = store.query("select code, severity, action, evidence from findings")
        assert (row["code"], row["severity"], row["action"]) == ("xid.79", "warning", "alert")
        assert json.loads(row["evidence"])["untrusted_source"] == str(syslog)
        tables = {r["name"] for r in store.query("select name from sqlite_master where type = 'table'")}
        at = store.query("select at from findings")[0]["at"]
        hw_events, hw_findings = jobdata._load_hw(store, tables, "7", ["n1"], at - 60, at + 60)
        assert (hw_events, hw_findings) == ([], [])
    finally:
        store.close()


def test_the_same_xid_from_a_kernel_only_file_is_evidence(tmp_path, make_config, write_replay):
    import gpuguard.epilog.schema  # noqa: F401
    from gpuguard.epilog import jobdata
    from gpuguard.health import run_health
    from gpuguard.store import open_store

    kern = tmp_path / "kern.log"
    kern.write_text(FORGED)
    _, cfg = make_config(replay=write_replay(node_snapshot(2)), kernel_log=str(kern))  # kernel_only = true
    store = open_store(cfg.store_path)
    try:
        res = run_health(cfg, hook="prolog", store=store, job_id="7")
        assert res.decision.outcome == "drain"
        assert store.query("select action, source from events") == [{"action": "drain", "source": "kernel_log"}]
        tables = {r["name"] for r in store.query("select name from sqlite_master where type = 'table'")}
        at = store.query("select at from findings")[0]["at"]
        hw_events, hw_findings = jobdata._load_hw(store, tables, "7", ["n1"], at - 60, at + 60)
        assert ([e["code"] for e in hw_events], [f["code"] for f in hw_findings]) == ([79], ["xid.79"])
    finally:
        store.close()
