"""The collector's parts in process: cgroup discovery and reading, the /proc fallback,
job liveness, store failures, the row buffer bound, NVML XID events."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
from conftest import node_snapshot

from gpuguard.collector import host as host_mod
from gpuguard.collector.host import HostSampler, ProcScanner, find_job_cgroups, read_cgroup
from gpuguard.collector.run import (
    Collector,
    JobLiveness,
    RowBuffer,
    parse_gpu_list,
    scontrol_job_state,
    select_gpus,
)
from gpuguard.store import StoreError, open_store


def mk(path, files=None):
    path.mkdir(parents=True, exist_ok=True)
    for name, text in (files or {}).items():
        (path / name).write_text(text)
    return path


# -- GPUs ----------------------------------------------------------------------------------


def test_parse_and_select_gpus():
    assert parse_gpu_list("0, 2,GPU-AB,MIG-x,NoDevFiles,") == ([0, 2], ["GPU-AB"])
    assert parse_gpu_list(None) == ([], [])
    snap = node_snapshot(4)
    sel = select_gpus(snap, [3], ["gpu-00000000-0000-0000-0000-000000000001", "GPU-nope"])
    assert [g.index for g in sel] == [1, 3]


# -- cgroups and /proc ---------------------------------------------------------------------


def test_find_v1_prefers_this_node_and_uid(tmp_path):
    for top in ("slurm", "slurm_n1", "slurm_n2"):
        for ctrl in ("cpuacct", "memory"):
            mk(tmp_path / ctrl / top / "uid_1001" / "job_7")
    mk(tmp_path / "memory" / "slurm_n1" / "uid_5" / "job_7")
    mk(tmp_path / "memory" / "other" / "uid_1001" / "job_7")
    got = find_job_cgroups(str(tmp_path), "7", node="n1", uid=1001)
    assert got == [str(tmp_path / "cpuacct/slurm_n1/uid_1001/job_7"), str(tmp_path / "memory/slurm_n1/uid_1001/job_7")]
    assert find_job_cgroups(str(tmp_path), "7", node="n9", uid=1001)[0] == str(tmp_path / "cpuacct/slurm/uid_1001/job_7")
    assert find_job_cgroups(str(tmp_path), "8", node="n1") == []


def test_find_and_read_v2(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpu io memory\n")
    mk(tmp_path / "system.slice" / "slurmstepd.scope" / "job_9")
    job = mk(tmp_path / "system.slice" / "n1_slurmstepd.scope" / "job_9", {
        "cpu.stat": "usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n",
        "memory.stat": "anon 10485760\nfile 99999999\n",
        "memory.current": "123456789\n",
        "io.stat": "8:0 rbytes=1048576 wbytes=2097152 rios=3 wios=4 dbytes=0 dios=0\n"
                   "8:16 rbytes=1048576 wbytes=0 rios=1 wios=0 dbytes=0 dios=0\n",
    })
    assert find_job_cgroups(str(tmp_path), "9", node="n1") == [str(job)]
    c = read_cgroup([str(job)])
    assert (c.cpu_ns, c.rss_bytes, c.io_read_bytes, c.io_write_bytes) == (2_500_000_000, 10485760, 2097152, 2097152)
    (job / "memory.stat").unlink()
    assert read_cgroup([str(job)]).rss_bytes == 123456789


def test_read_v1_fallbacks_and_missing(tmp_path):
    d = mk(tmp_path / "m", {"memory.usage_in_bytes": "4096\n"})
    c = read_cgroup([str(d)])
    assert (c.cpu_ns, c.rss_bytes, c.io_read_bytes, c.io_write_bytes) == (None, 4096, None, None)


def test_proc_scanner_sums_own_processes_and_keeps_exited_cpu(tmp_path):
    ps = ProcScanner(os.getuid())
    c = ps.read()
    assert ps.count > 0 and os.getpid() in ps.pids()
    assert c.rss_bytes > 0 and c.cpu_ns > 0 and c.io_read_bytes is not None
    # a fake /proc: pid 10 exits between two reads, its CPU time stays in the total
    fake = tmp_path / "proc"
    uid = os.getuid()
    for pid, ticks in ((10, 100), (11, 50)):
        mk(fake / str(pid), {"stat": f"{pid} (py (x)) S 1 1 1 0 -1 0 0 0 0 0 {ticks} 0 0 0 20 0 1 0 {pid * 7} 0 0",
                             "statm": "100 25 0 0 0 0 0\n",
                             "io": "rchar: 9\nread_bytes: 4096\nwrite_bytes: 8192\n"})
    os.chown(fake / "10", uid, uid)
    ps = ProcScanner(uid, str(fake))
    c1 = ps.read()
    assert (ps.count, c1.cpu_ns, c1.rss_bytes) == (2, 150 * 10**9 // host_mod._CLK_TCK, 50 * host_mod._PAGE)
    for f in (fake / "10").iterdir():
        f.unlink()
    (fake / "10").rmdir()
    c2 = ps.read()
    assert (ps.count, c2.cpu_ns, c2.io_read_bytes, c2.io_write_bytes) == (1, c1.cpu_ns, 8192, 16384)


def test_host_sampler_falls_back_to_proc_without_cgroup(tmp_path):
    hs = HostSampler("5", "n1", uid=os.getuid(), cgroup_root=str(tmp_path))
    row = hs.sample()
    assert hs.mode == "proc" and row["rss_mib"] > 0 and row["cpu_pct"] is None
    assert hs.sample()["cpu_pct"] is not None
    none = HostSampler("5", "n1", cgroup_root=str(tmp_path)).sample()
    assert (none["cpu_pct"], none["rss_mib"], none["io_read_mib"]) == (None, None, None)


# -- liveness --------------------------------------------------------------------------------


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_liveness_by_cgroup(tmp_path):
    cg = mk(tmp_path / "job_1")
    lv = JobLiveness(HostSampler("1", "n1", dirs=[str(cg)]), job_id="1", scontrol=None)
    assert lv.check() == (True, "job cgroup present")
    cg.rmdir()
    assert lv.check() == (False, "job cgroup removed")


def test_liveness_by_processes_waits_for_startup_and_two_empty_checks(tmp_path):
    clock = Clock()
    hs = HostSampler("1", "n1", uid=54321, cgroup_root=str(tmp_path))
    lv = JobLiveness(hs, job_id="1", scontrol=None, startup_grace_s=60, clock=clock)
    assert lv.check()[0] and lv.check()[0]  # in the grace period: the batch script may not exist yet
    clock.t += 61
    assert lv.check() == (False, "no process of uid 54321 left")
    mine = JobLiveness(HostSampler("1", "n1", uid=os.getuid(), cgroup_root=str(tmp_path)), job_id="1",
                       scontrol=None, startup_grace_s=0, clock=clock)
    assert all(mine.check()[0] for _ in range(3))


def test_liveness_gives_up_without_any_sign_of_the_job(tmp_path):
    clock = Clock()
    answers = ["RUNNING"] + [None] * 50
    lv = JobLiveness(HostSampler("1", "n1", cgroup_root=str(tmp_path)), job_id="1", scontrol="/x/scontrol",
                     startup_grace_s=60, scontrol_every_s=30, no_evidence_s=600, clock=clock,
                     state_fn=lambda *_: answers.pop(0))
    clock.t += 61
    assert lv.check()[0]  # scontrol: RUNNING
    clock.t += 599
    assert lv.check()[0]  # slurmctld down for a while: keep going
    clock.t += 2
    assert lv.check() == (False, "no sign of the job for 601 s")


def test_liveness_asks_scontrol_rate_limited(tmp_path):
    clock = Clock()
    answers = ["RUNNING", None, "COMPLETED"]
    calls = []

    def state(scontrol, job_id):
        calls.append((scontrol, job_id))
        return answers.pop(0)

    hs = HostSampler("1", "n1", uid=os.getuid(), cgroup_root=str(tmp_path))  # our uid: always has processes
    lv = JobLiveness(hs, job_id="1", scontrol="/x/scontrol", startup_grace_s=10, scontrol_every_s=30,
                     clock=clock, state_fn=state)
    assert lv.check()[0] and calls == []  # grace
    clock.t += 11
    assert lv.check()[0] and len(calls) == 1
    clock.t += 5
    assert lv.check()[0] and len(calls) == 1  # rate limit
    clock.t += 30
    assert lv.check()[0] and len(calls) == 2  # scontrol could not answer: no decision
    clock.t += 30
    assert lv.check() == (False, "scontrol: JobState=COMPLETED")
    assert calls[0] == ("/x/scontrol", "1")


def test_scontrol_job_state_parses_real_output(tmp_path):
    """squeue -h -t all -j N -o %T as the testbed's Slurm 22.05 answers (the state alone,
    or ``Invalid job id`` on stderr once slurmctld forgot the job)."""
    sc = tmp_path / "scontrol"
    sq = tmp_path / "squeue"
    sc.write_text("#!/bin/sh\necho 'JobId=42 JobName=x JobState=COMPLETED UserId=a(1) JobState=RUNNING'\n")
    sc.chmod(0o755)

    def fake(out, rc=0, err=""):
        sq.write_text(f"#!/bin/sh\nprintf '%s' '{out}'\nprintf '%s' '{err}' >&2\nexit {rc}\n")
        sq.chmod(0o755)

    fake("RUNNING\n")
    assert scontrol_job_state(str(sc), "42") == "RUNNING"
    fake("COMPLETING\n")
    assert scontrol_job_state(str(sc), "42") == "COMPLETING"
    fake("CANCELLED\n")
    assert scontrol_job_state(str(sc), "42") == "CANCELLED"
    fake("", 1, "slurm_load_jobs error: Invalid job id specified\n")
    assert scontrol_job_state(str(sc), "42") == "UNKNOWN_JOB"
    fake("", 1, "slurm_load_jobs error: Unable to contact slurm controller (connect failure)\n")
    assert scontrol_job_state(str(sc), "42") is None
    fake("")
    assert scontrol_job_state(str(sc), "42") is None
    assert scontrol_job_state(str(tmp_path / "missing"), "42") is None


# -- buffering and the store ----------------------------------------------------------------


def test_row_buffer_drops_oldest_samples_first():
    b = RowBuffer(max_rows=5)
    b.add("events", [{"e": 1}])
    b.add("samples", [{"s": i} for i in range(6)])
    assert len(b) == 5 and b.dropped == 2
    assert [r["s"] for r in b.rows["samples"]] == [2, 3, 4, 5]
    assert list(b.rows["events"]) == [{"e": 1}]


class Source:
    def __init__(self, snap):
        self.snap = snap
        self.n = 0

    def snapshot(self):
        # one second apart: the store keys samples by millisecond, and the test loop is faster
        self.n += 1
        s = self.snap
        s.taken_at = time.time() + self.n
        return s


class Alive:
    def check(self):
        return True, "test"


def collector(tmp_path, open_store_fn, **kw):
    return Collector(job_id="3", node="n1", source=Source(node_snapshot(2)), gpus="1",
                     host=HostSampler("3", "n1", dirs=[str(tmp_path / "none")]), liveness=Alive(),
                     open_store=open_store_fn, interval_s=0.05, flush_s=0.1, log=logging.getLogger("t"), **kw)


def test_store_errors_keep_rows_and_retry(tmp_path):
    db = str(tmp_path / "node.db")
    fails = {"n": 3}

    def opener():
        if fails["n"]:
            fails["n"] -= 1
            raise StoreError("store x: database is locked")
        return open_store(db)

    c = collector(tmp_path, opener)
    for _ in range(3):
        c.sample_once()
        assert c.flush() is False
    assert len(c.buffer) == 6  # 3 x (1 GPU row + 1 host row)
    c.sample_once()
    assert c.flush() is True
    s = open_store(db)
    assert s.query("select count(*) n from samples where gpu_index = 1")[0]["n"] == 4
    assert s.query("select count(*) n from samples")[0]["n"] == 4
    assert s.query("select count(*) n from host_samples")[0]["n"] == 4
    assert c._store_failures == 0


def test_run_survives_an_unwritable_store_and_stops_on_request(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "node.db").mkdir()  # a directory where the database file should be: every open fails
    c = collector(tmp_path, lambda: open_store(str(ro / "node.db")), max_rows=7)
    threading.Timer(0.6, c.stop_event.set).start()
    assert c.run() == 0
    assert len(c.buffer) == 7 and c.buffer.dropped > 0 and c._store_failures >= 3


def test_xid_events_of_job_gpus_only(tmp_path):
    db = str(tmp_path / "node.db")

    class XidSource:
        closed = False

        def __init__(self):
            self.calls = 0

        def watch_xid_events(self, timeout_ms):
            self.calls += 1
            if self.calls == 1:
                return [(1, 79), (0, 13)]
            if self.calls == 2:
                raise RuntimeError("NVML hiccup")  # logged, retried later
            time.sleep(timeout_ms / 1000)
            return []

        def close(self):
            XidSource.closed = True

    c = collector(tmp_path, lambda: open_store(db), xid_source_factory=XidSource)
    threading.Timer(0.5, c.stop_event.set).start()
    assert c.run() == 0
    rows = open_store(db).query("select kind, code, gpu_index, gpu_uuid, job_id, source, node, action from events")
    assert rows == [{"kind": "xid", "code": 79, "gpu_index": 1, "gpu_uuid": "GPU-00000000-0000-0000-0000-000000000001",
                     "job_id": "3", "source": "nvml", "node": "n1", "action": "drain"}]
    assert XidSource.closed


def test_collector_rejects_bad_intervals(tmp_path):
    with pytest.raises(ValueError):
        Collector(job_id="1", node="n1", source=None, gpus="", host=HostSampler("1", "n1"), liveness=Alive(),
                  open_store=lambda: None, interval_s=0, flush_s=1)


def test_row_buffer_flush_keeps_rows_added_or_dropped_during_the_write():
    """The sampler thread adds rows while the main thread writes a flush's copy: those stay
    buffered; rows a full buffer dropped meanwhile were the copy's oldest, so no newer row
    is removed in their place."""
    b = RowBuffer(max_rows=6)
    b.add("samples", [("s", i) for i in range(4)])

    class Store:
        def __init__(self, during):
            self.during, self.got = during, None

        def insert_tables(self, batches):
            self.got = {t: list(r) for t, r in batches.items()}
            self.during()

    st = Store(lambda: b.add("samples", [("s", 4), ("s", 5)]))
    b.flush(st, threading.Lock())
    assert st.got == {"samples": [("s", i) for i in range(4)]}
    assert list(b.rows["samples"]) == [("s", 4), ("s", 5)] and len(b) == 2 and b.written["samples"] == 4

    st = Store(lambda: b.add("samples", [("s", i) for i in range(6, 11)]))  # 7 rows > 6: the oldest goes
    b.flush(st)
    assert st.got == {"samples": [("s", 4), ("s", 5)]}
    assert list(b.rows["samples"]) == [("s", i) for i in range(6, 11)] and len(b) == 5 and b.dropped == 1
