"""nccl-tests output (``all_reduce_perf`` and friends) -> per-size algbw/busbw and errors.

Column semantics are those of nccl-tests ``src/util.cu`` (``writeResultHeader``,
``writeBenchmarkLineBody``, ``writeResultFooter``): each row is ``size (B)``, ``count
(elements)``, ``type``, ``redop``, ``root``, then one block per placement, out-of-place
first and in-place second, each ``time (us)``, ``algbw (GB/s)``, ``busbw (GB/s)``,
``#wrong`` (elements that failed validation, ``N/A`` with ``-c 0``). GB/s there is 1e9
bytes/s. Older layouts are read as well:

* nccl-tests 2.0-2.10 (NCCL 2.6-2.10): a float ``error`` column (the largest deviation
  from the expected value) instead of ``#wrong``; ``redop``/``root`` missing for some
  tests. That float is kept as ``max_error``, never read as a count: float sums carry
  rounding, and those versions report real corruption in ``# Out of bounds values``.
* extra columns: ``cputime`` instead of ``time``, a trailing ``timestamp``
  (``%Y-%m-%d %H:%M:%S``), per-iteration ``i_min``/``i_max``/``i_p99``/``i_cv%``.
* a row whose out-of-place block is blank (trace replay) has only the in-place block.

The JSON report of nccl-tests 2.17+ (``-J file.json``) is read into the same
:class:`NcclLog` (:func:`gpuguard.net.nccl_json.parse_json_report`).

Without a header line (a pasted excerpt) the last eight fields are the two blocks and
the first three to five are size, count, type, [redop], [root].

Pasted logs are messy; each line is read or accounted for, never silently skipped:
``[0]``/``[1,0]<stdout>:``/``0:`` rank labels and ``[2026-06-23 15:45:07]`` stamps are
removed; ``...``/``[...]`` elision lines are counted; NCCL INFO lines, MPI banners and
command lines are noise; a line that starts like a result row but does not parse is a
*problem*, and so is a header without results. :attr:`NcclLog.readable` is False when
there is no result at all or any problem: such output is reported as unreadable, never
as healthy.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from gpuguard.inputs import json_loads

#: ``enum ibv_wc_status`` (libibverbs ``verbs.h``): the ``error N`` of an NCCL NET/IB
#: completion error.
IBV_WC_STATUS = {
    1: "IBV_WC_LOC_LEN_ERR", 2: "IBV_WC_LOC_QP_OP_ERR", 3: "IBV_WC_LOC_EEC_OP_ERR",
    4: "IBV_WC_LOC_PROT_ERR", 5: "IBV_WC_WR_FLUSH_ERR", 6: "IBV_WC_MW_BIND_ERR",
    7: "IBV_WC_BAD_RESP_ERR", 8: "IBV_WC_LOC_ACCESS_ERR", 9: "IBV_WC_REM_INV_REQ_ERR",
    10: "IBV_WC_REM_ACCESS_ERR", 11: "IBV_WC_REM_OP_ERR", 12: "IBV_WC_RETRY_EXC_ERR",
    13: "IBV_WC_RNR_RETRY_EXC_ERR", 14: "IBV_WC_LOC_RDD_VIOL_ERR", 15: "IBV_WC_REM_INV_RD_REQ_ERR",
    16: "IBV_WC_REM_ABORT_ERR", 17: "IBV_WC_INV_EECN_ERR", 18: "IBV_WC_INV_EEC_STATE_ERR",
    19: "IBV_WC_FATAL_ERR", 20: "IBV_WC_RESP_TIMEOUT_ERR", 21: "IBV_WC_GENERAL_ERR",
}


@dataclass
class NcclResult:
    """One placement (out-of-place or in-place) of one row. ``wrong`` is None when not
    checked (``N/A``) or in the legacy layout, which gives ``max_error`` instead."""

    time_us: float
    algbw_gbs: float
    busbw_gbs: float
    wrong: int | None = None
    max_error: float | None = None


@dataclass
class NcclRow:
    """One message size. ``out_of_place`` is None for in-place-only (trace replay) rows."""

    size_b: int
    count: int
    dtype: str
    redop: str | None
    root: int | None
    out_of_place: NcclResult | None
    in_place: NcclResult | None
    line_no: int

    @property
    def busbw_gbs(self) -> float:
        """Mean busbw of the placements present (nccl-tests' own ``Avg bus bandwidth``
        also averages both)."""
        vals = [r.busbw_gbs for r in (self.out_of_place, self.in_place) if r]
        return sum(vals) / len(vals)

    @property
    def algbw_gbs(self) -> float:
        vals = [r.algbw_gbs for r in (self.out_of_place, self.in_place) if r]
        return sum(vals) / len(vals)

    @property
    def wrong(self) -> int:
        """Elements that failed validation, both placements (0 when not checked)."""
        return sum(r.wrong or 0 for r in (self.out_of_place, self.in_place) if r)


@dataclass
class NcclTable:
    """One test run inside the output (a log may hold several, e.g. all_reduce then
    broadcast). ``devices``: ``(rank, host, device, pci, gpu name)``."""

    test: str | None = None
    rows: list[NcclRow] = field(default_factory=list)
    ngpus: int | None = None
    min_bytes: int | None = None
    max_bytes: int | None = None
    devices: list[tuple[int, str, int, str, str]] = field(default_factory=list)
    avg_busbw_gbs: float | None = None
    out_of_bounds: int | None = None
    header_seen: bool = False
    columns: list[str] | None = None
    #: microseconds per printed time unit: nccl-tests 1.x printed milliseconds
    time_scale: float = 1.0


@dataclass
class NcclLog:
    """Everything read from one output. ``problems``: ``(line_no, text)`` of what could
    not be read; ``warnings``: NCCL WARN messages; ``failures``: ``Test NCCL/CUDA
    failure`` lines and MPI aborts; ``ib_errors``: NET/IB completion errors as dicts."""

    tables: list[NcclTable] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    ib_errors: list[dict[str, Any]] = field(default_factory=list)
    problems: list[tuple[int, str]] = field(default_factory=list)
    incomplete: list[str] = field(default_factory=list)
    elided_lines: int = 0
    nccl_version: str | None = None

    @property
    def rows(self) -> list[NcclRow]:
        return [r for t in self.tables for r in t.rows]

    @property
    def wrong_total(self) -> int:
        return sum(r.wrong for r in self.rows)

    @property
    def out_of_bounds_total(self) -> int:
        return sum(t.out_of_bounds or 0 for t in self.tables)

    @property
    def has_errors(self) -> bool:
        """Data corruption (``#wrong`` > 0, out-of-bounds values), NCCL WARN, a failure."""
        return bool(self.wrong_total or self.out_of_bounds_total or self.warnings
                    or self.failures or self.ib_errors)

    @property
    def readable(self) -> bool:
        """At least one result row and nothing that could not be read."""
        return bool(self.rows) and not self.problems

    def gpu_models(self) -> list[str]:
        return sorted({d[4] for t in self.tables for d in t.devices})


_STAMP = re.compile(r"^\[\d{4}-\d\d-\d\d[ T][\d:.,]+\]\s*")
#: Rank labels: Open MPI ``--tag-output`` (``[1,0]<stdout>:``), MPICH ``-prepend-rank``
#: (``[0]``), srun ``--label`` (``0:``; padded to the width of the largest task id,
#: `` 0:`` from 10 tasks on: Slurm write_labelled_message.c ``"%*d: "``; a label alone
#: on a line when the rank printed an empty line).
_RANK_LABEL = re.compile(r"^\s*(?:\[\d+(?:,\d+)*\](?:<std(?:out|err)>)?:?\s*|\d{1,5}:(?:\s+|$))")
_ELISION = {"...", "[...]", "<snip>", "\u2026", "[snip]", "(...)"}
_NTHREAD = re.compile(r"^#?\s*nThread\s+(\d+)\s+nGpus\s+(\d+)\s+minBytes\s+(\d+)\s+maxBytes\s+(\d+)")
_STARTING = re.compile(r"^#\s*Collective test starting:\s*(\S+)")
#: The nccl-tests binary in a command line (``all_reduce_perf``, ``.../all_reduce_perf_mpi``):
#: group 1 is the test's name.
TEST_COMMAND = re.compile(r"(?:^|/)(\w+_perf)(?:_mpi)?\b")
_DEVICE = re.compile(r"^#\s*Rank\s+(\d+)\s+(?:Group\s+\d+\s+)?(?:Pid\s+\d+\s+)?on\s+(\S+)\s+device\s+(\d+)\s+"
                     r"\[([^\]]*)\]\s*(.*?)\s*$")
_OOB = re.compile(r"^#?\s*Out of bounds values\s*:\s*(\d+)")
_AVG = re.compile(r"^#?\s*Avg bus bandwidth\s*:\s*(\S+)")
_WARN = re.compile(r"NCCL WARN\s*(.*?)\s*$")
#: the optional ``host:`` label only at the start of a word (``(?<!\S)``): searched
#: unanchored, ``\S+?`` from every position of a long word was quadratic in its length
#: (a 20 KB line without white space took 10 s)
_FAILURE = re.compile(r"(?:(?<!\S)(\S+?):\s+)?Test ((?:NCCL|CUDA) failure\s+.*?)\s*$")
#: NET/IB completion error, every layout NCCL has printed (``transport/net_ib``):
#: <= 2.11 ``Got completion with error 12, opcode 0, len 0, vendor err 129`` (no peer);
#: 2.12-2.20 ``... from peer <addr> with error 12, opcode 0, len 0, vendor err 129 (Recv)``;
#: 2.21-2.27 ``... with status=12 opcode=0 len=0 vendor err 129 (Recv)``;
#: 2.28+ ``... with status=IBV_WC_RETRY_EXC_ERR(12) opcode=IBV_WC_RECV(128) vendor_err=129``.
_IB = re.compile(r"Got completion (?:from peer (?P<peer>\S+) )?with "
                 r"(?:error (?P<status>\d+),?|status=(?:\w+\()?(?P<status_eq>\d+)\)?)\s*"
                 r"opcode[= ](?:\w+\()?(?P<opcode>\d+)\)?,?\s*(?:len[= ]-?\d+,?\s*)?"
                 r"vendor[ _]err[= ](?P<vendor_err>\d+)(?: \((?P<direction>\w+)\))?")
#: nccl-tests 2.17+ ends its output with ``# error: <ncclGetLastError()>`` (the text of
#: NCCL's last WARN) when NCCL recorded one (``writeErrors`` in ``src/util.cu``).
_LAST_ERROR = re.compile(r"^#\s*error:\s*(.*?)\s*$")
_MPI_ABORT = re.compile(r"mpirun detected that one or more processes exited with non-zero status|"
                        r"MPI_ABORT was invoked|mpirun noticed that process .* exited on signal")
_VERSION = re.compile(r"NCCL version (\S+)")
#: nccl-tests 2.17.4+ first line (``writeDeviceReport``): ``# nccl-tests version 2.19.6
#: nccl-headers=22809 nccl-library=22809``; the library's NCCL_VERSION_CODE is
#: major*10000 + minor*100 + patch (from NCCL 2.9). With NCCL_DEBUG unset it is the only
#: place the NCCL version is printed.
_TESTS_VERSION = re.compile(r"^#\s*nccl-tests version \S+ .*\bnccl-library=(\d+)")


def version_from_code(code: int) -> str | None:
    """``22809`` -> ``"2.28.9"`` (NCCL_VERSION_CODE of NCCL 2.9+); ``None`` below 20900."""
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}" if code >= 20900 else None
#: nccl-tests 1.x column names (``bytes N type op ... time algbw busbw res``; its time is
#: in ms and ``res`` is the largest deviation, the later ``error``).
_V1_NAMES = {"bytes": "size", "N": "count", "op": "redop", "res": "error"}
_TYPES = {"int8", "uint8", "int32", "uint32", "int64", "uint64", "half", "float", "double",
          "bfloat16", "f8e4m3", "f8e5m2", "char", "int", "fp8_e4m3", "fp8_e5m2"}


def parse_number(tok: str) -> float:
    """A finite float; raises ValueError for nan/inf (a failed measurement)."""
    v = float(tok)
    if not math.isfinite(v):
        raise ValueError(f"non-finite value {tok!r}")
    return v


def _block(toks: list[str], names: list[str], legacy: bool) -> NcclResult:
    d = dict(zip(names, toks, strict=True))
    t = d.get("time", d.get("cputime"))
    if t is None or "algbw" not in d or "busbw" not in d:
        raise ValueError("block without time/algbw/busbw")
    wrong: int | None = None
    max_error: float | None = None
    w = d.get("#wrong", d.get("error"))
    if w is not None and w != "N/A":
        if legacy or "error" in d:
            max_error = parse_number(w)
        else:
            wv = parse_number(w)
            if wv < 0 or wv != int(wv):
                raise ValueError(f"#wrong {w!r} is not a count")
            wrong = int(wv)
    res = NcclResult(parse_number(t), parse_number(d["algbw"]), parse_number(d["busbw"]), wrong, max_error)
    if res.time_us < 0 or res.algbw_gbs < 0 or res.busbw_gbs < 0:
        raise ValueError("negative time or bandwidth")
    return res


def _split_header(cols: list[str]) -> tuple[list[str], list[list[str]], bool]:
    """Header columns -> (prefix names, one name list per placement block, timestamp?)."""
    ts = bool(cols) and cols[-1] == "timestamp"
    if ts:
        cols = cols[:-1]
    starts = [i for i, c in enumerate(cols) if c in ("time", "cputime")]
    if not starts:
        raise ValueError("header without a time column")
    blocks = [cols[s:e] for s, e in zip(starts, [*starts[1:], len(cols)], strict=True)]
    return cols[: starts[0]], blocks, ts


def _parse_row(toks: list[str], table: NcclTable, line_no: int) -> NcclRow:
    """Raise ValueError when the row does not fit the table's columns."""
    if table.columns:
        prefix, blocks, ts = _split_header(table.columns)
        if ts and len(toks) == len(prefix) + sum(map(len, blocks)) + 2:
            toks = toks[:-2]
        legacy = "error" in table.columns
    else:
        if len(toks) < 11:
            raise ValueError(f"{len(toks)} fields, a result row has at least 11")
        blocks = [["time", "algbw", "busbw", "#wrong"]] * 2
        # nccl-tests <= 2.10 printed the largest deviation as "%5.0le" (0e+00, 1e-07);
        # a #wrong count prints as an integer ("%6g": 0, 237858, 1.23457e+06).
        m = re.fullmatch(r"\d(?:\.\d+)?e([+-]\d\d)", toks[-1])
        legacy = bool(m) and (float(toks[-1]) == 0 or int(m.group(1)) < 0)
        np = len(toks) - 8
        if not 3 <= np <= 5:
            raise ValueError(f"{len(toks)} fields do not match size/count/type/[redop]/[root] + 2 x 4")
        prefix = ["size", "count", "type"]
        if np >= 4 and not re.fullmatch(r"-?\d+", toks[3]):
            prefix.append("redop")
        if len(prefix) < np:
            prefix.append("root")
        if len(prefix) != np:
            raise ValueError("cannot tell redop/root apart")
    head = dict(zip(prefix, toks, strict=False))
    rest = toks[len(prefix):]
    blens = [len(b) for b in blocks]
    if len(rest) == sum(blens):
        parts, i = [], 0
        for b in blocks:
            parts.append(rest[i:i + len(b)])
            i += len(b)
        oop = _block(parts[0], blocks[0], legacy)
        ip = _block(parts[1], blocks[1], legacy) if len(parts) > 1 else None
    elif len(blocks) == 2 and len(rest) == blens[1]:  # blank out-of-place body (trace replay)
        oop, ip = None, _block(rest, blocks[1], legacy)
    else:
        raise ValueError(f"{len(toks)} fields, the header has {len(prefix) + sum(blens)}")
    if not re.fullmatch(r"\d+", head.get("size", "")) or not re.fullmatch(r"\d+", head.get("count", "")):
        raise ValueError("size/count not integers")
    for r in (oop, ip):
        if r is not None and table.time_scale != 1.0:
            r.time_us *= table.time_scale
    dtype = head.get("type", "")
    if dtype not in _TYPES and not re.fullmatch(r"[a-z][a-z0-9_]*", dtype):
        raise ValueError(f"unknown type {dtype!r}")
    root = head.get("root")
    return NcclRow(int(head["size"]), int(head["count"]), dtype, head.get("redop"),
                   int(root) if root is not None and re.fullmatch(r"-?\d+", root) else None,
                   oop, ip, line_no)


def _clean(line: str) -> str:
    line = line.rstrip("\r\n")
    line = _STAMP.sub("", line)
    return _RANK_LABEL.sub("", line).strip()


class LogReader:
    """Line-by-line state of :func:`parse`: the log so far and the table being read."""

    def __init__(self) -> None:
        self.log = NcclLog()
        self.cur = NcclTable()

    def new_table(self, test: str | None = None) -> NcclTable:
        c = self.cur
        if c.rows or c.header_seen or c.devices or c.ngpus is not None or c.test:
            self.log.tables.append(c)
        self.cur = NcclTable(test=test)
        return self.cur

    def comment(self, line: str, no: int) -> bool:
        """``#`` lines of nccl-tests (run header, devices, column header, footer)."""
        cur = self.cur
        if m := _TESTS_VERSION.match(line):
            if self.log.nccl_version is None:  # an NCCL INFO "NCCL version 2.x.y+cuda" line says more
                self.log.nccl_version = version_from_code(int(m.group(1)))
        elif m := _STARTING.match(line):
            self.new_table(m.group(1))
        elif m := _NTHREAD.match(line):
            if cur.ngpus is not None or cur.rows or cur.header_seen:
                cur = self.new_table(None)
            cur.ngpus, cur.min_bytes, cur.max_bytes = int(m.group(2)), int(m.group(3)), int(m.group(4))
        elif m := _DEVICE.match(line):
            cur.devices.append((int(m.group(1)), m.group(2), int(m.group(3)), m.group(4), m.group(5)))
        elif m := _LAST_ERROR.match(line):
            self.last_error(m.group(1))
        elif m := _OOB.match(line):
            cur.out_of_bounds = int(m.group(1))
        elif m := _AVG.match(line):
            try:
                cur.avg_busbw_gbs = parse_number(m.group(1))
            except ValueError:
                self.log.problems.append((no, f"Avg bus bandwidth not a number: {m.group(1)!r}"))
        elif line.startswith("#"):
            words = line.lstrip("#").split()
            if {"busbw"} <= set(words) and {"size", "bytes"} & set(words):
                if cur.rows:  # a second table without its own nThread line
                    cur = self.new_table(None)
                cur.header_seen, cur.columns = True, [_V1_NAMES.get(w, w) for w in words]
                cur.time_scale = 1000.0 if "bytes" in words else 1.0
        else:
            return False
        return True

    def last_error(self, text: str) -> None:
        """nccl-tests' closing report of NCCL's last WARN (``# error: ...`` from 2.17; a
        bare line in 2.13-2.16, read by :meth:`message` when it is an IB completion
        error): with ``NCCL_DEBUG`` unset it is the only trace of that WARN."""
        if text:
            self.log.warnings.append(text)
            self.ib_error(text)

    def ib_error(self, line: str) -> bool:
        """Record a NET/IB completion error (:data:`_IB`) found in ``line``."""
        ib = _IB.search(line)
        if ib is None:
            return False
        status = int(ib.group("status") or ib.group("status_eq"))
        self.log.ib_errors.append({"peer": ib.group("peer"), "wc_status": status,
                                   "wc_status_name": IBV_WC_STATUS.get(status, "unknown"),
                                   "opcode": int(ib.group("opcode")), "vendor_err": int(ib.group("vendor_err")),
                                   "direction": ib.group("direction")})
        return True

    def message(self, line: str) -> bool:
        """NCCL WARN/INFO lines, test failures, MPI aborts, the NCCL version."""
        log = self.log
        if m := _WARN.search(line):
            log.warnings.append(m.group(1))
            self.ib_error(line)
        elif m := _FAILURE.search(line):
            if not line.startswith(".."):  # " .. host: Test failure" lines are the call chain
                log.failures.append(f"{m.group(1)}: {m.group(2)}" if m.group(1) else m.group(2))
            self.ib_error(line)  # from 2.13 the failure quotes NCCL's last WARN: '<error> / <last WARN>'
        elif self.ib_error(line):  # nccl-tests 2.13-2.16 print NCCL's last WARN bare, at the end
            log.warnings.append(line)
        elif _MPI_ABORT.search(line):
            log.failures.append("mpirun: a rank exited with a non-zero status or was killed")
        elif m := _VERSION.match(line):
            log.nccl_version = m.group(1)
        elif not (" NCCL INFO " in line or "Test failure" in line):
            return False
        return True

    def other(self, line: str, no: int) -> None:
        """A result row, a command line starting the next test, or noise."""
        toks = line.split()
        if toks[0].isdigit() and len(toks) >= 3:
            try:
                row = _parse_row(toks, self.cur, no)
            except (ValueError, KeyError) as e:
                self.log.problems.append((no, f"result row not understood ({e}): {line[:120]}"))
                return
            if self.cur.avg_busbw_gbs is not None:  # rows after a footer: a second table
                self.new_table(None).columns = None
            self.cur.rows.append(row)
        elif m := TEST_COMMAND.search(toks[0]):
            self.new_table(m.group(1))
        # else: MPI banners, a header line that lost its '#', blank-ish noise


def parse(text: str) -> NcclLog:
    """Parse nccl-tests stdout/stderr (or a paste of it), or its JSON report (``-J
    file.json``, :func:`gpuguard.net.nccl_json.parse_json_report`). Never raises for bad
    input: what cannot be read lands in :attr:`NcclLog.problems`."""
    if text.lstrip().startswith("{"):
        try:
            doc = json_loads(text)
        except ValueError:
            doc = None
        if isinstance(doc, dict) and "results" in doc:
            from gpuguard.net.nccl_json import parse_json_report

            return parse_json_report(doc)
    r = LogReader()
    for no, raw in enumerate(text.splitlines(), 1):
        line = _clean(raw)
        if not line:
            continue
        if line.lower() in _ELISION or re.fullmatch(r"[.\u2026\s]{3,}", line):
            r.log.elided_lines += 1
        elif not (r.comment(line, no) or r.message(line)):
            r.other(line, no)
    r.new_table(None)
    log = r.log
    for t in log.tables:
        if not t.rows and not (log.failures or log.warnings):
            log.incomplete.append(f"{t.test or 'test'}: no results (output ends early)")
    return log


def summary(log: NcclLog) -> dict[str, Any]:
    """JSON-ready summary: per-size busbw/algbw (GB/s), errors, readability."""
    return {
        "readable": log.readable, "has_errors": log.has_errors, "nccl_version": log.nccl_version,
        "tables": [{"test": t.test, "avg_busbw_gbs": t.avg_busbw_gbs, "out_of_bounds": t.out_of_bounds,
                    "rows": len(t.rows), "gpus": sorted({d[4] for d in t.devices})} for t in log.tables],
        "busbw_gbs_by_size": {str(r.size_b): round(r.busbw_gbs, 3) for r in log.rows},
        "wrong": log.wrong_total, "warnings": log.warnings[:10], "failures": log.failures[:10],
        "ib_errors": log.ib_errors[:10], "problems": [f"line {n}: {p}" for n, p in log.problems[:10]],
        "incomplete": log.incomplete,
        "elided_lines": log.elided_lines,
    }
