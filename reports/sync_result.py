"""What an import says besides the rows it stores: :class:`SyncResult` (the caller's
answer) and :class:`Tally`, which counts it job by job (for one input, or per chunk of a
parallel import and merged in input order: :mod:`gpuguard.reports.sync_bulk`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from gpuguard.reports.jobstats import is_js1, store_readings
from gpuguard.reports.sacct import ParsedRow


@dataclass
class SyncResult:
    """What one import or sync did. ``malformed``: ``(line, message)`` of each skipped
    row (line 1-based in the input; for JSON the index in ``jobs``). ``notes``: the same
    for rows stored with something unknown (a ``|`` in JobName or Comment that either
    could hold)."""

    source: str
    jobs: int = 0
    steps_skipped: int = 0
    malformed: list[tuple[int, str]] = field(default_factory=list)
    notes: list[tuple[int, str]] = field(default_factory=list)
    since: float | None = None
    until: float | None = None
    #: ``(line, job id)`` of stored rows no report can count: no Start (so no usage or
    #: wait) and no End (so no outcome), yet not PENDING (the wait report's pending list).
    unreportable: list[tuple[int, str]] = field(default_factory=list)
    #: ``(line, job id)`` of stored rows whose GPU count is unknown (gpucount module).
    gpus_unknown: list[tuple[int, str]] = field(default_factory=list)
    #: Job ids seen more than once in this input with different submit times (requeued
    #: attempts, ``sacct -D``): each attempt is stored and charged.
    attempts: dict[str, int] = field(default_factory=dict)
    #: GPU utilisation readings taken from jobstats ``JS1:`` AdminComments.
    js1_readings: int = 0
    #: Live sync: why sacct's full output was not taken line by line (a free-text field
    #: held a newline), and where the jobs came from instead (:mod:`~gpuguard.reports.sacct_live`).
    record_check: str | None = None

    def summary(self) -> str:
        """One line: what was stored and what of it no report (or no GPU figure) can count,
        e.g. ``f.txt: 2 job(s) stored; 2 without Start/End: in no report (lines 2, 3)``."""
        s = f"{self.source}: {self.jobs} job(s) stored"
        requeued = {k: n for k, n in self.attempts.items() if n > 1}
        if requeued:
            s += f" ({sum(requeued.values())} attempts of {len(requeued)} requeued job(s), each charged)"
        if self.notes:
            s += f" ({len(self.notes)} with JobName/Comment unknown)"
        if self.unreportable:
            s += (f"; {len(self.unreportable)} without Start/End: in no report"
                  f" ({_lines(self.unreportable)})")
        if self.js1_readings:
            s += f"; {self.js1_readings} GPU utilisation reading(s) from jobstats AdminComments"
        if self.gpus_unknown:
            s += (f"; {len(self.gpus_unknown)} with GPU usage unknown (no field carries their GPU count:"
                  f" {_lines(self.gpus_unknown)})")
        if self.steps_skipped:
            s += f", {self.steps_skipped} step row(s) ignored"
        if self.malformed:
            s += f", {len(self.malformed)} malformed row(s) skipped"
        if self.record_check:
            s += f"; {self.record_check}"
        return s


def _lines(items: list[tuple[int, str]], n: int = 5) -> str:
    """``lines 2, 3, 9 ...`` naming the first ``n`` rows (with the job id)."""
    shown = ", ".join(f"{line} (job {jid})" for line, jid in items[:n])
    more = f", ... {len(items) - n} more" if len(items) > n else ""
    return f"line{'s' if len(items) > 1 else ''} {shown}{more}"


def in_no_report(job: dict) -> bool:
    """Whether a stored row reaches no report: cost, efficiency and wait need a Start,
    failures an End (and a final state); the wait report lists PENDING jobs."""
    return job["start_at"] is None and job["end_at"] is None and job["state"] != "PENDING"


class Tally:
    """What an import says besides the rows it stores, counted job by job: the
    :class:`SyncResult` lists (with their input lines), the submit times of each job id
    (requeued attempts) and the jobstats ``JS1:`` AdminComments. One tally per input, or
    one per chunk of a parallel import, merged in input order (:meth:`merge`)."""

    def __init__(self) -> None:
        self.malformed: list[tuple[int, str]] = []
        self.notes: list[tuple[int, str]] = []
        self.unreportable: list[tuple[int, str]] = []
        self.gpus_unknown: list[tuple[int, str]] = []
        self.steps_skipped = 0
        self.first_submit: dict[str, float | None] = {}  # job id -> the first submit time seen
        self.attempts: dict[str, set] = {}  # only job ids seen with two or more submit times
        self.js1: list[tuple[int, str]] = []

    def jobs(self, rows: Iterable[ParsedRow], gpus_tracked: bool | None = None,
             free_text: dict | None = None) -> Iterator[dict]:
        """The jobs of ``rows``, each counted; malformed rows and steps are counted, not
        yielded. ``gpus_tracked``, ``free_text``: as :func:`import_text`."""
        malformed, notes, first_submit = self.malformed, self.notes, self.first_submit
        for r in rows:
            if r.error is not None:
                malformed.append((r.line, r.error))
            elif r.step:
                self.steps_skipped += 1
            elif r.job is not None:
                j = r.job
                if free_text is not None:
                    from gpuguard.reports.sacct_live import set_free_text

                    set_free_text(j, free_text)
                if r.note is not None:
                    notes.append((r.line, r.note))
                if gpus_tracked is False and j["gpus"] == 0 and str(j["gpu_source"]).startswith("none:"):
                    j["gpus"], j["gpu_source"] = None, "unknown: AccountingStorageTRES has no gres/gpu"
                if j["start_at"] is None and in_no_report(j):
                    self.unreportable.append((r.line, j["job_id"]))
                if j["gpus"] is None:
                    self.gpus_unknown.append((r.line, j["job_id"]))
                jid, sub = j["job_id"], j["submit_at"]
                prev = first_submit.setdefault(jid, sub)
                if prev != sub:
                    self.attempts.setdefault(jid, {prev}).add(sub)
                ac = j["admin_comment"]
                if ac and is_js1(ac):
                    self.js1.append((j["job_id_raw"], ac))
                yield j

    def merge(self, other: Tally, line_offset: int) -> None:
        """Add the tally of the input's next chunk, whose line 1 is this input's line
        ``line_offset + 1``."""
        for mine, theirs in ((self.malformed, other.malformed), (self.notes, other.notes),
                             (self.unreportable, other.unreportable), (self.gpus_unknown, other.gpus_unknown)):
            mine.extend((line + line_offset, what) for line, what in theirs)
        self.steps_skipped += other.steps_skipped
        self.js1.extend(other.js1)
        first = self.first_submit
        for jid in other.first_submit.keys() & first.keys():  # job ids both hold (a set of the smaller)
            if first[jid] != other.first_submit[jid]:
                self.attempts.setdefault(jid, {first[jid]}).add(other.first_submit[jid])
            del other.first_submit[jid]
        for jid, subs in other.attempts.items():
            self.attempts.setdefault(jid, {first.get(jid, next(iter(subs)))}).update(subs)
        first.update(other.first_submit)

    def finish(self, store, result: SyncResult) -> None:
        """Hand the tally to ``result`` and store the jobstats readings it found in ``store``
        (a :class:`gpuguard.store.Store`)."""
        result.malformed, result.notes = self.malformed, self.notes
        result.unreportable, result.gpus_unknown = self.unreportable, self.gpus_unknown
        result.steps_skipped = self.steps_skipped
        result.attempts = {k: len(v) for k, v in self.attempts.items()}
        result.js1_readings = store_readings(store, self.js1)


__all__ = ["SyncResult", "Tally", "in_no_report"]
