"""Findings from saved DCGM outputs (``gpuguard check --from-file``): ``dcgmi diag``
results (:mod:`gpuguard.net.dcgm_diag`) and ``dcgmi dmon -e 230`` (the last XID per GPU).

* A failed test is ``dcgm.diag_fail`` (critical) on each GPU it failed on; ``Fail - All``
  applies to every GPU the table names (per-GPU results, 4.x ``GPU0:`` rows), else to
  the GPUs of the Metadata ``GPU Device IDs Detected`` (dcgmi's default group is every
  GPU, in index order), else to the node (no GPU index). The message names the test, the
  GPU and DCGM's message for that GPU with the wrap undone.
* A failed Deployment (software) test is ``dcgm.diag_setup_fail`` (warning): DCGM's
  level-1 checks (persistence mode, environment variables, graphics processes,
  permissions, libraries, denylisted driver) fail on setup, not on hardware — except page
  retirement / row remapping / InfoROM (test name, or the message in 4.x's single
  ``software`` test: ``dcgm_errors.h`` ``DCGM_FR_*PAGE_RETIREMENT*``, ``*ROW_REMAP*``,
  ``CORRUPT_INFOROM``), which stay ``dcgm.diag_fail``.
* ``Warn`` is ``dcgm.diag_warn`` (warning); ``Skip`` / ``Not Run`` give nothing but are
  named in the summary line.
* A table that cannot be read at all, a result word not understood, or a paste that
  ends before the table does with nothing failed in it is ``dcgm.diag_unreadable``
  (warning): never healthy.
* ``dcgmi dmon -e 230``: field 230 is ``DCGM_FI_DEV_XID_ERRORS`` (``dcgm_fields.h``,
  short name ``XIDER``), the *last* XID DCGM saw on the GPU since its host engine began
  watching, with no time. A non-zero value is the kernel-log path's ``xid.N`` finding
  for that code (same catalog classification), marked as read from DCGM: no timestamp,
  it may predate the last GPU reset. Layout (``dcgmi/DeviceMonitor.cpp``): a ``#Entity``
  header of field short names, a units line starting ``ID``, then ``GPU N  value...``
  rows (``N/A`` = no value); repeated samples keep the last.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpuguard.model import Finding, declare_codes
from gpuguard.net.dcgm_diag import DiagReport, DiagTest, rank

#: The DCGM family's finding codes: code -> (severity, default action, source).
CODES = declare_codes("dcgm", {
    "dcgm.diag_fail": ("critical", "drain",
        "NVIDIA DCGM diagnostics guide: a failed test means the GPU is not fit to run work until the failure is "
        "understood (its message says reset, rerun, field diagnostic or RMA)"),
    "dcgm.diag_setup_fail": ("warning", "alert",
        "DCGM Deployment (level-1 software) tests fail on node setup (persistence mode, environment, "
        "graphics processes, permissions): fix the setup, the GPU is not faulty"),
    "dcgm.diag_warn": ("warning", "alert",
        "DCGM result Warn: the test passed with a condition worth a look (DCGM_DIAG_RESULT_WARN)"),
    "dcgm.diag_unreadable": ("warning", "alert",
        "a saved dcgmi diag result that cannot be read, or ends early, is not evidence of health"),
})

_HW_SOFTWARE = re.compile(r"retire|row remap|inforom", re.I)
#: Longest DCGM message kept in a finding's message (the full text is in the evidence).
MESSAGE_MAX = 600


def diag_findings(name: str, rep: DiagReport) -> list[Finding]:
    """Findings for one parsed ``dcgmi diag`` file (see the module docstring); ``name``
    labels the file in messages."""
    every = all_gpus(rep)
    out: list[Finding] = []
    seen: set[tuple[str, int | None, str]] = set()
    for t in rep.tests:
        for gpu, word, via_all in _bad_results(t, every):
            f = _finding(name, rep, t, gpu, f"{word} - All" if via_all else word)
            if (f.code, f.gpu_index, f.message) not in seen:  # iterations of one run repeat a failure
                seen.add((f.code, f.gpu_index, f.message))
                out.append(f)
    if not any(f.code in ("dcgm.diag_fail", "dcgm.diag_setup_fail", "dcgm.diag_warn") for f in out) \
            and rep.problems:
        out.append(Finding("dcgm.diag_unreadable", "warning", f"{name}: dcgmi diag output unreadable: {rep.problems[0]}",
                           evidence={"problems": rep.problems[:10]}))
    elif any(t.status == "?" for t in rep.tests):
        bad = [t.name for t in rep.tests if t.status == "?"]
        out.append(Finding("dcgm.diag_unreadable", "warning", f"{name}: dcgmi diag result of {', '.join(bad)} "
                           "not understood", evidence={"problems": rep.problems[:10]}))
    return out


def all_gpus(rep: DiagReport) -> list[int | None]:
    """GPUs a ``- All`` result covers: those the table names, else one per Metadata
    device id (indices 0..n-1), else ``[None]`` (the node)."""
    named = sorted({g for t in rep.tests for g in t.per_gpu})
    if named:
        return list(named)
    return list(range(len(rep.device_ids))) or [None]


def _bad_results(t: DiagTest, every: list[int | None]) -> list[tuple[int | None, str, bool]]:
    """``(gpu, result word, from a "- All" cell)`` for each GPU the test failed or warned on."""
    bad: dict[int | None, tuple[str, bool]] = {g: (w, False) for g, w in t.per_gpu.items() if rank(w) >= 2}
    if t.all_gpus and rank(t.all_gpus) >= 2:
        bad.update({g: (t.all_gpus, True) for g in every if rank(bad.get(g, ("Pass",))[0]) < rank(t.all_gpus)})
    if not bad and rank(t.status) >= 2 and t.status != "?":
        named = sorted({m.gpu for m in t.messages if m.gpu is not None and m.kind == "Warning"})
        bad = {g: (t.status, False) for g in (named or [None])}
    return [(g, w, a) for g, (w, a) in sorted(bad.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))]


def _finding(name: str, rep: DiagReport, t: DiagTest, gpu: int | None, word: str) -> Finding:
    msgs = [m for m in t.messages if m.kind == "Warning" and (gpu is None or m.gpu in (gpu, None))] \
        or [m for m in t.messages if gpu is None or m.gpu in (gpu, None)]
    text = "; ".join(m.text + (" [paste ends here]" if m.truncated else "") for m in msgs)
    if word.startswith("Warn"):
        code, severity = "dcgm.diag_warn", "warning"
    elif (t.category or "").lower() == "deployment" and not _HW_SOFTWARE.search(t.name + " " + text):
        code, severity = "dcgm.diag_setup_fail", "warning"
    else:
        code, severity = "dcgm.diag_fail", "critical"
    who = f"gpu{gpu}" if gpu is not None else "all GPUs" if word.endswith("All") else "node"
    where = f" ({t.category})" if t.category else ""
    msg = f"{who} DCGM diag {t.name}{where} {word}" + (f": {text}" if text else "")
    if len(msg) > MESSAGE_MAX:
        msg = msg[: MESSAGE_MAX - 3] + "..."
    return Finding(code, severity, msg, gpu, None, {
        "file": name, "test": t.name, "category": t.category, "result": word.split(" - ")[0], "cells": t.cells,
        "messages": [m.text for m in msgs], "dcgm_version": rep.metadata.get("DCGM Version"),
        "driver_version": rep.metadata.get("Driver Version Detected")})


def diag_summary(name: str, kind: str, rep: DiagReport) -> str:
    """One line: versions, test count by result, and the tests skipped / not run."""
    meta = [f"DCGM {rep.metadata['DCGM Version']}" if "DCGM Version" in rep.metadata else "",
            f"driver {rep.metadata['Driver Version Detected']}" if "Driver Version Detected" in rep.metadata else "",
            f"{len(rep.device_ids)} GPU device id(s)" if rep.device_ids else ""]
    meta = [m for m in meta if m]
    line = f"{name}: {kind}" + (f" ({', '.join(meta)})" if meta else "") + f", {len(rep.tests)} test(s)"
    counts: dict[str, list[str]] = {}
    for t in rep.tests:
        counts.setdefault(t.status if t.status != "?" else "unreadable", []).append(t.name)
    if counts:
        line += ": " + ", ".join(f"{len(v)} {k}" for k, v in counts.items())
    for word in ("Skip", "Not Run"):
        if word in counts:
            line += f"; {word}: {', '.join(counts[word])}"
    return line


# --- dcgmi dmon -e 230 ---------------------------------------------------------------
@dataclass
class DmonReading:
    """The last value of each field per entity: ``{("GPU", 0): {"XIDER": "120"}}``."""

    columns: list[str]
    values: dict[tuple[str, int], dict[str, str]]
    problems: list[str]


_DMON_ROW = re.compile(r"^([A-Za-z][A-Za-z-]*)\s+(\d+)\s+(.*?)\s*$")


def parse_dmon(text: str) -> DmonReading:
    """Read ``dcgmi dmon`` output (see the module docstring). Rows before any
    ``#Entity`` header, or with a different number of values, are problems."""
    cols: list[str] = []
    values: dict[tuple[str, int], dict[str, str]] = {}
    problems: list[str] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line == "ID" or line.startswith("ID "):
            continue
        if line.startswith("#Entity"):
            cols = line.split()[1:]
            continue
        m = _DMON_ROW.match(line)
        vals = m.group(3).split() if m else []
        if not m or not cols or len(vals) != len(cols):
            problems.append(f"line {n}: not a dmon row of {len(cols)} field(s): {line[:60]!r}")
            continue
        values[(m.group(1).upper(), int(m.group(2)))] = dict(zip(cols, vals, strict=True))
    return DmonReading(cols, values, problems)


def dmon_xid_findings(name: str, reading: DmonReading) -> list[Finding]:
    """``xid.N`` per GPU whose ``XIDER`` (field 230) is a non-zero number, classified by
    the XID catalog like a kernel-log event; evidence says DCGM, no timestamp."""
    from gpuguard.xid.catalog import classify

    out = []
    for (kind, idx), vals in sorted(reading.values.items()):
        raw = next((v for k, v in vals.items() if k.upper() == "XIDER"), None)
        if kind != "GPU" or raw is None or not raw.isdigit() or int(raw) == 0:
            continue
        code = int(raw)
        c = classify(_DcgmXid(code))
        out.append(Finding(f"xid.{code}", c.severity,
                           f"XID {code} {c.name} on gpu{idx} (last XID DCGM saw, field 230; no timestamp: it may "
                           "predate the last GPU reset)", idx, None,
                           {"xid": code, "kind": "xid", "pci_bus_id": "", "count": 1, "catalog_action": c.action,
                            "untrusted_source": None, "meaning": c.meaning, "source": c.source,
                            "read_from": f"dcgmi dmon field 230 (DCGM_FI_DEV_XID_ERRORS) in {name}",
                            "timestamp": None, "pids": [], "processes": [], "message": ""}))
    return out


@dataclass
class _DcgmXid:
    """The event shape :func:`gpuguard.xid.catalog.classify` reads; DCGM gives no message."""

    xid: int
    kind: str = "xid"
    message: str = ""


def dmon_summary(name: str, reading: DmonReading) -> str:
    """One line: entities read and the last XID of each GPU that has one."""
    xids = {k: v for k, vals in reading.values.items() for c, v in vals.items() if c.upper() == "XIDER"}
    hit = [f"gpu{i} {v}" for (k, i), v in sorted(xids.items()) if k == "GPU" and v.isdigit() and int(v)]
    return (f"{name}: dcgmi dmon, {len(reading.values)} entity row(s), field(s) {', '.join(reading.columns) or 'none'}"
            + (f"; last XID: {', '.join(hit)}" if hit else "; no XID" if xids else "; no XIDER (field 230) column"))

