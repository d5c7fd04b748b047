"""Saved ``ibstat``, ``ibv_devinfo -v`` and ``perfquery [-x]`` output -> :class:`IbPort`,
so a paste in a ticket gets the findings the sysfs reader would give.

Formats (rdma-core / infiniband-diags as printed since ~2015):

* ``ibstat``: ``CA 'mlx5_0'`` then ``Port 1:`` blocks of ``State: Active``,
  ``Physical state: LinkUp``, ``Rate: 200``, ``Base lid: 425``, ``Link layer: InfiniBand``.
  libibumad's debug lines (``ibwarn: ...``) are skipped; its fatal ``ibpanic: ...`` ends
  the listing, so the device it names (port 0: CA-level) is a port whose state is unknown.
* ``ibstatus``: ``Infiniband device 'mlx5_0' port 1 status:`` blocks of the port's
  sysfs values (``state: 4: ACTIVE``, ``rate: 200 Gb/sec (4X HDR)``).
* ``ibv_devinfo -v``: ``hca_id: mlx5_0`` then ``port: 1`` blocks of
  ``state: PORT_ACTIVE (4)``, ``phys_state: LINK_UP (5)``, ``active_width: 4X (2)``,
  ``active_speed: 50.0 Gbps (64)``, ``link_layer: InfiniBand``; the rate is width x lane
  speed. An unknown width (``invalid width``, odd values from virtual functions) leaves
  the rate unknown rather than guessing.
* ``perfquery``: ``# Port counters: Lid 425 port 1`` (or ``# Port extended counters``)
  then ``SymbolErrorCounter:......0`` lines. Counter names map to the sysfs names.
  Extended (``-x``) error counters are 64-bit and do not saturate. perfquery prints no
  port state: only counters are judged.

Indentation may be lost in a paste; every reader keys on the field names, not on tabs.
Lines that look like fields of a port but do not parse are collected as problems.
"""

from __future__ import annotations

import re

from gpuguard.net.ib_model import IbPort, parse_phys_state, parse_rate, parse_state

PERFQUERY_NAMES = {
    "SymbolErrorCounter": "symbol_error", "LinkErrorRecoveryCounter": "link_error_recovery",
    "LinkDownedCounter": "link_downed", "PortRcvErrors": "port_rcv_errors",
    "PortRcvRemotePhysicalErrors": "port_rcv_remote_physical_errors",
    "PortRcvSwitchRelayErrors": "port_rcv_switch_relay_errors", "PortXmitDiscards": "port_xmit_discards",
    "PortXmitConstraintErrors": "port_xmit_constraint_errors", "PortRcvConstraintErrors": "port_rcv_constraint_errors",
    "LocalLinkIntegrityErrors": "local_link_integrity_errors",
    "ExcessiveBufferOverrunErrors": "excessive_buffer_overrun_errors", "VL15Dropped": "VL15_dropped",
    "PortXmitData": "port_xmit_data", "PortRcvData": "port_rcv_data", "PortXmitPkts": "port_xmit_packets",
    "PortRcvPkts": "port_rcv_packets", "PortXmitWait": "port_xmit_wait",
    "PortUnicastXmitPkts": "unicast_xmit_packets", "PortUnicastRcvPkts": "unicast_rcv_packets",
    "PortMulticastXmitPkts": "multicast_xmit_packets", "PortMulticastRcvPkts": "multicast_rcv_packets",
}
#: ``ibv_devinfo`` ``active_width`` lanes and ``active_speed`` Gb/s per lane -> IB speed name.
_LANE_SPEED_NAMES = {2.5: "SDR", 5.0: "DDR", 10.0: "QDR", 14.0: "FDR", 25.0: "EDR", 50.0: "HDR",
                     100.0: "NDR", 200.0: "XDR"}
_IBSTAT_STATE = {"active": "ACTIVE", "down": "DOWN", "initializing": "INIT", "init": "INIT", "armed": "ARMED"}


#: libibumad's fatal message (``ibpanic: [pid] func: text``), naming the device when it has one.
_IBPANIC = re.compile(r"^ibpanic:\s*(?:\[\d+\]\s*)?(?:\w+:\s*)?(.*?)\s*$")


class TextFormatError(ValueError):
    """The text is not the named tool's output (one line, names the format)."""


def parse_ibstat(text: str) -> list[IbPort]:
    """``ibstat`` output -> ports; raises :class:`TextFormatError` when no ``CA`` block."""
    ports: list[IbPort] = []
    dev = hca = None
    cur: IbPort | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if m := re.match(r"^CA\s+'([^']+)'", line):
            dev, hca, cur = m.group(1), None, None
            continue
        if m := _IBPANIC.match(line):
            # ibstat stops at a device it cannot read (libibumad's umad_get_ca failing,
            # e.g. a device gone from sysfs): that device, and any listed after it, unknown
            named = re.search(r"device '([^']+)'", m.group(1))
            gone = IbPort(named.group(1) if named else "ibstat", 0)
            gone.problems.append(f"ibstat stopped: {m.group(1)}")
            ports.append(gone)
            continue
        if dev is None or ":" not in line:
            continue
        key, _, val = (s.strip() for s in line.partition(":"))
        k = key.lower()
        if k == "ca type":
            hca = val or None
        elif m := re.match(r"^port\s+(\d+)$", k):
            cur = IbPort(dev, int(m.group(1)), hca_type=hca)
            ports.append(cur)
        elif cur is None:
            continue
        elif k == "state":
            cur.state = _IBSTAT_STATE.get(val.lower())
            if cur.state is None:
                cur.problems.append(f"state {val!r} not understood")
        elif k == "physical state":
            cur.phys_state = parse_phys_state(val)
        elif k == "rate":
            try:
                cur.rate_gbps = float(val)
            except ValueError:
                cur.problems.append(f"rate {val!r} not a number")
        elif k == "link layer":
            cur.link_layer = val or None
        elif k == "base lid":
            cur.lid = _int(val)
    if not ports:
        raise TextFormatError("no \"CA '...'\" block with a port: not ibstat output")
    return ports


def parse_ibstatus(text: str) -> list[IbPort]:
    """``ibstatus`` output (infiniband-diags' script printing each port's sysfs files:
    ``Infiniband device 'mlx5_0' port 1 status:`` then ``state: 4: ACTIVE``, ``phys
    state: 5: LinkUp``, ``rate: 200 Gb/sec (4X HDR)``, ``base lid: 0x33bf``,
    ``link_layer: InfiniBand``) -> ports; the values read as the sysfs ones do. Raises
    :class:`TextFormatError` when no port block is found."""
    ports: list[IbPort] = []
    cur: IbPort | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if m := re.match(r"^Infiniband device '([^']+)' port (\d+) status:", line):
            cur = IbPort(m.group(1), int(m.group(2)))
            ports.append(cur)
            continue
        if cur is None or ":" not in line:
            continue
        key, _, val = (x.strip() for x in line.partition(":"))
        k = key.lower()
        if k == "state":
            cur.state = parse_state(val)
            if cur.state is None:
                cur.problems.append(f"state {val!r} not understood")
        elif k in ("phys state", "physical state"):
            cur.phys_state = parse_phys_state(val)
        elif k == "rate":
            try:
                cur.rate_gbps, cur.width, cur.speed = parse_rate(val)
            except ValueError:
                cur.problems.append(f"rate {val!r} not understood")
        elif k == "link_layer":
            cur.link_layer = val or None
        elif k == "base lid":
            cur.lid = _int(val)
    if not ports:
        raise TextFormatError("no \"Infiniband device '...' port N status:\" block: not ibstatus output")
    return ports


def _int(v: str) -> int | None:
    try:
        return int(v, 0)
    except ValueError:
        return None


def _paren_code(val: str) -> tuple[str, int | None]:
    m = re.match(r"^(.*?)\s*\((\d+)\)\s*$", val)
    return (m.group(1).strip(), int(m.group(2))) if m else (val.strip(), None)


def parse_ibv_devinfo(text: str) -> list[IbPort]:
    """``ibv_devinfo [-v]`` output -> ports; raises :class:`TextFormatError`."""
    ports: list[IbPort] = []
    dev = None
    cur: IbPort | None = None
    width = speed = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or ":" not in line:
            continue
        key, _, val = (s.strip() for s in line.partition(":"))
        k = key.lower()
        if k == "hca_id":
            _finish_rate(cur, width, speed)
            dev, cur, width, speed = val, None, None, None
        elif dev is None:
            continue
        elif k == "port" and val.isdigit():
            _finish_rate(cur, width, speed)
            cur, width, speed = IbPort(dev, int(val)), None, None
            ports.append(cur)
        elif cur is None:
            continue
        elif k == "state":
            name, code = _paren_code(val)
            cur.state = parse_state(str(code)) if code is not None else parse_state(name.removeprefix("PORT_"))
        elif k == "phys_state":
            name, code = _paren_code(val)
            cur.phys_state = parse_phys_state(str(code)) if code is not None else None
        elif k == "link_layer":
            cur.link_layer = val or None
        elif k == "active_width":
            width = _paren_code(val)[0]
        elif k == "active_speed":
            speed = _paren_code(val)[0]
        elif k == "port_lid":
            cur.lid = _int(val)
    _finish_rate(cur, width, speed)
    if not ports:
        raise TextFormatError("no 'hca_id:' block with a 'port:': not ibv_devinfo output")
    return ports


def _finish_rate(p: IbPort | None, width: str | None, speed: str | None) -> None:
    if p is None or width is None or speed is None:
        return
    wm = re.fullmatch(r"(\d+)X", width)
    sm = re.match(r"^(\d+(?:\.\d+)?)\s*Gbps", speed)
    if not wm or not sm:
        p.problems.append(f"active_width {width!r} / active_speed {speed!r}: rate unknown")
        return
    lane = float(sm.group(1))
    p.width, p.speed = width, _LANE_SPEED_NAMES.get(lane)
    p.rate_gbps = int(wm.group(1)) * lane


def parse_perfquery(text: str) -> list[IbPort]:
    """``perfquery [-x]`` output -> counter-only ports named ``lid<N>/<port>``; raises
    :class:`TextFormatError`."""
    ports: list[IbPort] = []
    cur: IbPort | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if m := re.match(r"^#\s*Port (extended )?counters:\s*Lid\s+(\d+)\s+port\s+(\d+)", line, re.I):
            cur = IbPort(f"lid{m.group(2)}", int(m.group(3)), has_state=False, wide_counters=bool(m.group(1)))
            cur.lid = int(m.group(2))
            ports.append(cur)
            continue
        m = re.match(r"^(\w+):\.*\s*(\S+)$", line)
        if not m or cur is None:
            continue
        name = PERFQUERY_NAMES.get(m.group(1))
        if name is None:
            continue
        try:
            cur.counters[name] = int(m.group(2), 0)
        except ValueError:
            cur.problems.append(f"{m.group(1)} {m.group(2)!r} not a number")
    if not ports:
        raise TextFormatError("no '# Port counters: Lid N port M' header: not perfquery output")
    return ports


def merge_by_lid(ports: list[IbPort], counters: list[IbPort]) -> list[IbPort]:
    """Attach perfquery counters to the ibstat/ibv_devinfo port with the same LID; the
    rest stay counter-only ports."""
    by_lid = {(p.lid, p.port): p for p in ports if p.lid}
    rest = []
    for c in counters:
        p = by_lid.get((c.lid, c.port))
        if p is None:
            rest.append(c)
            continue
        p.counters.update(c.counters)
        p.wide_counters = c.wide_counters
        p.problems += c.problems
    return ports + rest
