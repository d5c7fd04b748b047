"""The job's CPU, memory and I/O: from its cgroup, else from the job user's processes.

Cumulative counters are read each sample; :class:`HostSampler` turns them into one
``host_samples`` row: ``cpu_pct`` (CPU time over wall time since the previous sample,
x100: 100 = one CPU busy, 800 = eight; ``None`` on the first sample), ``rss_mib``
(anonymous resident memory now), ``io_read_mib`` / ``io_write_mib`` (block I/O bytes since
the job started, cumulative, MiB).

Files read (kernel documentation ``admin-guide/cgroup-v1/{cpuacct,memory,blkio-controller}.rst``
and ``admin-guide/cgroup-v2.rst``); whichever exist in the job's cgroup directories count:

======================  =====================================  ==========================
what                    cgroup v1                              cgroup v2
======================  =====================================  ==========================
CPU time (ns)           ``cpuacct.usage``                      ``cpu.stat`` ``usage_usec``
resident memory         ``memory.stat`` ``total_rss`` (else    ``memory.stat`` ``anon``
                        ``memory.usage_in_bytes``)             (else ``memory.current``)
block I/O bytes         ``blkio.throttle.io_service_bytes_     ``io.stat`` ``rbytes=``,
                        recursive`` ``Read``/``Write`` lines   ``wbytes=``
======================  =====================================  ==========================

Where Slurm puts the job's cgroup (Slurm 22.05 ``cgroup/v1`` and ``cgroup/v2`` plugins;
SLURM-FACTS §6g for several slurmd on one host):

* v1: ``{root}/{cpuacct,memory,blkio}/slurm[_NODE]/uid_UID/job_N`` (one per controller);
* v2 (``{root}/cgroup.controllers`` exists): ``{root}/system.slice/[NODE_]slurmstepd.scope/job_N``.

Without a job cgroup (``proctrack/linuxproc``, or a cgroup not created yet) the job user's
processes are summed from ``/proc``: ``/proc/PID/stat`` ``utime+stime`` (clock ticks),
``/proc/PID/statm`` resident pages, ``/proc/PID/io`` ``read_bytes``/``write_bytes`` (proc(5)).
That over-counts when the user has other work on the node. CPU time and I/O of processes
that exited are kept (their last value), so the totals stay cumulative.
"""

from __future__ import annotations

import glob
import os
import re
import time
from typing import Any

MIB = 1024 * 1024
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


#: path -> monotonic time until which it is known not to exist. The sampler reads
#: whichever of the cgroup v1/v2 files exist every interval; a missing one is asked again
#: only after :data:`MISSING_RECHECK_S` (a controller enabled later is picked up then).
_MISSING: dict[str, float] = {}
MISSING_RECHECK_S = 300.0


def _read(path: str) -> str | None:
    """The file's text (ASCII, bad bytes replaced), or None when it cannot be read. Plain
    ``os.read`` (no text-file object): the collector reads a few of these every second."""
    until = _MISSING.get(path)
    if until is not None and until > time.monotonic():
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        _MISSING[path] = time.monotonic() + MISSING_RECHECK_S
        return None
    except OSError:
        return None
    try:
        data = os.read(fd, 65536)
        if len(data) == 65536:  # a large file: read to the end (cgroup files are a few KiB)
            chunks = [data]
            while chunk := os.read(fd, 65536):
                chunks.append(chunk)
            data = b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data.decode("ascii", errors="replace")


def _kv(text: str | None, key: str) -> int | None:
    """Value of ``key`` in a ``key value`` per-line file (``memory.stat``, ``cpu.stat``)."""
    if not text:
        return None
    want = key + " "
    i = text.find(want)
    while i > 0 and text[i - 1] != "\n":  # "rss " inside "total_rss ": not at a line start
        i = text.find(want, i + 1)
    if i < 0:
        return None
    end = text.find("\n", i)
    v = text[i + len(want):end if end >= 0 else len(text)].strip()
    return int(v) if v.isdigit() else None


def find_job_cgroups(root: str, job_id: str, node: str | None = None, uid: int | None = None) -> list[str]:
    """The job's cgroup directories under ``root`` (see the module docstring), best match
    first per controller; ``[]`` when none exist. Where several slurmd share a host, the
    directory named for ``node`` wins over the plain ``slurm`` one."""
    job = f"job_{job_id}"
    if os.path.exists(os.path.join(root, "cgroup.controllers")):
        cands = glob.glob(os.path.join(root, "system.slice", "*slurmstepd.scope", job))
        cands += glob.glob(os.path.join(root, "*slurmstepd.scope", job))

        def rank2(p: str) -> int:
            scope = os.path.basename(os.path.dirname(p))
            return 0 if node and scope == f"{node}_slurmstepd.scope" else (1 if scope == "slurmstepd.scope" else 2)

        cands.sort(key=rank2)
        return cands[:1]
    out = []
    for ctrl in ("cpuacct", "memory", "blkio"):
        cands = glob.glob(os.path.join(root, ctrl, "slurm*", "uid_*", job))

        def rank1(p: str) -> tuple[int, int]:
            uid_dir = os.path.basename(os.path.dirname(p))
            top = os.path.basename(os.path.dirname(os.path.dirname(p)))
            node_rank = 0 if node and top == f"slurm_{node}" else (1 if top == "slurm" else 2)
            return node_rank, 0 if uid is not None and uid_dir == f"uid_{uid}" else 1

        cands = [p for p in cands if os.path.basename(os.path.dirname(os.path.dirname(p))).startswith("slurm")]
        if cands:
            out.append(min(cands, key=rank1))
    return out


def _io_v1(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    r = w = 0
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2].isdigit():
            if parts[1] == "Read":
                r += int(parts[2])
            elif parts[1] == "Write":
                w += int(parts[2])
    return r, w


_RBYTES = re.compile(r"\brbytes=(\d+)")
_WBYTES = re.compile(r"\bwbytes=(\d+)")


def _io_v2(text: str | None) -> tuple[int, int] | None:
    """``io.stat``: ``MAJ:MIN rbytes=N wbytes=N rios=N ...`` per device, summed."""
    if text is None:
        return None
    return sum(map(int, _RBYTES.findall(text))), sum(map(int, _WBYTES.findall(text)))


class Counters:
    """Cumulative readings: ``cpu_ns``, ``rss_bytes``, ``io_read_bytes``,
    ``io_write_bytes``; each ``None`` when no source had it."""

    __slots__ = ("cpu_ns", "io_read_bytes", "io_write_bytes", "rss_bytes")

    def __init__(self, cpu_ns: int | None = None, rss_bytes: int | None = None,
                 io_read_bytes: int | None = None, io_write_bytes: int | None = None):
        self.cpu_ns = cpu_ns
        self.rss_bytes = rss_bytes
        self.io_read_bytes = io_read_bytes
        self.io_write_bytes = io_write_bytes


#: The files :func:`read_cgroup` reads in a directory, in the order it tries them.
_CG_FILES = ("cpuacct.usage", "cpu.stat", "memory.stat", "memory.current", "memory.usage_in_bytes",
             "blkio.throttle.io_service_bytes_recursive", "io.stat")
#: dirs -> per directory the paths of :data:`_CG_FILES` (joined once: the collector reads
#: the same files every interval).
_PATHS: dict[tuple[str, ...], list[dict[str, str]]] = {}


def read_cgroup(dirs: list[str]) -> Counters:
    """Read the counters from whichever of the v1/v2 files exist in ``dirs``."""
    key = tuple(dirs)
    plan = _PATHS.get(key)
    if plan is None:
        if len(_PATHS) > 64:  # one job's directories per collector; bounded all the same
            _PATHS.clear()
        plan = _PATHS[key] = [{n: os.path.join(d, n) for n in _CG_FILES} for d in dirs]
    c = Counters()
    for p in plan:
        if c.cpu_ns is None:
            v = _read(p["cpuacct.usage"])
            if v is not None and v.strip().isdigit():
                c.cpu_ns = int(v)
            else:
                usec = _kv(_read(p["cpu.stat"]), "usage_usec")
                if usec is not None:
                    c.cpu_ns = usec * 1000
        if c.rss_bytes is None:
            st = _read(p["memory.stat"])
            c.rss_bytes = _kv(st, "total_rss")
            if c.rss_bytes is None:
                c.rss_bytes = _kv(st, "anon")
            if c.rss_bytes is None:
                for name in ("memory.current", "memory.usage_in_bytes"):
                    v = _read(p[name])
                    if v is not None and v.strip().isdigit():
                        c.rss_bytes = int(v)
                        break
        if c.io_read_bytes is None:
            io = _io_v1(_read(p["blkio.throttle.io_service_bytes_recursive"]))
            if io is None:
                io = _io_v2(_read(p["io.stat"]))
            if io is not None:
                c.io_read_bytes, c.io_write_bytes = io
    return c


class ProcScanner:
    """Sum the counters of every process whose ``/proc/PID`` is owned by ``uid``.

    ``count`` after :meth:`read` is the number of such processes (a liveness signal).
    Processes are keyed by (pid, start time) so a reused pid is a new process.
    """

    def __init__(self, uid: int, proc_root: str = "/proc"):
        self.uid = uid
        self.proc_root = proc_root
        self.count = 0
        self._last: dict[tuple[int, int], tuple[int, int, int]] = {}
        self._dead = [0, 0, 0]

    def pids(self) -> list[int]:
        """Pids owned by ``uid`` right now."""
        out = []
        try:
            it = os.scandir(self.proc_root)
        except OSError:
            return out
        with it:
            for e in it:
                if e.name.isdigit():
                    try:
                        if e.stat(follow_symlinks=False).st_uid == self.uid:
                            out.append(int(e.name))
                    except OSError:
                        continue  # exited while we looked
        return out

    def read(self) -> Counters:
        now: dict[tuple[int, int], tuple[int, int, int]] = {}
        rss = 0
        io_seen = False
        for pid in self.pids():
            base = os.path.join(self.proc_root, str(pid))
            stat_txt = _read(os.path.join(base, "stat"))
            if not stat_txt:
                continue
            fields = stat_txt[stat_txt.rfind(")") + 2:].split()
            try:
                # fields[0] is field 3 (state): utime=14, stime=15, starttime=22 (proc(5))
                cpu = int(fields[11]) + int(fields[12])
                start = int(fields[19])
            except (IndexError, ValueError):
                continue
            statm = _read(os.path.join(base, "statm"))
            if statm:
                parts = statm.split()
                if len(parts) > 1 and parts[1].isdigit():
                    rss += int(parts[1]) * _PAGE
            io = _read(os.path.join(base, "io"))
            rb = _kv_colon(io, "read_bytes")
            wb = _kv_colon(io, "write_bytes")
            io_seen = io_seen or rb is not None
            now[(pid, start)] = (cpu, rb or 0, wb or 0)
        for key, vals in self._last.items():
            if key not in now:
                for i in range(3):
                    self._dead[i] += vals[i]
        self._last = now
        self.count = len(now)
        tot = [self._dead[i] + sum(v[i] for v in now.values()) for i in range(3)]
        return Counters(
            cpu_ns=tot[0] * 1_000_000_000 // _CLK_TCK,
            rss_bytes=rss,
            io_read_bytes=tot[1] if io_seen or tot[1] else None,
            io_write_bytes=tot[2] if io_seen or tot[2] else None,
        )


def _kv_colon(text: str | None, key: str) -> int | None:
    if not text:
        return None
    for line in text.splitlines():
        k, _, v = line.partition(":")
        if k == key and v.strip().isdigit():
            return int(v)
    return None


class HostSampler:
    """One ``host_samples`` row per :meth:`sample` from the job's cgroup directories (found
    with :func:`find_job_cgroups`, or given as ``dirs``), else from :class:`ProcScanner`
    when ``uid`` is known, else all ``None``.

    ``dirs``: fixed cgroup directories (no discovery). ``cgroup_root``: where to look
    (``/sys/fs/cgroup``). Discovery is repeated by :meth:`discover` until it succeeds (the
    job's cgroup may appear only when its first step starts, after the prolog).
    """

    def __init__(self, job_id: str, node: str, *, uid: int | None = None,
                 cgroup_root: str = "/sys/fs/cgroup", dirs: list[str] | None = None,
                 proc_root: str = "/proc"):
        self.job_id = job_id
        self.node = node
        self.uid = uid
        self.cgroup_root = cgroup_root
        self.fixed = dirs is not None
        self.dirs: list[str] = list(dirs or [])
        self.procs = ProcScanner(uid, proc_root) if uid is not None else None
        self._prev: tuple[int, int] | None = None  # (monotonic ns, cpu ns)
        self._mode: str | None = None

    def discover(self) -> bool:
        """Look for the job's cgroup if not known yet; True when known."""
        if not self.dirs and not self.fixed:
            self.dirs = find_job_cgroups(self.cgroup_root, self.job_id, self.node, self.uid)
        return bool(self.dirs)

    def cgroup_exists(self) -> bool | None:
        """True/False when a cgroup is known (any of its directories still exists);
        ``None`` when there is none."""
        if not self.dirs:
            return None
        return any(os.path.isdir(d) for d in self.dirs)

    def sample(self) -> dict[str, Any]:
        """A ``host_samples`` row (``job_id, node, at, cpu_pct, rss_mib, io_read_mib,
        io_write_mib``)."""
        self.discover()
        c = read_cgroup(self.dirs) if self.dirs else None
        if c is not None and (c.cpu_ns is not None or c.rss_bytes is not None or c.io_read_bytes is not None
                              or self.cgroup_exists()):  # a stat only when nothing could be read
            mode = "cgroup"
        elif self.procs is not None:
            mode = "proc"
            c = self.procs.read()
        else:
            mode = "none"
            c = Counters()
        if mode != self._mode:
            self._prev = None  # counters from another source are not comparable
            self._mode = mode
        mono = time.monotonic_ns()
        cpu_pct = None
        if c.cpu_ns is not None:
            if self._prev is not None and mono > self._prev[0]:
                cpu_pct = max(0.0, (c.cpu_ns - self._prev[1]) * 100.0 / (mono - self._prev[0]))
            self._prev = (mono, c.cpu_ns)
        return {
            "job_id": self.job_id, "node": self.node, "at": time.time(),
            "cpu_pct": None if cpu_pct is None else round(cpu_pct, 2),
            "rss_mib": None if c.rss_bytes is None else c.rss_bytes / MIB,
            "io_read_mib": None if c.io_read_bytes is None else c.io_read_bytes / MIB,
            "io_write_mib": None if c.io_write_bytes is None else c.io_write_bytes / MIB,
        }

    @property
    def mode(self) -> str | None:
        """``"cgroup"``, ``"proc"`` or ``"none"``: where the last sample came from."""
        return self._mode
