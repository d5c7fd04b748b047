"""One InfiniBand/RoCE port as every reader gives it (sysfs, ``ibstat``, ``ibv_devinfo
-v``, ``perfquery -x``), and the parsing of the kernel's sysfs value formats.

Value formats are those of the Linux RDMA core (``drivers/infiniband/core/sysfs.c``):
``state`` ``"4: ACTIVE"``, ``phys_state`` ``"5: LinkUp"`` (code 0 prints
``"0: <unknown>"``: unknown, never read as down or up), ``rate`` ``"200 Gb/sec (4X HDR)"``
(SDR has no speed name: ``"10 Gb/sec (4X)"``; a width the core cannot map makes the read
fail with EINVAL, seen on some virtual functions). Counter widths are those of the IBTA
PortCounters attribute (InfiniBand Architecture Specification vol. 1, 16.1.3.5): the
counters saturate at their maximum instead of wrapping, so a counter at its maximum is a
lower bound: how much it grew is unknown.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

#: IBTA PortState (``enum ib_port_state``).
PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
#: IBTA PortPhysicalState (``enum ib_port_phys_state``); 0 is not defined: unknown.
PHYS_STATES = {1: "Sleep", 2: "Polling", 3: "Disabled", 4: "PortConfigurationTraining", 5: "LinkUp",
               6: "LinkErrorRecovery", 7: "PhyTest"}

#: PortCounters widths in bits (IBTA vol. 1, PortCounters); sysfs counters of the same names.
COUNTER_BITS = {
    "symbol_error": 16, "link_error_recovery": 8, "link_downed": 8, "port_rcv_errors": 16,
    "port_rcv_remote_physical_errors": 16, "port_rcv_switch_relay_errors": 16, "port_xmit_discards": 16,
    "port_xmit_constraint_errors": 8, "port_rcv_constraint_errors": 8, "local_link_integrity_errors": 4,
    "excessive_buffer_overrun_errors": 4, "VL15_dropped": 16,
}


def counter_max(name: str) -> int | None:
    """Saturation value of a PortCounters counter, None for 64-bit/extended/hw counters."""
    bits = COUNTER_BITS.get(name)
    return (1 << bits) - 1 if bits else None


@dataclass
class IbPort:
    """One port. ``state``/``phys_state`` are the IBTA names (``ACTIVE``, ``LinkUp``),
    None when unknown; ``rate_gbps`` the active rate in Gb/s (None: unreadable);
    ``counters`` the PortCounters by sysfs name; ``hw_counters`` the driver's extra
    counters (mlx5: ``out_of_buffer``, ``local_ack_timeout_err``...); ``problems`` what
    could not be read; ``lid`` the port's LID (to join perfquery output)."""

    device: str
    port: int
    state: str | None = None
    phys_state: str | None = None
    rate_gbps: float | None = None
    width: str | None = None
    speed: str | None = None
    link_layer: str | None = None
    hca_type: str | None = None
    counters: dict[str, int] = field(default_factory=dict)
    hw_counters: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    lid: int | None = None
    #: False for a source that prints no port state (perfquery): only counters are judged.
    has_state: bool = True
    #: True for 64-bit (PortCountersExtended) error counters, which do not saturate.
    wide_counters: bool = False

    @property
    def name(self) -> str:
        return f"{self.device}/{self.port}"


def parse_state(text: str) -> str | None:
    """``"4: ACTIVE"`` / ``"ACTIVE"`` / ``"4"`` -> ``ACTIVE``; unknown -> None."""
    return _code_name(text, PORT_STATES, upper=True)


def parse_phys_state(text: str) -> str | None:
    """``"5: LinkUp"`` -> ``LinkUp``; ``"0: <unknown>"`` -> None (unknown)."""
    return _code_name(text, PHYS_STATES, upper=False)


def _code_name(text: str, table: dict[int, str], upper: bool) -> str | None:
    t = text.strip()
    m = re.match(r"^(\d+)\s*(?::\s*(.*))?$", t)
    if m:
        code = int(m.group(1))
        if code in table:
            return table[code]
        return None
    names = {v.lower(): v for v in table.values()}
    key = t.replace(" ", "").lower()
    return names.get(key)


_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*Gb/sec\s*(?:\((\d+)X\s*([A-Z]+)?\))?", re.I)


def parse_rate(text: str) -> tuple[float, str | None, str | None]:
    """``"200 Gb/sec (4X HDR)"`` -> ``(200.0, "4X", "HDR")``; raises ValueError."""
    m = _RATE.match(text)
    if not m:
        raise ValueError(f"not a rate: {text.strip()!r}")
    width = f"{m.group(2)}X" if m.group(2) else None
    return float(m.group(1)), width, (m.group(3) or ("SDR" if width else None))
