"""Value handling shared by the ``nvidia-smi -q`` text and ``-q -x`` XML parsers.

nvidia-smi prints every value as text with its unit (``67.74 W``, ``16x``, ``29 C``)
and uses a handful of sentinel strings for fields it cannot read. This module turns
those strings into the typed values of :class:`gpuguard.model.GpuState`:

* *Not available* sentinels (``N/A``, ``[N/A]``, ``Not Supported``, ``Not Available``,
  ``Requested functionality has been deprecated``, an empty value) become ``None``
  with no error: the model reserves ``None`` for "unsupported", never zero.
* *Read-error* sentinels (``Unknown Error``, ``GPU is lost``, ``GPU requires reset``,
  ``Insufficient Permissions``, ``Timeout``) become ``None`` **and** are recorded in
  ``GpuState.read_errors`` under the model field name, with the NVML error name
  (``Unknown``, ``GpuIsLost``, ...), so the checks can raise a finding.
* A value that is neither a sentinel nor parseable (a layout we do not know) becomes
  ``None`` and is logged; it is *not* a read error, so our own parsing gaps never
  drain a node (DESIGN.md, "Fail open on our own errors").
"""

from __future__ import annotations

import csv
import io
import logging
import re
import time
from collections.abc import Iterable
from typing import Any

from gpuguard.model import CLOCK_EVENT_REASONS, NodeSnapshot

log = logging.getLogger(__name__)


class NvsmiParseError(ValueError):
    """An nvidia-smi dump that cannot be read at all (wrong format, malformed XML,
    unsafe XML). The message is one line and names the file when one is known."""


def csv_rows(text: str, where: str) -> list[list[str]]:
    """The non-blank rows of nvidia-smi's comma-separated ``text`` (``--format=csv``:
    a space after each comma, skipped). Raises :class:`NvsmiParseError` naming ``where``
    and the line when the csv module cannot read it, e.g. a field longer than its limit
    (``csv.field_size_limit()``, 131,072 characters by default: no nvidia-smi value is
    near it), so such a file is "could not check", never a traceback."""
    reader = csv.reader(io.StringIO(text), skipinitialspace=True)
    try:
        return [r for r in reader if any(c.strip() for c in r)]
    except csv.Error as e:
        what = (f"a field longer than {csv.field_size_limit()} characters" if "field limit" in str(e)
                else str(e))
        raise NvsmiParseError(f"{where}: line {reader.line_num}: {what} (not nvidia-smi CSV)") from None


_NOT_AVAILABLE = {
    "",
    "n/a",
    "not supported",
    "not available",
    "requested functionality has been deprecated",
    "none",
}

#: nvidia-smi error strings -> NVML error name stored in ``GpuState.read_errors``.
READ_ERROR_NAMES = {
    "unknown error": "Unknown",
    "gpu is lost": "GpuIsLost",
    "gpu requires reset": "ResetRequired",
    "insufficient permissions": "NoPermission",
    "timeout": "Timeout",
}

#: a number and its unit: ``W``, ``MHz``, ``%``, or ``bank(s)`` (``Bank Remap Availability Histogram``)
_NUMBER_RE = re.compile(r"^([+-]?\d+(?:\.\d+)?)\s*(?:[A-Za-z%]+(?:\(s\))?)?$")

_TRUE = {"enabled", "yes", "active", "true", "on"}
_FALSE = {"disabled", "no", "not active", "false", "off"}


def clean_value(raw: str | None) -> str | None:
    """Strip whitespace and ``[...]`` brackets from a raw value (XML text nodes can
    span lines). Returns ``None`` only for a missing value."""
    if raw is None:
        return None
    s = " ".join(raw.split())
    if len(s) >= 2 and s[0] == "[" and s[-1] == "]":
        s = s[1:-1].strip()
    return s


def first_available(raws: Iterable[str | None]) -> str | None:
    """Of the raw values of one quantity under its successive names (``Power Draw``,
    ``Average Power Draw``, ``Instantaneous Power Draw``), the first that is present and
    not a *not available* sentinel; else the first present one (its ``N/A`` then reads as
    ``None``); ``None`` when none is present. R545+ drivers print ``Average Power Draw :
    N/A`` on GPUs without averaged power (Volta, Turing) next to the instantaneous reading."""
    present = [r for r in raws if r is not None]
    for r in present:
        v = clean_value(r)
        if v is not None and v.lower() not in _NOT_AVAILABLE:
            return r
    return present[0] if present else None


class ValueReader:
    """Converts one GPU's raw nvidia-smi strings to typed values.

    Each method takes the model field name (for ``read_errors``) and the raw string
    (``None`` when the key is absent from the dump) and returns the typed value or
    ``None``. Read-error sentinels are recorded into the ``read_errors`` dict given at
    construction (normally ``GpuState.read_errors``).
    """

    def __init__(self, read_errors: dict[str, str], where: str = "") -> None:
        self.read_errors = read_errors
        self.where = where

    def text(self, field: str, raw: str | None) -> str | None:
        """A string value; ``None`` for sentinels."""
        s = clean_value(raw)
        if s is None:
            return None
        low = s.lower()
        if low in READ_ERROR_NAMES:
            self.read_errors[field] = READ_ERROR_NAMES[low]
            return None
        if low in _NOT_AVAILABLE:
            return None
        return s

    def _number(self, field: str, raw: str | None) -> str | None:
        s = self.text(field, raw)
        if s is None:
            return None
        m = _NUMBER_RE.match(s)
        if not m:
            log.warning(
                "%s: cannot read %s from %r; left as None",
                self.where or "nvidia-smi",
                field,
                s,
            )
            return None
        return m.group(1)

    def int(self, field: str, raw: str | None) -> int | None:
        """An integer counter; the unit suffix (``x``, ``C``...) is dropped."""
        s = self._number(field, raw)
        if s is None:
            return None
        return int(float(s)) if "." in s else int(s)

    def float(self, field: str, raw: str | None) -> float | None:
        """A measurement in the unit of the model field (W, MHz, MiB, C, %)."""
        s = self._number(field, raw)
        return None if s is None else float(s)

    def bool(self, field: str, raw: str | None) -> bool | None:
        """``Enabled``/``Yes``/``Active`` -> True, ``Disabled``/``No``/``Not Active`` -> False."""
        s = self.text(field, raw)
        if s is None:
            return None
        low = s.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        log.warning(
            "%s: cannot read %s from %r; left as None",
            self.where or "nvidia-smi",
            field,
            s,
        )
        return None

    def recovery_action(self, raw: str | None, strict: bool = False) -> int | None:
        """The NVML ``nvmlDeviceGpuRecoveryAction_t`` value of a printed GPU recovery
        action (``None``, ``Reset``, ``0x2 (OS Reboot)``...:
        :func:`gpuguard.xid.catalog.recovery_action_code`), field ``recovery_action``.

        Its sentinels are those of every other field: ``N/A`` / ``[Not Supported]`` ->
        ``None``; ``[GPU requires reset]``, ``[Unknown Error]``, ``[GPU is lost]`` ->
        ``None`` and recorded in ``read_errors`` (a GPU nvidia-smi cannot read is a
        finding, not a parse failure of the whole dump). Text that is neither a sentinel
        nor a known action -> ``None`` and logged, or ``ValueError`` with ``strict``."""
        from gpuguard.xid.catalog import recovery_action_code

        code = recovery_action_code(clean_value(raw))  # first: "None" is action 0, not N/A
        if code is not None:
            return code
        s = self.text("recovery_action", raw)
        if s is None:
            return None
        if strict:
            raise ValueError(f"unknown GPU recovery action {s!r}")
        log.warning("%s: cannot read recovery_action from %r; left as None", self.where or "nvidia-smi", s)
        return None

    def counter_sum(self, field: str, raws: Iterable[str | None]) -> int | None:
        """Sum of several counters (SRAM + DRAM, parity + SEC-DED). ``None`` when no
        part is available; parts that are ``N/A`` are left out of the sum."""
        total = None
        for raw in raws:
            v = self.int(field, raw)
            if v is not None:
                total = (total or 0) + v
        return total


def order_reasons(names: Iterable[str]) -> list[str]:
    """Reason names in NVML bit order (the order of ``CLOCK_EVENT_REASONS``)."""
    wanted = set(names)
    return [n for n in CLOCK_EVENT_REASONS if n in wanted]


_TABLE_RE = re.compile(r"^\|\s*NVIDIA-SMI\s", re.MULTILINE)
_TABLE_RULE_RE = re.compile(r"^\+-{10,}", re.MULTILINE)
_NVLINK_STATUS_RE = re.compile(r"^GPU \d+: .*\(UUID: ")
_XML_START_RE = re.compile(r"^\s*(?:<\?xml|<!DOCTYPE\s+nvidia_smi_log|<nvidia_smi_log)")


def is_xml(text: str) -> bool:
    """True when ``text`` starts like ``nvidia-smi -q -x`` output (``<?xml`` or
    ``<nvidia_smi_log``, after an optional BOM and whitespace)."""
    return bool(_XML_START_RE.match(text.lstrip("\ufeff")))


def reject_other_formats(text: str, where: str) -> None:
    """Raise :class:`NvsmiParseError` for dumps of the *other* nvidia-smi outputs
    (the default table, ``--query-gpu`` CSV, ``nvlink --status``) and empty input,
    with a message that says which command to run instead."""
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    if not first:
        raise NvsmiParseError(
            f"{where}: empty input; expected the output of nvidia-smi -q or nvidia-smi -q -x"
        )
    if _TABLE_RE.search(text) or (_TABLE_RULE_RE.search(text) and "|" in text):
        raise NvsmiParseError(
            f"{where}: this is the default nvidia-smi table, which drops counters; use nvidia-smi -q "
            "(or nvidia-smi -q -x)"
        )
    if _NVLINK_STATUS_RE.match(first):
        raise NvsmiParseError(
            f"{where}: this is nvidia-smi nvlink --status output; use nvidia-smi -q "
            "(or nvidia-smi -q -x)"
        )
    if "," in first and " : " not in first and not is_xml(text):
        raise NvsmiParseError(
            f"{where}: this is comma-separated output without a header line of --query-gpu property names "
            "(--format=csv,noheader?) or with no column to judge: keep the header, or use nvidia-smi -q "
            "(or nvidia-smi -q -x)"
        )


_TIMESTAMP_RE = re.compile(
    r"^(?:[A-Za-z]{3}\s+)?([A-Za-z]{3})\s+(\d{1,2})\s+(\d{1,2}):(\d{2}):(\d{2})\s+(\d{4})$"
)
_MONTH_NAMES = (
    "jan",
    "feb",
    "mar",
    "apr",
    "may",
    "jun",
    "jul",
    "aug",
    "sep",
    "oct",
    "nov",
    "dec",
)
_MONTHS = {m: i for i, m in enumerate(_MONTH_NAMES, 1)}


def parse_timestamp(value: str | None) -> float | None:
    """``Wed Jul 31 11:22:39 2024`` -> epoch seconds, or ``None`` if unreadable.

    nvidia-smi prints the node's local time without a zone, so the string is read in
    this process's local time zone (``TZ``): exact when parsed on the node that wrote
    it, off by the zone difference for a dump carried to another machine.
    """
    if not value:
        return None
    m = _TIMESTAMP_RE.match(" ".join(value.split()))
    if not m or m.group(1).lower() not in _MONTHS:
        return None
    mon, day, hh, mm, ss, year = m.groups()
    y, d, h, mi, sec = int(year), int(day), int(hh), int(mm), int(ss)
    local = (y, _MONTHS[mon.lower()], d, h, mi, sec, 0, 0, -1)
    try:
        return time.mktime(local)
    except (OverflowError, ValueError):
        return None


def new_snapshot(source: str, where: str, driver_raw: str | None, cuda_raw: str | None,
                 timestamp_raw: str | None, taken_at: float | None) -> NodeSnapshot:
    """The (GPU-less) :class:`NodeSnapshot` both dump formats start from: driver and CUDA
    versions, and ``taken_at`` from the dump's own timestamp, else ``taken_at``, else now."""
    rd = ValueReader({}, where=where)
    stamp = parse_timestamp(timestamp_raw)
    return NodeSnapshot(
        taken_at=stamp if stamp is not None else (taken_at if taken_at is not None else time.time()),
        source=source,
        driver_version=rd.text("driver_version", driver_raw),
        cuda_version=rd.text("cuda_version", cuda_raw),
    )


#: ``Incorrect Configuration`` texts -> reason (:data:`gpuguard.model.FABRIC_INCORRECT_CONFIGURATION`):
#: the printed words, lower-cased with everything but letters and digits dropped, are
#: matched on a keyword (the nvml.h names: SYSGUID, CHASSIS_SN, NO_PARTITION,
#: INSUFFICIENT_NVLINKS, INCOMPATIBLE_GPU_FW, INVALID_LOCATION, GPU_STATE_INVALID).
_INCORRECT_CONFIG_WORDS = (("sysguid", "incorrect_sysguid"), ("chassis", "incorrect_chassis_sn"),
                           ("partition", "no_partition"), ("nvlink", "insufficient_nvlinks"),
                           ("firmware", "incompatible_gpu_fw"), ("fw", "incompatible_gpu_fw"),
                           ("location", "invalid_location"), ("state", "gpu_state_invalid"))


def _known_name(where: str, field_name: str, text: str, names: Any) -> str | None:
    """``text`` as a snake_case name (``"In Progress"`` -> ``in_progress``) when it is one
    of ``names``; else None, logged (a value gpuguard does not know is our parsing gap)."""
    name = "_".join(text.lower().split())
    if name in names:
        return name
    log.warning("%s: cannot read %s from %r; left as None", where, field_name, text)
    return None


def read_fabric(gpu: Any, rd: ValueReader, state: str | None, status: str | None, clique: str | None = None,
                cluster: str | None = None, summary: str | None = None,
                flags: dict[str, str | None] | None = None, incorrect: str | None = None) -> None:
    """Fill ``gpu``'s ``fabric_*`` fields from the printed values of nvidia-smi's
    ``Fabric`` block (``-q`` text and ``-q -x`` XML alike; ``--query-gpu`` gives
    ``fabric.state`` / ``fabric.status`` only). ``flags``: :data:`FABRIC_HEALTH_FLAGS`
    name -> printed value. ``N/A`` (GPUs without NVLink fabric) leaves every field None.

    ``Status`` is the registration's *error* (``Success``, ``Insufficient Resources``,
    ``Unknown Error``): kept as printed, never a read error of the dump. A state or health
    text gpuguard does not know is logged and left None (our parsing gap is no fault;
    ``Summary`` still says ``Unhealthy`` for any problem)."""
    from gpuguard.model import FABRIC_HEALTH_FLAGS, FABRIC_HEALTH_SUMMARIES, FABRIC_STATES

    where = rd.where or "nvidia-smi"
    s = rd.text("fabric_state", state)
    if (clean_value(state) or "").lower() == "not supported":
        gpu.fabric_state = "not_supported"  # NVML state 0: not an N/A to drop, a GPU without a fabric
    elif s is not None:
        gpu.fabric_state = _known_name(where, "fabric_state", s, FABRIC_STATES.values())
    st = clean_value(status)
    if st and st.lower() not in _NOT_AVAILABLE:
        gpu.fabric_status = st
    gpu.fabric_clique_id = rd.int("fabric_clique_id", clique)
    gpu.fabric_cluster_uuid = rd.text("fabric_cluster_uuid", cluster)
    sm = rd.text("fabric_health_summary", summary)
    if sm is not None:
        gpu.fabric_health_summary = _known_name(where, "fabric_health_summary", sm, FABRIC_HEALTH_SUMMARIES.values())
    health: list[str] = []
    seen = False
    for name, raw in (flags or {}).items():
        v = rd.text("fabric_health", raw)
        if v is None:
            continue
        seen = True
        bad = FABRIC_HEALTH_FLAGS[name][3]
        if v.lower() == bad:
            health.append(name)
        elif v.lower() not in ("full", "false"):
            log.warning("%s: cannot read fabric health %s from %r; ignored", where, name, v)
    ic = rd.text("fabric_health", incorrect)
    if ic is not None:
        seen = True
        word = re.sub(r"[^a-z0-9]", "", ic.lower())
        reason = next((r for k, r in _INCORRECT_CONFIG_WORDS if k in word), None)
        if reason is not None:
            health.append(f"incorrect_configuration.{reason}")
        elif word != "none":
            log.warning("%s: cannot read fabric Incorrect Configuration from %r; ignored", where, ic)
    if seen:
        gpu.fabric_health = health
