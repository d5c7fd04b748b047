"""The cases of the fault-injection matrix (:mod:`fault_matrix`). Each returns None when
its own check holds, else one line saying what did not."""

from __future__ import annotations

import json
import os
import subprocess
import time

from fault_matrix import (
    BUDGET_S,
    SPOOF_SYSLOG,
    XID79,
    XID79_KERNEL_ONLY,
    Case,
    Node,
    can_fuse,
    can_mount,
    hold_lock,
    hung_fs,
    mounted,
)


def _cfg(n: Node) -> str:
    """The node's config path, as its collectors carry it in ``--config``."""
    return str(n.root / "etc" / "gpuguard.toml")


def _first(*checks: str | None) -> str | None:
    return next((c for c in checks if c), None)


def _expect(cond: bool, why: str) -> str | None:
    return None if cond else why


# -- kernel log and spoofing ---------------------------------------------------------------

def healthy(n: Node) -> str | None:
    a = n.hook("prolog", "1")
    b = n.hook("epilog", "1")
    return _expect((a.rc, b.rc) == (0, 0), f"rcs {a.rc},{b.rc}")


def xid79_then_two_more_jobs(n: Node) -> str | None:
    n.log_kernel(XID79)
    rcs = [n.hook("prolog", "1").rc]
    n.resume()  # repaired and resumed: the same XID must not drain it again
    rcs += [n.hook("prolog", "2").rc, n.hook("epilog", "2").rc]
    return _expect(rcs == [1, 0, 0], f"rcs {rcs}")


def xid79_kernel_prefix_only(n: Node) -> str | None:
    n.log_kernel(XID79_KERNEL_ONLY)
    return _expect(n.hook("prolog", "1").rc == 1, "XID 79 behind 'kernel:' not acted on")


def xid79_during_job_epilog(n: Node) -> str | None:
    n.hook("prolog", "1")
    n.log_kernel(XID79)
    n.hook("epilog", "1")
    return _expect("gpuguard: xid.79" in (n.root / "drains.log").read_text(), "epilog did not drain xid.79")


def spoof_logger_in_syslog(n: Node) -> str | None:
    # /var/log/syslog of all facilities: any user's `logger -t kernel` lands in it
    n.log_kernel(SPOOF_SYSLOG + "NVRM: Xid (PCI:0000:3a:00): 48, pid=1, name=x, DBE\n")
    a = n.hook("prolog", "1")
    rows = n.query("select code, action from findings order by code")
    return _first(_expect(a.rc == 0, f"prolog rc {a.rc}"),
                  _expect(rows == [("xid.48", "alert"), ("xid.79", "alert")], f"findings {rows}"))


def spoof_user_text_in_kernel_only_file(n: Node) -> str | None:
    n.log_kernel("Nov 30 03:40:01 n1 alice: NVRM: Xid (PCI:0000:3a:00): 79, pid=1, name=x, spoof\n"
                 '[ 5013.2] audit: type=1400 name="/tmp/NVRM: Xid (PCI:0000:3a:00): 79, pid=1, name=x, y"\n')
    a = n.hook("prolog", "1")
    return _first(_expect(a.rc == 0, f"prolog rc {a.rc}"),
                  _expect("XID/SXid line(s) not accepted: 2 (not a kernel-log prefix" in n.log(),
                          "rejected lines not logged with their reasons"))


def spoof_userspace_kmsg(n: Node) -> str | None:
    # the real attack on the structured source: a userspace write to /dev/kmsg (facility
    # user); the marker PCI address is one no GPU here has
    with open("/dev/kmsg", "w") as fh:
        fh.write("NVRM: Xid (PCI:0000:fe:00): 79, pid=1, name=gpuguard-fault-matrix, spoofed by userspace\n")
    a = n.hook("prolog", "1")
    return _expect(a.rc == 0, f"prolog rc {a.rc}")


# -- the store -----------------------------------------------------------------------------

def store_locked(n: Node, xid: bool) -> str | None:
    n.hook("prolog", "0")  # create the store
    if xid:
        n.log_kernel(XID79)
    hold_lock(n.root / "node.db", BUDGET_S + 8)
    a = n.hook("prolog", "1")
    n.resume()
    b = n.hook("epilog", "1")
    return _expect(a.rc == (1 if xid else 0) and b.rc == 0, f"rcs {a.rc},{b.rc}")


def store_corrupt(n: Node, xid: bool) -> str | None:
    (n.root / "node.db").write_bytes(b"garbage" * 100)
    if xid:
        n.log_kernel(XID79)
    rcs = [n.hook("prolog", "1").rc]
    n.resume()
    rcs += [n.hook("epilog", "1").rc, n.hook("prolog", "2").rc]
    return _first(_expect(rcs == ([1, 0, 0] if xid else [0, 0, 0]), f"rcs {rcs}"),
                  _expect((n.root / "node.db").read_bytes().startswith(b"garbage"), "corrupt store overwritten"))


def store_readonly(n: Node) -> str | None:
    # store and state_dir on a read-only mount (the cursor's disk copy cannot move)
    n.hook("prolog", "0")
    ro = n.root / "ro"
    with mounted(ro, ["--bind", str(n.root / "state")]):
        subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True, capture_output=True)
        n.state_dir = str(ro)
        n.write_config()
        n.log_kernel(XID79)
        rcs = [n.hook("prolog", "1").rc]
        n.resume()
        rcs += [n.hook("epilog", "1").rc, n.hook("prolog", "2").rc, n.hook("epilog", "2").rc]
    return _expect(rcs == [1, 0, 0, 0], f"rcs {rcs}")


def store_full(n: Node) -> str | None:
    full = n.root / "full"
    with mounted(full, ["-t", "tmpfs", "-o", "size=256k", "tmpfs"]):
        n.store, n.state_dir = str(full / "node.db"), str(full / "state")
        n.write_config()
        n.hook("prolog", "0")
        fd = os.open(full / "filler", os.O_WRONLY | os.O_CREAT)
        try:  # fill what is left
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        n.log_kernel(XID79)
        rcs = [n.hook("prolog", "1").rc]
        n.resume()
        rcs += [n.hook("epilog", "1").rc, n.hook("prolog", "2").rc]
    return _expect(rcs == [1, 0, 0], f"rcs {rcs}")


def store_hung(n: Node, xid: bool) -> str | None:
    # the store's filesystem hangs (a FUSE mount that never answers: processes touching it
    # sit in state D, as on a dead NFS server)
    with hung_fs(n.root / "hung") as mnt:
        n.store = str(mnt / "node.db")
        n.write_config()
        if xid:
            n.log_kernel(XID79)
        a = n.hook("prolog", "1")
        b = n.hook("epilog", "1")
        log = n.log()
    return _first(_expect((a.rc, b.rc) == ((1 if xid else 0), 0), f"rcs {a.rc},{b.rc}"),
                  _expect("exceeded its time budget" in log, "the store did not hang"))


# -- GPUs ----------------------------------------------------------------------------------

def pynvml_missing(n: Node) -> str | None:
    # gpuguard's own install problem (nvidia-ml-py not importable): a tool error, never a drain
    a = n.hook("prolog", "1", nvml={"missing": True})
    return _first(_expect(a.rc == 0, f"prolog rc {a.rc}"),
                  _expect("tool error: GPU source: pynvml not importable" in n.log(), "no tool error logged"))


def nvml_library_missing(n: Node) -> str | None:
    # libnvidia-ml cannot be loaded on a node whose gres gives the job GPUs (no driver):
    # the node cannot run GPU jobs; DCGM/NHC fail such a node, and so does gpuguard
    a = n.hook("prolog", "1")
    return _expect(a.rc == 1 and "gpu.driver_unusable" in (n.root / "drains.log").read_text(), f"rc {a.rc}")


def nvml_hung(n: Node) -> str | None:
    # one GPU's NVML call never returns: that GPU is lost (a driver/GPU fault: drain), and
    # the prolog still ends within its budget
    a = n.hook("prolog", "1", nvml={"hang": [["nvmlDeviceGetTemperature", 1]]})
    return _expect(a.rc == 1 and "gpu.lost gpu1" in (n.root / "drains.log").read_text(), f"prolog rc {a.rc}")


# -- config ----------------------------------------------------------------------------------

def config_broken_between_hooks(n: Node) -> str | None:
    n.extra_toml = ""
    n.write_config(n.root.joinpath("etc", "gpuguard.toml").read_text().replace("start_collector = false",
                                                                                "start_collector = true"))
    a = n.hook("prolog", "1")
    from gpuguard.collector.scan import find_collector_pids

    started = bool(find_collector_pids("1", config=_cfg(n)))
    (n.root / "etc" / "gpuguard.toml").write_text("[gpu\nsource = 'cuda'\n")  # broken TOML
    n.log_kernel(XID79)
    b = n.hook("epilog", "1")
    gone = not find_collector_pids("1", config=_cfg(n))
    return _first(_expect((a.rc, b.rc) == (0, 0), f"rcs {a.rc},{b.rc}"), _expect(started, "no collector started"),
                  _expect(gone, "collector left running"))


def config_dangling(n: Node) -> str | None:
    cfg = n.root / "etc" / "gpuguard.toml"
    cfg.unlink()
    cfg.symlink_to(n.root / "etc" / "missing.toml")
    n.log_kernel(XID79)
    rcs = [n.hook("prolog", "1").rc, n.hook("epilog", "1").rc]
    return _expect(rcs == [0, 0], f"rcs {rcs}")


# -- collector, epilog, clocks, job files ----------------------------------------------------

def collector_sigkill(n: Node) -> str | None:
    import signal

    from gpuguard.collector.scan import find_collector_pids

    n.write_config(n.root.joinpath("etc", "gpuguard.toml").read_text().replace("start_collector = false",
                                                                                "start_collector = true"))
    n.hook("prolog", "1")
    deadline = time.monotonic() + 20
    while len(find_collector_pids("1", config=_cfg(n))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = find_collector_pids("1", config=_cfg(n))
    sup = int((n.root / "state" / "collector.1.pid").read_text())
    child = [p for p in pids if p != sup]
    if not child:
        return f"no collector child ({pids})"
    os.kill(child[0], signal.SIGKILL)
    killed = time.monotonic()
    while time.monotonic() - killed < 5:
        now = [p for p in find_collector_pids("1", config=_cfg(n)) if p not in (sup, child[0])]
        if now:
            break
        time.sleep(0.05)
    back_s = time.monotonic() - killed
    time.sleep(1.0)
    b = n.hook("epilog", "1")
    rows = n.query("select summary from job_summaries where job_id = '1'")
    s = json.loads(rows[0][0]) if rows else {}
    return _first(_expect(b.rc == 0, f"epilog rc {b.rc}"),
                  _expect(back_s <= 2 * 0.5 + 0.5, f"restarted after {back_s:.2f} s (interval 0.5 s)"),
                  _expect(s.get("collector_restarts") == 1 and 0 < (s.get("collector_down_s") or 0) < 1.0,
                          f"summary restarts={s.get('collector_restarts')} down={s.get('collector_down_s')}"),
                  _expect(not find_collector_pids("1", config=_cfg(n)), "collector left running"))


def _job_with_records(n: Node, job_id: str) -> None:
    n.hook("prolog", job_id)
    lines = "".join(json.dumps({"v": 1, "kind": "step", "rank": 0, "step": k, "t": time.time(), "step_time_s": 0.5,
                                "samples": 32}) + "\n" for k in range(1, 11))
    n.make_job_dir(job_id, {"train.rank0.jsonl": lines})
    from gpuguard.store import open_store

    s = open_store(str(n.root / "node.db"))
    s.insert_many("samples", [{"job_id": job_id, "node": "n1", "at": time.time() + i, "gpu_index": 0,
                               "gpu_util_pct": 90.0} for i in range(6)])
    s.close()


def _summary_state(n: Node, job_id: str) -> tuple:
    steps = n.query("select count(*) from steps where job_id = ?", (job_id,))[0][0]
    rows = n.query("select created_at, sample_count, step_records, collector_status from job_summaries "
                   "where job_id = ?", (job_id,))
    return steps, rows


def epilog_twice(n: Node) -> str | None:
    _job_with_records(n, "5")
    n.hook("epilog", "5")
    first = _summary_state(n, "5")
    n.hook("epilog", "5")
    second = _summary_state(n, "5")
    return _first(_expect(first[0] == 10 and first[1][0][1:] == (6, 10, "never_started"), f"first {first}"),
                  _expect(second == first, f"second epilog changed the records: {first} -> {second}"))


def epilog_concurrent(n: Node) -> str | None:
    _job_with_records(n, "6")
    runs = n.concurrently([("epilog", "6"), ("epilog", "6")])
    st = _summary_state(n, "6")
    return _first(_expect([r.rc for r in runs] == [0, 0], f"rcs {[r.rc for r in runs]}"),
                  _expect(st[0] == 10 and len(st[1]) == 1 and st[1][0][1:3] == (6, 10), f"records {st}"))


def clock_step_back(n: Node) -> str | None:
    n.hook("prolog", "7")
    from gpuguard.store import open_store

    now = time.time()
    s = open_store(str(n.root / "node.db"))
    # 48 samples at 10 s; the clock steps back one hour after the 12th
    s.insert_many("samples", [{"job_id": "7", "node": "n1", "gpu_index": 0, "gpu_util_pct": 80.0,
                               "at": now + 10 * i - (3600 if i >= 12 else 0)} for i in range(48)])
    s.close()
    b = n.hook("epilog", "7")
    rows = n.query("select sample_count from job_summaries where job_id = '7'")
    return _first(_expect(b.rc == 0, f"epilog rc {b.rc}"), _expect(rows == [(48,)], f"sample_count {rows}"))


def hostile_job_files(n: Node) -> str | None:
    n.hook("prolog", "8")
    d = n.make_job_dir("8", {"train.rank0.jsonl": "{not json\n" * 100})
    (d / "train.rank1.jsonl").symlink_to("/etc/shadow")
    os.mkfifo(d / "train.rank2.jsonl")
    with open(d / "train.rank3.jsonl", "wb") as fh:  # 2 GiB sparse
        fh.truncate(2 * 2**30)
    os.chown(d / "train.rank3.jsonl", 1001, 1001)
    os.link("/etc/hostname", d / "train.rank4.jsonl")
    b = n.hook("epilog", "8")
    rows = n.query("select summary from job_summaries where job_id = '8'")
    s = json.loads(rows[0][0]) if rows else {}
    return _first(_expect(b.rc == 0, f"epilog rc {b.rc}"),
                  _expect(len(s.get("rejected_files") or []) >= 2 and s.get("records_truncated"),
                          f"rejected {s.get('rejected_files')} truncated {s.get('records_truncated')}"),
                  _expect(not d.exists(), "job dir left behind"))


# -- Slurm commands ---------------------------------------------------------------------------

def scontrol_hung(n: Node) -> str | None:
    n.log_kernel(XID79)
    n.set_mode("scontrol", "hang")
    a = n.hook("prolog", "1")
    n.set_mode("scontrol", "ok")
    b = n.hook("prolog", "2")  # slurmctld answers again: the pending drain goes through
    n.resume()
    c = n.hook("prolog", "3")
    return _expect([a.rc, b.rc, c.rc] == [1, 0, 0], f"rcs {[a.rc, b.rc, c.rc]}")


def scontrol_failing(n: Node) -> str | None:
    n.log_kernel(XID79)
    n.set_mode("scontrol", "fail")
    a = n.hook("epilog", "1")  # the epilog saw the XID; slurmctld is down
    b = n.hook("epilog", "2")
    n.set_mode("scontrol", "ok")
    c = n.hook("prolog", "3")
    n.resume()
    d = n.hook("prolog", "4")
    if d.rc != 0:
        return f"drained again after resume (rc {d.rc})"
    pending = json.loads((n.root / "state" / "pending_drains.json").read_text())["value"]
    return _first(_expect([a.rc, b.rc, c.rc] == [0, 0, 0], f"rcs {[a.rc, b.rc, c.rc]}"),
                  _expect(pending == {}, f"still pending: {pending}"))


def sacctmgr_hung(n: Node) -> str | None:
    # nothing in the Prolog/Epilog calls sacctmgr; a hung one must change nothing
    n.set_mode("sacctmgr", "hang")
    n.log_kernel(XID79)
    rcs = [n.hook("prolog", "1").rc, n.hook("epilog", "1").rc]
    return _expect(rcs == [1, 0], f"rcs {rcs}")


def xid79_four_prologs_at_once(n: Node) -> str | None:
    """Four hooks start together on a node with one new XID 79: one reads it (the
    kernel-log cursor lock, gpuguard.cursorlock), so it is drained and recorded once."""
    n.log_kernel(XID79)
    runs = n.concurrently([("prolog", str(20 + i)) for i in range(4)])
    events = n.query("select count(*) from events where code = 79")
    return _first(_expect(sorted(r.rc for r in runs) == [0, 0, 0, 1], f"rcs {[r.rc for r in runs]}"),
                  _expect(events == [(1,)], f"XID 79 recorded {events} times"))


def eight_concurrent_jobs(n: Node) -> str | None:
    n.write_config(n.root.joinpath("etc", "gpuguard.toml").read_text().replace("start_collector = false",
                                                                                "start_collector = true"))
    jobs = [str(100 + i) for i in range(8)]
    pro = n.concurrently([("prolog", j) for j in jobs])
    time.sleep(1.5)
    epi = n.concurrently([("epilog", j) for j in jobs])
    rows = n.query("select count(distinct job_id) from job_summaries")
    from gpuguard.collector.scan import find_collector_pids

    left = [j for j in jobs if find_collector_pids(j, config=_cfg(n))]
    return _first(_expect([r.rc for r in pro + epi] == [0] * 16, f"rcs {[r.rc for r in pro + epi]}"),
                  _expect(rows == [(8,)], f"summaries {rows}"), _expect(not left, f"collectors left: {left}"))


CASES: list[Case] = [
    Case("healthy node", 0, healthy),
    Case("XID 79, then 2 more jobs", 1, xid79_then_two_more_jobs),
    Case("XID 79 behind 'kernel:' only", 1, xid79_kernel_prefix_only),
    Case("XID 79, 4 Prologs at once", 1, xid79_four_prologs_at_once),
    Case("XID 79 during the job (epilog)", 1, xid79_during_job_epilog),
    Case("spoof: logger -t kernel in syslog", 0, spoof_logger_in_syslog, {"kernel_only": False}),
    Case("spoof: user text in kern.log", 0, spoof_user_text_in_kernel_only_file),
    Case("spoof: userspace write to /dev/kmsg", 0, spoof_userspace_kmsg, {"kernel_log": "kmsg"}),
    Case("store locked, healthy", 0, lambda n: store_locked(n, False)),
    Case("store locked, XID 79", 1, lambda n: store_locked(n, True)),
    Case("store corrupt, healthy", 0, lambda n: store_corrupt(n, False)),
    Case("store corrupt, XID 79", 1, lambda n: store_corrupt(n, True)),
    Case("store + state read-only, XID 79", 1, store_readonly, needs_root_mounts=True),
    Case("store + state full, XID 79", 1, store_full, needs_root_mounts=True),
    Case("store fs hung (D state), healthy", 0, lambda n: store_hung(n, False), needs_root_mounts=True),
    Case("store fs hung (D state), XID 79", 1, lambda n: store_hung(n, True), needs_root_mounts=True),
    Case("pynvml missing (our install)", 0, pynvml_missing, {"gpu_source": "nvml"}),
    Case("NVML library missing (no driver)", 1, nvml_library_missing, {"gpu_source": "nvml"}),
    Case("NVML hung on one GPU", 1, nvml_hung, {"gpu_source": "nvml"}),
    Case("config broken between hooks", 0, config_broken_between_hooks),
    Case("config dangling symlink", 0, config_dangling),
    Case("collector SIGKILL", 0, collector_sigkill),
    Case("epilog twice", 0, epilog_twice),
    Case("epilog concurrent", 0, epilog_concurrent),
    Case("clock step back 1 h", 0, clock_step_back),
    Case("hostile job files", 0, hostile_job_files),
    Case("scontrol hung, XID 79", 1, scontrol_hung),
    Case("scontrol failing, XID 79", 1, scontrol_failing),
    Case("sacctmgr hung, XID 79", 1, sacctmgr_hung),
    # 16 Python hook processes and 8 collectors on 2 shared cores: the default-sized budget
    Case("8 concurrent jobs (budget 10 s)", 0, eight_concurrent_jobs, {"budget_s": 10.0}),
]


def selected(names: list[str] | None = None) -> list[Case]:
    """The cases to run: all (minus mount cases where mounting is impossible, and the kmsg
    spoof where /dev/kmsg is not writable), or those whose name contains a given word."""
    out = []
    for c in CASES:
        if c.needs_root_mounts and not (can_mount() and can_fuse()):
            continue
        if c.run is spoof_userspace_kmsg and not os.access("/dev/kmsg", os.W_OK):
            continue
        if names and not any(w in c.name for w in names):
            continue
        out.append(c)
    return out

