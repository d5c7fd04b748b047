"""``sacct --json`` documents (``openapi/dbv0.0.38`` of 22.05, ``data_parser/v0.0.39``
of 23.02, ``v0.0.40``-``v0.0.43`` of 23.11-25.05) -> cache rows; the shapes and rules are in the docstring of
:mod:`gpuguard.reports.sacct`, which re-exports :func:`iter_json`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from gpuguard.reports.gpucount import resolve as resolve_gpus
from gpuguard.reports.sacct_fields import (
    MAX_ELAPSED_S,
    MAX_TIME,
    MIN_TIME,
    ParsedRow,
    RowError,
    SacctParseError,
    _finish,
    _js1_gpus,
    _short,
    normalize_state,
    parse_tres,
)


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
    """``exit_code`` -> ``(exit status, signal)``. ``status`` as one string is the dumper
    of dbv0.0.37/38 (21.08, 22.05) and data_parser v0.0.39 (23.02): it prints
    ``SUCCESS``/``return_code 0`` for every exit that was not a signal (``WIFEXITED``,
    whatever the code; src/plugins/data_parser/v0.0.39/parsers.c ``JOB_EXIT_CODE``), so
    the code is unknown. From v0.0.40 ``status`` is a list and ``return_code`` the code."""
    if not isinstance(ec, dict):
        return None, None
    status = ec.get("status")
    buggy = buggy or isinstance(status, str)
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
    errors = doc.get("errors")
    if not doc["jobs"] and isinstance(errors, list) and errors:
        # sacct failed (slurmdbd unreachable...): its empty job list says nothing about jobs
        e = errors[0]
        text = (" ".join(str(e.get(k)) for k in ("error", "description") if e.get(k)) if isinstance(e, dict)
                else str(e))
        raise SacctParseError(f"{source}: sacct reported an error and no jobs: {_short(text, 160)}")
    meta = doc.get("meta") or {}
    # 22.05 names its plugin in meta.plugin, 23.02 in meta.plugins.data_parser
    plugin = json.dumps([meta.get("plugin") or {}, meta.get("plugins") or {}])
    buggy = any(v in plugin for v in ("0.0.37", "0.0.38", "0.0.39"))
    for i, j in enumerate(doc["jobs"], start=1):
        try:
            job, step = json_job_to_row(j, cluster, buggy)
        except (RowError, TypeError, AttributeError, ValueError, OverflowError) as e:
            yield ParsedRow(line=i, error=f"jobs[{i - 1}]: {e}")
            continue
        yield ParsedRow(line=i, job=job, step=step)
