"""A fake ``pynvml`` built from recorded per-GPU values, raising the REAL ``pynvml`` errors.

``FakeNvml(devices, driver_version=..., cuda_driver_version=...)`` holds the state;
``FakeNvml.module`` is the module-like object to inject (``NvmlSource(pynvml_module=
fake.module)``). It carries the real ``NVML_*`` constants and ``NVMLError*`` classes
from nvidia-ml-py and one function per NVML call gpuguard makes, with the real
signatures (checked against ``pynvml.py`` of nvidia-ml-py 13.x).

A device is a dict of raw NVML values (units as NVML returns them: mW, bytes, MHz,
bit masks, NVML_FEATURE_* ints); a key that is absent means the call answers
``NVML_ERROR_NOT_SUPPORTED``. Keys: see :func:`h100_gpu`.

Fault injection:

* ``fail(func, code, gpu=None)``: ``func`` raises ``pynvml.NVMLError(code)`` (the real
  subclass) or, if ``code`` is an exception instance/class, that. ``func="*"`` means every
  per-device call of that GPU except ``nvmlDeviceGetHandleByIndex``. ``gpu=None``: all.
* ``hang(func, gpu=None, max_s=10)``: ``func`` blocks until :meth:`FakeNvml.release`
  or ``max_s``, then answers normally (so code that ignores its deadline sees a value,
  not ``"Timeout"``, and the test fails on the result).
* ``delay(func, seconds, gpu=None)``: ``func`` sleeps, then answers.
* ``hide(name)``: remove a function from the module (an older nvidia-ml-py).
* ``init_error``: code (or exception) raised by ``nvmlInit``.
* ``queue_xid(gpu, xid)``: an XID event for ``nvmlEventSetWait``.

MIG: a device with ``"mig": [1, 1]`` and ``"mig_devices": ["MIG-<uuid>", None, ...]``
(slot -> MIG device UUID, None: empty slot; ``nvmlDeviceGetMaxMigDeviceCount`` answers the
list's length) has MIG device handles (:class:`FakeMigHandle`): ``nvmlDeviceGetUUID`` on
one answers its MIG UUID, ``nvmlDeviceGetHandleByUUID`` finds GPUs and MIG devices.

``calls`` records ``(func, gpu_index_or_None)`` for every call made.
"""

from __future__ import annotations

import copy
import ctypes
import threading
import time
import types
from typing import Any

import pynvml as _real

#: Structures (and their version constants) callers fill through the binding, copied
#: into the fake module as they are.
_STRUCTS = frozenset({"c_nvmlEccSramErrorStatus_v1_t", "nvmlEccSramErrorStatus_v1",
                      "c_nvmlGpuFabricInfo_t", "c_nvmlGpuFabricInfo_v2_t", "c_nvmlGpuFabricInfo_v3_t",
                      "nvmlGpuFabricInfo_v2", "nvmlGpuFabricInfo_v3"})

NVMLError = _real.NVMLError


class FakeHandle:
    """Stands in for ``c_nvmlDevice_t``."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"FakeHandle({self.index})"


class FakeMigHandle(FakeHandle):
    """Stands in for a MIG device's ``c_nvmlDevice_t``: slot ``slot`` of GPU ``index``."""

    def __init__(self, index: int, slot: int) -> None:
        super().__init__(index)
        self.slot = slot

    def __repr__(self) -> str:
        return f"FakeMigHandle({self.index}, {self.slot})"


class _Struct(types.SimpleNamespace):
    """Stands in for the ctypes structures (``c_nvmlMemory_t``, ``nvmlPciInfo_t``, ...)."""


def h100_gpu(index: int) -> dict[str, Any]:
    """One GPU of an 8-GPU DGX-H100-like node, idle. PCI buses as on a DGX H100."""
    bus = [0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB][index]
    return {
        "uuid": f"GPU-3a9e1c52-7b4f-d0a8-61e2-0f5c9b8d4e0{index}",
        "serial": f"165422201{index:04d}",
        "name": "NVIDIA H100 80GB HBM3",
        "pci_bus_id": f"00000000:{bus:02X}:00.0",  # as NVML's busId prints it
        "vbios": "96.00.89.00.01",
        "inforom_image": "G520.0200.00.05",
        "temp": 33 + index,
        "temp_slowdown": 90,
        "temp_shutdown": 92,
        "power_mw": 71234 + index,
        "power_limit_mw": 700000,
        "clock_sm": 345,
        "clock_mem": 2619,
        "max_clock_sm": 1980,
        "max_clock_mem": 2619,
        "clock_event_reasons": 0x1,  # GpuIdle
        "util_gpu": 0,
        "util_mem": 0,
        "mem_used_b": 595591168,  # 568 MiB
        "mem_total_b": 85520809984,  # 81559 MiB
        "ecc_mode": [1, 1],
        # (NVML_MEMORY_ERROR_TYPE_*, NVML_*_ECC) -> count
        "ecc": {(0, 0): 0, (1, 0): 0, (0, 1): 0, (1, 1): 0},
        # Hopper uses row remapping: nvmlDeviceGetRetiredPages* answer NotSupported
        "remapped": (0, 0, 0, 0),
        "pcie_gen": 5,
        "pcie_gen_max": 5,
        "pcie_width": 16,
        "pcie_width_max": 16,
        "pcie_replay": 0,
        "energy_mj": 81_234_567_890 + index,  # nvmlDeviceGetTotalEnergyConsumption: mJ since driver load
        "nvlink_state": [1] * 18,  # links past the list answer InvalidArgument
        # link -> [DL_REPLAY, DL_RECOVERY, DL_CRC_FLIT, DL_CRC_DATA]
        "nvlink_errors": {link: [0, 0, 0, 0] for link in range(18)},
        "persistence": 1,
        "mig": [0, 0],
        # NVLink fabric registration as an HGX H100 with Fabric Manager reports it (state
        # 3 Completed, status 0 Success; the 535 corpus dump prints the same); R550+ health
        # mask: every two-bit field 2 (false), Incorrect Configuration 1 (none)
        "fabric": fabric_info(),
    }


def fabric_info(state: int = 3, status: int = 0, clique_id: int = 32766,
                cluster_uuid: str = "7bf9f4ab-4a1c-4d52-9c57-0e7d4a3b1f20",
                health_mask: int = 0x1AA, health_summary: int = 0, versions: tuple[int, ...] = (3, 2)) -> dict[str, Any]:
    """A device's ``fabric`` key: what ``nvmlDeviceGetGpuFabricInfo[V]`` fills in
    (``versions``: the ``nvmlGpuFabricInfo_v*`` struct versions the fake driver takes;
    ``()`` = a pre-R550 driver without ``nvmlDeviceGetGpuFabricInfoV``)."""
    return {"state": state, "status": status, "clique_id": clique_id,
            "cluster_uuid": bytes.fromhex(cluster_uuid.replace("-", "")), "health_mask": health_mask,
            "health_summary": health_summary, "versions": versions}


def h100_node() -> list[dict[str, Any]]:
    """8 H100s; GPU 5 is busy, power- and thermally capped, with ECC/NVLink history."""
    gpus = [h100_gpu(i) for i in range(8)]
    g5 = gpus[5]
    g5.update(
        temp=71,
        power_mw=689512,
        clock_sm=1755,
        clock_event_reasons=0x4 | 0x20,  # SwPowerCap | SwThermalSlowdown
        util_gpu=97,
        util_mem=41,
        mem_used_b=80530636800,  # 76800 MiB
        ecc={(0, 0): 3, (1, 0): 0, (0, 1): 17, (1, 1): 1},
        remapped=(1, 1, 1, 0),
        pcie_replay=12,
    )
    g5["nvlink_errors"][3] = [12, 1, 40, 0]
    return gpus


def a100_gpu() -> dict[str, Any]:
    """A 1-GPU A100 PCIe node on driver 525 (no ClocksEventReasons API, no NVLink)."""
    return {
        "uuid": "GPU-0c7f4a11-95de-2b3c-8e64-a1d2f3e4b5c6",
        "serial": "1323220034567",
        "name": "NVIDIA A100-PCIE-40GB",
        "pci_bus_id": "00000000:3B:00.0",
        "vbios": "92.00.25.00.08",
        "inforom_image": "G500.0202.00.02",
        "temp": 41,
        "temp_slowdown": 92,
        "temp_shutdown": 95,
        "power_mw": 250125,
        "power_limit_mw": 250000,
        "clock_sm": 1410,
        "clock_mem": 1215,
        "max_clock_sm": 1410,
        "max_clock_mem": 1215,
        "clock_event_reasons": 0x4,  # SwPowerCap
        "clock_events_api": False,  # nvmlDeviceGetCurrentClocksEventReasons: FunctionNotFound
        "util_gpu": 100,
        "util_mem": 63,
        "mem_used_b": 32212254720,  # 30720 MiB
        "mem_total_b": 42949672960,  # 40960 MiB
        "ecc_mode": [1, 1],
        "ecc": {(0, 0): 0, (1, 0): 0, (0, 1): 2, (1, 1): 0},
        "remapped": (0, 0, 0, 0),
        "pcie_gen": 4,
        "pcie_gen_max": 4,
        "pcie_width": 16,
        "pcie_width_max": 16,
        "pcie_replay": 0,
        # no nvlink_state: link 0 answers NotSupported
        "persistence": 0,
        "mig": [1, 1],
    }


def v100_gpu() -> dict[str, Any]:
    """A V100 SXM2: page retirement instead of row remapping, no MIG, 6 NVLinks."""
    return {
        "uuid": "GPU-7d1e2f30-4a5b-6c7d-8e9f-0a1b2c3d4e5f",
        "serial": "0323018012345",
        "name": "Tesla V100-SXM2-32GB",
        "pci_bus_id": "00000000:1A:00.0",
        "vbios": "88.00.80.00.01",
        "inforom_image": "G503.0203.00.04",
        "temp": 38,
        "temp_slowdown": 84,
        "temp_shutdown": 87,
        "power_mw": 43500,
        "power_limit_mw": 300000,
        "clock_sm": 135,
        "clock_mem": 877,
        "max_clock_sm": 1530,
        "max_clock_mem": 877,
        "clock_event_reasons": 0x1,
        "util_gpu": 0,
        "util_mem": 0,
        "mem_used_b": 0,
        "mem_total_b": 34359738368,  # 32768 MiB
        "ecc_mode": [1, 1],
        "ecc": {(0, 0): 0, (1, 0): 0, (0, 1): 4, (1, 1): 2},
        "retired_sbe": [0x1F2A3000, 0x2B3C4000],
        "retired_dbe": [0x3C4D5000],
        "retired_pending": 1,
        # no "remapped" (Volta), no "mig"
        "pcie_gen": 3,
        "pcie_gen_max": 3,
        "pcie_width": 16,
        "pcie_width_max": 16,
        "pcie_replay": 0,
        "nvlink_state": [1, 1, 1, 1, 1, 0],
        # link 5 is down: its counters answer NotSupported
        "nvlink_errors": {link: [0, 0, 0, 0] for link in range(5)},
        "persistence": 1,
    }


_MISSING = object()


class FakeNvml:
    """State behind a fake ``pynvml`` module; see the module docstring."""

    def __init__(
        self,
        devices: list[dict[str, Any]],
        driver_version: str = "535.129.03",
        cuda_driver_version: int | None = 12020,
    ) -> None:
        self.devices = copy.deepcopy(devices)
        self.driver_version = driver_version
        self.cuda_driver_version = cuda_driver_version
        self.init_error: Any = None
        self.calls: list[tuple[str, int | None]] = []
        self.init_count = 0
        self.shutdown_count = 0
        self._fails: dict[tuple[str, int | None], Any] = {}
        self._hangs: dict[tuple[str, int | None], float] = {}
        self._delays: dict[tuple[str, int | None], float] = {}
        self._release = threading.Event()
        self._events: list[tuple[int, int]] = []
        self._registered: set[int] = set()
        self._lock = threading.Lock()
        self.module = self._build_module()

    # -- fault injection -------------------------------------------------------

    def fail(self, func: str, code: Any, gpu: int | None = None) -> None:
        self._fails[(func, gpu)] = code

    def hang(self, func: str, gpu: int | None = None, max_s: float = 10.0) -> None:
        self._hangs[(func, gpu)] = max_s

    def delay(self, func: str, seconds: float, gpu: int | None = None) -> None:
        self._delays[(func, gpu)] = seconds

    def release(self) -> None:
        """Let every hung call return."""
        self._release.set()

    def hide(self, name: str) -> None:
        delattr(self.module, name)

    def queue_xid(self, gpu: int, xid: int) -> None:
        self._events.append((gpu, xid))

    def calls_for(self, gpu: int) -> list[str]:
        return [f for f, g in self.calls if g == gpu]

    # -- machinery -------------------------------------------------------------

    def _lookup(self, table: dict, func: str, gpu: int | None) -> Any:
        for key in ((func, gpu), (func, None), ("*", gpu), ("*", None)):
            if key[0] == "*" and func == "nvmlDeviceGetHandleByIndex":
                continue
            if key[0] == "*" and gpu is None:
                continue
            if key in table:
                return table[key]
        return _MISSING

    def _enter(self, func: str, gpu: int | None = None) -> None:
        with self._lock:
            self.calls.append((func, gpu))
        max_s = self._lookup(self._hangs, func, gpu)
        if max_s is not _MISSING:
            self._release.wait(max_s)
        d = self._lookup(self._delays, func, gpu)
        if d is not _MISSING:
            time.sleep(d)
        err = self._lookup(self._fails, func, gpu)
        if err is not _MISSING:
            if isinstance(err, int):
                raise NVMLError(err)
            raise err

    def _dev(self, func: str, handle: FakeHandle) -> dict[str, Any]:
        self._enter(func, handle.index)
        return self.devices[handle.index]

    @staticmethod
    def _get(dev: dict[str, Any], key: str) -> Any:
        if key not in dev:
            raise NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
        return dev[key]

    def _build_module(self) -> types.ModuleType:
        mod = types.ModuleType("fake_pynvml")
        for name in dir(_real):
            if name.startswith(("NVML_", "NVMLError", "nvmlEventType")) or name in _STRUCTS:
                setattr(mod, name, getattr(_real, name))
        for name in dir(self):
            if name.startswith("nvml"):
                setattr(mod, name, getattr(self, name))
        return mod

    # -- node ------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self._enter("nvmlInit")
        if self.init_error is not None:
            if isinstance(self.init_error, int):
                raise NVMLError(self.init_error)
            raise self.init_error
        self.init_count += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.shutdown_count += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._enter("nvmlSystemGetCudaDriverVersion")
        if self.cuda_driver_version is None:
            raise NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
        return self.cuda_driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._enter("nvmlDeviceGetHandleByIndex", index)
        if not 0 <= index < len(self.devices):
            raise NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        return FakeHandle(index)

    def nvmlDeviceGetIndex(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetIndex", handle.index)
        return handle.index

    # -- identity --------------------------------------------------------------

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str:
        dev = self._dev("nvmlDeviceGetUUID", handle)
        if isinstance(handle, FakeMigHandle):
            return dev["mig_devices"][handle.slot]
        return self._get(dev, "uuid")

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeHandle:
        self._enter("nvmlDeviceGetHandleByUUID")
        for i, dev in enumerate(self.devices):
            if dev.get("uuid") == uuid:
                return FakeHandle(i)
            for k, m in enumerate(dev.get("mig_devices") or []):
                if m == uuid:
                    return FakeMigHandle(i, k)
        raise NVMLError(_real.NVML_ERROR_NOT_FOUND)

    # -- MIG -------------------------------------------------------------------

    def nvmlDeviceIsMigDeviceHandle(self, handle: FakeHandle) -> bool:
        self._enter("nvmlDeviceIsMigDeviceHandle", handle.index)
        return isinstance(handle, FakeMigHandle)

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: FakeHandle) -> int:
        return len(self._get(self._dev("nvmlDeviceGetMaxMigDeviceCount", handle), "mig_devices"))

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: FakeHandle, index: int) -> FakeMigHandle:
        slots = self._get(self._dev("nvmlDeviceGetMigDeviceHandleByIndex", handle), "mig_devices")
        if not 0 <= index < len(slots) or slots[index] is None:
            raise NVMLError(_real.NVML_ERROR_NOT_FOUND)
        return FakeMigHandle(handle.index, index)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: FakeHandle) -> FakeHandle:
        self._enter("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", handle.index)
        if not isinstance(handle, FakeMigHandle):
            raise NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        return FakeHandle(handle.index)

    def nvmlDeviceGetSerial(self, handle: FakeHandle) -> str:
        return self._get(self._dev("nvmlDeviceGetSerial", handle), "serial")

    def nvmlDeviceGetName(self, handle: FakeHandle) -> str:
        return self._get(self._dev("nvmlDeviceGetName", handle), "name")

    def nvmlDeviceGetPciInfo(self, handle: FakeHandle) -> _Struct:
        bus_id = self._get(self._dev("nvmlDeviceGetPciInfo", handle), "pci_bus_id")
        return _Struct(busId=bus_id)

    def nvmlDeviceGetVbiosVersion(self, handle: FakeHandle) -> str:
        return self._get(self._dev("nvmlDeviceGetVbiosVersion", handle), "vbios")

    def nvmlDeviceGetInforomImageVersion(self, handle: FakeHandle) -> str:
        dev = self._dev("nvmlDeviceGetInforomImageVersion", handle)
        return self._get(dev, "inforom_image")

    # -- thermal, power, clocks ------------------------------------------------

    def nvmlDeviceGetTemperature(self, handle: FakeHandle, sensor: int) -> int:
        assert sensor == _real.NVML_TEMPERATURE_GPU
        return self._get(self._dev("nvmlDeviceGetTemperature", handle), "temp")

    def nvmlDeviceGetTemperatureV(self, handle: FakeHandle, sensor: int) -> int:
        assert sensor == _real.NVML_TEMPERATURE_GPU
        return self._get(self._dev("nvmlDeviceGetTemperatureV", handle), "temp")

    def nvmlDeviceGetTemperatureThreshold(self, handle: FakeHandle, threshold: int) -> int:
        dev = self._dev("nvmlDeviceGetTemperatureThreshold", handle)
        key = {
            _real.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: "temp_slowdown",
            _real.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: "temp_shutdown",
        }[threshold]
        return self._get(dev, key)

    def nvmlDeviceGetPowerUsage(self, handle: FakeHandle) -> int:
        return self._get(self._dev("nvmlDeviceGetPowerUsage", handle), "power_mw")

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: FakeHandle) -> int:
        dev = self._dev("nvmlDeviceGetEnforcedPowerLimit", handle)
        return self._get(dev, "power_limit_mw")

    def _clock(self, func: str, handle: FakeHandle, clock_type: int, prefix: str) -> int:
        dev = self._dev(func, handle)
        kind = {_real.NVML_CLOCK_SM: "sm", _real.NVML_CLOCK_MEM: "mem"}[clock_type]
        return self._get(dev, f"{prefix}{kind}")

    def nvmlDeviceGetClockInfo(self, handle: FakeHandle, clock_type: int) -> int:
        return self._clock("nvmlDeviceGetClockInfo", handle, clock_type, "clock_")

    def nvmlDeviceGetMaxClockInfo(self, handle: FakeHandle, clock_type: int) -> int:
        return self._clock("nvmlDeviceGetMaxClockInfo", handle, clock_type, "max_clock_")

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: FakeHandle) -> int:
        dev = self._dev("nvmlDeviceGetCurrentClocksEventReasons", handle)
        if not dev.get("clock_events_api", True):
            raise NVMLError(_real.NVML_ERROR_FUNCTION_NOT_FOUND)
        return self._get(dev, "clock_event_reasons")

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: FakeHandle) -> int:
        dev = self._dev("nvmlDeviceGetCurrentClocksThrottleReasons", handle)
        return self._get(dev, "clock_event_reasons")

    # -- utilisation, memory ---------------------------------------------------

    def nvmlDeviceGetUtilizationRates(self, handle: FakeHandle) -> _Struct:
        dev = self._dev("nvmlDeviceGetUtilizationRates", handle)
        return _Struct(gpu=self._get(dev, "util_gpu"), memory=self._get(dev, "util_mem"))

    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle) -> _Struct:
        dev = self._dev("nvmlDeviceGetMemoryInfo", handle)
        used, total = self._get(dev, "mem_used_b"), self._get(dev, "mem_total_b")
        return _Struct(total=total, used=used, free=total - used)

    # -- ECC, retired pages, row remapping -------------------------------------

    def nvmlDeviceGetEccMode(self, handle: FakeHandle) -> list[int]:
        return list(self._get(self._dev("nvmlDeviceGetEccMode", handle), "ecc_mode"))

    def nvmlDeviceGetTotalEccErrors(self, handle: FakeHandle, error_type: int, counter_type: int) -> int:
        dev = self._dev("nvmlDeviceGetTotalEccErrors", handle)
        return self._get(dev, "ecc")[(error_type, counter_type)]

    def nvmlDeviceGetRetiredPages(self, handle: FakeHandle, source_filter: int) -> list[int]:
        dev = self._dev("nvmlDeviceGetRetiredPages", handle)
        key = {
            _real.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS: "retired_sbe",
            _real.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR: "retired_dbe",
        }[source_filter]
        return list(self._get(dev, key))

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: FakeHandle) -> int:
        dev = self._dev("nvmlDeviceGetRetiredPagesPendingStatus", handle)
        return self._get(dev, "retired_pending")

    def nvmlDeviceGetSramEccErrorStatus(self, handle: FakeHandle, status: Any) -> int:
        """Fills the caller's ``nvmlEccSramErrorStatus_v1_t`` (passed by reference, its
        ``version`` set) from the device's ``sram_threshold`` (absent: NotSupported)."""
        st = ctypes.cast(status, ctypes.POINTER(_real.c_nvmlEccSramErrorStatus_v1_t)).contents
        if st.version != _real.nvmlEccSramErrorStatus_v1:
            raise NVMLError(_real.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        st.bThresholdExceeded = int(self._get(self._dev("nvmlDeviceGetSramEccErrorStatus", handle), "sram_threshold"))
        return _real.NVML_SUCCESS

    def nvmlDeviceGetGpuFabricInfoV(self, handle: FakeHandle, info: Any) -> int:
        """Fills the caller's ``nvmlGpuFabricInfo_v2/v3`` (by reference, ``version`` set)
        from the device's ``fabric`` (absent: NotSupported); a version not in its
        ``versions``: ArgumentVersionMismatch; ``versions == ()``: FunctionNotFound."""
        f = self._get(self._dev("nvmlDeviceGetGpuFabricInfoV", handle), "fabric")
        if not f["versions"]:
            raise NVMLError(_real.NVML_ERROR_FUNCTION_NOT_FOUND)
        version = ctypes.cast(info, ctypes.POINTER(ctypes.c_uint)).contents.value
        structs = {_real.nvmlGpuFabricInfo_v3: (3, _real.c_nvmlGpuFabricInfo_v3_t),
                   _real.nvmlGpuFabricInfo_v2: (2, _real.c_nvmlGpuFabricInfo_v2_t)}
        if version not in structs or structs[version][0] not in f["versions"]:
            raise NVMLError(_real.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        n, struct = structs[version]
        st = ctypes.cast(info, ctypes.POINTER(struct)).contents
        self._fill_fabric(st, f)
        st.healthMask = f["health_mask"]
        if n == 3:
            st.healthSummary = f["health_summary"]
        return _real.NVML_SUCCESS

    def nvmlDeviceGetGpuFabricInfo(self, handle: FakeHandle, info: Any) -> int:
        """The legacy call (``c_nvmlGpuFabricInfo_t``: no version, no health)."""
        f = self._get(self._dev("nvmlDeviceGetGpuFabricInfo", handle), "fabric")
        self._fill_fabric(ctypes.cast(info, ctypes.POINTER(_real.c_nvmlGpuFabricInfo_t)).contents, f)
        return _real.NVML_SUCCESS

    @staticmethod
    def _fill_fabric(st: Any, f: dict[str, Any]) -> None:
        st.state, st.status, st.cliqueId = f["state"], f["status"], f["clique_id"]
        ctypes.memmove(st.clusterUuid, f["cluster_uuid"], 16)

    def nvmlDeviceGetRemappedRows(self, handle: FakeHandle) -> tuple[int, int, int, int]:
        return tuple(self._get(self._dev("nvmlDeviceGetRemappedRows", handle), "remapped"))

    def nvmlDeviceGetRowRemapperHistogram(self, handle: FakeHandle) -> Any:
        """``c_nvmlRowRemapperHistogramValues`` from ``remap_histogram`` (max, high, partial,
        low, none); a device without the key answers NotSupported (pre-Ampere GPUs)."""
        v = self._get(self._dev("nvmlDeviceGetRowRemapperHistogram", handle), "remap_histogram")
        return _real.c_nvmlRowRemapperHistogramValues(*v)

    def nvmlDeviceGetRepairStatus(self, handle: FakeHandle) -> list[int]:
        """R575+ (Blackwell): ``[bChannelRepairPending, bTpcRepairPending]``, as pynvml returns
        it; a device without a ``repair`` key answers NotSupported (pre-Blackwell GPUs)."""
        return list(self._get(self._dev("nvmlDeviceGetRepairStatus", handle), "repair"))

    def nvmlDeviceGetUnrepairableMemoryFlag_v1(self, handle: FakeHandle) -> int:
        return self._get(self._dev("nvmlDeviceGetUnrepairableMemoryFlag_v1", handle), "unrepairable")

    # -- PCIe ------------------------------------------------------------------

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: FakeHandle) -> int:
        return self._get(self._dev("nvmlDeviceGetCurrPcieLinkGeneration", handle), "pcie_gen")

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: FakeHandle) -> int:
        dev = self._dev("nvmlDeviceGetMaxPcieLinkGeneration", handle)
        return self._get(dev, "pcie_gen_max")

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: FakeHandle) -> int:
        return self._get(self._dev("nvmlDeviceGetCurrPcieLinkWidth", handle), "pcie_width")

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: FakeHandle) -> int:
        dev = self._dev("nvmlDeviceGetMaxPcieLinkWidth", handle)
        return self._get(dev, "pcie_width_max")

    def nvmlDeviceGetPcieReplayCounter(self, handle: FakeHandle) -> int:
        dev = self._dev("nvmlDeviceGetPcieReplayCounter", handle)
        return self._get(dev, "pcie_replay")

    # -- energy ----------------------------------------------------------------

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: FakeHandle) -> int:
        return self._get(self._dev("nvmlDeviceGetTotalEnergyConsumption", handle), "energy_mj")

    # -- NVLink ----------------------------------------------------------------

    def nvmlDeviceGetNvLinkState(self, handle: FakeHandle, link: int) -> int:
        dev = self._dev("nvmlDeviceGetNvLinkState", handle)
        states = self._get(dev, "nvlink_state")
        if link >= len(states):
            raise NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        return states[link]

    def nvmlDeviceGetNvLinkErrorCounter(self, handle: FakeHandle, link: int, counter: int) -> int:
        dev = self._dev("nvmlDeviceGetNvLinkErrorCounter", handle)
        per_link = self._get(dev, "nvlink_errors")
        if link not in per_link:
            raise NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
        return per_link[link][counter]

    # -- modes -----------------------------------------------------------------

    def nvmlDeviceGetPersistenceMode(self, handle: FakeHandle) -> int:
        return self._get(self._dev("nvmlDeviceGetPersistenceMode", handle), "persistence")

    def nvmlDeviceGetMigMode(self, handle: FakeHandle) -> list[int]:
        return list(self._get(self._dev("nvmlDeviceGetMigMode", handle), "mig"))

    def nvmlDeviceGetFieldValues(self, handle: FakeHandle, field_ids: list[int]) -> list[_Struct]:
        """Field values as ``c_nvmlFieldValue_t`` holds them (per field ``nvmlReturn``, 0 or
        NVML_ERROR_NOT_SUPPORTED inside the value as NVML does, and ``value``):
        ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`` (device key ``recovery_action``, ``uiVal``),
        ``NVML_FI_DEV_ECC_DBE_VOL_TOTAL`` (from the ``ecc`` key) and
        ``NVML_FI_DEV_PCIE_REPLAY_COUNTER`` (``pcie_replay``) and
        ``NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION`` (``energy_mj``) and
        ``NVML_FI_DEV_MEMORY_TEMP`` (``mem_temp``, °C; absent from the recorded GPUs), all
        ``ullVal``."""
        dev = self._dev("nvmlDeviceGetFieldValues", handle)
        unsupported = _real.NVML_ERROR_NOT_SUPPORTED
        out = []
        for fid in field_ids:
            if fid == _real.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION:
                v = dev.get("recovery_action")
                out.append(_Struct(fieldId=fid, nvmlReturn=0 if v is not None else unsupported,
                                   value=_Struct(uiVal=v or 0)))
                continue
            if fid == _real.NVML_FI_DEV_ECC_DBE_VOL_TOTAL:
                v = dev.get("ecc", {}).get((_real.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, _real.NVML_VOLATILE_ECC))
            elif fid == _real.NVML_FI_DEV_PCIE_REPLAY_COUNTER:
                v = dev.get("pcie_replay")
            elif fid == _real.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION:
                v = dev.get("energy_mj")
            elif fid == _real.NVML_FI_DEV_MEMORY_TEMP:
                v = dev.get("mem_temp")
            else:
                v = None
            out.append(_Struct(fieldId=fid, scopeId=0, valueType=_real.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG,
                               nvmlReturn=0 if v is not None else unsupported, value=_Struct(ullVal=v or 0)))
        return out

    # -- events ----------------------------------------------------------------

    def nvmlEventSetCreate(self) -> object:
        self._enter("nvmlEventSetCreate")
        return object()

    def nvmlDeviceRegisterEvents(self, handle: FakeHandle, event_types: int, event_set: object) -> None:
        self._enter("nvmlDeviceRegisterEvents", handle.index)
        assert event_types == _real.nvmlEventTypeXidCriticalError
        self._registered.add(handle.index)

    def nvmlEventSetWait(self, event_set: object, timeout_ms: int) -> _Struct:
        self._enter("nvmlEventSetWait")
        while self._events:
            gpu, xid = self._events.pop(0)
            if gpu in self._registered:
                return _Struct(
                    device=FakeHandle(gpu),
                    eventType=_real.nvmlEventTypeXidCriticalError,
                    eventData=xid,
                    gpuInstanceId=0xFFFFFFFF,
                    computeInstanceId=0xFFFFFFFF,
                )
        raise NVMLError(_real.NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, event_set: object) -> None:
        self._enter("nvmlEventSetFree")
