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

import csv
import functools
import itertools
import operator
import re
from collections.abc import Iterator

from gpuguard.reports.gpucount import GpuCount
from gpuguard.reports.gpucount import resolve as resolve_gpus
from gpuguard.reports.sacct_fields import (
    ACTIVE_STATES,
    COLUMNS,
    FINAL_STATES,
    FREE_TEXT_FIELDS,
    INT64_MAX,
    INT64_MIN,
    MAX_COUNT,
    MAX_ELAPSED_S,
    MAX_EXTRA_FIELDS,
    MAX_TIME,
    MIN_TIME,
    SACCT_FIELDS,
    _DIGITS_RE,
    ParsedRow,
    RowError,
    VALUE_CACHE,
    SacctParseError,
    TimeConverter,
    _finish,
    _int_or_none,
    check_column,
    check_header,
    derive_usage,
    _js1_gpus,
    check_int,
    normalize_state,
    parse_elapsed,
    parse_exit_code,
    parse_int,
    parse_job_id,
    parse_tres,
    resolve_timezone,
    split_record,
    template_of,
)
from gpuguard.reports.sacct_json import (
    iter_json,
    json_job_to_row,
)

# Re-exported: this module is the parsers' public face (sync, reports and tests import from here).
__all__ = [
    "ACTIVE_STATES",
    "COLUMNS",
    "FINAL_STATES",
    "FREE_TEXT_FIELDS",
    "INT64_MAX",
    "INT64_MIN",
    "MAX_COUNT",
    "MAX_ELAPSED_S",
    "MAX_EXTRA_FIELDS",
    "MAX_TIME",
    "MIN_TIME",
    "SACCT_FIELDS",
    "ParsedRow",
    "RowError",
    "SacctParseError",
    "TimeConverter",
    "_finish",
    "check_int",
    "iter_json",
    "json_job_to_row",
    "normalize_state",
    "parse_elapsed",
    "parse_exit_code",
    "parse_int",
    "parse_job_id",
    "parse_tres",
    "resolve_timezone",
    "split_record",
    "template_of",
]


# --- sacct -P / -p ----------------------------------------------------------------------
_FIELD_ALIASES = {"ncpus": "alloccpus", "jobidraw": "jobidraw"}


def pipe_row_to_job(rec: dict[str, str], conv: TimeConverter, cluster: str) -> tuple[dict | None, bool]:
    """One ``-P`` record (lower-cased field name -> text) -> ``(job, is_step)``.
    Raises :class:`RowError`."""
    return PipeRowParser(list(rec), conv, cluster)(list(rec.values()))


#: The fields :class:`PipeRowParser` reads, in the order its ``pick`` returns them.
_PICKED = ("jobid", "jobidraw", "cluster", "jobname", "user", "account", "partition", "qos", "submit", "eligible",
           "start", "end", "elapsedraw", "elapsed", "state", "exitcode", "alloctres", "alloccpus", "nnodes",
           "nodelist", "comment", "admincomment", "timelimitraw", "timelimit")
#: The fields the GPU count falls back on when AllocTRES holds no GPU (:func:`_pipe_gpus`).
_GPU_FALLBACK_FIELDS = ("reqtres", "allocgres", "reqgres", "admincomment", "submitline")


class PipeRowParser:
    """Parse the data rows of one ``-P`` header: ``names`` (lower-cased field names, in
    order; a repeated name reads its last column) with times read by ``conv`` and
    ``cluster`` for rows without a Cluster field. Calling it with one row (a list of
    ``len(names)`` strings) returns ``(job, is_step)`` (``job`` a dict of :data:`COLUMNS`,
    None for a step row) or raises :class:`RowError`.

    Each field's column is looked up once per header, not per row, and the values that
    repeat across jobs (TRES, state, exit code, time limit, comment) go through the
    parsers' caches (:data:`~gpuguard.reports.sacct_fields.VALUE_CACHE`): a million-row
    sync spends its time on what differs between rows.
    """

    def __init__(self, names: list[str], conv: TimeConverter, cluster: str):
        self.names, self.conv, self.cluster = names, conv, cluster
        #: the converter's fast callable (a plain function: cheaper to call than __call__)
        self.time = getattr(conv, "convert", conv)
        ix = {name: i for i, name in enumerate(names)}  # the last column of a repeated name
        absent = len(names)  # each row gets a None appended: the value of an absent field

        def at(name: str) -> int:
            return ix.get(name, absent)

        # one C call picks every field a job needs out of a row (None for an absent one)
        self.pick = operator.itemgetter(*map(at, _PICKED))
        self.has_raw, self.has_alloctres = "jobidraw" in ix, "alloctres" in ix
        self.fallback = tuple((k, ix[k]) for k in _GPU_FALLBACK_FIELDS if k in ix)

    def __call__(self, row: list[str]) -> tuple[dict | None, bool]:
        r = [*row, None]
        (jid_text, raw_text, clus, name, user, account, partition, qos, submit, eligible, start, end, elapsed,
         elapsed_text, state_raw, exit_text, alloc_text, cpus_text, nnodes, nodes, comment, admin, limit_raw,
         limit_text) = self.pick(r)
        jid_text = jid_text or raw_text
        if not jid_text:
            raise RowError("no JobID")
        raw, ids = self._ids(jid_text, raw_text or jid_text)
        if raw is None:
            return None, True
        alloc = parse_tres(alloc_text) if self.has_alloctres else None
        if alloc is not None and alloc[0] > 0:  # AllocTRES counts the GPUs: nothing else is read
            gpus, gpu_type, gpu_source = alloc[0], alloc[1], "AllocTRES"
        else:
            gpus, gpu_type, gpu_source = self._gpus(alloc, r)
        code, sig = parse_exit_code(exit_text)
        conv = self.time
        # converted in the order of the fields, so a row with several faults names the first
        # (Eligible is most often Submit's very text: converted once)
        submit_at = conv(submit)
        eligible_at = submit_at if eligible == submit else conv(eligible)
        start_at, end_at = conv(start), conv(end)
        state = normalize_state(state_raw)
        elapsed_s = _elapsed(elapsed if elapsed is not None else elapsed_text)
        limit_s = time_limit_s(limit_raw, limit_text)
        cpus = _count(cpus_text, "AllocCPUS") if cpus_text else (alloc[2] if alloc is not None else None)
        nnodes_n = _count(nnodes, "NNodes")
        if state is None:
            raise RowError("empty State")
        if start_at is not None and end_at is not None and start_at > end_at:
            raise RowError(f"Start {start.strip()} is after End {end.strip()}")
        # Every integer and time above came from a range-checked parser and Start <= End,
        # so :func:`_finish`'s checks would pass: the row is built whole, in one step.
        elapsed_s, usage_end, charge, wait, submit_wait = derive_usage(start_at, end_at, elapsed_s, submit_at,
                                                                        eligible_at)
        # a literal of at most 30 keys is built in one step; a longer one key by key (CPython)
        job = {
            "cluster": clus or self.cluster or "",
            "job_id_raw": raw,
            "job_id": jid_text.strip(),
            "array_job_id": ids["array_job_id"],
            "array_task_id": ids["array_task_id"],
            "het_job_id": ids["het_job_id"],
            "het_job_offset": ids["het_job_offset"],
            "job_name": name,
            "user": user or None,
            "account": account or None,
            "partition": partition or None,
            "qos": qos or None,
            "submit_at": submit_at,
            "eligible_at": eligible_at,
            "start_at": start_at,
            "end_at": end_at,
            "elapsed_s": elapsed_s,
            "usage_end_at": usage_end,
            "charge_s": charge,
            "wait_s": wait,
            "submit_wait_s": submit_wait,
            "state": state,
            "state_raw": state_raw or None,
            "exit_code": code,
            "exit_signal": sig,
            "gpus": gpus,
            "gpu_type": gpu_type,
            "cpus": cpus,
            "alloc_tres": alloc_text or None,
            "nnodes": nnodes_n,
        }
        job["node_list"] = nodes or None
        job["comment"] = comment = comment or None
        job["admin_comment"] = admin or None
        job["template"] = template_of(comment, job["admin_comment"])
        job["synced_at"] = job["source"] = None
        # one row per attempt of a requeued job: slurmdbd keys its job table on (id, submit time)
        job["attempt_at"] = submit_at if submit_at is not None else 0.0
        job["gpu_source"] = gpu_source
        job["time_limit_s"] = limit_s
        return job, False

    def _ids(self, jid_text: str, raw_text: str) -> tuple[int | None, dict]:
        """``(JobIDRaw as an int, parsed JobID parts)``; ``(None, ...)`` for a step's line."""
        if jid_text.isdigit() and jid_text.isascii():  # the common case: a plain job, not a step
            ids, is_step = _NO_IDS, False
        else:
            ids, is_step = parse_job_id(jid_text)
        if is_step or "." in raw_text:
            return None, ids
        if raw_text.isdigit() and raw_text.isascii() and len(raw_text) <= 18:  # the common case, inline
            return int(raw_text), ids
        return self._raw_id(raw_text, jid_text, ids), ids

    def _gpus(self, alloc: tuple[int, str | None, int | None] | None, r: list) -> tuple:
        """``(gpus, gpu_type, gpu_source)`` of a row (``r``: its fields and a trailing None)."""
        if alloc is not None and alloc[0] > 0:  # AllocTRES counts the GPUs: nothing else is read
            return alloc[0], alloc[1], "AllocTRES"
        g = _pipe_gpus({k: r[i] for k, i in self.fallback}, alloc)
        # GRES and jobstats counts are not range-checked by their parsers
        return check_column("gpus", g.gpus), g.gpu_type, g.source

    def _raw_id(self, raw_text: str, jid_text: str, ids: dict) -> int:
        """JobIDRaw as an int (from JobID when the header has no JobIDRaw and the id is plain)."""
        if raw_text.isdigit() and raw_text.isascii() and len(raw_text) <= 18:
            return int(raw_text)
        if _DIGITS_RE.match(raw_text.strip()):
            return parse_int(raw_text, "JobIDRaw", 0)
        if not self.has_raw and ids["array_job_id"] is None and ids["het_job_id"] is None:
            return parse_int(re.match(r"^\d+", jid_text.strip(), re.ASCII).group(0), "JobID", 0)  # plain id: raw
        if not self.has_raw:
            raise RowError(f"JobID {jid_text!r} is an array task or het component: its raw id needs the JobIDRaw field")
        raise RowError(f"JobIDRaw {raw_text!r} is not an integer")


_NO_IDS = {"array_job_id": None, "array_task_id": None, "het_job_id": None, "het_job_offset": None}


def _elapsed(s: str | None) -> int | None:
    """:func:`parse_elapsed`, with plain seconds (ElapsedRaw) converted inline."""
    if s is not None and s.isdigit() and s.isascii() and len(s) <= 10:
        n = int(s)
        if n <= MAX_ELAPSED_S:
            return n
    return parse_elapsed(s)


def _count(s: str | None, what: str) -> int | None:
    """A CPU or node count (``0..MAX_COUNT``), None when empty or ``Unknown``."""
    if s is not None and s.isdigit() and s.isascii() and len(s) <= 7:
        n = int(s)
        if n <= MAX_COUNT:
            return n
    return _int_or_none(s, what, 0, MAX_COUNT)


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


@functools.lru_cache(maxsize=VALUE_CACHE)
def time_limit_s(raw: str | None, text: str | None) -> int | None:
    """``TimelimitRaw`` (minutes, ``raw``) or ``Timelimit`` (``[D-]HH:MM:SS``, ``text``)
    -> seconds; None for ``UNLIMITED``, ``Partition_Limit`` or absent (both None).
    Raises :class:`RowError` for a TimelimitRaw beyond :data:`MAX_ELAPSED_S` or another word (shifted fields)."""
    raw = (raw or "").strip()
    if raw and raw.casefold() not in ("unlimited", "partition_limit"):
        return parse_int(raw, "TimelimitRaw", 0, MAX_ELAPSED_S // 60) * 60
    text = (text or "").strip()
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


def _parse_long_row(row: list[str], names: list[str], parse: PipeRowParser, delimiter: str,
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
            valid.append(parse(cand))
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

    Rows are split by :func:`split_record` (``csv`` with ``delimiter`` and no quoting: sacct
    does not quote). A
    header ending in the delimiter marks ``-p`` output: each row's trailing empty field is
    dropped. Otherwise (``-P``, or header-less output) a trailing empty field is data, as
    the last field may be empty, unless the header has no free-text column: then a row with
    one empty field too many can only be ``-p`` and the field is dropped. A row with too many fields is rebuilt when the header
    has JobName or Comment (:func:`rebuild_row`, module docstring); else it is malformed.
    Raises :class:`SacctParseError` for an input that is not ``-P`` output at all (no
    header, fixed-width columns, no JobID column).
    """
    numbered = enumerate(lines, 1)
    if fields is None:
        first = next((x for x in numbered if x[1].strip()), None)  # a paste may start with blank lines
        if first is None:
            return
        header = split_record(first[1], delimiter)
        if isinstance(header, csv.Error):
            raise SacctParseError(f"{source}:1: {header}")
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
    check_header(names, fields is None, source)
    header_len = len(names)
    parse = PipeRowParser(names, conv, cluster)
    split = split_record
    for line_no, text in numbered:
        row = split(text, delimiter)
        if type(row) is not list:
            yield ParsedRow(line=line_no, error=str(row))
            continue
        if len(row) != header_len:
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            if row[-1] == "" and ((trailing and len(row) > header_len) or (lenient and len(row) == header_len + 1)):
                row = row[:-1]
            if len(row) > header_len:
                yield _parse_long_row(row, names, parse, delimiter, line_no)
                continue
            if len(row) != header_len:
                yield ParsedRow(line=line_no, error=f"{len(row)} fields, header has {header_len}")
                continue
        elif header_len == 1 and not row[0].strip():
            continue  # a blank line
        try:
            job, is_step = parse(row)
        except (RowError, OverflowError) as e:
            yield ParsedRow(line=line_no, error=str(e))
            continue
        yield ParsedRow(line_no, job, is_step)


def sniff_format(head: str) -> str:
    """``"json"`` when the text starts with ``{``, else ``"pipe"``."""
    return "json" if head.lstrip()[:1] == "{" else "pipe"
