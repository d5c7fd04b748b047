"""The data every stage exchanges: one GPU's state, a node snapshot, a finding.

Conventions (DESIGN.md, "Storage"):

* Units are in the names: ``temp_c`` (degrees Celsius), ``power_w`` (watts),
  ``*_mhz`` (megahertz), ``*_mib`` (MiB = 2**20 bytes), ``*_pct`` (0-100).
* ``None`` means *unsupported or not available on this GPU* (NVML
  ``NVML_ERROR_NOT_SUPPORTED``, nvidia-smi ``N/A``). It is never an error and never
  a zero: checks skip a ``None`` field. Read *errors* (a timeout, ``GpuIsLost``,
  ``Unknown``) are recorded by field name in :attr:`GpuState.read_errors` and become
  findings in the checks.
* Times are UTC epoch seconds (float).
* PCI bus ids are normalised by :func:`norm_pci` to ``dddd:bb:dd.f`` in lower-case hex
  (``00000000:75:00.0`` from nvidia-smi and ``0000:75:00`` from an XID line both map
  to the same GPU through :func:`pci_key`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from gpuguard.metrics import gpu_state_fields, with_fields

SEVERITIES = ("info", "warning", "critical")
SEVERITY_RANK = {s: i for i, s in enumerate(SEVERITIES)}
#: Policy actions, mildest first (see :mod:`gpuguard.policy`).
ACTIONS = ("record", "alert", "fail-job", "drain")


@dataclass(frozen=True)
class FindingCode:
    """A finding code as its family declares it: ``severity`` (one of
    :data:`SEVERITIES`), ``action`` (the shipped default, one of :data:`ACTIONS`; the
    ``[policy]`` config overrides it) and ``source`` (why that default: a document, a
    tool's behaviour, or "our choice: why")."""

    code: str
    family: str
    severity: str
    action: str
    source: str


#: Every declared finding code; filled by :func:`declare_codes` in each family's module
#: (``gpuguard.checks.*`` for hardware, ``gpuguard.epilog.finding_codes`` for verdicts).
FINDING_CODES: dict[str, FindingCode] = {}


def declare_codes(family: str, rows: dict[str, tuple[str, str, str]]) -> dict[str, FindingCode]:
    """Declare ``family``'s codes: ``code -> (severity, default action, source)``. Raises
    ValueError for an unknown severity/action or a code declared twice."""
    out = {}
    for code, (severity, action, source) in rows.items():
        if severity not in SEVERITIES or action not in ACTIONS:
            raise ValueError(f"finding code {code}: bad severity {severity!r} or action {action!r}")
        fc = FindingCode(code, family, severity, action, source)
        if FINDING_CODES.get(code, fc) != fc:
            raise ValueError(f"finding code {code} declared twice")
        FINDING_CODES[code] = out[code] = fc
    return out

#: Clock-event (throttle) reason names, in NVML bit order. Source: nvml.h
#: ``nvmlClocksEventReason*`` (formerly ``nvmlClocksThrottleReason*``) and the
#: labels nvidia-smi prints under "Clocks Event Reasons" / "Clocks Throttle Reasons".
CLOCK_EVENT_REASONS: dict[str, tuple[int, str]] = {
    # name: (NVML bit mask, nvidia-smi -q label)
    "gpu_idle": (0x1, "Idle"),
    "applications_clocks_setting": (0x2, "Applications Clocks Setting"),
    "sw_power_cap": (0x4, "SW Power Cap"),
    "hw_slowdown": (0x8, "HW Slowdown"),
    "sync_boost": (0x10, "Sync Boost"),
    "sw_thermal_slowdown": (0x20, "SW Thermal Slowdown"),
    "hw_thermal_slowdown": (0x40, "HW Thermal Slowdown"),
    "hw_power_brake_slowdown": (0x80, "HW Power Brake Slowdown"),
    "display_clock_setting": (0x100, "Display Clock Setting"),
}


#: Reasons that mean a limit slowed the GPU (not idle, not a clock setting): the
#: DCGM/GPUd "throttle" set. SW power cap is one: GPUs at TDP run capped.
SLOWDOWN_REASONS = ("sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown",
                    "hw_power_brake_slowdown")
#: Slowdowns signalled by hardware (board sensor, thermal trip, external power brake):
#: at idle they point at the board, its cooling or the node's power (GPUd treats HW
#: slowdown the same way).
HW_SLOWDOWN_REASONS = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")
#: Slowdowns never part of a healthy run: every slowdown but the SW power cap.
HARD_SLOWDOWN_REASONS = tuple(r for r in SLOWDOWN_REASONS if r != "sw_power_cap")


def reasons_mask(names: tuple[str, ...] | list[str]) -> int:
    """The NVML bit mask of reason ``names`` (see :data:`CLOCK_EVENT_REASONS`)."""
    return encode_clock_event_reasons(list(names))


def decode_clock_event_reasons(mask: int) -> list[str]:
    """Decode an NVML clock-event reason bit mask to reason names (NVML bit order)."""
    return [name for name, (bit, _label) in CLOCK_EVENT_REASONS.items() if mask & bit]


def encode_clock_event_reasons(names: list[str]) -> int:
    """Inverse of :func:`decode_clock_event_reasons`; unknown names raise ``KeyError``."""
    mask = 0
    for name in names:
        mask |= CLOCK_EVENT_REASONS[name][0]
    return mask


#: ``nvmlGpuFabricState_t`` value -> state name (nvml.h ``NVML_GPU_FABRIC_STATE_*``;
#: nvidia-smi -q prints ``Not Supported`` / ``Not Started`` / ``In Progress`` / ``Completed``).
FABRIC_STATES = {0: "not_supported", 1: "not_started", 2: "in_progress", 3: "completed"}
#: ``NVML_GPU_FABRIC_HEALTH_SUMMARY_*`` 1..3 (0 = not supported: None); nvidia-smi prints
#: ``Healthy`` / ``Unhealthy`` / ``Limited Capacity``.
FABRIC_HEALTH_SUMMARIES = {1: "healthy", 2: "unhealthy", 3: "limited_capacity"}
#: Two-bit fields of the NVML fabric ``healthMask`` (nvml.h
#: ``NVML_GPU_FABRIC_HEALTH_MASK_{SHIFT,WIDTH}_*``: 0 not supported, 1 true, 2 false):
#: name -> (shift, nvidia-smi -q label under ``Fabric > Health``, -q -x element, printed
#: value meaning the problem). ``Bandwidth`` prints ``Full`` / ``Degraded``, the rest
#: ``True`` / ``False``.
FABRIC_HEALTH_FLAGS: dict[str, tuple[int, str, str, str]] = {
    "bandwidth_degraded": (0, "Bandwidth", "bandwidth", "degraded"),
    "route_recovery_in_progress": (2, "Route Recovery in progress", "route_recovery_in_progress", "true"),
    "route_unhealthy": (4, "Route Unhealthy", "route_unhealthy", "true"),
    "access_timeout_recovery": (6, "Access Timeout Recovery", "access_timeout_recovery", "true"),
}
#: The four-bit ``Incorrect Configuration`` field of the health mask (shift 8, width 0xf;
#: 0 not supported, 1 none): value -> reason (nvml.h
#: ``NVML_GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_*``).
FABRIC_INCORRECT_CONFIGURATION = {2: "incorrect_sysguid", 3: "incorrect_chassis_sn", 4: "no_partition",
                                  5: "insufficient_nvlinks", 6: "incompatible_gpu_fw", 7: "invalid_location",
                                  8: "gpu_state_invalid"}
#: Every name ``GpuState.fabric_health`` may hold.
FABRIC_HEALTH_NAMES = frozenset(FABRIC_HEALTH_FLAGS) | {
    f"incorrect_configuration.{r}" for r in FABRIC_INCORRECT_CONFIGURATION.values()}


def decode_fabric_health(mask: int) -> list[str] | None:
    """The problems an NVML fabric ``healthMask`` flags (:data:`FABRIC_HEALTH_NAMES`, in
    bit order), or None when the mask reports no field at all (every field 0 = not
    supported: a pre-R550 driver or a GPU without health telemetry)."""
    if not mask & 0xFFF:
        return None
    out = [name for name, (shift, *_rest) in FABRIC_HEALTH_FLAGS.items() if (mask >> shift) & 0x3 == 1]
    reason = FABRIC_INCORRECT_CONFIGURATION.get((mask >> 8) & 0xF)
    if reason is not None:
        out.append(f"incorrect_configuration.{reason}")
    return out


_PCI_RE = re.compile(
    r"^(?:(?P<dom>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{1,2}):(?P<dev>[0-9a-fA-F]{1,2})(?:\.(?P<fn>[0-7]))?$"
)


def norm_pci(bus_id: str) -> str:
    """Normalise a PCI bus id to ``dddd:bb:dd.f`` lower-case (domain cut to 4 digits
    when its high digits are zero, as the kernel prints it).

    Raises ``ValueError`` for a string that is not a PCI address.
    """
    s = bus_id.strip()
    if s.upper().startswith("PCI:"):
        s = s[4:]
    m = _PCI_RE.match(s)
    if not m:
        raise ValueError(f"not a PCI bus id: {bus_id!r}")
    dom = int(m.group("dom") or "0", 16)
    bus = int(m.group("bus"), 16)
    dev = int(m.group("dev"), 16)
    fn = int(m.group("fn") or "0")
    return f"{dom:04x}:{bus:02x}:{dev:02x}.{fn}"


def pci_key(bus_id: str) -> str:
    """The domain:bus:device part of :func:`norm_pci` (XID lines carry no function)."""
    return norm_pci(bus_id).rsplit(".", 1)[0]


@dataclass
class NvLinkState:
    """One NVLink link. Counters are cumulative since driver load; ``None`` = unsupported."""

    link: int
    active: bool | None = None
    replay_errors: int | None = None
    recovery_errors: int | None = None
    crc_flit_errors: int | None = None
    crc_data_errors: int | None = None


#: Reads every working GPU answers (the handle, identity and basic telemetry): an internal
#: driver error on one of them makes the GPU lost (:attr:`GpuState.lost`). ``handle``: the
#: NVML source's handle lookup; ``device_handle``: nvidia-smi's "Unable to determine the
#: device handle".
CORE_READS = frozenset({"handle", "device_handle", "uuid", "pci_bus_id", "temp_c", "gpu_util_pct",
                        "mem_used_mib", "mem_total_mib"})


@dataclass
@with_fields(gpu_state_fields())
class GpuState:
    """Everything gpuguard reads from one GPU at one time. See the module docstring for
    units and the meaning of ``None``. A metric-table row with an NVML read
    (:func:`gpuguard.metrics.gpu_state_fields`) that is not declared here becomes a field
    (after ``read_errors``), filled by the collector's NVML read."""

    index: int
    uuid: str | None = None
    serial: str | None = None
    name: str | None = None
    pci_bus_id: str | None = None
    driver_version: str | None = None
    cuda_version: str | None = None
    vbios_version: str | None = None
    inforom_version: str | None = None  # InfoROM image version
    temp_c: float | None = None
    temp_slowdown_c: float | None = None
    temp_shutdown_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None  # enforced limit
    sm_clock_mhz: float | None = None
    sm_clock_max_mhz: float | None = None
    mem_clock_mhz: float | None = None
    mem_clock_max_mhz: float | None = None
    clock_event_reasons: list[str] | None = None  # active reasons, names of CLOCK_EVENT_REASONS
    gpu_util_pct: float | None = None
    mem_util_pct: float | None = None
    mem_used_mib: float | None = None
    mem_total_mib: float | None = None
    ecc_enabled: bool | None = None  # current ECC mode
    ecc_volatile_corrected: int | None = None
    ecc_volatile_uncorrected: int | None = None
    ecc_aggregate_corrected: int | None = None
    ecc_aggregate_uncorrected: int | None = None
    #: the driver's SRAM uncorrectable-error threshold flag (NVML
    #: nvmlEccSramErrorStatus_v1_t.bThresholdExceeded, "if the error threshold of field
    #: diag is exceeded"; nvidia-smi -q "ECC Errors / Aggregate / SRAM Threshold Exceeded")
    sram_threshold_exceeded: bool | None = None
    retired_pages_sbe: int | None = None
    retired_pages_dbe: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    #: DRAM banks with no spare row left for remapping: the ``none`` bucket of NVML
    #: ``nvmlDeviceGetRowRemapperHistogram`` (``nvmlRowRemapperHistogramValues_t``: "None
    #: means that there are no reserved rows available"), nvidia-smi -q ``Remapped Rows >
    #: Bank Remap Availability Histogram > None``, -q -x ``row_remapper_histogram_none``;
    #: a count of banks. None = not reported (pre-Ampere GPUs, MIG, the CSV query)
    remap_banks_none: int | None = None
    #: Blackwell memory/TPC repair (NVML ``nvmlDeviceGetRepairStatus``, R575+; nvidia-smi
    #: ``ECC Errors > Channel Repair Pending`` / ``TPC Repair Pending``): a repair waits
    #: for a GPU reset. None = not reported (older drivers and GPUs)
    channel_repair_pending: bool | None = None
    tpc_repair_pending: bool | None = None
    #: NVML ``nvmlDeviceGetUnrepairableMemoryFlag_v1`` / nvidia-smi ``Unrepairable Memory``:
    #: memory faults the GPU can no longer repair (replace the GPU)
    unrepairable_memory: bool | None = None
    pcie_gen_current: int | None = None
    pcie_gen_max: int | None = None
    pcie_width_current: int | None = None
    pcie_width_max: int | None = None
    pcie_replay_count: int | None = None
    nvlinks: list[NvLinkState] | None = None
    persistence_mode: bool | None = None
    mig_mode: bool | None = None
    #: NVML nvmlDeviceGpuRecoveryAction_t (0 none, 1 GPU reset, 2 node reboot, 3 drain
    #: P2P, 4 drain and reset); None = not reported (drivers before R550)
    recovery_action: int | None = None
    #: NVLink fabric registration (multi-node NVLink / NVSwitch: NVML
    #: ``nvmlDeviceGetGpuFabricInfoV``, nvidia-smi -q ``Fabric``, -q -x ``<fabric>``): one of
    #: :data:`FABRIC_STATES` (``not_supported`` / None: no fabric, never judged)
    fabric_state: str | None = None
    #: the registration's error as nvidia-smi prints it (``Success``, ``Insufficient
    #: Resources``); only meaningful once ``fabric_state`` is ``completed`` (NVML docs)
    fabric_status: str | None = None
    fabric_clique_id: int | None = None
    fabric_cluster_uuid: str | None = None
    #: NVML ``healthSummary`` (v3+, R570+ nvidia-smi ``Health > Summary``): one of
    #: :data:`FABRIC_HEALTH_SUMMARIES`
    fabric_health_summary: str | None = None
    #: the fabric health problems flagged (names of :data:`FABRIC_HEALTH_FLAGS`, and
    #: ``incorrect_configuration.<reason>`` of :data:`FABRIC_INCORRECT_CONFIGURATION`);
    #: ``[]`` = health read, nothing flagged; None = no health reported
    fabric_health: list[str] | None = None
    #: field name -> error name ("GpuIsLost", "Timeout", "Unknown", ...) for reads that
    #: failed for a reason other than "not supported".
    read_errors: dict[str, str] = field(default_factory=dict)

    @property
    def lost(self) -> bool:
        """True when the driver reported the GPU lost (``GpuIsLost``) or in need of a reset
        (``ResetRequired``), a read hung (``Timeout``), or an internal driver error
        (``Unknown``) hit one of the :data:`CORE_READS` a working GPU always answers. An
        ``Unknown`` on another read alone (a fan speed, a power limit, the node's driver
        version, which is copied to every GPU) is a ``gpu.read_error`` warning: nvidia-smi
        prints 'Unknown Error' for such fields of GPUs that work, and one failed auxiliary
        read is no proof of a broken GPU (NVML API reference, ``NVML_ERROR_UNKNOWN``: an
        internal driver error)."""
        return any(e in ("GpuIsLost", "Timeout", "ResetRequired") or (e == "Unknown" and k in CORE_READS)
                   for k, e in self.read_errors.items())

    @property
    def mig_or_unknown(self) -> bool:
        """In MIG mode, or its MIG mode (or its handle) could not be read (``read_errors``
        names ``mig_mode`` or ``handle``). On a node with such a GPU, Slurm's GPU index may
        count MIG devices (gres.conf(5), MIG with ``AutoDetect=nvml``) and so cannot be
        taken as NVML's: the collector, the GPU-count check and the exporters' job map
        all read it this way. ``mig_mode`` None without a read error is no MIG (nvidia-smi
        prints ``N/A``, NVML answers NotSupported on GPUs without MIG)."""
        return bool(self.mig_mode) or "mig_mode" in self.read_errors or "handle" in self.read_errors

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (nested NvLinkState become dicts)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GpuState:
        """Build from :meth:`to_dict` output (a replay file: user-editable input).

        Raises ``ValueError`` for unknown keys and for values of the wrong type (a
        counter given as ``"3"`` would otherwise crash a check and hide a real fault)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown GPU field(s): {', '.join(sorted(unknown))}")
        d = dict(d)
        for k, v in d.items():
            check_field(k, v)
        if d.get("nvlinks") is not None:
            try:
                d["nvlinks"] = [NvLinkState(**x) for x in d["nvlinks"]]
            except TypeError as e:
                raise ValueError(f"nvlinks: {e}") from None
            for n in d["nvlinks"]:
                for f in dataclasses.fields(NvLinkState):
                    v = getattr(n, f.name)
                    want = bool if f.name == "active" else int
                    if not (v is None or (isinstance(v, want) and (want is bool or not isinstance(v, bool)))):
                        raise ValueError(f"nvlinks[].{f.name} must be {want.__name__} or null, got {v!r}")
        if d.get("read_errors") is None:
            d["read_errors"] = {}
        return cls(**d)


def _field_types() -> dict[str, tuple[type, ...]]:
    out: dict[str, tuple[type, ...]] = {}
    for f in dataclasses.fields(GpuState):
        ann = str(f.type)
        if ann.startswith("int"):
            out[f.name] = (int,)
        elif ann.startswith("float"):
            out[f.name] = (int, float)
        elif ann.startswith("bool"):
            out[f.name] = (bool,)
        elif ann.startswith("str"):
            out[f.name] = (str,)
        elif ann.startswith("list"):
            out[f.name] = (list,)
        elif ann.startswith("dict"):
            out[f.name] = (dict,)
    return out


def check_field(name: str, value: Any) -> None:
    """Raise ``ValueError`` unless ``value`` fits :class:`GpuState` field ``name``
    (``None`` fits every optional field; ``bool`` is not a number here)."""
    types = _FIELD_TYPES.get(name)
    if types is None:
        raise ValueError(f"unknown GPU field: {name}")
    if value is None and name not in ("index", "read_errors"):
        return
    if isinstance(value, bool) and bool not in types:
        raise ValueError(f"{name} must be {'/'.join(t.__name__ for t in types)}, got {value!r}")
    if not isinstance(value, types):
        raise ValueError(f"{name} must be {'/'.join(t.__name__ for t in types)}, got {value!r}")
    if name == "fabric_state" and value not in FABRIC_STATES.values():
        raise ValueError(f"fabric_state must be one of {sorted(FABRIC_STATES.values())}, got {value!r}")
    if name == "fabric_health_summary" and value not in FABRIC_HEALTH_SUMMARIES.values():
        raise ValueError(f"fabric_health_summary must be one of {sorted(FABRIC_HEALTH_SUMMARIES.values())}, "
                         f"got {value!r}")
    if name == "fabric_health" and any(not isinstance(v, str) or v not in FABRIC_HEALTH_NAMES for v in value):
        raise ValueError(f"fabric_health: unknown problem(s) {[v for v in value if v not in FABRIC_HEALTH_NAMES]}")
    if name == "clock_event_reasons" and any(r not in CLOCK_EVENT_REASONS for r in value):
        raise ValueError(f"clock_event_reasons: unknown reason(s) {[r for r in value if r not in CLOCK_EVENT_REASONS]}")


@dataclass
class NodeSnapshot:
    """All GPUs of a node at one time.

    ``error`` is set when the source itself is unusable (NVML library missing, driver
    not loaded, nvidia-smi dump unreadable); ``gpus`` is then usually empty.
    """

    taken_at: float
    source: str
    gpus: list[GpuState] = field(default_factory=list)
    hostname: str | None = None
    driver_version: str | None = None
    cuda_version: str | None = None
    error: str | None = None
    #: set (one line) when a saved dump was read only in part (cut short): the GPUs were
    #: judged on what it holds, so finding nothing there proves nothing
    incomplete: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NodeSnapshot:
        d = dict(d)
        d["gpus"] = [GpuState.from_dict(g) for g in d.get("gpus", [])]
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown snapshot field(s): {', '.join(sorted(unknown))}")
        return cls(**d)

    def by_pci(self) -> dict[str, GpuState]:
        """Map :func:`pci_key` of each GPU's bus id to the GPU."""
        out = {}
        for g in self.gpus:
            if g.pci_bus_id:
                out[pci_key(g.pci_bus_id)] = g
        return out


_FIELD_TYPES = _field_types()


@dataclass
class Finding:
    """One thing a check found. ``code`` is a stable dotted id (``ecc.dbe_volatile``,
    ``xid.79``) that the policy table maps to an action; ``evidence`` holds the numbers
    behind the message (JSON-ready)."""

    code: str
    severity: str
    message: str
    gpu_index: int | None = None
    gpu_uuid: str | None = None
    evidence: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.severity not in SEVERITY_RANK:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
