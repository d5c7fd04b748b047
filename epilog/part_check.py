"""The fields of a decoded spool part, checked before the job judge reads them.

:mod:`gpuguard.epilog.part_codec` bounds a part's size and checks its series' shapes;
the rest of a part (``meta``: ``job``, ``summary``, ``window_s``, ``checkpoints_s``,
``hw_events``, ``hw_findings``, the GPUs' ``index``/``uuid``/``name``/``mem_total_mib``,
the ranks' ``rank``) is JSON that the judge, the reports and the AdminComment read as the
types :func:`gpuguard.epilog.part.build_part` writes. A part from another release, a
truncated rewrite or a hand-made file may carry other types or name another job or node;
read as it is, such a part raises ``TypeError``/``AttributeError`` deep in the judge, or
writes its summary over another job's.

:func:`check_part` refuses such a part as a whole (:class:`SpoolError`, one line, logged by
:func:`gpuguard.epilog.part.read_parts`): the job is then judged with that node *missing*,
which the verdict and the AdminComment say, rather than on data we cannot vouch for. Our
choice: a part is one node's account of the job, all or nothing; a half-read part would
judge the job on a summary whose series were dropped.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from gpuguard.epilog.spool import SpoolError

#: Scalars a JSON field of a part may hold where build_part writes a scalar.
_SCALAR = (str, int, float, type(None))


def _is(value: Any, kind: str) -> bool:
    """Whether ``value`` is of the annotation ``kind`` (a dataclass field's annotation
    text, e.g. ``"float | None"``, ``"list[GpuSummary]"``): ``bool`` is not a number."""
    for alt in (a.strip() for a in kind.split("|")):
        base = alt.split("[", 1)[0]
        if base == "None" and value is None:
            return True
        if base == "bool" and isinstance(value, bool):
            return True
        if isinstance(value, bool):
            continue
        if base == "int" and isinstance(value, int):
            return True
        if base == "float" and isinstance(value, (int, float)) and math.isfinite(value):
            return True
        if base == "str" and isinstance(value, str):
            return True
        if base in ("dict", "Mapping") and isinstance(value, dict):
            return True
        if base == "list" and isinstance(value, list):
            return True
        if base == "Any":
            return True
    return False


def _check_fields(cls: type, d: Mapping[str, Any], where: str) -> None:
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in d and not _is(d[f.name], str(f.type)):
            raise SpoolError(f"{where}.{f.name} is {type(d[f.name]).__name__} {repr(d[f.name])[:40]}, "
                             f"not {f.type}")


def _check_summary(s: Any, job_id: str, node: str) -> None:
    from gpuguard.epilog.summary_doc import GpuSummary, JobSummary

    if s is None:
        return
    if not isinstance(s, dict):
        raise SpoolError(f"summary is {type(s).__name__}, not a dict")
    if str(s.get("job_id")) != job_id or s.get("node") != node:
        raise SpoolError(f"summary names job {s.get('job_id')!r} node {s.get('node')!r}")
    _check_fields(JobSummary, s, "summary")
    for i, g in enumerate(s.get("gpus") or []):
        if not isinstance(g, dict):
            raise SpoolError(f"summary.gpus[{i}] is {type(g).__name__}, not a dict")
        _check_fields(GpuSummary, g, f"summary.gpus[{i}]")


def _check_records(doc: Mapping[str, Any], key: str, node: str) -> None:
    """``hw_events``/``hw_findings``: a list of flat dicts about this node only (the judge
    drains the node a finding names)."""
    recs = doc.get(key)
    if recs is None:
        return
    if not isinstance(recs, list):
        raise SpoolError(f"{key} is {type(recs).__name__}, not a list")
    for i, r in enumerate(recs):
        if not isinstance(r, dict) or not all(isinstance(v, _SCALAR) for v in r.values()):
            raise SpoolError(f"{key}[{i}] is not a flat record")
        if r.get("node") not in (None, node):
            raise SpoolError(f"{key}[{i}] is about node {r.get('node')!r}, not {node!r}")


def check_part(doc: Mapping[str, Any], job_id: str, node: str) -> None:
    """Raise :class:`SpoolError` (one line) unless the decoded part ``doc`` is about job
    ``job_id`` on ``node`` and its fields have the types build_part writes (module
    docstring)."""
    job_id = str(job_id)
    if doc.get("node") != node or str(doc.get("job_id")) != job_id:
        raise SpoolError(f"names job {doc.get('job_id')!r} node {doc.get('node')!r}")
    ws = doc.get("window_s")
    if not _is(ws, "float") or ws <= 0:
        raise SpoolError(f"window_s is {ws!r}, not a positive number of seconds")
    job = doc.get("job")
    if job is not None and (not isinstance(job, dict) or not all(isinstance(v, _SCALAR) for v in job.values())):
        raise SpoolError("job is not a flat record")
    ck = doc.get("checkpoints_s")
    if ck is not None and (not isinstance(ck, list) or not all(_is(x, "float | None") for x in ck)):
        raise SpoolError("checkpoints_s is not a list of seconds")
    _check_summary(doc.get("summary"), job_id, node)
    _check_records(doc, "hw_events", node)
    _check_records(doc, "hw_findings", node)
    for i, g in enumerate(doc.get("gpus") or []):
        for k, kind in (("index", "int | None"), ("uuid", "str | None"), ("name", "str | None"),
                        ("mem_total_mib", "float | None")):
            if not _is(g.get(k), kind):
                raise SpoolError(f"gpus[{i}].{k} is {type(g.get(k)).__name__}, not {kind}")
    for i, r in enumerate(doc.get("ranks") or []):
        if not _is(r.get("rank"), "int | None"):
            raise SpoolError(f"ranks[{i}].rank is {type(r.get('rank')).__name__}, not int | None")
