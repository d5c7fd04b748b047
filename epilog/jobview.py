"""Where ``gpuguard job show`` gets a job from: the data source, not the page.

:func:`job_view` works for anyone on any host:

1. the job header (user, account, state, elapsed vs time limit, nodes, GPUs) comes from
   ``sacct`` — the user's own ``sacct``, so *Slurm* decides who may see the job
   (``PrivateData=jobs`` in slurm.conf/slurmdbd.conf); gpuguard adds no ACL of its own;
2. the verdict and the node summaries come from the cluster store when this user can
   read it, opened **read-only** (``file:...?mode=ro``: nothing is created, migrated or
   written, and a world-readable copy works), else from the job's AdminComment
   (:mod:`gpuguard.epilog.admincomment`), else from the node store given with ``--store``.

A job Slurm does not show the user and no readable store holds is :class:`JobNotVisible`.
"""

from __future__ import annotations

from typing import Any

#: sacct fields of the header, in this order (``sacct --helpformat``).
HEADER_FIELDS = ("JobIDRaw", "JobName", "User", "Account", "Partition", "State", "Elapsed", "Timelimit",
                 "NNodes", "NodeList", "AllocTRES", "Start", "End", "ExitCode", "Comment", "AdminComment")
#: The header fields a user (JobName, Comment) or an admin (AdminComment) writes text into.
FREE_TEXT = ("JobName", "Comment", "AdminComment")
#: The header fields without them: one line of ``-P`` output is one job, whatever the names hold.
RECORD_FIELDS = tuple(f for f in HEADER_FIELDS if f not in FREE_TEXT)
#: sacct does not escape its delimiter; comments may hold ``|``, the unit separator not.
DELIM = "\x1f"


class JobNotVisible(LookupError):
    """Neither Slurm (for this user) nor a readable store knows the job; one line."""


def open_readonly(path: str) -> Any:
    """:func:`gpuguard.store.open_readonly` (kept here under its first name)."""
    from gpuguard.store import open_readonly as _open

    return _open(path)


def _gpus_of(tres: str) -> int | None:
    for item in (tres or "").split(","):
        k, _, v = item.partition("=")
        if k == "gres/gpu" and v.isdigit():
            return int(v)
    return None


def _header_dict(r: dict[str, Any]) -> dict[str, Any]:
    return {"job_id": r["JobIDRaw"], "name": r.get("JobName"), "user": r["User"], "account": r["Account"],
            "partition": r["Partition"], "state": r["State"], "elapsed": r["Elapsed"],
            "time_limit": r["Timelimit"], "nodes": r["NodeList"],
            "num_nodes": int(r["NNodes"]) if r["NNodes"].isdigit() else None,
            "gpus": _gpus_of(r["AllocTRES"]), "start": r["Start"], "end": r["End"], "exit_code": r["ExitCode"],
            "comment": r.get("Comment"), "admin_comment": r.get("AdminComment")}


def _rows(out: str, fields: tuple[str, ...], job_id: str) -> list[dict[str, Any]]:
    """The lines of ``-P`` output (split on newlines only: str.splitlines would also split
    on \\x1c-\\x1e) that have exactly ``fields`` and name ``job_id``."""
    lines = out.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    rows = []
    for line in lines:
        vals = line.split(DELIM)
        if len(vals) == len(fields) and vals[0] == str(job_id):
            rows.append(dict(zip(fields, vals, strict=True)))
    return rows


def _free_text_json(slurm: Any, job_id: str) -> tuple[str | None, str | None, str | None]:
    """``(job_name, comment, admin_comment)`` of the job from ``sacct -X -j JOB --json``
    (JSON escapes what ``-P`` prints raw); all None when sacct cannot give them (no JSON
    support, an error, the job absent or listed twice with different text)."""
    import json

    from gpuguard.reports.sacct import iter_json
    from gpuguard.slurm import SlurmError

    try:
        doc = json.loads(slurm.run("sacct", "-X", "-j", str(job_id), "--json"))
        rows = [r.job for r in iter_json(doc, source="sacct --json") if r.job is not None
                and str(r.job.get("job_id_raw")) == str(job_id)]
    except (SlurmError, ValueError):
        return None, None, None
    texts = {(j.get("job_name"), j.get("comment"), j.get("admin_comment")) for j in rows}
    return texts.pop() if len(texts) == 1 else (None, None, None)


def sacct_header(slurm: Any, job_id: str) -> dict[str, Any] | None:
    """The job's header from ``sacct -X -j JOB`` as the calling user, or None when sacct
    shows nothing (unknown job, or one Slurm hides from this user). Raises
    :class:`gpuguard.slurm.SlurmError` when sacct cannot run.

    JobName, Comment and AdminComment are free text that sacct prints raw: a newline or the
    delimiter in them would let a job's name carry a whole forged header line (another
    user, another AdminComment verdict). So the full query is taken only when it is one
    line with exactly :data:`HEADER_FIELDS`; otherwise the header comes from a query
    without the free-text fields (:data:`RECORD_FIELDS`: one line is the job) and the
    free text from ``sacct --json`` (:func:`_free_text_json`), the approach of
    :mod:`gpuguard.reports.sacct_live`."""
    out = slurm.run("sacct", "-X", "-n", "-P", f"--delimiter={DELIM}", "-j", str(job_id),
                    f"--format={','.join(HEADER_FIELDS)}")
    rows = _rows(out, HEADER_FIELDS, job_id)
    if len(rows) == 1 and out.rstrip("\n").count("\n") == 0:
        return _header_dict(rows[0])
    if not out.strip():
        return None
    out = slurm.run("sacct", "-X", "-n", "-P", f"--delimiter={DELIM}", "-j", str(job_id),
                    f"--format={','.join(RECORD_FIELDS)}")
    rows = _rows(out, RECORD_FIELDS, job_id)
    if not rows:
        return None
    r = dict(rows[0])
    r["JobName"], r["Comment"], r["AdminComment"] = _free_text_json(slurm, job_id)
    return _header_dict(r)


def _duration_s(text: str) -> float | None:
    """Slurm's ``[D-]HH:MM:SS`` / ``MM:SS`` (Elapsed, Timelimit) in seconds; None for
    ``UNLIMITED``, ``Partition_Limit`` or anything else."""
    days, _, rest = text.strip().rpartition("-")
    parts = rest.split(":")
    if not all(p.isdigit() for p in parts) or not 1 <= len(parts) <= 3 or (days and not days.isdigit()):
        return None
    secs = 0
    for p in parts:
        secs = secs * 60 + int(p)
    if len(parts) == 2:  # MM:SS
        pass
    return float(secs + (int(days) * 86400 if days else 0))


def _local_epoch(text: str) -> float | None:
    """sacct's local wall-clock time (``2026-11-30T18:23:55``) as epoch seconds."""
    import time

    try:
        return time.mktime(time.strptime(text.strip(), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def page_header(h: dict[str, Any], nodes: list[str]) -> dict[str, Any]:
    """:func:`sacct_header` in the job page's header shape
    (:func:`gpuguard.epilog.jobpage.job_header`)."""
    ec = h.get("exit_code") or None
    return {"job_id": h["job_id"], "name": h.get("name") or None, "user": h.get("user") or None,
            "account": h.get("account") or None, "partition": h.get("partition") or None,
            "state": h.get("state") or None, "exit": ec, "elapsed_s": _duration_s(h.get("elapsed") or ""),
            "time_limit_s": _duration_s(h.get("time_limit") or ""), "start_at": _local_epoch(h.get("start") or ""),
            "end_at": _local_epoch(h.get("end") or ""), "nodes": nodes or ([h["nodes"]] if h.get("nodes") else []),
            "gpus": h.get("gpus"), "source": "sacct"}


def _from_store(store: Any, job_id: str, tz: Any) -> dict[str, Any] | None:
    from gpuguard.epilog.cli import JobNotFound, job_report

    try:
        rep = job_report(store, job_id, tz)
    except JobNotFound:
        rep = None
    row = None
    try:
        rows = store.query("select * from cluster_jobs where job_id = ?", [str(job_id)])
        row = rows[0] if rows else None
    except Exception:  # a node store without the cluster tables: no cluster row
        row = None
    if rep is None and row is None:
        return None
    import json

    if rep is None:
        rep = {"job_id": str(job_id), "nodes": json.loads(row["nodes"] or "[]"), "verdict": None, "gpus": [],
               "summaries": [], "health_runs": [], "findings": [], "events": []}
    from gpuguard.epilog.jobpage import job_header

    rep["job"] = job_header(store, rep)
    if row is not None:
        rep["cluster"] = {"user": row["user"], "account": row["account"], "partition": row["partition"],
                          "nodes": json.loads(row["nodes"] or "[]"), "missing_nodes": json.loads(row["missing"] or "[]"),
                          "gpus": row["gpus"], "state": row["state"]}
        if rep["job"].get("source") == "gpuguard summaries" and row["gpus"]:
            # the judge's count is the GPUs allocated (epilog.judge._allocated_gpus), as
            # sacct's AllocTRES; the summaries count GPUs sampled (none on a MIG node)
            rep["job"]["gpus"] = row["gpus"]
    return rep


def _from_admin_comment(job_id: str, text: str) -> dict[str, Any] | None:
    """A report in :func:`gpuguard.epilog.cli.job_report`'s shape from the AdminComment:
    the verdict's headline and one summary per node (its figures, per-GPU utilisation)."""
    from gpuguard.epilog import admincomment

    doc = admincomment.decode(text)
    if doc is None:
        return None
    verdict = None
    if doc.get("c"):
        e = dict(doc.get("e") or {})
        e["gpus"] = [{"node": g[0], "gpu_index": g[1], "metric": g[2], "rel_change": g[3]}
                     for g in e.get("gpus") or [] if isinstance(g, list) and len(g) == 4]
        comps = [{"metric": m, "value": v, "median": med, "rel_change": rel, "flagged": True, "unit": ""}
                 for m, v, med, rel in (e.get("flag") or [])]
        verdict = {"job_id": str(job_id), "cause": doc["c"], "state": doc.get("s"), "template": doc.get("t"),
                   "summary": doc.get("m") or "", "baseline_runs": doc.get("b"), "evidence": e, "also": [],
                   "comparisons": comps, "context": [],
                   "gpu_model": doc["g"] if isinstance(doc.get("g"), str) else ""}
    from gpuguard.epilog.summary import JobSummary

    figures = admincomment.node_summaries(doc)
    summaries = []
    for n, f in sorted(figures.items()):
        # the summary shape, with what the AdminComment does not carry left unknown
        gpus = [{"gpu_index": g.get("gpu_index"), "gpu_uuid": None, "sample_count": 0,
                 "gpu_util_mean_pct": g.get("gpu_util_mean_pct")} for g in f.get("gpus") or []]
        s = JobSummary.from_dict(dict(f, job_id=str(job_id), node=n, gpus=gpus)).to_dict()
        s["source"] = "admin_comment"
        summaries.append(s)
    return {"job_id": str(job_id), "nodes": sorted(figures), "verdict": verdict,
            "gpus": [{"node": s["node"], "gpu_index": g["gpu_index"], "gpu_uuid": None}
                     for s in summaries for g in s["gpus"]],
            "summaries": summaries, "health_runs": [], "findings": [], "events": [],
            "missing_nodes": doc.get("x") or [], "admin_comment_version": doc.get("v")}


def job_view(job_id: str, *, cfg: Any, slurm: Any, store_path: str | None = None,
             tz: Any = None) -> tuple[dict[str, Any], str | None]:
    """Everything this user may see about ``job_id``, in
    :func:`gpuguard.epilog.cli.job_report`'s shape plus ``job`` (the header:
    :func:`gpuguard.epilog.jobpage.job_header`'s keys, from the user's ``sacct`` when it
    answers), ``source`` (``cluster store PATH`` | ``store PATH`` | ``AdminComment
    (sacct)`` | ``sacct``) and ``sacct_error`` when sacct could not run. Returns ``(report,
    path of the store read or None)``.

    ``store_path`` reads that store (read-only) instead of the cluster store; a store
    named so that cannot be read is :class:`gpuguard.store.StoreError`. Raises
    :class:`JobNotVisible`."""
    from gpuguard.slurm import SlurmError
    from gpuguard.store import StoreError

    header, sacct_error = None, None
    try:
        header = sacct_header(slurm, job_id)
    except SlurmError as e:
        sacct_error = str(e)
    tried: list[str] = []
    path = store_path or cfg.cluster_store_path
    rep, used, source = None, None, ""
    if path:
        try:
            store = open_readonly(path)
            try:
                rep = _from_store(store, job_id, tz)
            finally:
                store.close()
            if rep is None:
                tried.append(f"not found in store {path}")
            else:
                used, source = path, f"{'store' if store_path else 'cluster store'} {path}"
        except StoreError as e:
            if store_path:
                raise
            tried.append(str(e))
    if rep is None and header and header.get("admin_comment"):
        rep = _from_admin_comment(job_id, header["admin_comment"])
        source = "AdminComment (sacct)"
    if rep is None and header is not None:
        rep = {"job_id": str(job_id), "nodes": [], "verdict": None, "gpus": [], "summaries": [],
               "health_runs": [], "findings": [], "events": [], "note": "no gpuguard record for this job"}
        source = "sacct"
    if rep is None:
        if not store_path:
            tried.append(sacct_error or "sacct shows no such job for this user (Slurm's PrivateData decides)")
        raise JobNotVisible(f"job {job_id}: " + "; ".join(tried))
    if header is not None:
        rep["job"] = page_header(header, list(rep.get("nodes") or []))
    elif "job" not in rep:
        rep["job"] = {"job_id": str(job_id), "nodes": list(rep.get("nodes") or []), "source": source}
    rep["source"] = source
    if sacct_error:
        rep["sacct_error"] = sacct_error
    return rep, used
