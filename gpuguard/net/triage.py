"""Offline triage: saved tool outputs pasted into a ticket -> the findings the live
readers would give (``gpuguard check --from-file``).

Formats are told apart by content (:func:`detect`): nccl-tests logs, ``ibstat``,
``ibv_devinfo -v``, ``perfquery [-x]``, ``nvidia-smi nvlink -s`` / ``-e``,
``dcgmi nvlink --link-status``, ``nvidia-smi topo -m``, ``dcgmi diag`` (table or ``-j``
JSON) and ``dcgmi dmon -e 230`` (:mod:`gpuguard.net.dcgm_triage`). Outputs of one node are merged:
NVLink status and error counters by GPU index, perfquery counters onto the
``ibstat``/``ibv_devinfo`` port with the same LID. The same judges run as on a live node,
with no previous reading (a paste has no history): growth cannot be seen, saturated
counters and ports that are down can.

Input that is none of these, or empty, raises :class:`TriageError` (one line naming
the file); output that is recognised but partly unreadable is reported in
:attr:`Triage.problems` and, for nccl-tests, as ``nccl.output_unreadable`` — never as
healthy.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

from gpuguard.model import Finding, GpuState, NodeSnapshot

KINDS = ("nccl-tests", "ibstat", "ibstatus", "ibv_devinfo", "perfquery", "nvidia-smi nvlink -s", "nvidia-smi nvlink -e",
         "dcgmi nvlink --link-status", "nvidia-smi topo -m", "dcgmi diag", "dcgmi diag -j", "dcgmi dmon")


class TriageError(ValueError):
    """A file gpuguard cannot triage (``str()`` is one line naming it)."""


@dataclass
class Triage:
    """Findings, one summary line per file, and what could not be read."""

    findings: list[Finding] = field(default_factory=list)
    summary: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def detect(text: str) -> str | None:
    """The format of ``text`` (one of :data:`KINDS`) or None. ``dcgmi health`` (text or
    JSON, ``Health Monitor Report`` / ``Overall Health``) is none of them."""
    dcgm = _detect_dcgm(text)
    if dcgm is not None:
        return dcgm or None
    if re.search(r"^\s*CA\s+'[^']+'", text, re.M):
        return "ibstat"
    if re.search(r"^\s*Infiniband device '[^']+' port \d+ status:", text, re.M):
        return "ibstatus"
    if re.search(r"^\s*hca_id:", text, re.M):
        return "ibv_devinfo"
    if re.search(r"^#\s*Port (extended )?counters:", text, re.M | re.I):
        return "perfquery"
    if "NvLink Link Status" in text or re.search(r"^\s*gpuId\s+\d+:\s*$", text, re.M):
        return "dcgmi nvlink --link-status"
    if re.search(r"^\s*GPU0\s+(GPU1|NIC0|CPU)", text, re.M) and re.search(r"^\s*GPU0\s+X\b", text, re.M):
        return "nvidia-smi topo -m"
    if re.search(r"^\s*GPU \d+: .*", text, re.M):
        if re.search(r"^\s*Link \d+: [A-Za-z ]+ Errors?:", text, re.M):
            return "nvidia-smi nvlink -e"
        if re.search(r"^\s*Link \d+: |all links are inactive", text, re.M | re.I):
            return "nvidia-smi nvlink -s"
    if re.search(r"nThread|busbw|NCCL (WARN|INFO|version)|Test (NCCL|CUDA) failure|_perf\b", text):
        return "nccl-tests"
    if _NCCL_ROW.search(text):  # an excerpt of result rows only
        return "nccl-tests"
    return None


#: dcgmi diag table structure (dcgmi/Diag.cpp stencils): the header, a section rule, or a
#: ``| name | result |`` row / 4.x entity sub-row, or a ``| Warning | message`` row.
_DIAG_TABLE = re.compile(r"^\s*\|\s*Diagnostic\s*\|\s*Result\s*\||^\s*[+|]-{3,}\s+[A-Z][A-Za-z ]+?\s+-+\+"
                         r"|^\s*\|[^|\n]*\|\s*(?:(?:GPU|CPU)\d+:\s*)?(?:Pass|Fail|Warn|Skip|Not Run)(?:\s+-\s+(?:All|GPUs?:)|\s*\|)"
                         r"|^\s*\|\s*(?:Warning|Info)(?::\s*GPU\d+)?\s+\|.{20,}",
                         re.M)


def _detect_dcgm(text: str) -> str | None:
    """A DCGM kind, ``""`` for DCGM output gpuguard does not read (``dcgmi health``), or
    None for anything else."""
    head = text[:4096]
    if "Health Monitor Report" in head or '"Overall Health"' in head:
        return ""
    if re.search(r'"DCGM (GPU )?Diagnostic"\s*:', head) or (head.lstrip().startswith("{")
                                                            and re.search(r'"iterations"\s*:', head)):
        return "dcgmi diag -j"
    if head.lstrip().startswith("{"):
        return None
    if re.search(r"^\s*#Entity\s+\S", head, re.M):
        return "dcgmi dmon"
    if _DIAG_TABLE.search(text) or re.search(r"Successfully ran diagnostic for group|^Error: .*diagnostic", head, re.M):
        return "dcgmi diag"
    return None


_NCCL_ROW = re.compile(r"^\s*\d+\s+\d+\s+[a-z][a-z0-9_]*(?:\s+\S+){8,}\s*$", re.M)


def triage(files: list[tuple[str, str]], cfg: Any) -> Triage:
    """Judge ``[(name, text), ...]``. Raises :class:`TriageError` for an empty or
    unrecognised file."""
    from gpuguard.net import dcgm_diag, ib_text, nvlink_text

    out = Triage()
    gpus: dict[int, nvlink_text.GpuLinks] = {}
    ib_ports: list[Any] = []
    counters: list[Any] = []
    topo: dict[int, dict[int, str]] | None = None
    for name, text in files:
        if not text.strip():
            raise TriageError(f"{name}: empty (nvidia-smi nvlink -s prints nothing on GPUs without NVLink); nothing to judge")
        kind = detect(text)
        if kind is None and _detect_dcgm(text) == "":
            raise TriageError(f"{name}: dcgmi health output is not read (its Healthy/Warning/Failure summary is "
                              "DCGM's own verdict); paste dcgmi diag -r 2 or dcgmi dmon -e 230 output")
        if kind is None:
            raise TriageError(f"{name}: not a format gpuguard reads ({', '.join(KINDS)})")
        try:
            if kind == "nccl-tests":
                _nccl(name, text, out)
                continue
            if kind.startswith("dcgmi d"):
                _dcgm(name, kind, text, out)
                continue
            if kind in ("ibstat", "ibstatus", "ibv_devinfo", "perfquery"):
                parse = {"ibstat": ib_text.parse_ibstat, "ibstatus": ib_text.parse_ibstatus,
                         "ibv_devinfo": ib_text.parse_ibv_devinfo, "perfquery": ib_text.parse_perfquery}[kind]
                ports = parse(text)
                (counters if kind == "perfquery" else ib_ports).extend(ports)
                out.summary.append(f"{name}: {kind}, {len(ports)} port(s)")
                out.problems += [f"{name}: {p.name}: {x}" for p in ports for x in p.problems]
                continue
            if kind == "nvidia-smi topo -m":
                topo, probs = nvlink_text.parse_topo(text)
                out.summary.append(f"{name}: {kind}, {len(topo)} GPU(s)")
                out.problems += [f"{name}: {p}" for p in probs]
                continue
            parse = {"nvidia-smi nvlink -s": nvlink_text.parse_nvlink_status,
                     "nvidia-smi nvlink -e": nvlink_text.parse_nvlink_errors,
                     "dcgmi nvlink --link-status": nvlink_text.parse_dcgmi_link_status}[kind]
            found, probs = parse(text)
        except (ib_text.TextFormatError, nvlink_text.NvlinkTextError, dcgm_diag.DiagFormatError) as e:
            raise TriageError(f"{name}: {e}") from None
        out.problems += [f"{name}: {p}" for p in probs]
        _merge_gpus(gpus, found)
        out.summary.append(_links_summary(name, kind, found))
    if ib_ports or counters:
        _ib(ib_text.merge_by_lid(ib_ports, counters), cfg, out)
    if gpus:
        _nvlink(list(gpus.values()), cfg, out)
    if topo:
        out.findings += topo_findings(topo)
    return out


def _links_summary(name: str, kind: str, found: list[Any]) -> str:
    line = f"{name}: {kind}, {len(found)} GPU(s)"
    if kind == "nvidia-smi nvlink -e":
        return line
    ups = [(g.index, sum(1 for x in g.links.values() if x.active), len(g.links), g.all_inactive) for g in found]
    line += "; links up: " + ", ".join(f"gpu{i} {'none (NVML: all links inactive)' if a else f'{u}/{n}'}"
                                       for i, u, n, a in ups)
    if ups and all(u == 0 for _i, u, _n, _a in ups):
        line += ("; no link up on any GPU: inactive by design on this SKU or a fault, which only the node's "
                 "history or [checks] nvlink_expected_links can tell")
    return line


def _merge_gpus(into: dict[int, Any], found: list[Any]) -> None:
    for g in found:
        cur = into.setdefault(g.index, g)
        if cur is g:
            continue
        cur.name, cur.uuid = cur.name or g.name, cur.uuid or g.uuid
        cur.all_inactive = cur.all_inactive or g.all_inactive
        for n, link in g.links.items():
            mine = cur.links.setdefault(n, link)
            if mine is not link:
                for attr in ("active", "replay_errors", "recovery_errors", "crc_flit_errors", "crc_data_errors"):
                    if getattr(mine, attr) is None:
                        setattr(mine, attr, getattr(link, attr))


def _nvlink(gpus: list[Any], cfg: Any, out: Triage) -> None:
    from gpuguard.checks import CheckContext
    from gpuguard.checks.nvlink import nvlink
    from gpuguard.net.nvlink_text import fill_all_inactive

    fill_all_inactive(gpus)
    states = [GpuState(index=g.index, name=g.name, uuid=g.uuid,
                       nvlinks=[g.links[k] for k in sorted(g.links)] or None) for g in sorted(gpus, key=lambda g: g.index)]
    snap = NodeSnapshot(taken_at=time.time(), source="triage", gpus=states)
    out.findings += nvlink(CheckContext(snapshot=snap, settings=cfg.values["checks"]))


def _ib(ports: list[Any], cfg: Any, out: Triage) -> None:
    from gpuguard.net.fabric import select_ports
    from gpuguard.net.ib_judge import judge_ports

    # the same ports as the live check: an unused Ethernet port or a port left out of
    # [fabric] ports is Down on a healthy node
    ports = select_ports(ports, cfg)
    out.findings += judge_ports(ports, {}, time.time(), float(cfg.get("fabric", "expected_rate_gbps")),
                                listed=bool(cfg.get("fabric", "ports")))


def _nccl(name: str, text: str, out: Triage) -> None:
    from gpuguard.net.nccl_check import errors_finding
    from gpuguard.net.nccl_parse import parse

    log = parse(text)
    err = errors_finding(log, what=name)
    if err is not None:
        out.findings.append(err)
    elif not log.readable or log.incomplete:  # a test that ended early is not a healthy reading either
        why = log.problems[0][1] if log.problems else (log.incomplete[0] if log.incomplete else "no results")
        out.findings.append(Finding("nccl.output_unreadable", "warning", f"{name}: nccl-tests output unreadable: {why}"[:160],
                                    evidence={"problems": [p for _n, p in log.problems[:10]], "incomplete": log.incomplete}))
    rows = log.rows
    line = f"{name}: nccl-tests, {len(rows)} result row(s)"
    if rows:
        big = max(rows, key=lambda r: r.size_b)
        line += f", busbw {big.busbw_gbs:.2f} GB/s at {big.size_b} B"
    avgs = [t.avg_busbw_gbs for t in log.tables if t.avg_busbw_gbs is not None]
    if avgs:
        line += f", Avg bus bandwidth {avgs[-1]:g} GB/s"
    if log.elided_lines:
        line += f", {log.elided_lines} elided line(s)"
    out.summary.append(line)
    out.problems += [f"{name}: line {n}: {p}" for n, p in log.problems] + [f"{name}: {x}" for x in log.incomplete]


def _dcgm(name: str, kind: str, text: str, out: Triage) -> None:
    from gpuguard.net import dcgm_diag, dcgm_triage

    if kind == "dcgmi dmon":
        reading = dcgm_triage.parse_dmon(text)
        out.findings += dcgm_triage.dmon_xid_findings(name, reading)
        out.summary.append(dcgm_triage.dmon_summary(name, reading))
        out.problems += [f"{name}: {p}" for p in reading.problems]
        return
    rep = dcgm_diag.parse(text)
    out.findings += dcgm_triage.diag_findings(name, rep)
    out.summary.append(dcgm_triage.diag_summary(name, kind, rep))
    out.problems += [f"{name}: {p}" for p in rep.problems]


def topo_findings(matrix: dict[int, dict[int, str]]) -> list[Finding]:
    """``nvlink.link_down`` for a GPU with fewer NVLinks to its peers than the best-linked
    GPU of the matrix: some but not all (0 < n < max), or none while every other GPU has
    some. GPUs that all lack NVLink, or NVLink pairs by design (H100 NVL, bridged PCIe
    pairs), have equal counts and give nothing."""
    from gpuguard.net.nvlink_text import topo_nvlink_counts

    counts = topo_nvlink_counts(matrix)
    if not counts:
        return []
    best = max(counts.values())
    out = []
    for g, n in sorted(counts.items()):
        others_linked = all(v > 0 for k, v in counts.items() if k != g)
        if n < best and (n > 0 or (others_linked and len(counts) > 1)):
            out.append(Finding("nvlink.link_down", "critical",
                               f"gpu{g} has {n} NVLink(s) to its peers in topo -m, the best-linked GPU {best}",
                               g, None, {"nvlinks_to_peers": n, "best": best, "row": matrix[g]}))
    return out
