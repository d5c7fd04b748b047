"""``nvidia-smi --query-gpu=... --format=csv[,nounits]`` (and ``--query-remapped-rows``)
-> :class:`~gpuguard.model.NodeSnapshot`.

The columns are whatever the operator asked for, in that order, named on the header line
by their ``--help-query-gpu`` names (``temperature.gpu``, ``power.draw [W]``,
``ecc.errors.uncorrected.volatile.total``...). With ``nounits`` the unit moves from each
value (``32.70 W``) into the header (``power.draw [W]``); either way it is dropped.
Values use the sentinels of ``-q`` (``[N/A]``, ``[Not Supported]``, ``[Unknown Error]``,
``[GPU requires reset]``), read by :class:`~gpuguard.gpu.nvsmi_common.ValueReader`.
``fabric.state`` / ``fabric.status`` fill the NVLink fabric registration fields
(:func:`~gpuguard.gpu.nvsmi_common.read_fabric`). Columns gpuguard has no field for (``fan.speed``, ``pstate``...) are skipped.

``clocks_throttle_reasons.active`` / ``clocks_event_reasons.active`` (R535 renamed
"throttle" to "event") is the NVML bit mask in hex (``0x0000000000000004``), decoded by
:func:`gpuguard.model.decode_clock_event_reasons`; without it the per-reason columns
(``clocks_event_reasons.hw_slowdown``: ``Active``/``Not Active``) give the reasons.

Refused with :class:`NvsmiParseError` (one line): CSV without the header line
(``noheader``: the columns cannot be named; the header-less ``index, gpu_recovery_action``
pair is read by :func:`gpuguard.gpu.nvsmi_lost.parse_recovery_csv`), a header with no
column gpuguard judges (``index, name`` only), and rows whose field count differs from
the header's.
"""

from __future__ import annotations

import re
import time
from datetime import datetime

from gpuguard.gpu.nvsmi_common import csv_rows, NvsmiParseError, ValueReader, clean_value, order_reasons, read_fabric
from gpuguard.model import CLOCK_EVENT_REASONS, GpuState, NodeSnapshot, decode_clock_event_reasons, norm_pci

SOURCE = "nvidia-smi-query"

#: ``--help-query-gpu`` / ``--help-query-remapped-rows`` name -> (GpuState field, kind).
#: Where nvidia-smi has two names for one value (``gpu_bus_id`` is ``pci.bus_id``), both
#: are listed; where a GPU field has several sources, the first column present wins
#: (:data:`_PREFERENCE`).
_FIELDS: dict[str, tuple[str, str]] = {
    "index": ("index", "int"),
    "name": ("name", "text"), "gpu_name": ("name", "text"),
    "uuid": ("uuid", "text"), "gpu_uuid": ("uuid", "text"),
    "serial": ("serial", "text"), "gpu_serial": ("serial", "text"),
    "pci.bus_id": ("pci_bus_id", "bus"), "gpu_bus_id": ("pci_bus_id", "bus"),
    "vbios_version": ("vbios_version", "text"),
    "inforom.img": ("inforom_version", "text"), "inforom.image": ("inforom_version", "text"),
    "persistence_mode": ("persistence_mode", "bool"),
    "mig.mode.current": ("mig_mode", "bool"),
    "temperature.gpu": ("temp_c", "float"),
    "power.draw": ("power_w", "float"), "power.draw.average": ("power_w", "float"),
    "power.draw.instant": ("power_w", "float"),
    "enforced.power.limit": ("power_limit_w", "float"), "power.limit": ("power_limit_w", "float"),
    "clocks.current.sm": ("sm_clock_mhz", "float"), "clocks.sm": ("sm_clock_mhz", "float"),
    "clocks.current.memory": ("mem_clock_mhz", "float"), "clocks.mem": ("mem_clock_mhz", "float"),
    "clocks.max.sm": ("sm_clock_max_mhz", "float"),
    "clocks.max.memory": ("mem_clock_max_mhz", "float"), "clocks.max.mem": ("mem_clock_max_mhz", "float"),
    "utilization.gpu": ("gpu_util_pct", "float"), "utilization.memory": ("mem_util_pct", "float"),
    "memory.used": ("mem_used_mib", "float"), "memory.total": ("mem_total_mib", "float"),
    "ecc.mode.current": ("ecc_enabled", "bool"),
    "ecc.errors.corrected.volatile.total": ("ecc_volatile_corrected", "int"),
    "ecc.errors.uncorrected.volatile.total": ("ecc_volatile_uncorrected", "int"),
    "ecc.errors.corrected.aggregate.total": ("ecc_aggregate_corrected", "int"),
    "ecc.errors.uncorrected.aggregate.total": ("ecc_aggregate_uncorrected", "int"),
    "retired_pages.single_bit_ecc.count": ("retired_pages_sbe", "int"), "retired_pages.sbe": ("retired_pages_sbe", "int"),
    "retired_pages.double_bit.count": ("retired_pages_dbe", "int"), "retired_pages.dbe": ("retired_pages_dbe", "int"),
    "retired_pages.pending": ("retired_pages_pending", "bool"),
    "remapped_rows.correctable": ("remapped_rows_correctable", "int"),
    "remapped_rows.uncorrectable": ("remapped_rows_uncorrectable", "int"),
    "remapped_rows.pending": ("remapped_rows_pending", "bool"),
    "remapped_rows.failure": ("remapped_rows_failure", "bool"),
    "pcie.link.gen.current": ("pcie_gen_current", "int"), "pcie.link.gen.gpucurrent": ("pcie_gen_current", "int"),
    "pcie.link.gen.max": ("pcie_gen_max", "int"), "pcie.link.gen.gpumax": ("pcie_gen_max", "int"),
    "pcie.link.width.current": ("pcie_width_current", "int"), "pcie.link.width.max": ("pcie_width_max", "int"),
    "gpu_recovery_action": ("recovery_action", "recovery"),
    # NVLink fabric registration (R550+ --help-query-gpu: "fabric.state", "fabric.status")
    "fabric.state": ("fabric_state", "fabric"), "fabric.status": ("fabric_status", "fabric"),
}
#: Columns that carry nothing to judge: a CSV of only these is refused.
_IDENTITY = {"index", "name", "gpu_name", "uuid", "gpu_uuid", "serial", "gpu_serial", "pci.bus_id", "gpu_bus_id",
             "vbios_version", "inforom.img", "inforom.image", "driver_version", "timestamp", "count"}
_REASON_PREFIXES = ("clocks_event_reasons.", "clocks_throttle_reasons.")
#: The per-reason column suffixes (nvidia-smi's; ``display_clock_setting`` is NVML's).
_REASON_SUFFIX = {name: name for name in CLOCK_EVENT_REASONS} | {"display_clocks_setting": "display_clock_setting"}
_UNIT_RE = re.compile(r"\s*\[[^\]]*\]\s*$")


def _column(name: str) -> str:
    """``power.draw [W]`` -> ``power.draw`` (lower case)."""
    return _UNIT_RE.sub("", name).strip().lower()


#: The shape of a ``--help-query-gpu`` property name (``encoder.stats.sessionCount``).
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*(?:\.[a-z0-9_]+)*$")


def _judged(col: str) -> bool:
    """A column gpuguard reads a health value from."""
    if col in _FIELDS:
        return col not in _IDENTITY
    return any(col.startswith(p) and (col[len(p):] in _REASON_SUFFIX or col[len(p):] == "active")
               for p in _REASON_PREFIXES)


def _header(text: str) -> list[str] | None:
    """The column names of the first line, or None when it is not a header of property names."""
    first = next((ln for ln in text.splitlines() if ln.strip()), "")
    cols = [_column(c) for c in first.split(",")]
    return cols if all(_NAME_RE.match(c) for c in cols) else None


def looks_like_query_csv(text: str) -> bool:
    """True when the first line is a ``--query-gpu``/``--query-remapped-rows`` CSV header
    (property names) with at least one column gpuguard judges."""
    cols = _header(text)
    return cols is not None and any(_judged(c) for c in cols)


def _bool(rd: ValueReader, field: str, raw: str) -> bool | None:
    # nvidia-smi prints Yes/No (remapped_rows.pending), Enabled/Disabled...; 0/1 is read too
    v = clean_value(raw)
    if v in ("0", "1"):
        return v == "1"
    return rd.bool(field, raw)


def _timestamp(raw: str | None) -> float | None:
    """``2021/06/26 16:19:47.995`` (node local time) -> epoch seconds."""
    v = clean_value(raw) or ""
    try:
        return time.mktime(datetime.strptime(v, "%Y/%m/%d %H:%M:%S.%f").timetuple())
    except ValueError:
        return None


def _reasons(rd: ValueReader, row: dict[str, str]) -> list[str] | None:
    for p in _REASON_PREFIXES:
        raw = row.get(p + "active")
        if raw is None:
            continue
        v = rd.text("clock_event_reasons", raw)
        if v is None:
            return None
        try:
            return decode_clock_event_reasons(int(v, 16))
        except ValueError:
            raise ValueError(f"{p}active {v!r} is not a hex bit mask") from None
    seen, active = False, []
    for col, raw in row.items():
        p = next((p for p in _REASON_PREFIXES if col.startswith(p)), None)
        name = _REASON_SUFFIX.get(col[len(p):]) if p else None
        if name is None:
            continue
        state = rd.bool("clock_event_reasons", raw)
        if state is not None:
            seen = True
            if state:
                active.append(name)
    return order_reasons(active) if seen else None


def _gpu(row: dict[str, str], n: int, where: str) -> GpuState:
    g = GpuState(index=n - 1)
    rd = ValueReader(g.read_errors, where=where)
    done: set[str] = set()
    for col, raw in row.items():
        spec = _FIELDS.get(col)
        if spec is None or spec[0] in done:
            continue
        field, kind = spec
        if kind == "fabric":
            continue  # both columns at once, below
        if kind == "int":
            v = rd.int(field, raw)
        elif kind == "float":
            v = rd.float(field, raw)
        elif kind == "bool":
            v = _bool(rd, field, raw)
        elif kind == "bus":
            text = rd.text(field, raw)
            v = norm_pci(text) if text else None
        elif kind == "recovery":
            v = rd.recovery_action(raw, strict=True)
        else:
            v = rd.text(field, raw)
        if v is None:
            continue
        if field == "index" and v < 0:
            raise NvsmiParseError(f"{where}: row {n}: index {v} is negative")
        setattr(g, field, v)
        done.add(field)
    g.clock_event_reasons = _reasons(rd, row)
    if "fabric.state" in row or "fabric.status" in row:
        read_fabric(g, rd, row.get("fabric.state"), row.get("fabric.status"))
    return g


def parse_query_csv(text: str, where: str, taken_at: float) -> NodeSnapshot:
    """Parse ``--query-gpu``/``--query-remapped-rows`` CSV with its header line. The GPU
    index is the ``index`` column, else the row's position. ``taken_at``: used when the
    CSV has no ``timestamp`` column. Raises :class:`NvsmiParseError`."""
    if not looks_like_query_csv(text):
        raise NvsmiParseError(f"{where}: not nvidia-smi --query-gpu CSV with its header line and a column to judge")
    rows = csv_rows(text, where)
    cols = [_column(c) for c in rows[0]]
    snap = NodeSnapshot(taken_at=taken_at, source=SOURCE)
    for n, values in enumerate(rows[1:], 1):
        if len(values) != len(cols):
            raise NvsmiParseError(f"{where}: row {n}: {len(values)} fields, the header has {len(cols)}")
        row = dict(zip(cols, values, strict=True))
        try:
            g = _gpu(row, n, where)
        except NvsmiParseError:
            raise
        except ValueError as e:
            raise NvsmiParseError(f"{where}: row {n}: {e}") from None
        rd = ValueReader({}, where=where)
        g.driver_version = rd.text("driver_version", row.get("driver_version"))
        if n == 1:
            snap.driver_version = g.driver_version
            stamp = _timestamp(row.get("timestamp"))
            if stamp is not None:
                snap.taken_at = stamp
        snap.gpus.append(g)
    return snap
