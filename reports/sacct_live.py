"""A live sync's defence against job records forged through free text.

Slurm keeps newlines and the ASCII unit separator in ``sbatch --job-name`` and
``--comment`` (measured on the testbed, Slurm 22.05), and ``sacct -P`` prints them raw.
So one job's name can hold a whole line of ``-P`` output: a *forged record* (any job id,
account, user, GPU count) that a plain parse stores and charges. What a user cannot
write into is every other field, so a live sync also asks sacct for those alone
(:data:`RECORD_FIELDS`: one line is one job, whatever the names hold), after the full
query, and takes the full query only when it is exactly one line per job of that list
(:func:`one_job_per_line`). Otherwise the jobs and their usage come from the record
list, and JobName/Comment/AdminComment from ``sacct --json`` (which escapes them;
:func:`free_text_from_json`), matched by job id and submit time.
"""

from __future__ import annotations

import io
import json
from collections import Counter
from datetime import tzinfo

from gpuguard.reports.sacct import SACCT_FIELDS, TimeConverter, iter_json, iter_pipe

#: sacct fields a job's owner (JobName, Comment) or an admin (AdminComment) writes text into.
FREE_TEXT = ("JobName", "Comment", "AdminComment")
#: The live sync's fields without them: one output line is one job record.
RECORD_FIELDS = tuple(f for f in SACCT_FIELDS if f not in FREE_TEXT)
#: Job columns taken from the free-text fields.
FREE_TEXT_COLUMNS = ("job_name", "comment", "admin_comment")


def _keys(text: str, fields: tuple[str, ...], tz: tzinfo, delimiter: str) -> tuple[Counter, int]:
    """Counter of ``(job_id_raw, submit_at)`` of the jobs in ``-P`` output, and the number
    of lines that did not parse as a job or a step."""
    keys: Counter = Counter()
    bad = 0
    for r in iter_pipe(io.StringIO(text, newline="\n"), conv=TimeConverter(tz), fields=list(fields),
                       delimiter=delimiter, source="sacct"):
        if r.error is not None:
            bad += 1
        elif r.job is not None:
            keys[(r.job["job_id_raw"], r.job["submit_at"])] += 1
    return keys, bad


def one_job_per_line(full: str, records: str, tz: tzinfo, delimiter: str) -> str | None:
    """None when ``full`` (``-P -n`` of :data:`SACCT_FIELDS`) holds exactly the jobs of
    ``records`` (of :data:`RECORD_FIELDS`, asked after it), one per line, every line a
    valid row; else why not, one line. A newline in a free-text field adds a line and
    splits a record, so the counts or the job keys differ."""
    n_full, n_rec = full.count("\n"), records.count("\n")
    if n_full != n_rec:
        return f"sacct printed {n_full} lines for {n_rec} jobs: a JobName or Comment holds a newline"
    full_keys, bad = _keys(full, SACCT_FIELDS, tz, delimiter)
    if bad:
        return f"{bad} line(s) of sacct's output are not job records"
    rec_keys, _ = _keys(records, RECORD_FIELDS, tz, delimiter)
    if full_keys != rec_keys:
        return "sacct's output names jobs its record list does not hold"
    return None


def free_text_from_json(slurm, start: str, end: str, timeout_s: float) -> dict[tuple[int, float | None], tuple]:
    """``(job_id_raw, submit_at) -> (job_name, comment, admin_comment)`` from ``sacct -a
    -X -D --json`` over the same window (JSON escapes what ``-P`` prints raw). A job seen
    twice with different text maps to ``(None, None, None)`` (unknown). Raises
    :class:`gpuguard.slurm.SlurmError` and ``ValueError`` (not JSON)."""
    doc = json.loads(slurm.run("sacct", "-X", "-a", "-D", "--json", "-S", start, "-E", end, timeout_s=timeout_s))
    out: dict[tuple[int, float | None], tuple] = {}
    for r in iter_json(doc, source="sacct --json"):
        if r.job is None:
            continue
        key = (r.job["job_id_raw"], r.job["submit_at"])
        text = tuple(r.job[c] for c in FREE_TEXT_COLUMNS)
        out[key] = text if out.get(key, text) == text else (None, None, None)
    return out


def set_free_text(job: dict, free_text: dict[tuple[int, float | None], tuple]) -> None:
    """Give a job read without its free-text fields their values from ``free_text``
    (:func:`free_text_from_json`; a job it lacks gets None: unknown, so a stored value is
    kept) and its template (:func:`~gpuguard.reports.sacct_fields.template_of`)."""
    from gpuguard.reports.sacct import template_of

    name, comment, admin = free_text.get((job["job_id_raw"], job["submit_at"]), (None, None, None))
    job["job_name"], job["comment"], job["admin_comment"] = name, comment or None, admin or None
    job["template"] = template_of(job["comment"], job["admin_comment"])
