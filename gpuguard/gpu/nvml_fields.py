"""Which NVML functions fill which :class:`~gpuguard.model.GpuState` fields, and how
their values are converted (function names, units and error handling: the module
docstring of :mod:`gpuguard.gpu.nvml`).

:class:`GpuFieldReaders` is mixed into :class:`gpuguard.gpu.nvml.NvmlSource`, which
supplies the deadline-bound ``_call``/``_read`` and the budget book-keeping; this module
only says what to read, grouped by area (identity, thermal/power/clocks, utilisation and
memory, ECC/retired pages/row remapping, PCIe, NVLink, modes).
"""

from __future__ import annotations

import ctypes
import re
from typing import Any

from gpuguard.gpu.nvml_calls import END, SKIP, _GpuRead, error_name
from gpuguard.model import (
    FABRIC_HEALTH_SUMMARIES,
    FABRIC_STATES,
    NvLinkState,
    decode_clock_event_reasons,
    decode_fabric_health,
    norm_pci,
)

_NVLINK_COUNTERS = (
    # NvLinkState field, nvmlNvLinkErrorCounter_t constant name
    ("replay_errors", "NVML_NVLINK_ERROR_DL_REPLAY"),
    ("recovery_errors", "NVML_NVLINK_ERROR_DL_RECOVERY"),
    ("crc_flit_errors", "NVML_NVLINK_ERROR_DL_CRC_FLIT"),
    ("crc_data_errors", "NVML_NVLINK_ERROR_DL_CRC_DATA"),
)


def _mib(n_bytes: int) -> float:
    return n_bytes / 2**20


def _text(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v


def _recovery_field(values: Any) -> int | None:
    """``nvmlDeviceGetFieldValues(h, [NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])`` -> the
    ``nvmlDeviceGpuRecoveryAction_t`` value (0..4), or None when NVML could not read it."""
    from gpuguard.xid.catalog import recovery_action_code

    v = values[0]
    if getattr(v, "nvmlReturn", 0) != 0:
        return None
    return recovery_action_code(int(v.value.uiVal))


#: ``nvmlDeviceGetGpuFabricInfoV`` struct versions, newest first: (struct, has healthMask,
#: has healthSummary). A driver that does not know a version answers
#: ``ArgumentVersionMismatch`` and the next one is tried; a driver before R550 lacks the
#: function (``FunctionNotFound``) and the legacy ``nvmlDeviceGetGpuFabricInfo``
#: (``c_nvmlGpuFabricInfo_t``: no health) is called.
_FABRIC_STRUCTS = (("c_nvmlGpuFabricInfo_v3_t", True, True), ("c_nvmlGpuFabricInfo_v2_t", True, False))
_FABRIC_FALLBACK = frozenset({"ArgumentVersionMismatch", "FunctionNotFound"})


def _fabric_status(nv: Any, code: int) -> str:
    """An ``nvmlReturn_t`` registration status as nvidia-smi prints it: ``Success``, or the
    error's words (``NVMLError_InsufficientResources`` -> ``Insufficient Resources``;
    ``Unknown`` -> ``Unknown Error``, nvmlErrorString's text)."""
    if code == 0:
        return "Success"
    name = error_name(nv.NVMLError(code))
    words = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", name)
    return "Unknown Error" if words == "Unknown" else words


def _uuid16(raw: Any) -> str:
    """16 bytes -> ``8-4-4-4-12`` lower-case hex (as nvidia-smi prints ``ClusterUUID``)."""
    h = bytes(raw).hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


class GpuFieldReaders:
    """The per-GPU reads of :class:`gpuguard.gpu.nvml.NvmlSource`, in GpuState field order.

    Needs from the class it is mixed into: ``_call``, ``_read`` and ``_budget_skips``.
    """

    def _read_gpu(self, nv: Any, rd: _GpuRead) -> None:
        """Fill ``rd.state`` from NVML, in the GpuState field order."""
        h = self._call(
            rd,
            ("handle",),
            ("nvmlDeviceGetHandleByIndex",),
            rd.state.index,
            missing_is_error=True,
        )
        if h is SKIP:
            return
        self._read_identity(rd, h)
        self._read_thermal_power_clocks(nv, rd, h)
        self._read_util_memory(rd, h)
        self._read_ecc_pages_rows(nv, rd, h)
        self._read_pcie(rd, h)
        self._read_nvlinks(nv, rd, h)
        self._read_modes(nv, rd, h)
        self._read_fabric(nv, rd, h)

    def _read_identity(self, rd: _GpuRead, h: Any) -> None:
        """UUID, serial, name, PCI bus id, VBIOS and InfoROM versions."""
        r = self._read
        r(rd, {"uuid": _text}, "nvmlDeviceGetUUID", h)
        r(rd, {"serial": _text}, "nvmlDeviceGetSerial", h)
        r(rd, {"name": _text}, "nvmlDeviceGetName", h)
        r(
            rd,
            {"pci_bus_id": lambda p: norm_pci(_text(p.busId))},
            "nvmlDeviceGetPciInfo",
            h,
        )
        r(rd, {"vbios_version": _text}, "nvmlDeviceGetVbiosVersion", h)
        r(rd, {"inforom_version": _text}, "nvmlDeviceGetInforomImageVersion", h)

    def _read_thermal_power_clocks(self, nv: Any, rd: _GpuRead, h: Any) -> None:
        """Temperature and its thresholds, power draw and limit, clocks, clock-event reasons."""
        r = self._read
        temp_fns = ("nvmlDeviceGetTemperature", "nvmlDeviceGetTemperatureV")
        r(rd, {"temp_c": float}, temp_fns, h, nv.NVML_TEMPERATURE_GPU)
        thr = "nvmlDeviceGetTemperatureThreshold"
        r(
            rd,
            {"temp_slowdown_c": float},
            thr,
            h,
            nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN,
        )
        r(
            rd,
            {"temp_shutdown_c": float},
            thr,
            h,
            nv.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN,
        )
        r(rd, {"power_w": lambda mw: mw / 1000.0}, "nvmlDeviceGetPowerUsage", h)
        r(
            rd,
            {"power_limit_w": lambda mw: mw / 1000.0},
            "nvmlDeviceGetEnforcedPowerLimit",
            h,
        )
        r(rd, {"sm_clock_mhz": float}, "nvmlDeviceGetClockInfo", h, nv.NVML_CLOCK_SM)
        r(
            rd,
            {"sm_clock_max_mhz": float},
            "nvmlDeviceGetMaxClockInfo",
            h,
            nv.NVML_CLOCK_SM,
        )
        r(rd, {"mem_clock_mhz": float}, "nvmlDeviceGetClockInfo", h, nv.NVML_CLOCK_MEM)
        r(
            rd,
            {"mem_clock_max_mhz": float},
            "nvmlDeviceGetMaxClockInfo",
            h,
            nv.NVML_CLOCK_MEM,
        )
        reason_fns = (
            "nvmlDeviceGetCurrentClocksEventReasons",
            "nvmlDeviceGetCurrentClocksThrottleReasons",
        )
        r(
            rd,
            {"clock_event_reasons": lambda m: decode_clock_event_reasons(int(m))},
            reason_fns,
            h,
        )

    def _read_util_memory(self, rd: _GpuRead, h: Any) -> None:
        """GPU and memory utilisation, framebuffer memory used/total."""
        r = self._read
        r(
            rd,
            {
                "gpu_util_pct": lambda u: float(u.gpu),
                "mem_util_pct": lambda u: float(u.memory),
            },
            "nvmlDeviceGetUtilizationRates",
            h,
        )
        r(
            rd,
            {
                "mem_used_mib": lambda m: _mib(m.used),
                "mem_total_mib": lambda m: _mib(m.total),
            },
            "nvmlDeviceGetMemoryInfo",
            h,
        )

    def _read_ecc_pages_rows(self, nv: Any, rd: _GpuRead, h: Any) -> None:
        """ECC mode and volatile/aggregate counters, retired pages, row remapping."""
        r = self._read
        r(
            rd,
            {"ecc_enabled": lambda m: m[0] == nv.NVML_FEATURE_ENABLED},
            "nvmlDeviceGetEccMode",
            h,
        )
        for fld, etype, counter in (
            (
                "ecc_volatile_corrected",
                nv.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                nv.NVML_VOLATILE_ECC,
            ),
            (
                "ecc_volatile_uncorrected",
                nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                nv.NVML_VOLATILE_ECC,
            ),
            (
                "ecc_aggregate_corrected",
                nv.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                nv.NVML_AGGREGATE_ECC,
            ),
            (
                "ecc_aggregate_uncorrected",
                nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                nv.NVML_AGGREGATE_ECC,
            ),
        ):
            r(rd, {fld: int}, "nvmlDeviceGetTotalEccErrors", h, etype, counter)
        r(
            rd,
            {"retired_pages_sbe": len},
            "nvmlDeviceGetRetiredPages",
            h,
            nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
        )
        r(
            rd,
            {"retired_pages_dbe": len},
            "nvmlDeviceGetRetiredPages",
            h,
            nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
        )
        r(
            rd,
            {"retired_pages_pending": lambda s: s == nv.NVML_FEATURE_ENABLED},
            "nvmlDeviceGetRetiredPagesPendingStatus",
            h,
        )
        self._read_sram_status(nv, rd, h)
        r(
            rd,
            {
                "remapped_rows_correctable": lambda t: int(t[0]),
                "remapped_rows_uncorrectable": lambda t: int(t[1]),
                "remapped_rows_pending": lambda t: bool(t[2]),
                "remapped_rows_failure": lambda t: bool(t[3]),
            },
            "nvmlDeviceGetRemappedRows",
            h,
        )
        # nvmlRowRemapperHistogramValues_t (Ampere+): banks by spare rows left; "none" = no spare row
        r(rd, {"remap_banks_none": lambda v: int(v.none)}, "nvmlDeviceGetRowRemapperHistogram", h)
        # R575+ (Blackwell); an older pynvml lacks the names and the fields stay None
        r(rd, {"channel_repair_pending": lambda t: bool(t[0]), "tpc_repair_pending": lambda t: bool(t[1])},
          "nvmlDeviceGetRepairStatus", h)
        r(rd, {"unrepairable_memory": bool}, "nvmlDeviceGetUnrepairableMemoryFlag_v1", h)

    def _read_sram_status(self, nv: Any, rd: _GpuRead, h: Any) -> None:
        """``sram_threshold_exceeded`` from ``nvmlDeviceGetSramEccErrorStatus`` (NVML API
        reference: fills an ``nvmlEccSramErrorStatus_v1_t`` whose ``version`` the caller
        sets; ``bThresholdExceeded``). A binding without the struct, or a driver without
        the call (NotSupported / FunctionNotFound), leaves the field None."""
        struct = getattr(nv, "c_nvmlEccSramErrorStatus_v1_t", None)
        version = getattr(nv, "nvmlEccSramErrorStatus_v1", None)
        if struct is None or version is None:
            return
        st = struct()
        st.version = version
        self._read(rd, {"sram_threshold_exceeded": lambda _ok: bool(st.bThresholdExceeded)},
                   "nvmlDeviceGetSramEccErrorStatus", h, ctypes.byref(st))

    def _read_pcie(self, rd: _GpuRead, h: Any) -> None:
        """PCIe link generation and width (current, max) and the replay counter."""
        r = self._read
        r(rd, {"pcie_gen_current": int}, "nvmlDeviceGetCurrPcieLinkGeneration", h)
        r(rd, {"pcie_gen_max": int}, "nvmlDeviceGetMaxPcieLinkGeneration", h)
        r(rd, {"pcie_width_current": int}, "nvmlDeviceGetCurrPcieLinkWidth", h)
        r(rd, {"pcie_width_max": int}, "nvmlDeviceGetMaxPcieLinkWidth", h)
        r(rd, {"pcie_replay_count": int}, "nvmlDeviceGetPcieReplayCounter", h)

    def _read_modes(self, nv: Any, rd: _GpuRead, h: Any) -> None:
        """Persistence and MIG modes, and the GPU recovery action where the driver has it."""
        r = self._read
        r(
            rd,
            {"persistence_mode": lambda s: s == nv.NVML_FEATURE_ENABLED},
            "nvmlDeviceGetPersistenceMode",
            h,
        )
        r(
            rd,
            {"mig_mode": lambda m: m[0] == nv.NVML_DEVICE_MIG_ENABLE},
            "nvmlDeviceGetMigMode",
            h,
        )
        # GPU recovery action (R550+ field; an older driver answers NotSupported inside
        # the field value, which leaves the field None, not an error)
        fi = getattr(nv, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if fi is not None:
            r(rd, {"recovery_action": _recovery_field}, "nvmlDeviceGetFieldValues", h, [fi])

    def _read_fabric(self, nv: Any, rd: _GpuRead, h: Any) -> None:
        """NVLink fabric registration: ``nvmlDeviceGetGpuFabricInfoV`` with the newest struct
        the driver takes (:data:`_FABRIC_STRUCTS`), else ``nvmlDeviceGetGpuFabricInfo``
        (pre-R550). One call per GPU per snapshot (the health run's read; the collector's
        per-interval telemetry never reads it). NotSupported (no fabric) leaves every
        ``fabric_*`` field None; another error is recorded under ``fabric_state``."""
        calls: list[tuple[str, Any, bool, bool]] = []
        if getattr(nv, "nvmlDeviceGetGpuFabricInfoV", None) is not None:
            calls += [("nvmlDeviceGetGpuFabricInfoV", getattr(nv, name, None), mask, summary)
                      for name, mask, summary in _FABRIC_STRUCTS]
        calls.append(("nvmlDeviceGetGpuFabricInfo", getattr(nv, "c_nvmlGpuFabricInfo_t", None), False, False))
        for fn, struct, has_mask, has_summary in calls:
            if struct is None:
                continue
            st = struct()  # the versioned structs set their version in __init__
            raw = self._call(rd, ("fabric_state",), (fn,), h, ctypes.byref(st), end_on=_FABRIC_FALLBACK)
            if raw is END:
                continue
            if raw is SKIP:
                return
            g = rd.state
            try:
                g.fabric_state = FABRIC_STATES.get(int(st.state))
                g.fabric_status = _fabric_status(nv, int(st.status))
                g.fabric_clique_id = int(st.cliqueId)
                g.fabric_cluster_uuid = _uuid16(st.clusterUuid)
                g.fabric_health = decode_fabric_health(int(st.healthMask)) if has_mask else None
                g.fabric_health_summary = FABRIC_HEALTH_SUMMARIES.get(int(st.healthSummary)) if has_summary else None
            except Exception as e:  # an unconvertible value is a read error
                g.read_errors["fabric_state"] = error_name(e)
            return

    def _read_nvlinks(self, nv: Any, rd: _GpuRead, h: Any) -> None:
        """Links 0.. up to ``NVML_NVLINK_MAX_LINKS``; the first link index answering
        ``NotSupported`` or ``InvalidArgument`` to ``nvmlDeviceGetNvLinkState`` ends the list.

        ``nvlinks`` is None when link 0 ends it (no NVLink), and also when the enumeration
        was cut short (GPU stopped, budget spent): a partial list would read as missing links.
        """
        links: list[NvLinkState] = []
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            state = self._call(
                rd,
                (f"nvlinks[{link}].active",),
                ("nvmlDeviceGetNvLinkState",),
                h,
                link,
                end_on=frozenset({"NotSupported", "InvalidArgument"}),
            )
            if state is END:
                break
            ls = NvLinkState(
                link=link,
                active=None if state is SKIP else state == nv.NVML_FEATURE_ENABLED,
            )
            for fld, const in _NVLINK_COUNTERS:
                v = self._call(
                    rd,
                    (f"nvlinks[{link}].{fld}",),
                    ("nvmlDeviceGetNvLinkErrorCounter",),
                    h,
                    link,
                    getattr(nv, const),
                )
                if v is not SKIP:
                    setattr(ls, fld, int(v))
            if rd.stopped or rd.scope in self._budget_skips:
                return  # cut short: leave nvlinks None rather than a list missing links
            links.append(ls)
        rd.state.nvlinks = links or None
