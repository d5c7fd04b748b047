"""The bulk path's parse of a chunk's common ``-P`` rows in SQLite (a worker's part of
:mod:`gpuguard.reports.sync_bulk`).

A worker stages each line of the live sync's field list (:data:`SQL_NAMES`: the saved-file
format the README gives, and ``sacct -n`` of the live sync) split on the delimiter, as
text (table ``raw``, keyed by the line number), and one ``INSERT ... SELECT`` converts the
rows of a strict shape into the staged table: every conversion that is not arithmetic is a
lookup into a small table that the Python parsers fill, once per distinct value of the
chunk (times per wall-clock hour: :meth:`~gpuguard.reports.sacct_fields.TimeConverter.hour_epoch`;
AllocTRES and ReqTRES with :meth:`~gpuguard.reports.sacct.PipeRowParser.gpu_fields`; state,
exit code, time limit and template with their parsers). A row of any other shape (an array
or het job id, a step, an AdminComment, a time other than ``YYYY-MM-DDTHH:MM:SS`` or
``Unknown``, a value a parser refuses, a line with a CR or NUL, a field count other than
the header's) goes to the Python parser (:func:`~gpuguard.reports.sacct.pipe_rows`), which
says what is wrong with it; so the SQL only stores what the parser would store, and the
parser keeps every message. ``tests/test_reports_sync.py`` imports every corpus file, fuzzed
files and DST-edge times both ways and compares every stored column.

The strict shape, field by field (each the parser's common case): JobIDRaw ASCII digits
(at most 18) and JobID the same text; ElapsedRaw digits (at most 10, at most
:data:`~gpuguard.reports.sacct_fields.MAX_ELAPSED_S`); AllocCPUS and NNodes empty or digits
(at most 7, at most :data:`~gpuguard.reports.sacct_fields.MAX_COUNT`); AdminComment empty;
Start not after End.

Measured by ``bench/sync_phases.py`` (the README gives the figures).
"""

from __future__ import annotations

import re
import sqlite3
from datetime import datetime

from gpuguard.reports.sacct_fields import MAX_COUNT, MAX_ELAPSED_S, MAX_TIME, MIN_TIME, SACCT_FIELDS

#: The header (lower-cased) whose rows this path converts: :data:`SACCT_FIELDS`.
SQL_NAMES = [f.lower() for f in SACCT_FIELDS]
_UNSET = "('', 'Unknown', 'None', 'N/A', '0')"  # sacct_fields._UNSET_TIMES
_TIME_GLOB = "[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]T[0-9][0-9]:[0-9][0-9]:[0-9][0-9]"
_TIMES = ("submit", "eligible", "start", "end")
#: TimelimitRaw, the last field: its line's ``\n`` dropped (as :func:`~gpuguard.reports.sacct_fields.split_record` does)
_LIMIT = "rtrim(timelimitraw, char(10))"


def fits(names: list[str], trailing: bool) -> bool:
    """Whether rows under the header ``names`` (``trailing``: ``-p``) take this path."""
    return names == SQL_NAMES and not trailing


def _q(f: str) -> str:
    return f'r."{f}"'


def _count(col: str, top: int, most: int = 7) -> str:
    """``col`` is ASCII digits (at most ``most``, no sign, no leading zero) of at most ``top``."""
    return (f"(length({col}) <= {most} AND CAST(CAST({col} AS INTEGER) AS TEXT) = {col} "
            f"AND CAST({col} AS INTEGER) BETWEEN 0 AND {top})")


def _time(f: str) -> str:
    """A time field's UTC epoch: its hour's (table ``hours``) plus its ``:MM:SS`` (``mmss``);
    NULL when unset or of another shape."""
    return f"(h_{f}.base + m_{f}.s)"


def _time_ok(f: str) -> str:
    return f"({_q(f)} IN {_UNSET} OR (length({_q(f)}) = 19 AND h_{f}.base IS NOT NULL AND m_{f}.s IS NOT NULL))"


def _convert_sql() -> str:
    """The ``INSERT ... SELECT`` of the strict-shape rows of ``raw`` into ``staged``."""
    from gpuguard.reports.sync_bulk import STAGE_COLUMNS

    sub, elig, start, end = (_time(f) for f in _TIMES)
    el = "CAST(r.elapsedraw AS INTEGER)"
    value = {
        "cluster": "COALESCE(NULLIF(r.cluster, ''), :cluster)",
        "job_id_raw": "CAST(r.jobidraw AS INTEGER)", "job_id": "r.jobid", "job_name": "r.jobname",
        "user": "NULLIF(r.user, '')", "account": "NULLIF(r.account, '')",
        "partition": "NULLIF(r.partition, '')", "qos": "NULLIF(r.qos, '')",
        "submit_at": sub, "eligible_at": elig, "start_at": start, "end_at": end, "elapsed_s": el,
        # sacct_fields.derive_usage, with the elapsed time known
        "usage_end_at": f"(CASE WHEN {start} IS NULL THEN NULL ELSE COALESCE({end}, {start} + {el}) END)",
        "charge_s": f"(CASE WHEN {start} IS NULL THEN NULL ELSE {el} END)",
        "wait_s": f"max(0.0, {start} - COALESCE({elig}, {sub}))",
        "submit_wait_s": f"max(0.0, {start} - COALESCE({sub}, {elig}))",
        "state": "st.v", "state_raw": "NULLIF(r.state, '')", "exit_code": "ex.code", "exit_signal": "ex.sig",
        "gpus": "g.gpus", "gpu_source": "g.src", "gpu_type": "g.gtype",
        "cpus": "(CASE WHEN r.alloccpus = '' THEN g.cpus ELSE CAST(r.alloccpus AS INTEGER) END)",
        "alloc_tres": "NULLIF(r.alloctres, '')",
        "nnodes": "(CASE WHEN r.nnodes = '' THEN NULL ELSE CAST(r.nnodes AS INTEGER) END)",
        "node_list": "NULLIF(r.nodelist, '')", "comment": "NULLIF(r.comment, '')", "template": "tp.v",
        "time_limit_s": "tl.v",
    }
    ok = ["length(r.jobidraw) <= 18", "CAST(CAST(r.jobidraw AS INTEGER) AS TEXT) = r.jobidraw",
          "r.jobid = r.jobidraw", "r.jobidraw NOT GLOB '-*'", _count("r.elapsedraw", MAX_ELAPSED_S, 10),
          f"(r.alloccpus = '' OR {_count('r.alloccpus', MAX_COUNT)})",
          f"(r.nnodes = '' OR {_count('r.nnodes', MAX_COUNT)})",
          "r.admincomment = ''", "st.v IS NOT NULL", "ex.k IS NOT NULL", "g.alloc IS NOT NULL",
          "tl.k IS NOT NULL", "tp.k IS NOT NULL", *(_time_ok(f) for f in _TIMES),
          f"NOT ({start} IS NOT NULL AND {end} IS NOT NULL AND {start} > {end})"]
    joins = " ".join(f"LEFT JOIN hours AS h_{f} ON h_{f}.k = substr({_q(f)}, 1, 13) "
                     f"LEFT JOIN mmss AS m_{f} ON m_{f}.k = substr({_q(f)}, 14)" for f in _TIMES)
    return (f"INSERT INTO main.staged (rowid, {', '.join(STAGE_COLUMNS)}) SELECT r.n, "
            f"{', '.join(value[c] for c in STAGE_COLUMNS)} FROM raw AS r {joins} "
            "LEFT JOIN states AS st ON st.k = r.state LEFT JOIN exits AS ex ON ex.k = r.exitcode "
            "LEFT JOIN gpus AS g ON g.alloc = r.alloctres AND g.req = r.reqtres "
            f"LEFT JOIN limits AS tl ON tl.k = {_LIMIT} LEFT JOIN templates AS tp ON tp.k = r.comment "
            f"WHERE {' AND '.join(ok)} ORDER BY r.n")


#: The lookup tables, in the work schema (``w``): each a parser's result per distinct value.
_LOOKUPS = (
    "CREATE TABLE w.hours (k TEXT PRIMARY KEY, base REAL) WITHOUT ROWID",
    "CREATE TABLE w.mmss (k TEXT PRIMARY KEY, s INTEGER) WITHOUT ROWID",
    "CREATE TABLE w.states (k TEXT PRIMARY KEY, v TEXT) WITHOUT ROWID",
    "CREATE TABLE w.exits (k TEXT PRIMARY KEY, code INTEGER, sig INTEGER) WITHOUT ROWID",
    "CREATE TABLE w.gpus (alloc TEXT, req TEXT, gpus INTEGER, gtype TEXT, src TEXT, cpus INTEGER, "
    "PRIMARY KEY (alloc, req)) WITHOUT ROWID",
    "CREATE TABLE w.limits (k TEXT PRIMARY KEY, v INTEGER) WITHOUT ROWID",
    "CREATE TABLE w.templates (k TEXT PRIMARY KEY, v TEXT) WITHOUT ROWID",
)
_HOUR_RE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}", re.ASCII)


def _fill(db: sqlite3.Connection, parser, gpus_tracked: bool | None) -> None:
    """Fill the lookup tables from the distinct values of ``raw``, each parsed by the
    Python parser's own function (a value it refuses gets no entry: its rows fall back)."""
    from gpuguard.epilog.template import template_of
    from gpuguard.reports.sacct import normalize_state, parse_exit_code, time_limit_s
    from gpuguard.reports.sacct_fields import _MM_SS, RowError
    from gpuguard.reports.sync_result import untracked_gpus

    def each(sql: str, fn) -> list[tuple]:
        out = []
        for key in db.execute(sql).fetchall():
            try:
                out.append((*key, *fn(*key)))
            except (RowError, ValueError, OverflowError):
                pass
        return out

    def hour(k: str) -> tuple:
        # TimeConverter: a time's hour's epoch; an hour near the ends of the range falls back
        # (the parser range-checks each time of it)
        if not _HOUR_RE.fullmatch(k):
            raise ValueError(k)
        base = parser.conv.hour_epoch(datetime.fromisoformat(k + ":00:00"))
        if not MIN_TIME <= base <= MAX_TIME - 3600:
            raise ValueError(k)
        return (base,)
    keys = " UNION ".join(f"SELECT substr({f}, 1, 13) FROM raw WHERE length({f}) = 19" for f in _TIMES)
    db.executemany("INSERT INTO w.hours VALUES (?, ?)", each(keys, hour))
    db.executemany("INSERT INTO w.mmss VALUES (?, ?)", _MM_SS.items())
    db.executemany("INSERT INTO w.states VALUES (?, ?)",
                   [r for r in each("SELECT DISTINCT state FROM raw", lambda s: (normalize_state(s),)) if r[1]])
    db.executemany("INSERT INTO w.exits VALUES (?, ?, ?)", each("SELECT DISTINCT exitcode FROM raw", parse_exit_code))
    db.executemany("INSERT INTO w.limits VALUES (?, ?)",
                   each(f"SELECT DISTINCT {_LIMIT} FROM raw", lambda t: (time_limit_s(t, None),)))
    db.executemany("INSERT INTO w.templates VALUES (?, ?)",
                   each("SELECT DISTINCT comment FROM raw", lambda c: (template_of(c or None, None),)))
    width = len(parser.names)
    at = {n: i for i, n in enumerate(parser.names)}

    def gpus(alloc: str, req: str) -> tuple:
        r = [None] * (width + 1)
        r[at["reqtres"]], r[at["admincomment"]] = req, ""
        g, gtype, src, parsed = parser.gpu_fields(alloc, r)
        if gpus_tracked is False:  # as Tally.jobs
            g, src = untracked_gpus(g, src)
        return g, gtype, src, parsed[2] if parsed is not None else None
    db.executemany("INSERT INTO w.gpus VALUES (?, ?, ?, ?, ?, ?)",
                   each("SELECT DISTINCT alloctres, reqtres FROM raw WHERE admincomment = ''", gpus))


def stage_lines(db: sqlite3.Connection, numbered, parser, delimiter: str, cluster: str,
                gpus_tracked: bool | None) -> tuple[list[tuple[int, str]], list, list]:
    """Stage, in ``db``'s transaction, the data lines of ``numbered`` (``(line number, text)`` after the header of
    :data:`SQL_NAMES`) into ``db``'s table ``staged`` (rowid: the line number) where their
    shape is the strict one (module docstring). Returns the lines left to the Python parser
    (in line order), and the ``(line, job id)`` lists :class:`~gpuguard.reports.sync_result.Tally`
    keeps of the staged ones (``unreportable``, ``gpus_unknown``). ``db`` has the in-memory
    schema ``w`` attached (its work tables: not in the chunk's serialized database)."""
    from gpuguard.reports.sacct_fields import _SPLIT_MAX

    width = len(SQL_NAMES)
    cols = ", ".join(f'"{n}" TEXT' for n in SQL_NAMES)
    db.execute(f"CREATE TABLE w.raw ({cols}, n INTEGER PRIMARY KEY)")
    for ddl in _LOOKUPS:
        db.execute(ddl)
    good, odd = [], []
    for n, text in numbered:
        if "\r" in text or "\0" in text or len(text) > _SPLIT_MAX:
            odd.append((n, text))
            continue
        r = text.split(delimiter)
        if len(r) == width:
            r.append(n)
            good.append(r)
        else:
            odd.append((n, text))
    db.executemany(f"INSERT INTO w.raw VALUES ({', '.join('?' * (width + 1))})", good)
    del good
    _fill(db, parser, gpus_tracked)
    db.execute(_convert_sql(), {"cluster": cluster or ""})
    unreportable = db.execute("SELECT rowid, job_id FROM staged WHERE start_at IS NULL AND end_at IS NULL "
                              "AND state != 'PENDING' ORDER BY rowid").fetchall()
    unknown = db.execute("SELECT rowid, job_id FROM staged WHERE gpus IS NULL ORDER BY rowid").fetchall()
    # the rows the SQL did not take, as the text they were read from
    for *fields, n in db.execute("SELECT * FROM raw WHERE n NOT IN (SELECT rowid FROM staged)"):
        odd.append((n, delimiter.join(fields)))  # its line end kept in the last field
    db.execute("DROP TABLE w.raw")
    odd.sort()
    return odd, unreportable, unknown


def tally_attempts(db: sqlite3.Connection, tally) -> None:
    """Set ``tally``'s (a chunk's :class:`~gpuguard.reports.sync_result.Tally`) submit times
    per job id (requeued attempts) from every staged row: one submit time of each job id,
    and every submit time of the ids staged with two or more (what :meth:`Tally.merge
    <gpuguard.reports.sync_result.Tally.merge>` reads; the order of the rows does not
    change it)."""
    tally.first_submit = dict(db.execute("SELECT job_id, submit_at FROM staged GROUP BY job_id"))
    attempts: dict[str, set] = {}
    for jid, sub in db.execute("SELECT job_id, submit_at FROM staged WHERE job_id IN (SELECT job_id FROM staged "
                               "GROUP BY job_id HAVING COUNT(DISTINCT COALESCE(submit_at, 'none')) > 1)"):
        attempts.setdefault(jid, set()).add(sub)
    tally.attempts = attempts


__all__ = ["SQL_NAMES", "fits", "stage_lines", "tally_attempts"]
