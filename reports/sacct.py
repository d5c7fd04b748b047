"""Parse Slurm accounting output (``sacct -P``/``-p`` and ``sacct --json``) into cache rows.

Field meanings and job states follow the sacct man page (Slurm 22.05 and 24.11,
https://slurm.schedmd.com/sacct.html, "Job Accounting Fields" and "Job State Codes");
the JSON shapes are those of Slurm's ``openapi/dbv0.0.38`` plugin (22.05: plain
integers, ``state.current`` a string, NO_VAL as ``null``) and ``data_parser/v0.0.41``
(24.11: ``{"set", "infinite", "number"}`` wrappers, ``state.current`` a list).

One parsed job is a :class:`dict` with the keys of :data:`COLUMNS` (the ``sacct_jobs``
cache table of the cluster store). Times are UTC epoch seconds (float) or ``None``;
``elapsed_s`` is whole seconds; ``gpus`` an int (0 when the job holds no GPU).

Rules (each with its reason):

* GPUs come from AllocTRES. ``gres/gpu=N`` is the count; typed entries
  ``gres/gpu:TYPE=N`` (MIG slices too: ``gres/gpu:a100_3g.20gb=1``) give the type and,
  only when the untyped entry is absent, the count: Slurm lists both forms for the same
  GPUs when ``AccountingStorageTRES`` names both, so adding them would double count.
  ``gres/gpumem`` and ``gres/gpuutil`` are not GPUs. Several types: ``gpu_type`` is
  their sorted names joined by ``,``.
* ``Unknown``, ``None`` and empty times are ``None`` (sacct prints them for jobs that
  have not reached that point).
* ``CANCELLED by 1234`` is state ``CANCELLED`` (the raw text stays in ``state_raw``).
* sacct prints wall-clock times in the timezone of the sacct process (``TZ``), without
  an offset; :class:`TimeConverter` turns them into UTC epoch seconds with an explicit
  zone (DST-ambiguous wall-clock times take the first occurrence, ``fold=0``).
* Step rows (``123.batch``, ``123_4.0``, ``123+1.extern``) are skipped: reports count
  jobs (``sacct -X``).
* ``sacct --json`` of 22.05 (dbv0.0.38) reports every non-zero exit as
  ``{"status": "SUCCESS", "return_code": 0}`` (SLURM-FACTS §6d), so its exit codes are
  ``None`` (unknown) unless the job was signalled; exit codes come from ``-P`` output.
* Impossible values make the row malformed (reported with its line, not stored), never
  the whole import: an integer outside SQLite's signed 64 bits, a GPU, CPU or node count
  below 0 or above :data:`MAX_COUNT`, an elapsed time below 0 or above
  :data:`MAX_ELAPSED_S`, a time after 9999-12-31T23:59:59 UTC, a Start after the End.
* A ``|`` inside JobName or Comment (set by the job's owner: ``--job-name``,
  ``--comment``; sacct does not escape its delimiter) gives a ``-P`` row more fields than
  the header. Such a row is rebuilt, not dropped (:func:`rebuild_row`): the fields left of
  the first free-text column and right of the last one are where they should be; the
  extra delimiters belong to the free-text columns (:data:`FREE_TEXT_FIELDS`) in the
  header. With one free-text column, the fields between are that column's text, joined
  back with the delimiter. With two (JobName and Comment), each way of sharing the extra
  delimiters between them is parsed; the readings that give a valid row are kept. The
  true reading is always among them, so one valid reading is the row. Several valid
  readings: the row is ambiguous; when they agree on every other field (account, times,
  TRES...) it is stored with JobName and Comment unknown (``None``) and its usage
  counted, with a note for the caller; when they disagree on the usage itself, nothing
  tells the true one from a forged one, so the row is malformed (reported, not guessed).
"""

from __future__ import annotations

import calendar
import csv
import itertools
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, tzinfo

from gpuguard.output import ZoneError, iso_time, resolve_zone

from gpuguard.reports.gpucount import GpuCount
from gpuguard.reports.gpucount import resolve as resolve_gpus

#: Columns of the ``sacct_jobs`` cache table, in order (see :mod:`gpuguard.reports.schema`).
COLUMNS = (
    "cluster", "job_id_raw", "job_id", "array_job_id", "array_task_id", "het_job_id", "het_job_offset",
    "job_name", "user", "account", "partition", "qos",
    "submit_at", "eligible_at", "start_at", "end_at", "elapsed_s", "usage_end_at", "charge_s", "wait_s",
    "submit_wait_s",
    "state", "state_raw", "exit_code", "exit_signal",
    "gpus", "gpu_type", "cpus", "alloc_tres", "nnodes", "node_list",
    "comment", "admin_comment", "template", "synced_at", "source",
    "attempt_at", "gpu_source", "time_limit_s",
)

#: The ``--format`` a live sync asks sacct for (``sacct -a -X -P -n --format=...``).
SACCT_FIELDS = (
    "JobIDRaw", "JobID", "Cluster", "JobName", "User", "Account", "Partition", "QOS",
    "Submit", "Eligible", "Start", "End", "ElapsedRaw", "State", "ExitCode",
    "AllocTRES", "AllocCPUS", "NNodes", "NodeList", "Comment", "AdminComment",
    "ReqTRES", "TimelimitRaw",
)

#: States after which sacct's record no longer changes (sacct man page, JOB STATE CODES).
FINAL_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
    "BOOT_FAIL", "DEADLINE", "REVOKED",
})
#: States a later sync may still change (``PENDING``, ``RUNNING``, ``REQUEUED``, ``SUSPENDED``...).
ACTIVE_STATES = frozenset({"PENDING", "RUNNING", "REQUEUED", "RESIZING", "SUSPENDED", "COMPLETING",
                           "CONFIGURING", "STOPPED", "SIGNALING", "STAGE_OUT", "SPECIAL_EXIT",
                           "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "RESIZE"})

#: SQLite's INTEGER range (signed 64-bit): a larger value cannot be stored.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
#: Most GPUs, CPUs or nodes one job can hold (far above the largest cluster; beyond it a
#: count is garbage that would swamp every total).
MAX_COUNT = 1_000_000
#: Longest elapsed time taken (100 years).
MAX_ELAPSED_S = 100 * 366 * 86400
#: Times stored lie in 0001-01-01T00:00:00 .. 9999-12-31T23:59:59 UTC (what datetime, and
#: so every report, can print).
MIN_TIME, MAX_TIME = -62135596800.0, 253402300799.0
#: sacct fields a job's owner writes free text into (lower-cased): a ``|`` in them is not
#: escaped by ``sacct -P`` (see :func:`rebuild_row`).
FREE_TEXT_FIELDS = ("jobname", "comment", "submitline")
#: A row with more extra fields than this is malformed instead of rebuilt.
MAX_EXTRA_FIELDS = 1000

_JOBID_RE = re.compile(r"^(\d+)(?:_(\d+|\[[^\]]*\]))?(?:\+(\d+))?(\.\S+)?$", re.ASCII)
_ELAPSED_RE = re.compile(r"^(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)(?:\.\d+)?$", re.ASCII)
_INT_RE = re.compile(r"^[+-]?[0-9]+$", re.ASCII)
_DIGITS_RE = re.compile(r"^[0-9]+$", re.ASCII)
_UNSET_TIMES = {"", "Unknown", "None", "N/A", "0"}


class SacctParseError(ValueError):
    """A whole input could not be read as sacct output; ``str()`` is one line naming the
    source (and line, where there is one)."""


class RowError(ValueError):
    """One row is malformed; the caller reports it with its line number and skips it."""


@dataclass
class ParsedRow:
    """One parse outcome: a job (``job`` set), a skipped step (``step`` true), or a
    malformed row (``error`` set). ``line`` is 1-based in the input (for JSON: the
    1-based index of the job in ``jobs[]``)."""

    line: int
    job: dict | None = None
    step: bool = False
    error: str | None = None
    #: Set on a stored row the caller should hear about (JobName/Comment unknown).
    note: str | None = None


# --- integers ---------------------------------------------------------------------------
def _short(s: str, n: int = 32) -> str:
    """``s`` for a one-line message: at most ``n`` characters."""
    s = s.strip()
    return s if len(s) <= n else s[:n] + "..."


def parse_int(s: str, what: str, lo: int = INT64_MIN, hi: int = INT64_MAX) -> int:
    """ASCII decimal ``s`` -> int in ``lo..hi``. Raises :class:`RowError` naming ``what``
    otherwise (not an integer, negative, too large); never converts a 5000-digit string."""
    t = s.strip()
    if len(t) <= 18 and t.isdigit() and t.isascii():  # the common case, fast
        n = int(t)
        if lo <= n <= hi:
            return n
    elif not _INT_RE.match(t):
        raise RowError(f"{what} {_short(s)!r} is not an integer")
    n = int(t) if len(t) <= 40 else (INT64_MAX + 1 if t[0] != "-" else INT64_MIN - 1)
    return check_int(n, what, lo, hi, shown=t)


def check_int(n: int, what: str, lo: int = INT64_MIN, hi: int = INT64_MAX, shown: str | None = None) -> int:
    """``n`` when ``lo <= n <= hi``, else :class:`RowError` (``what`` names the field,
    ``shown`` is the text ``n`` came from)."""
    if lo <= n <= hi:
        return n
    text = _short(shown if shown is not None else str(n))
    if n < lo:
        raise RowError(f"{what} {text} is negative" if lo == 0 else f"{what} {text} is out of range (at least {lo})")
    raise RowError(f"{what} {text} is out of range (at most {hi})")


# --- time -------------------------------------------------------------------------------
def resolve_timezone(name: str | None = None) -> tzinfo:
    """The zone sacct printed its times in: ``name`` (an IANA name such as
    ``Europe/Berlin`` or ``UTC``), else ``$TZ``, else ``/etc/localtime``, else UTC
    (:func:`gpuguard.output.resolve_zone`).

    Raises :class:`SacctParseError` for an unknown zone name.
    """
    try:
        return resolve_zone(name)
    except ZoneError as e:
        raise SacctParseError(str(e)) from None


class TimeConverter:
    """Wall-clock ``YYYY-MM-DDTHH:MM:SS`` (sacct's default ``SLURM_TIME_FORMAT``) in
    ``tz`` -> UTC epoch seconds. Bare integers are taken as epoch seconds already
    (``SLURM_TIME_FORMAT=%s``). ``Unknown``/``None``/empty -> ``None``.

    The UTC offset is looked up once per wall-clock hour (zones change offset on the hour
    or half hour at most, and the half-hour zones change at 02:00), which keeps a
    million-row import fast. Raises :class:`RowError` on anything else.
    """

    def __init__(self, tz: tzinfo):
        self.tz = tz
        self._offsets: dict[str, float] = {}

    def __call__(self, s: str | None) -> float | None:
        if s is None:
            return None
        s = s.strip()
        if s in _UNSET_TIMES:
            return None
        if _DIGITS_RE.match(s):
            if len(s) > 12 or int(s) > MAX_TIME:
                raise RowError(f"time {_short(s)!r} is out of range (after 9999-12-31)")
            return float(s)
        if len(s) < 19 or s[4] != "-" or s[10] != "T":
            raise RowError(f"time {s!r} is not YYYY-MM-DDTHH:MM:SS")
        try:
            naive = datetime.fromisoformat(s[:19])
        except ValueError:
            raise RowError(f"time {s!r} is not YYYY-MM-DDTHH:MM:SS") from None
        key = s[:13]
        off = self._offsets.get(key)
        if off is None:
            hour = naive.replace(minute=0, second=0, tzinfo=self.tz)
            delta = hour.utcoffset()
            off = delta.total_seconds() if delta is not None else 0.0
            self._offsets[key] = off
        t = calendar.timegm(naive.timetuple()) - off
        if not MIN_TIME <= t <= MAX_TIME:
            raise RowError(f"time {_short(s)!r} is out of range (after 9999-12-31T23:59:59 UTC)")
        return t


def parse_elapsed(s: str | None) -> int | None:
    """sacct ``Elapsed`` (``[DD-[HH:]]MM:SS``) or ``ElapsedRaw`` (seconds) -> seconds."""
    if s is None:
        return None
    s = s.strip()
    if not s or s in ("Unknown", "INVALID"):
        return None
    if _DIGITS_RE.match(s):
        return parse_int(s, "elapsed", 0, MAX_ELAPSED_S)
    m = _ELAPSED_RE.match(s)
    if not m or any(x and len(x) > 12 for x in m.groups()):
        raise RowError(f"elapsed {_short(s)!r} is not [DD-]HH:MM:SS")
    d, h, mi, sec = (int(x) if x else 0 for x in m.groups())
    return check_int(((d * 24 + h) * 60 + mi) * 60 + sec, "elapsed", 0, MAX_ELAPSED_S)


# --- TRES, state, ids, comment ----------------------------------------------------------
def parse_tres(s: str | None) -> tuple[int, str | None, int | None]:
    """AllocTRES ``billing=4,cpu=4,gres/gpu=2,gres/gpu:a100=2,mem=8G,node=1`` ->
    ``(gpus, gpu_type, cpus)``. See the module docstring for the GPU rules.
    Raises :class:`RowError` on a GPU or CPU count that is not an integer in
    ``0..MAX_COUNT``."""
    untyped: int | None = None
    typed: dict[str, int] = {}
    cpus: int | None = None
    if s:
        for item in s.split(","):
            name, sep, val = item.strip().partition("=")
            if not sep:
                continue
            if name == "gres/gpu" or name.startswith("gres/gpu:"):
                if not _INT_RE.match(val.strip()):
                    raise RowError(f"AllocTRES {name}={_short(val)!r}: GPU count is not an integer")
                n = _tres_count(name, val, "GPU count")
                if name == "gres/gpu":
                    untyped = n
                else:
                    gtype = name[len("gres/gpu:"):]
                    typed[gtype] = typed.get(gtype, 0) + n
            elif name == "cpu":
                if not _INT_RE.match(val.strip()):
                    raise RowError(f"AllocTRES cpu={_short(val)!r}: not an integer")
                cpus = _tres_count(name, val, "CPU count")
    gpus = untyped if untyped is not None else sum(typed.values())
    types = sorted(t for t, n in typed.items() if n > 0)
    return gpus, (",".join(types) or None), cpus


def _tres_count(name: str, val: str, what: str) -> int:
    """An AllocTRES count (an integer already): 0..MAX_COUNT or :class:`RowError`."""
    v = val.strip()
    n = int(v) if len(v) <= 40 else (MAX_COUNT + 1 if v[0] != "-" else -1)
    if n < 0:
        raise RowError(f"AllocTRES {name}={_short(v)}: {what} is negative")
    if n > MAX_COUNT:
        raise RowError(f"AllocTRES {name}={_short(v)}: {what} is more than {MAX_COUNT}")
    return n


def normalize_state(s: str | None) -> str | None:
    """``CANCELLED by 1234`` -> ``CANCELLED``; ``RUNNING`` -> ``RUNNING``; empty -> None."""
    if not s:
        return None
    return s.split()[0].upper().rstrip("+")


def parse_job_id(s: str) -> tuple[dict, bool]:
    """``123``, ``123_4``, ``123_[1-5%2]``, ``123+1``, ``123.batch`` -> (id fields, is_step).
    Raises :class:`RowError` on anything else."""
    m = _JOBID_RE.match(s.strip())
    if not m:
        raise RowError(f"JobID {s!r} is not NNN, NNN_T, NNN+K or a step of one")
    base, task, het, step = m.groups()
    out: dict = {"array_job_id": None, "array_task_id": None, "het_job_id": None, "het_job_offset": None}
    if task is not None:
        out["array_job_id"] = parse_int(base, "JobID", 0)
        out["array_task_id"] = parse_int(task, "JobID array task", 0) if task.isdigit() else None
    if het is not None:
        out["het_job_id"] = parse_int(base, "JobID", 0)
        out["het_job_offset"] = parse_int(het, "JobID het offset", 0)
    return out, step is not None


def parse_exit_code(s: str | None) -> tuple[int | None, int | None]:
    """sacct ``ExitCode`` ``3:0`` -> ``(3, 0)`` (exit status, signal)."""
    if not s:
        return None, None
    a, sep, b = s.strip().partition(":")
    if not _INT_RE.match(a.strip()) or (sep and not _INT_RE.match(b.strip())):
        raise RowError(f"ExitCode {_short(s)!r} is not N:S")
    return parse_int(a, "ExitCode status"), (parse_int(b, "ExitCode signal") if sep else 0)


def template_of(comment: str | None) -> str | None:
    """The template named in a job comment (``gpuguard:template=NAME``, other text allowed)."""
    from gpuguard.epilog.template import from_comment  # the one parser of our key

    return from_comment(comment)


def _int_or_none(s: str | None, what: str, lo: int = INT64_MIN, hi: int = INT64_MAX) -> int | None:
    if s is None or s.strip() in ("", "Unknown"):
        return None
    return parse_int(s, what, lo, hi)


#: Integer columns and the range each must lie in (what an import may store).
_INT_RANGES = {
    "job_id_raw": (0, INT64_MAX), "array_job_id": (0, INT64_MAX), "array_task_id": (0, INT64_MAX),
    "het_job_id": (0, INT64_MAX), "het_job_offset": (0, INT64_MAX), "elapsed_s": (0, MAX_ELAPSED_S),
    "exit_code": (INT64_MIN, INT64_MAX), "exit_signal": (INT64_MIN, INT64_MAX),
    "gpus": (0, MAX_COUNT), "cpus": (0, MAX_COUNT), "nnodes": (0, MAX_COUNT), "time_limit_s": (0, MAX_ELAPSED_S),
}
_TIME_COLUMNS = ("submit_at", "eligible_at", "start_at", "end_at")


def _iso_utc(ts: float) -> str:
    return iso_time(ts) or "-"


def _validate(job: dict) -> None:
    """Every integer column an int in its range, every time finite and printable, Start
    not after End: else :class:`RowError` (both parsers' last line of defence; SQLite
    cannot store an integer beyond 64 bits and the reports cannot print year 10000)."""
    for c, (lo, hi) in _INT_RANGES.items():
        v = job.get(c)
        if v is None or (type(v) is int and lo <= v <= hi):
            continue
        if isinstance(v, float) and math.isfinite(v) and v.is_integer():
            v = job[c] = int(v)
        if not isinstance(v, int) or isinstance(v, bool):
            raise RowError(f"{c} {_short(repr(v))} is not an integer")
        check_int(v, c, lo, hi)
    for c in _TIME_COLUMNS:
        v = job.get(c)
        # NaN fails every comparison and infinities are out of range: no isfinite() needed
        if v is not None and not (type(v) in (float, int) and MIN_TIME <= v <= MAX_TIME):
            raise RowError(f"{c} {_short(repr(v))} is out of range")
    start, end = job.get("start_at"), job.get("end_at")
    if start is not None and end is not None and start > end:
        raise RowError(f"Start {_iso_utc(start)} is after End {_iso_utc(end)}")


def _finish(job: dict) -> dict:
    """Fill the derived columns the reports aggregate (computed once here, not per query):

    * ``usage_end_at``: ``end_at``, or ``start_at + elapsed_s`` for a job still running;
    * ``charge_s``: seconds to charge, ``elapsed_s`` (sacct excludes suspended time),
      else ``end - start``; None before the start;
    * ``wait_s``: ``start - eligible`` (``submit`` when Eligible is unknown), at least 0;
      ``submit_wait_s``: ``start - submit``, at least 0; None before the start;
    * ``template`` from the comment; defaults for ``gpus`` and ``cluster``.

    Raises :class:`RowError` on an impossible value (:func:`_validate`).
    """
    _validate(job)
    start, end, el = job.get("start_at"), job.get("end_at"), job.get("elapsed_s")
    if el is None and start is not None and end is not None:
        job["elapsed_s"] = el = int(max(0.0, end - start))
    if start is not None:
        job["usage_end_at"] = end if end is not None else (start + el if el is not None else start)
        job["charge_s"] = el if el is not None else max(0.0, job["usage_end_at"] - start)
        elig = job.get("eligible_at") if job.get("eligible_at") is not None else job.get("submit_at")
        sub = job.get("submit_at") if job.get("submit_at") is not None else job.get("eligible_at")
        job["wait_s"] = max(0.0, start - elig) if elig is not None else None
        job["submit_wait_s"] = max(0.0, start - sub) if sub is not None else None
    else:
        job["usage_end_at"] = job["charge_s"] = job["wait_s"] = job["submit_wait_s"] = None
    job["template"] = template_of(job.get("comment"))
    for c in COLUMNS:
        job.setdefault(c, None)
    if job.get("gpu_source") is None:  # a caller that set gpus itself
        job["gpu_source"] = "AllocTRES" if job["gpus"] is not None else "unknown"
    # one row per attempt of a requeued job: slurmdbd keys its job table on (id, submit time)
    job["attempt_at"] = job["submit_at"] if job["submit_at"] is not None else 0.0
    if job["cluster"] is None:
        job["cluster"] = ""
    return job


# --- sacct -P / -p ----------------------------------------------------------------------
_FIELD_ALIASES = {"ncpus": "alloccpus", "jobidraw": "jobidraw"}


def pipe_row_to_job(rec: dict[str, str], conv: TimeConverter, cluster: str) -> tuple[dict | None, bool]:
    """One ``-P`` record (lower-cased field name -> text) -> ``(job, is_step)``.
    Raises :class:`RowError`."""
    jid_text = rec.get("jobid") or rec.get("jobidraw")
    if not jid_text:
        raise RowError("no JobID")
    ids, is_step = parse_job_id(jid_text)
    raw_text = rec.get("jobidraw") or jid_text
    if is_step or "." in raw_text:
        return None, True
    if _DIGITS_RE.match(raw_text.strip()):
        raw = parse_int(raw_text, "JobIDRaw", 0)
    elif "jobidraw" not in rec and ids["array_job_id"] is None and ids["het_job_id"] is None:
        raw = parse_int(re.match(r"^\d+", jid_text.strip(), re.ASCII).group(0), "JobID", 0)  # a plain id is the raw id
    elif "jobidraw" not in rec:
        raise RowError(f"JobID {jid_text!r} is an array task or het component: its raw id needs the JobIDRaw field")
    else:
        raise RowError(f"JobIDRaw {raw_text!r} is not an integer")
    alloc = parse_tres(rec.get("alloctres")) if "alloctres" in rec else None
    gpu = _pipe_gpus(rec, alloc)
    tres_cpus = alloc[2] if alloc is not None else None
    code, sig = parse_exit_code(rec.get("exitcode"))
    elapsed = rec.get("elapsedraw")
    job = {
        "cluster": rec.get("cluster") or cluster,
        "job_id_raw": raw,
        "job_id": jid_text.strip(),
        **ids,
        "job_name": rec.get("jobname"),
        "user": rec.get("user") or None,
        "account": rec.get("account") or None,
        "partition": rec.get("partition") or None,
        "qos": rec.get("qos") or None,
        "submit_at": conv(rec.get("submit")),
        "eligible_at": conv(rec.get("eligible")),
        "start_at": conv(rec.get("start")),
        "end_at": conv(rec.get("end")),
        "elapsed_s": parse_elapsed(elapsed if elapsed is not None else rec.get("elapsed")),
        "state": normalize_state(rec.get("state")),
        "state_raw": rec.get("state") or None,
        "exit_code": code,
        "exit_signal": sig,
        "gpus": gpu.gpus,
        "gpu_type": gpu.gpu_type,
        "gpu_source": gpu.source,
        "time_limit_s": _limit_s(rec),
        "cpus": _int_or_none(rec.get("alloccpus"), "AllocCPUS", 0, MAX_COUNT) if rec.get("alloccpus") else tres_cpus,
        "alloc_tres": rec.get("alloctres") or None,
        "nnodes": _int_or_none(rec.get("nnodes"), "NNodes", 0, MAX_COUNT),
        "node_list": rec.get("nodelist") or None,
        "comment": rec.get("comment") or None,
        "admin_comment": rec.get("admincomment") or None,
    }
    if job["state"] is None:
        raise RowError("empty State")
    if job["start_at"] is not None and job["end_at"] is not None and job["start_at"] > job["end_at"]:
        raise RowError(f"Start {rec['start'].strip()} is after End {rec['end'].strip()}")
    return _finish(job), False


def _pipe_gpus(rec: dict[str, str], alloc: tuple[int, str | None, int | None] | None) -> GpuCount:
    """The GPU count of a ``-P`` record from the fields it has (:mod:`gpuguard.reports.gpucount`)."""
    tres: dict[str, tuple[int, str | None] | None] = {}
    if alloc is not None:
        tres["AllocTRES"] = alloc[:2]
        if alloc[0] > 0:  # the common case: AllocTRES counts the GPUs, nothing else is read
            return GpuCount(alloc[0], alloc[1], "AllocTRES")
    if "reqtres" in rec:
        tres["ReqTRES"] = parse_tres(rec.get("reqtres"))[:2]
    gres = {name: rec.get(key) for key, name in (("allocgres", "AllocGRES"), ("reqgres", "ReqGRES")) if key in rec}
    return resolve_gpus(tres, gres, js1_gpus=_js1_gpus(rec.get("admincomment")), submit_line=rec.get("submitline"))


def _js1_gpus(admin_comment: str | None) -> int | None:
    """GPU count from a jobstats ``JS1:`` AdminComment; None when absent or unreadable (a
    broken comment is no reason to drop the job's accounting)."""
    from gpuguard.reports.jobstats import Js1Error, decode_js1, gpu_count, is_js1

    if not is_js1(admin_comment):
        return None
    try:
        doc = decode_js1(admin_comment)
    except Js1Error:
        return None
    return gpu_count(doc) if doc is not None else None


def _limit_s(rec: dict[str, str]) -> int | None:
    """``TimelimitRaw`` (minutes) or ``Timelimit`` (``[D-]HH:MM:SS``) -> seconds; None for
    ``UNLIMITED``, ``Partition_Limit`` or absent."""
    raw = (rec.get("timelimitraw") or "").strip()
    if raw.isdigit() and raw.isascii():
        return parse_int(raw, "TimelimitRaw", 0, MAX_ELAPSED_S // 60) * 60
    text = (rec.get("timelimit") or "").strip()
    if text and text[0].isdigit():
        try:
            return parse_elapsed(text)
        except RowError:
            return None
    return None


_DISPLAY = {"jobname": "JobName", "comment": "Comment", "submitline": "SubmitLine"}
#: Job fields that come from the free-text columns (differ between readings of one row).
_FREE_TEXT_COLUMNS = ("job_name", "comment", "template")


def rebuild_row(row: list[str], names: list[str], delimiter: str = "|") -> list[list[str]]:
    """The readings of a ``-P`` row that has more fields than the header (``names``,
    lower-cased) because a free-text field held the delimiter: one list of ``len(names)``
    fields for each way of giving the extra fields to the free-text columns
    (:data:`FREE_TEXT_FIELDS`), each such column's share joined back with ``delimiter``.
    Fields left of the first free-text column and right of the last one keep their places.
    ``[]`` when the header has no free-text column, or the row more than
    :data:`MAX_EXTRA_FIELDS` extra fields."""
    free = [i for i, n in enumerate(names) if n in FREE_TEXT_FIELDS]
    extra = len(row) - len(names)
    if not free or extra <= 0 or extra > MAX_EXTRA_FIELDS:
        return []
    readings = []
    # stars and bars: every split of `extra` into len(free) shares >= 0
    for bars in itertools.combinations(range(extra + len(free) - 1), len(free) - 1):
        edges = (-1, *bars, extra + len(free) - 1)
        shares = [edges[j + 1] - edges[j] - 1 for j in range(len(free))]
        if len(readings) >= MAX_EXTRA_FIELDS + 1:
            return []
        cand: list[str] = []
        pos, k = 0, 0
        for i in range(len(names)):
            if i in free:
                take = shares[k] + 1
                k += 1
                cand.append(delimiter.join(row[pos:pos + take]))
                pos += take
            else:
                cand.append(row[pos])
                pos += 1
        readings.append(cand)
    return readings


def _parse_long_row(row: list[str], names: list[str], conv: TimeConverter, cluster: str, delimiter: str,
                    line: int) -> ParsedRow:
    """A row with more fields than the header: its readings (:func:`rebuild_row`) parsed;
    see the module docstring for which one is taken."""
    head = f"{len(row)} fields, header has {len(names)}"
    readings = rebuild_row(row, names, delimiter)
    if not readings:
        return ParsedRow(line=line, error=head)
    cols = "/".join(_DISPLAY[n] for n in names if n in FREE_TEXT_FIELDS)
    valid: list[tuple[dict | None, bool]] = []
    errors: list[str] = []
    for cand in readings:
        try:
            valid.append(pipe_row_to_job(dict(zip(names, cand, strict=True)), conv, cluster))
        except (RowError, OverflowError) as e:
            errors.append(str(e))
    if not valid:
        if len(readings) == 1:
            return ParsedRow(line=line, error=f"{head}; with the extra {delimiter!r} in {cols}: {errors[0]}")
        return ParsedRow(line=line, error=f"{head}; no way of placing the extra {delimiter!r} in {cols} "
                                          "gives a valid row")
    if len(valid) == 1:
        job, step = valid[0]
        return ParsedRow(line=line, job=job, step=step)

    def rest(j: dict | None) -> dict | None:
        return None if j is None else {k: v for k, v in j.items() if k not in _FREE_TEXT_COLUMNS}

    first_job, first_step = valid[0]
    differ = sorted({k for j, st in valid[1:] for k in COLUMNS
                     if st != first_step or (rest(j) or {}).get(k) != (rest(first_job) or {}).get(k)})
    if differ:
        return ParsedRow(line=line, error=f"{head}; the extra {delimiter!r} may belong to {cols}, and the "
                                          f"{len(valid)} readings differ in {', '.join(differ[:5])}: not stored")
    if first_job is not None:
        for k in _FREE_TEXT_COLUMNS:
            first_job[k] = None
    return ParsedRow(line=line, job=first_job, step=first_step,
                     note=f"the extra {delimiter!r} may belong to {cols} ({len(valid)} readings): "
                          f"stored with {cols} unknown")


def iter_pipe(lines, *, conv: TimeConverter, cluster: str = "", fields: list[str] | None = None,
              delimiter: str = "|", source: str = "<input>") -> Iterator[ParsedRow]:
    """Parse ``sacct -P`` (``-p``: a trailing delimiter) text, one :class:`ParsedRow` per
    data line. ``lines``: an iterable of text lines (an open file works). With ``fields``
    None the first line must be the header (sacct without ``-n``); otherwise ``fields``
    names the columns of header-less output (``-n --format=...``).

    Rows read by :mod:`csv` with ``delimiter`` and no quoting (sacct does not quote). A
    header ending in the delimiter marks ``-p`` output: each row's trailing empty field is
    dropped. Otherwise (``-P``, or header-less output) a trailing empty field is data, as
    the last field may be empty, unless the header has no free-text column: then a row with
    one empty field too many can only be ``-p`` and the field is dropped. A row with too many fields is rebuilt when the header
    has JobName or Comment (:func:`rebuild_row`, module docstring); else it is malformed.
    Raises :class:`SacctParseError` for an input that is not ``-P`` output at all (no
    header, fixed-width columns, no JobID column).
    """
    reader = csv.reader(lines, delimiter=delimiter, quoting=csv.QUOTE_NONE)
    header_len: int
    if fields is None:
        try:
            header = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            raise SacctParseError(f"{source}:1: {e}") from None
        if len(header) < 2:
            if header and re.match(r"^\s*JobID\b", header[0]):
                raise SacctParseError(f"{source}:1: fixed-width sacct output; save it with sacct -P (or -p)")
            raise SacctParseError(f"{source}:1: no sacct -P header line (fields separated by {delimiter!r})")
        trailing = header[-1] == ""
        if trailing:
            header = header[:-1]  # -p: trailing delimiter
        names = [_FIELD_ALIASES.get(h.strip().lower(), h.strip().lower()) for h in header]
    else:
        names = [_FIELD_ALIASES.get(f.lower(), f.lower()) for f in fields]
        trailing = False
    # Without a free-text column a row with one empty field too many can only be -p
    # (sacct -P output saved with -p rows, or -n -p): take it as before.
    lenient = not any(n in FREE_TEXT_FIELDS for n in names)
    if "jobid" not in names and "jobidraw" not in names:
        raise SacctParseError(f"{source}:1: header has no JobID or JobIDRaw field")
    header_len = len(names)
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            yield ParsedRow(line=reader.line_num, error=str(e))
            continue
        if not row or (len(row) == 1 and not row[0].strip()):
            continue
        if row[-1] == "" and ((trailing and len(row) > header_len) or (lenient and len(row) == header_len + 1)):
            row = row[:-1]
        if len(row) > header_len:
            yield _parse_long_row(row, names, conv, cluster, delimiter, reader.line_num)
            continue
        if len(row) != header_len:
            yield ParsedRow(line=reader.line_num, error=f"{len(row)} fields, header has {header_len}")
            continue
        try:
            job, is_step = pipe_row_to_job(dict(zip(names, row, strict=True)), conv, cluster)
        except (RowError, OverflowError) as e:
            yield ParsedRow(line=reader.line_num, error=str(e))
            continue
        yield ParsedRow(line=reader.line_num, job=job, step=is_step)


# --- sacct --json -----------------------------------------------------------------------
def _num(v):
    """A JSON number, ``{"set", "infinite", "number"}`` (v0.0.40+) or null -> int/None."""
    if isinstance(v, dict):
        if not v.get("set", False) or v.get("infinite", False):
            return None
        v = v.get("number")
    if v is None or isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return v
    raise RowError(f"expected a number, got {v!r}")


def _time(v) -> float | None:
    n = _num(v)
    if n and not (MIN_TIME <= n <= MAX_TIME):  # NaN compares false: out of range too
        raise RowError(f"time {_short(str(n))} is out of range")
    return None if not n else float(n)  # 0 = not reached (pending: start 0)


def _json_exit(ec, buggy: bool) -> tuple[int | None, int | None]:
    if not isinstance(ec, dict):
        return None, None
    status = ec.get("status")
    statuses = set(status if isinstance(status, list) else [status] if status else [])
    sig = ec.get("signal") or {}
    sig_id = _num(sig.get("id", sig.get("signal_id"))) if isinstance(sig, dict) else None
    if "SIGNALED" in statuses:
        return 0, sig_id
    if "PENDING" in statuses:
        return None, None
    if buggy:
        return None, None
    return _num(ec.get("return_code")), (sig_id or 0)


def _json_job_ids(j: dict, raw: int) -> tuple[str, dict]:
    """The printed job id and the array/heterogeneous id columns of one ``sacct --json`` job:
    ``<array job>_<task>`` (``_[<task expr>]`` for a pending array), ``<het job>+<offset>``,
    else ``raw``; id columns are None where the job is not an array or het component."""
    arr = j.get("array") or {}
    het = j.get("het") or {}
    arr_job = _num(arr.get("job_id")) or None
    arr_task = _num(arr.get("task_id"))
    het_job = _num(het.get("job_id")) or None
    het_off = _num(het.get("job_offset"))
    ids = {"array_job_id": None, "array_task_id": None, "het_job_id": None, "het_job_offset": None}
    job_id = str(raw)
    if arr_job:
        ids["array_job_id"] = int(arr_job)
        if arr_task is not None:
            ids["array_task_id"] = int(arr_task)
            job_id = f"{int(arr_job)}_{int(arr_task)}"
        else:
            job_id = f"{int(arr_job)}_[{arr.get('task') or ''}]"
    if het_job and het_off is not None:
        ids["het_job_id"], ids["het_job_offset"] = int(het_job), int(het_off)
        job_id = f"{int(het_job)}+{int(het_off)}"
    return job_id, ids


def json_job_to_row(j: dict, conv_cluster: str, buggy_exit: bool) -> tuple[dict, bool]:
    """One ``jobs[]`` element of ``sacct --json`` -> cache row. Raises :class:`RowError`."""
    if not isinstance(j, dict):
        raise RowError("job is not an object")
    raw = _num(j.get("job_id"))
    if raw is None:
        raise RowError("no job_id")
    raw = int(raw)
    job_id, ids = _json_job_ids(j, raw)
    state = j.get("state") or {}
    cur = state.get("current") if isinstance(state, dict) else state
    if isinstance(cur, list):
        cur = cur[0] if cur else None
    if not cur:
        raise RowError("no state")
    tres_obj = j.get("tres") or {}
    tres_text = _json_tres_text(tres_obj.get("allocated"))
    gpus, gtype, cpus = parse_tres(tres_text)
    tres_pairs: dict[str, tuple[int, str | None] | None] = {}
    if "allocated" in tres_obj:
        tres_pairs["AllocTRES"] = (gpus, gtype)
    if "requested" in tres_obj:
        tres_pairs["ReqTRES"] = parse_tres(_json_tres_text(tres_obj.get("requested")))[:2]
    gres = {"AllocGRES": j["used_gres"]} if isinstance(j.get("used_gres"), str) else {}
    comment0 = j.get("comment") or {}
    admin = comment0.get("administrator") if isinstance(comment0, dict) else None
    gpu = resolve_gpus(tres_pairs, gres, js1_gpus=_js1_gpus(admin), submit_line=j.get("submit_line"))
    limit = _num((j.get("time") or {}).get("limit")) if isinstance(j.get("time"), dict) else None
    tm = j.get("time") or {}
    code, sig = _json_exit(j.get("exit_code"), buggy_exit)
    comment = j.get("comment") or {}
    qos = j.get("qos")
    job = {
        "cluster": j.get("cluster") or conv_cluster,
        "job_id_raw": raw,
        "job_id": job_id,
        **ids,
        "job_name": j.get("name"),
        "user": j.get("user") or None,
        "account": j.get("account") or None,
        "partition": j.get("partition") or None,
        "qos": qos if isinstance(qos, str) and qos else None,
        "submit_at": _time(tm.get("submission")),
        "eligible_at": _time(tm.get("eligible")),
        "start_at": _time(tm.get("start")),
        "end_at": _time(tm.get("end")),
        "elapsed_s": _num(tm.get("elapsed")),
        "state": normalize_state(str(cur)),
        "state_raw": str(cur),
        "exit_code": code,
        "exit_signal": sig,
        "gpus": gpu.gpus,
        "gpu_type": gpu.gpu_type,
        "gpu_source": gpu.source,
        "time_limit_s": int(limit) * 60 if limit is not None and 0 <= limit <= MAX_ELAPSED_S // 60 else None,
        "cpus": cpus,
        "alloc_tres": tres_text or None,
        "nnodes": _num(j.get("allocation_nodes")),
        "node_list": j.get("nodes") or None,
        "comment": (comment.get("job") if isinstance(comment, dict) else None) or None,
        "admin_comment": (comment.get("administrator") if isinstance(comment, dict) else None) or None,
    }
    if job["state"] in ("PENDING",):
        job["start_at"] = job["end_at"] = None
    return _finish(job), False


def _json_tres_text(tres) -> str:
    """A ``tres.allocated``/``tres.requested`` list of ``{"type", "name", "count"}`` ->
    ``type/name=count,...`` (the text form AllocTRES prints)."""
    parts = []
    for t in tres or []:
        if isinstance(t, dict) and t.get("type"):
            name = f"{t['type']}/{t['name']}" if t.get("name") else t["type"]
            parts.append(f"{name}={t.get('count')}")
    return ",".join(parts)


def iter_json(doc: dict, *, cluster: str = "", source: str = "<input>") -> Iterator[ParsedRow]:
    """Parse a ``sacct --json`` document (``{"jobs": [...], "meta": {...}}``); ``line``
    of each :class:`ParsedRow` is the 1-based index in ``jobs``. Raises
    :class:`SacctParseError` when ``jobs`` is missing."""
    if not isinstance(doc, dict) or not isinstance(doc.get("jobs"), list):
        raise SacctParseError(f"{source}: JSON without a \"jobs\" list: not sacct --json output")
    plugin = json.dumps((doc.get("meta") or {}).get("plugin") or {})
    buggy = "0.0.38" in plugin or "0.0.37" in plugin
    for i, j in enumerate(doc["jobs"], start=1):
        try:
            job, step = json_job_to_row(j, cluster, buggy)
        except (RowError, TypeError, AttributeError, ValueError, OverflowError) as e:
            yield ParsedRow(line=i, error=f"jobs[{i - 1}]: {e}")
            continue
        yield ParsedRow(line=i, job=job, step=step)


def sniff_format(head: str) -> str:
    """``"json"`` when the text starts with ``{``, else ``"pipe"``."""
    return "json" if head.lstrip()[:1] == "{" else "pipe"
