"""The values inside sacct output, shared by the ``-P`` and ``--json`` parsers: the
``sacct_jobs`` cache-row columns, job-state sets, range limits, the field parsers
(integers, times with their zone, elapsed, TRES, job ids, exit codes) and the last-line
validation and derived columns of a parsed row (:func:`_finish`), and the split of a
``-P`` line into its fields (:func:`split_record`).

The rules each value follows, with their reasons, are in the docstring of
:mod:`gpuguard.reports.sacct`, which re-exports the public names.
"""

from __future__ import annotations

import calendar
import csv
import functools
import math
import re
from dataclasses import dataclass
from datetime import datetime, tzinfo

from gpuguard.epilog.template import template_of  # the one reader of a job's template
from gpuguard.output import ZoneError, iso_time, resolve_zone

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


@dataclass(slots=True)
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


# --- a -P line's fields ------------------------------------------------------------------
#: Longest field :func:`split_record` reads: the csv module's field limit, which the csv
#: reader it replaced held sacct's fields to.
_SPLIT_MAX = csv.field_size_limit()


#: A JobID/JobIDRaw value (``123``, ``123_4``, ``123+0``, ``123.batch``): never a field name.
_JOB_ID_START = re.compile(r"^\d+(?:[_+.][\w\[\]%,-]*)?$", re.ASCII)


def headerless_fields(first_line: str, delimiter: str = "|") -> list[str] | None:
    """:data:`SACCT_FIELDS` when ``first_line`` is a job's row of ``sacct -P -n
    --format=<SACCT_FIELDS>`` (the live sync's field list, the one the README gives for
    saved files, saved without its header): a JobIDRaw (digits), then a JobID, and at
    least that many fields (more when a JobName or Comment holds the delimiter). Else
    None: the line is a header, or header-less output of another field list (refused by
    :func:`iter_pipe` as having no header line)."""
    row = split_record(first_line.rstrip("\r\n"), delimiter)
    if not isinstance(row, list) or len(row) < len(SACCT_FIELDS) or (row[-1] == "" and len(row) == len(SACCT_FIELDS) + 1):
        return None  # too short, or -p's trailing delimiter (not the -P list)
    if not (row[0].isdigit() and row[0].isascii() and _JOB_ID_START.match(row[1].strip())):
        return None
    return list(SACCT_FIELDS)


def check_header(names: list[str], from_text: bool, source: str) -> None:
    """Raise :class:`SacctParseError` when the column ``names`` (lower-cased; read from the
    input's first line when ``from_text``) have no JobID or JobIDRaw."""
    if "jobid" in names or "jobidraw" in names:
        return
    if from_text and names and _JOB_ID_START.match(names[0]):  # sacct -n: the first line is a job's row
        raise SacctParseError(f"{source}:1: no header line (saved with sacct -n?): save sacct -P output "
                              "with its header line (-n works only with the field list the README gives)")
    raise SacctParseError(f"{source}:1: header has no JobID or JobIDRaw field")


def split_record(line: str, delimiter: str) -> list[str] | csv.Error:
    """The fields of one ``-P`` line (its line terminator, ``\\n`` or ``\\r\\n``, dropped),
    or a :class:`csv.Error` (returned, not raised) when a field is longer than csv's field
    limit (``csv.field_size_limit()``, the limit the csv reader kept before). sacct
    neither quotes nor escapes, so a line is its fields joined by the delimiter and
    ``str.split`` reads it; a lone ``\\r`` or a NUL inside a field is text a user wrote
    (``sbatch --comment``), kept as it is. Before, such a line went to the csv reader,
    which refuses a CR in an unquoted field: the job was skipped as malformed."""
    body = line[:-1] if line[-1:] == "\n" else line
    if body[-1:] == "\r":
        body = body[:-1]
    fields = body.split(delimiter)
    if len(body) > _SPLIT_MAX and any(len(f) > _SPLIT_MAX for f in fields):
        return csv.Error(f"field larger than field limit ({_SPLIT_MAX})")
    return fields


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


#: ``":MM:SS"`` -> seconds past the hour, for every valid minute and second: one dict
#: lookup both checks and converts the tail of a wall-clock time (:class:`TimeConverter`).
_MM_SS = {f":{m:02d}:{s:02d}": m * 60 + s for m in range(60) for s in range(60)}
#: Most wall-clock hours a :class:`TimeConverter` remembers (about 11 years of hours; the
#: memory stays below ~10 MB whatever the input).
_MAX_HOURS = 100_000


class TimeConverter:
    """Wall-clock ``YYYY-MM-DDTHH:MM:SS`` (sacct's default ``SLURM_TIME_FORMAT``) in
    ``tz`` -> UTC epoch seconds. Bare integers are taken as epoch seconds already
    (``SLURM_TIME_FORMAT=%s``). ``Unknown``/``None``/empty -> ``None``.

    The UTC offset is looked up once per wall-clock hour (zones change offset on the hour
    or half hour at most, and the half-hour zones change at 02:00): the first time of an
    hour is parsed in full, and the hour's UTC epoch is kept, so a later time of the same
    hour costs two dict lookups (a million-row import converts four times a row).
    Raises :class:`RowError` on anything else.
    """

    def __init__(self, tz: tzinfo):
        self.tz = tz
        #: ``YYYY-MM-DDTHH`` (validated by a full parse) -> UTC epoch of that hour's start.
        self._hours: dict[str, float] = {}
        hour, mm_ss, parse = self._hours.get, _MM_SS.get, self._parse

        def convert(s: str | None) -> float | None:
            if s is None:
                return None
            base = hour(s[:13])
            if base is not None:
                sec = mm_ss(s[13:19])
                if sec is not None:
                    t = base + sec
                    if MIN_TIME <= t <= MAX_TIME:
                        return t
            return parse(s)

        #: The conversion as a plain function (what :meth:`__call__` does, with its
        #: lookups bound once: a million-row import calls it four million times).
        self.convert = convert

    def __call__(self, s: str | None) -> float | None:
        return self.convert(s)

    def _parse(self, s: str) -> float | None:
        """The full parse (and the errors) of one time; remembers its hour."""
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
        base = self._hours.get(key)
        if base is None:
            hour = naive.replace(minute=0, second=0, tzinfo=self.tz)
            delta = hour.utcoffset()
            base = calendar.timegm(hour.timetuple()) - (delta.total_seconds() if delta is not None else 0.0)
            if len(self._hours) >= _MAX_HOURS:
                self._hours.clear()
            self._hours[key] = base
        t = base + naive.minute * 60 + naive.second
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
#: Distinct values each parser below remembers: a cluster's TRES strings, states, exit
#: codes and comments repeat across its jobs (a few thousand distinct values in a 1 M-job
#: trace), so a sync parses each once. Only successful parses are cached: a bad value
#: raises its error every time. Our choice; results are immutable.
VALUE_CACHE = 8192


@functools.lru_cache(maxsize=VALUE_CACHE)
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


@functools.lru_cache(maxsize=VALUE_CACHE)
def normalize_state(s: str | None) -> str | None:
    """``CANCELLED by 1234`` -> ``CANCELLED``; ``RUNNING`` -> ``RUNNING``; empty or blank -> None."""
    words = s.split() if s else None
    if not words:  # empty or blank: no state
        return None
    return words[0].upper().rstrip("+")


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


@functools.lru_cache(maxsize=VALUE_CACHE)
def parse_exit_code(s: str | None) -> tuple[int | None, int | None]:
    """sacct ``ExitCode`` ``3:0`` -> ``(3, 0)`` (exit status, signal)."""
    if not s:
        return None, None
    a, sep, b = s.strip().partition(":")
    if not _INT_RE.match(a.strip()) or (sep and not _INT_RE.match(b.strip())):
        raise RowError(f"ExitCode {_short(s)!r} is not N:S")
    return parse_int(a, "ExitCode status"), (parse_int(b, "ExitCode signal") if sep else 0)


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
_INT_RANGE_ITEMS = tuple((c, lo, hi) for c, (lo, hi) in _INT_RANGES.items())
_TIME_COLUMNS = ("submit_at", "eligible_at", "start_at", "end_at")
_COLUMN_SET = frozenset(COLUMNS)


def _iso_utc(ts: float) -> str:
    return iso_time(ts) or "-"


def check_column(c: str, v):
    """``v`` as the integer column ``c`` may store it (an integral float becomes an int):
    else :class:`RowError` naming ``c``. ``None`` passes."""
    if v is None:
        return None
    lo, hi = _INT_RANGES[c]
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool):
        raise RowError(f"{c} {_short(repr(v))} is not an integer")
    return check_int(v, c, lo, hi)


def _validate(job: dict) -> None:
    """Every integer column an int in its range, every time finite and printable, Start
    not after End: else :class:`RowError` (both parsers' last line of defence; SQLite
    cannot store an integer beyond 64 bits and the reports cannot print year 10000)."""
    for c, lo, hi in _INT_RANGE_ITEMS:
        v = job.get(c)
        if v is None or (type(v) is int and lo <= v <= hi):
            continue
        job[c] = check_column(c, v)
    for c in _TIME_COLUMNS:
        v = job.get(c)
        # NaN fails every comparison and infinities are out of range: no isfinite() needed
        if v is not None and not (type(v) in (float, int) and MIN_TIME <= v <= MAX_TIME):
            raise RowError(f"{c} {_short(repr(v))} is out of range")
    start, end = job.get("start_at"), job.get("end_at")
    if start is not None and end is not None and start > end:
        raise RowError(f"Start {_iso_utc(start)} is after End {_iso_utc(end)}")


def derive_usage(start: float | None, end: float | None, el: int | None, submit: float | None,
                 eligible: float | None) -> tuple[int | None, float | None, float | None, float | None, float | None]:
    """The derived columns of one job (see :func:`_finish`) from its Start, End,
    elapsed seconds, Submit and Eligible: ``(elapsed_s, usage_end_at, charge_s, wait_s,
    submit_wait_s)``; ``elapsed_s`` is ``end - start`` when sacct gave none."""
    if el is None and start is not None and end is not None:
        el = int(max(0.0, end - start))
    if start is None:
        return el, None, None, None, None
    usage_end = end if end is not None else (start + el if el is not None else start)
    elig = eligible if eligible is not None else submit
    sub = submit if submit is not None else eligible
    return (el, usage_end, el if el is not None else max(0.0, usage_end - start),
            max(0.0, start - elig) if elig is not None else None, max(0.0, start - sub) if sub is not None else None)


def _finish(job: dict, *, checked: bool = False) -> dict:
    """Fill the derived columns the reports aggregate (computed once here, not per query):

    * ``usage_end_at``: ``end_at``, or ``start_at + elapsed_s`` for a job still running;
    * ``charge_s``: seconds to charge, ``elapsed_s`` (sacct excludes suspended time),
      else ``end - start``; None before the start;
    * ``wait_s``: ``start - eligible`` (``submit`` when Eligible is unknown), at least 0;
      ``submit_wait_s``: ``start - submit``, at least 0; None before the start;
    * ``template``: :func:`template_of` (comment, else the judge's AdminComment); defaults for ``gpus`` and ``cluster``.

    Raises :class:`RowError` on an impossible value (:func:`_validate`). ``checked``: the
    caller's parsers already range-checked every integer and time and compared Start
    with End (:class:`~gpuguard.reports.sacct.PipeRowParser`), so that pass is skipped.
    """
    if not checked:
        _validate(job)
    get = job.get
    start = get("start_at")
    (job["elapsed_s"], job["usage_end_at"], job["charge_s"], job["wait_s"],
     job["submit_wait_s"]) = derive_usage(start, get("end_at"), get("elapsed_s"), get("submit_at"), get("eligible_at"))
    job["template"] = template_of(get("comment"), get("admin_comment"))
    for c in _COLUMN_SET - job.keys():
        job[c] = None
    if job["gpu_source"] is None:  # a caller that set gpus itself
        job["gpu_source"] = "AllocTRES" if job["gpus"] is not None else "unknown"
    # one row per attempt of a requeued job: slurmdbd keys its job table on (id, submit time)
    job["attempt_at"] = job["submit_at"] if job["submit_at"] is not None else 0.0
    if job["cluster"] is None:
        job["cluster"] = ""
    return job


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
