"""XID / SXid classification as data: code -> name, meaning, default action, source.

Every row carries the public source(s) it rests on (abbreviations from
``shared/XID.md``):

* ``NV``  NVIDIA's XID catalog ("immediate action" column, as mirrored in GPUd's
  generated catalog, 2025-10).
* ``DC``  DCGM health-watch XID mapping (``DcgmHealthWatch.cpp``): fail / warn.
* ``KDP`` NVIDIA k8s-device-plugin "application error" list {13, 31, 43, 45, 68}.
* ``GCM`` facebookresearch/gcm: non-critical {13, 31, 43, 45, 63, 68, 92, 109}.
* ``AZ``  Azure HPC health checks: drain on {48, 56-58, 62-65, 68, 69, 73, 74,
  79-81, 92, 119, 120}.
* ``FM``  NVIDIA Fabric Manager user guide (NVSwitch SXid list).

The action is the *default* the policy table starts from; rows marked "disputed" in
the meaning are exactly where a site is expected to override it (DESIGN.md: one policy
table maps finding codes ``xid.<N>`` / ``sxid.<N>`` to actions). Severity follows the
action: ``record`` -> ``info``, ``alert`` -> ``warning``, ``drain`` -> ``critical``.

Rules that read the message, not just the code (all in :func:`classify`):

* XID 144-150 (NVLink5, GB200 era): the driver prints ``Fatal`` or ``Nonfatal`` in
  the message. Fatal -> drain, Nonfatal -> alert, neither word -> alert (source: XID.md
  "drain on fatal rows only").
* XID 154 (GPU recovery action changed): act on the *new* action after ``to``,
  classified by its numeric code (NVML ``nvmlDeviceGpuRecoveryAction_t``: 0x0 None,
  0x1 GPU Reset, 0x2 Node Reboot, 0x3 Drain P2P, 0x4 Drain and Reset) whatever name
  the driver prints (a newer driver says ``0x2 (OS Reboot)``); the name is read only
  when no number is printed. Reset / reboot / drain-and-reset -> drain, drain P2P ->
  alert, none -> record (source: DC, which fails on reset / reboot / drain-and-reset
  and warns on drain-P2P). Unreadable -> alert.
* SXid (NVSwitch): a message containing ``Non-fatal`` -> alert, ``Fatal`` -> drain;
  otherwise the row's default (unknown SXid -> alert).
* A ``fallen_off_bus`` event (no Xid line) is classified as XID 79.

Unknown XIDs default to ``alert`` / ``warning``: draining on every code we do not know
would drain whole clusters after a driver upgrade adds new (often informational)
codes, while ``record`` would hide a new hardware fault from the operator. An alert
makes a human look once and add a row or a policy override. (GCM treats all unknown
codes as critical; we deliberately do not.)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

ACTIONS = ("record", "alert", "drain")

#: Severity implied by each default action.
SEVERITY_FOR_ACTION = {"record": "info", "alert": "warning", "drain": "critical"}


@dataclass(frozen=True)
class XidRow:
    """One catalog row. ``action`` is one of :data:`ACTIONS`; ``source`` names the
    public sources (see module docstring) the action rests on."""

    code: int
    name: str
    meaning: str
    action: str
    source: str

    @property
    def severity(self) -> str:
        return SEVERITY_FOR_ACTION[self.action]


@dataclass(frozen=True)
class Classification:
    """The verdict for one event: default ``action`` (``record`` | ``alert`` |
    ``drain``), ``severity`` (``info`` | ``warning`` | ``critical``), the row's short
    ``name`` and ``meaning``, and the ``source`` the decision rests on."""

    action: str
    severity: str
    name: str
    meaning: str
    source: str


class _EventLike(Protocol):
    kind: str
    xid: int
    message: str


def _rows(*rows: tuple[int, str, str, str, str]) -> dict[int, XidRow]:
    out: dict[int, XidRow] = {}
    for code, name, meaning, action, source in rows:
        if action not in ACTIONS:
            raise ValueError(f"bad action {action!r} for XID {code}")
        out[code] = XidRow(code, name, meaning, action, source)
    return out


# fmt: off
#: GPU XID rows. Columns: code, short name, meaning, default action, source.
XID_TABLE: dict[int, XidRow] = _rows(
    (13, "graphics engine exception", "Application fault on the SM (illegal instruction, out-of-range address); restart the app", "record", "NV restart app; KDP app; GCM non-critical"),
    (31, "GPU memory page fault", "MMU fault, usually an application bug; repeated on one GPU across jobs suggests hardware", "record", "NV restart app; KDP app; DC warn"),
    (32, "invalid or corrupted push buffer stream", "Corrupted command stream from the driver/application (DMA, PCIe or driver fault)", "alert", "NV (no app action listed)"),
    (38, "driver firmware error", "Driver firmware error; check driver/firmware versions", "alert", "NV"),
    (43, "GPU stopped processing", "Channel reset after an application fault; the GPU keeps working", "record", "NV ignore; KDP app; GCM non-critical"),
    (45, "preemptive cleanup", "Cleanup after an earlier error; follow the companion XID (the 'previous Xid N' is not this code)", "record", "NV follow companion; KDP app; GCM non-critical"),
    (46, "GPU stopped processing", "GPU stopped; needs a GPU reset", "drain", "NV reset GPU; GPUd fatal"),
    (48, "double-bit ECC error", "Uncorrectable (DBE) ECC error in GPU memory", "drain", "NV reset GPU; DC fail; AZ drain"),
    (56, "display engine error", "Display engine error", "drain", "AZ drain"),
    (57, "video memory interface programming error", "Error programming video memory interface", "drain", "AZ drain"),
    (58, "unstable video memory interface", "Unstable video memory interface detected", "drain", "AZ drain"),
    (61, "internal micro-controller breakpoint/warning", "GPU firmware (PMU) breakpoint or warning; often precedes XID 62", "alert", "NV; AZ does not drain"),
    (62, "internal micro-controller halt", "GPU firmware (PMU/GSP) halted; needs a GPU reset", "drain", "NV reset GPU; AZ drain"),
    (63, "row-remapping / page-retirement event", "A row was marked for remapping; takes effect after a GPU reset (drain after the job). Disputed: AZ drains", "alert", "NV ignore until reset; GCM non-critical; DC warn; AZ drain"),
    (64, "row-remapping / page-retirement failure", "Remapping could not be recorded; likely RMA", "drain", "NV reset GPU; DC fail; AZ drain"),
    (65, "video processor exception", "Video processor exception", "drain", "AZ drain"),
    (68, "video decoder (NVDEC) exception", "NVDEC exception. Disputed: application per KDP/GCM, drain per AZ", "alert", "NV restart app; KDP app; GCM non-critical; AZ drain"),
    (69, "graphics engine class error", "Graphics engine class error", "drain", "AZ drain"),
    (73, "NVENC2 error", "Video encoder error", "drain", "AZ drain"),
    (74, "NVLink error", "NVLink error (fatal register tuple); NVLink workflow", "drain", "NV NVLink workflow; DC fail; AZ drain"),
    (79, "GPU has fallen off the bus", "GPU no longer reachable on PCIe; reboot / power-cycle", "drain", "NV reboot; DC fail; AZ drain; all sources"),
    (80, "corrupted data sent to GPU", "Corrupted data sent to GPU", "drain", "AZ drain"),
    (81, "VGA subsystem error", "VGA subsystem error", "drain", "AZ drain"),
    (92, "high single-bit ECC error rate", "Correctable ECC error rate is high. Disputed: AZ drains", "alert", "NV ignore; GCM non-critical; AZ drain"),
    (94, "contained ECC error", "Uncorrectable ECC error contained to one application; restart the app", "alert", "NV restart app; DC warn"),
    (95, "uncontained ECC error", "Uncorrectable ECC error not contained; reset the GPU", "drain", "NV reset GPU; DC fail"),
    (109, "context-switch timeout", "Context switch timeout. Disputed: GCM non-critical", "alert", "NV reset GPU; GCM non-critical"),
    (119, "GSP RPC timeout", "GPU System Processor did not answer an RPC; reset the GPU", "drain", "NV reset GPU; DC fail; AZ drain"),
    (120, "GSP error", "GPU System Processor error; reset the GPU", "drain", "NV reset GPU; DC fail; AZ drain"),
    (137, "NVLink FLA privilege error", "An NVLink fabric-linear-address (FLA) access was refused: usually a peer-mapping or application fault, not a broken GPU", "alert", "NV catalog entry 'NVLink FLA privilege error' (GPUd mirror 2025-10); no reset/reboot action listed, so alert (our choice)"),
    (140, "unrecovered ECC error", "Unrecovered ECC error; reset the GPU", "drain", "NV reset GPU; DC fail"),
    (143, "GPU initialisation failure", "GPU failed to initialise; hardware inspection", "drain", "NV reset GPU; GPUd hardware inspection"),
    (144, "NVLink SAW error", "NVLink5 unit error (SAW); drain only when the message says Fatal", "alert", "NV NVLink5 workflow; XID.md fatal flag"),
    (145, "NVLink RLW error", "NVLink5 unit error (RLW); drain only when the message says Fatal", "alert", "NV NVLink5 workflow; XID.md fatal flag"),
    (146, "NVLink TLW error", "NVLink5 unit error (TLW); drain only when the message says Fatal", "alert", "NV NVLink5 workflow; XID.md fatal flag"),
    (147, "NVLink TREX error", "NVLink5 unit error (TREX); drain only when the message says Fatal", "alert", "NV NVLink5 workflow; XID.md fatal flag"),
    (148, "NVLink NVLPW_CTRL error", "NVLink5 unit error (NVLPW_CTRL); drain only when the message says Fatal", "alert", "NV NVLink5 workflow; XID.md fatal flag"),
    (149, "NVLink NETIR error", "NVLink5 unit error (NETIR); drain only when the message says Fatal", "alert", "NV NVLink5 workflow; XID.md fatal flag"),
    (150, "NVLink MSE error", "NVLink5 unit error (MSE); drain only when the message says Fatal", "alert", "NV NVLink5 workflow; XID.md fatal flag"),
    (171, "uncorrectable memory error detail", "Companion of XID 48 naming the particulars of an uncorrectable ECC fault (DRAM or SRAM); same workflow as XID 48: reset the GPU", "drain", "NV catalog entry 'Additional to Xid 48 ... differentiate DRAM/SRAM' (GPUd mirror 2025-10); NVIDIA GPU memory error management: uncorrectable ECC -> GPU reset; DC fail on XID 48"),
    (172, "uncorrectable memory error detail", "Companion of XID 48 naming the particulars of an uncorrectable ECC fault (DRAM or SRAM); same workflow as XID 48: reset the GPU", "drain", "NV catalog entry 'Additional to Xid 48 ... differentiate DRAM/SRAM' (GPUd mirror 2025-10); NVIDIA GPU memory error management: uncorrectable ECC -> GPU reset; DC fail on XID 48"),
    (154, "GPU recovery action changed", "Driver asks for a recovery action; act on the new action it names", "alert", "NV follow new action; DC reset/reboot/drain-and-reset fail, drain-P2P warn"),
)

#: NVSwitch SXid rows (same columns). The Fatal / Non-fatal word in the message
#: overrides the default action (see :func:`classify`).
SXID_TABLE: dict[int, XidRow] = _rows(
    (20034, "NVLink LTSSM fault up", "NVSwitch port link training (LTSSM) fault; the link is down", "drain", "FM SXid list (fatal); GPUd sxid catalog"),
)
# fmt: on

#: XIDs whose message carries a Fatal / Nonfatal flag (NVLink5).
NVLINK5_XIDS = range(144, 151)

#: NVML ``nvmlDeviceGpuRecoveryAction_t`` value -> (name, action). Actions per DC: fail
#: (drain) on GPU reset / node reboot / drain-and-reset, warn (alert) on drain P2P.
RECOVERY_ACTIONS: dict[int, tuple[str, str]] = {
    0: ("None", "record"),
    1: ("GPU Reset", "drain"),
    2: ("Node Reboot", "drain"),
    3: ("Drain P2P", "alert"),
    4: ("Drain and Reset", "drain"),
}
#: Printed names (lower case, spaces squeezed) -> enum value, for text that carries no
#: number: nvidia-smi's CSV prints ``Reset`` / ``Reboot``, -q text and XID 154 messages
#: longer forms, newer drivers ``OS Reboot``.
RECOVERY_NAMES: dict[str, int] = {
    "none": 0, "no action": 0,
    "reset": 1, "gpu reset": 1, "gpu reset required": 1,
    "reboot": 2, "node reboot": 2, "node reboot required": 2, "os reboot": 2, "os reboot required": 2,
    "drain p2p": 3, "drain_p2p": 3,
    "drain and reset": 4, "drain and reset required": 4, "drain_and_reset": 4,
}


def recovery_action_code(value: str | int | None) -> int | None:
    """The ``nvmlDeviceGpuRecoveryAction_t`` value of a printed recovery action: a number
    (``2``, ``0x2``, ``0x2 (OS Reboot)``: the number wins whatever name follows, since
    names change between drivers) or a known name (:data:`RECOVERY_NAMES`). ``None`` for
    N/A, empty, out-of-range or unknown text."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value in RECOVERY_ACTIONS else None
    text = " ".join(str(value).split())
    m = re.match(r"^(0x[0-9a-fA-F]+|\d+)\b", text)
    if m:
        n = int(m.group(1), 0)
        return n if n in RECOVERY_ACTIONS else None
    return RECOVERY_NAMES.get(text.lower())


_FLAG_RE = re.compile(r"\b(?P<non>non-?)?fatal\b", re.IGNORECASE)
_RECOVERY_RE = re.compile(r"\bto\s+(?P<num>0x[0-9a-fA-F]+|\d+)?\s*(?:\((?P<name>[^)]*)\))?")


def fatal_flag(message: str) -> bool | None:
    """``True`` when the *last* of the words Fatal / Nonfatal / Non-fatal in ``message``
    is Fatal, ``False`` when it is Nonfatal or Non-fatal, ``None`` when none appears.
    Case-insensitive, whole words. The last, because the driver prints its flag after the
    process name a program chose (``145, pid=N, name=COMM, RLW_RXPIPE Fatal XC0 ...``):
    a process named ``x, Nonfatal`` must not turn a Fatal NVLink error into an alert."""
    flags = list(_FLAG_RE.finditer(message))
    if not flags:
        return None
    return flags[-1]["non"] is None


def recovery_action(message: str) -> int | None:
    """The *new* recovery action of an XID 154 message as the NVML enum value
    (``"... changed from 0x0 (None) to 0x2 (OS Reboot)"`` -> 2), or ``None`` when it
    cannot be read. The number decides; the name is used only when no number is printed."""
    # The last "to <value> (<name>)" is the new action; "from ... to ..." order.
    for m in reversed(list(_RECOVERY_RE.finditer(message))):
        if m.group("num"):
            return recovery_action_code(m.group("num"))
        if m.group("name"):
            return recovery_action_code(m.group("name"))
    return None


def lookup(code: int, kind: str = "xid") -> XidRow | None:
    """The catalog row for an XID (``kind`` ``"xid"`` or ``"fallen_off_bus"``) or an
    SXid (``kind="sxid"``); ``None`` when the code is not in the table."""
    table = SXID_TABLE if kind == "sxid" else XID_TABLE
    return table.get(code)


def _verdict(action: str, name: str, meaning: str, source: str) -> Classification:
    return Classification(action, SEVERITY_FOR_ACTION[action], name, meaning, source)


def classify(event: _EventLike) -> Classification:
    """Classify one parsed event (any object with ``kind``, ``xid``, ``message``,
    e.g. :class:`gpuguard.xid.parse.XidEvent`).

    Returns a :class:`Classification`; never raises for an unknown code (unknown XID
    or SXid -> ``alert``/``warning``, see the module docstring for why). Raises
    ``ValueError`` for an unknown ``kind``.
    """
    kind = event.kind
    if kind not in ("xid", "sxid", "fallen_off_bus"):
        raise ValueError(f"unknown event kind {kind!r}")
    code = 79 if kind == "fallen_off_bus" else event.xid
    row = lookup(code, kind)
    message = event.message or ""
    label = "SXid" if kind == "sxid" else "XID"

    if row is None:
        base = _verdict(
            "alert",
            f"unknown {label} {code}",
            f"{label} {code} is not in gpuguard's catalog",
            "gpuguard default for unknown codes (alert)",
        )
        row_name, row_meaning = base.name, base.meaning
    else:
        base = _verdict(row.action, row.name, row.meaning, row.source)
        row_name, row_meaning = row.name, row.meaning

    if kind == "sxid":
        flag = fatal_flag(message)
        if flag is True:
            return _verdict("drain", row_name, row_meaning, base.source + "; message says Fatal")
        if flag is False:
            return _verdict("alert", row_name, row_meaning, base.source + "; message says Non-fatal")
        return base

    if code in NVLINK5_XIDS:
        flag = fatal_flag(message)
        if flag is True:
            return _verdict("drain", row_name, row_meaning, base.source + "; message says Fatal")
        if flag is False:
            return _verdict("alert", row_name, row_meaning, base.source + "; message says Nonfatal")
        return base

    if code == 154:
        new_action = recovery_action(message)
        if new_action is None:
            return base
        name, action = RECOVERY_ACTIONS[new_action]
        meaning = f"{row_meaning} (new action: 0x{new_action:x} {name})"
        return _verdict(action, row_name, meaning, base.source + "; NVML nvmlDeviceGpuRecoveryAction_t")

    return base
