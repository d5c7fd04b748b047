"""Maintenance: config windows (validated), MAINT reservations, and hooks that neither
drain nor alert for a node in maintenance."""

from __future__ import annotations

import os

import pytest
from conftest import node_snapshot

from gpuguard.config import ConfigError, from_dict
from gpuguard.ops.maintenance import maint_reservation, parse_reservations, parse_windows, status
from gpuguard.store import open_store

XID79 = "[  912.345678] NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"
WINDOW = ('[maintenance]\nslurm_reservations = false\nwindows = [{nodes = "n[1-2]", start = "2020-01-01T00:00:00Z", '
          'end = "2099-01-01T00:00:00+01:00", reason = "PSU swap"}]\n')
RES = ("ReservationName=maint_a StartTime=2026-11-30T18:00:00 EndTime=2026-11-30T20:00:00 Duration=02:00:00 "
       "Nodes=gpu[01-03] NodeCnt=3 CoreCnt=6 Features=(null) PartitionName=(null) Flags=MAINT,SPEC_NODES "
       "TRES=cpu=6 Users=root Groups=(null) Accounts=(null) Licenses=(null) State=ACTIVE BurstBuffer=(null) "
       "Watts=n/a MaxStartDelay=(null)\n"
       "ReservationName=train StartTime=2026-11-30T18:00:00 EndTime=2026-12-30T20:00:00 Duration=30-00:00:00 "
       "Nodes=gpu04 NodeCnt=1 CoreCnt=2 Features=(null) PartitionName=(null) Flags=SPEC_NODES "
       "TRES=cpu=2 Users=alice Groups=(null) Accounts=(null) Licenses=(null) State=ACTIVE BurstBuffer=(null) "
       "Watts=n/a MaxStartDelay=(null)\n")


def test_windows_are_validated_with_one_line_errors():
    w = parse_windows([{"nodes": "gpu[01-04]", "start": "2026-12-01T08:00:00Z", "end": "2026-12-01T12:00:00+01:00"}])
    assert (w[0].start_at, w[0].end_at) == (1796112000.0, 1796122800.0)
    for bad, msg in [
        ({"nodes": "gpu[01-04", "start": "2026-12-01T08:00:00Z", "end": "2026-12-02T08:00:00Z"},
         "window 1: nodes 'gpu[01-04': "),
        ({"nodes": "n1", "start": "2026-12-01T08:00:00", "end": "2026-12-02T08:00:00Z"},
         "window 1: start 2026-12-01T08:00:00 has no UTC offset (write Z or +01:00)"),
        ({"nodes": "n1", "start": "2026-12-02T08:00:00Z", "end": "2026-12-01T08:00:00Z"},
         "window 1: end is not after start"),
        ({"nodes": "n1", "start": "soon", "end": "2026-12-01T08:00:00Z"},
         "window 1: start 'soon' is not an ISO 8601 time"),
        ({"nodes": "n1", "start": "2026-12-01T08:00:00Z", "end": "2026-12-02T08:00:00Z", "why": 1},
         "window 1: unknown key(s) why"),
    ]:
        with pytest.raises(ConfigError) as e:
            from_dict({"maintenance": {"windows": [bad]}}, "t.toml")
        assert str(e.value).startswith("t.toml: maintenance.windows: " + msg), str(e.value)


def test_maint_reservation_parsing():
    rs = parse_reservations(RES)
    assert [r["ReservationName"] for r in rs] == ["maint_a", "train"]
    assert maint_reservation(rs, "gpu02")["ReservationName"] == "maint_a"
    assert maint_reservation(rs, "gpu04") is None  # a reservation without MAINT is not maintenance
    assert parse_reservations("No reservations in the system\n") == []


def test_status_from_reservation_text(make_config):
    _, cfg = make_config()
    m, errs = status(cfg, "gpu03", reservations_text=RES)
    assert errs == [] and m.active and m.source == "reservation maint_a"
    assert not status(cfg, "gpu05", reservations_text=RES)[0].active


@pytest.fixture
def prolog_node(tmp_path, make_config, write_replay, fake_slurm_bin):
    (tmp_path / "kern.log").write_text(XID79)
    _, cfg = make_config("[prolog]\nstart_collector = false\n" + WINDOW, replay=write_replay(node_snapshot(4)))
    return cfg, fake_slurm_bin


def test_prolog_in_a_window_records_but_neither_drains_nor_alerts(prolog_node, tmp_path):
    from gpuguard.prolog.hook import run

    cfg, calls = prolog_node
    rc = run({"SLURM_JOB_ID": "7", "SLURMD_NODENAME": "n1", "SLURM_JOB_GPUS": "0"})
    assert rc == 0
    assert calls() == []
    st = open_store(cfg.store_path)
    assert [r["code"] for r in st.query("select code from findings")] == ["xid.79"]
    rows = st.query("select action, by, outcome, why from node_actions")
    assert rows == [{"action": "suppressed", "by": "prolog", "outcome": "refused",
                     "why": "would drain: in maintenance (window: PSU swap) until 2098-12-31T23:00:00Z"}]
    assert not os.path.exists(tmp_path / "state" / "alerts.spool")


def test_epilog_in_a_window_does_not_drain(prolog_node):
    from gpuguard.epilog.hook import run

    _cfg, calls = prolog_node
    assert run({"SLURM_JOB_ID": "8", "SLURMD_NODENAME": "n1", "SLURM_JOB_GPUS": "0"}) == 0
    assert [c for c in calls() if c[:2] == ["scontrol", "update"]] == []


def test_prolog_outside_maintenance_queues_the_alert(tmp_path, make_config, write_replay, fake_slurm_bin):
    import json

    from gpuguard.prolog.hook import run

    (tmp_path / "kern.log").write_text(XID79 * 3)
    make_config("[prolog]\nstart_collector = false\n", replay=write_replay(node_snapshot(4)))
    assert run({"SLURM_JOB_ID": "7", "SLURMD_NODENAME": "n1", "SLURM_JOB_GPUS": "0"}) == 1
    lines = [json.loads(x) for x in (tmp_path / "state" / "alerts.spool").read_text().splitlines()]
    assert [(a["code"], a["node"], a["gpu_index"], a["count"], a["action"], a["source"], a["job_id"]) for a in lines] == [
        ("xid.79", "n1", 0, 3, "drain", "prolog", "7")]
    # the drain is a node action by the Prolog
    st = open_store(str(tmp_path / "node.db"))
    assert [(r["action"], r["by"], r["outcome"], r["recovery"]) for r in st.query("select * from node_actions")] == [
        ("drain", "prolog", "done", "reboot")]
