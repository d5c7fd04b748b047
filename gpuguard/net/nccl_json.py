"""nccl-tests' JSON report (2.17+, ``-J file.json``) -> the :class:`NcclLog` its text
output gives (:func:`gpuguard.net.nccl_parse.parse` hands such a document here)."""

from __future__ import annotations

import re
from typing import Any

from gpuguard.net.nccl_parse import TEST_COMMAND, NcclLog, NcclResult, NcclRow, NcclTable, parse_number, LogReader, version_from_code


def _json_block(b: Any, where: str) -> NcclResult | None:
    """One ``out_of_place``/``in_place`` object of the JSON report (``writeBenchmarkLineBody``)."""
    if b is None:
        return None
    if not isinstance(b, dict):
        raise ValueError(f"{where} is not an object")
    t = b.get("time", b.get("cpu_time"))
    w = b.get("nwrong")
    if w is not None and (isinstance(w, bool) or not isinstance(w, (int, float)) or w < 0 or w != int(w)):
        raise ValueError(f"{where}.nwrong {w!r} is not a count")
    res = NcclResult(parse_number(str(t)), parse_number(str(b.get("alg_bw"))), parse_number(str(b.get("bus_bw"))),
                     None if w is None else int(w))
    if res.time_us < 0 or res.algbw_gbs < 0 or res.busbw_gbs < 0:
        raise ValueError(f"{where}: negative time or bandwidth")
    return res


def parse_json_report(doc: dict[str, Any]) -> NcclLog:
    """nccl-tests' JSON report (2.17+, ``-J file.json``; ``src/util.cu``: ``config``,
    ``devices``, ``results`` rows with ``out_of_place``/``in_place`` blocks of ``time`` or
    ``cpu_time`` (us), ``alg_bw``/``bus_bw`` (GB/s), ``nwrong`` (null with ``-c 0``),
    ``out_of_bounds.count``, ``average_bus_bandwidth.bandwidth`` (2.17.3-2.17.8:
    ``average_bus_bandwidith.bandwidith``), ``errors``: NCCL's
    last error) -> the :class:`NcclLog` its text output gives."""
    log = NcclLog()
    args = doc.get("args") if isinstance(doc.get("args"), list) else []
    prog = TEST_COMMAND.search(str(args[0])) if args else None
    t = NcclTable(test=prog.group(1) if prog else None, header_seen=True)
    cfg = doc.get("config") if isinstance(doc.get("config"), dict) else {}
    t.ngpus, t.min_bytes, t.max_bytes = cfg.get("ngpus"), cfg.get("minimum_bytes"), cfg.get("maximum_bytes")
    for d in doc.get("devices") or []:
        if isinstance(d, dict):
            t.devices.append((d.get("rank"), d.get("hostname"), d.get("device"), d.get("device_hex"),
                              d.get("device_info")))
    for i, r in enumerate(doc.get("results") or [], 1):
        try:
            if not isinstance(r, dict):
                raise ValueError("not an object")
            root = str(r.get("root", "")).strip()
            t.rows.append(NcclRow(int(r["size"]), int(r["count"]), str(r.get("type")), r.get("redop"),
                                  int(root) if re.fullmatch(r"-?\d+", root) else None,
                                  _json_block(r.get("out_of_place"), "out_of_place"),
                                  _json_block(r.get("in_place"), "in_place"), i))
        except (KeyError, TypeError, ValueError) as e:
            log.problems.append((i, f"results[{i - 1}] not understood: {e}"))
    # nccl-tests 2.17.3-2.17.8 spelled the footer "average_bus_bandwidith": {"bandwidith": ...}
    # (src/util.cu writeResultFooter; corrected in 2.17.9 / 2.18.0, commit 85ca91d)
    oob = doc.get("out_of_bounds")
    avg = doc.get("average_bus_bandwidth", doc.get("average_bus_bandwidith"))
    if isinstance(oob, dict) and isinstance(oob.get("count"), int):
        t.out_of_bounds = oob["count"]
    bw = avg.get("bandwidth", avg.get("bandwidith")) if isinstance(avg, dict) else None
    if isinstance(bw, (int, float)) and not isinstance(bw, bool):
        t.avg_busbw_gbs = float(bw)
    log.tables.append(t)
    if not t.rows:
        log.incomplete.append(f"{t.test or 'test'}: no results (output ends early)")
    reader = LogReader()
    reader.log = log
    for e in doc.get("errors") or []:
        reader.last_error(str(e).strip())
    v = doc.get("nccl_version")
    if isinstance(v, int) and not isinstance(v, bool):
        log.nccl_version = version_from_code(v)
    return log

