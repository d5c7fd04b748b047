"""A ``-P`` row with more fields than its header (a ``|`` in JobName or Comment, which
sacct does not escape): its readings and the one stored, as the rules in the docstring of
:mod:`gpuguard.reports.sacct` say (that module re-exports :func:`rebuild_row`)."""

from __future__ import annotations

import itertools

from gpuguard.reports.sacct_fields import COLUMNS, FREE_TEXT_FIELDS, MAX_EXTRA_FIELDS, ParsedRow, RowError

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


def _parse_long_row(row: list[str], names: list[str], parse, delimiter: str,
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
