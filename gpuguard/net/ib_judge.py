"""InfiniBand/RoCE port findings: a pure function of the ports read now and the stored
reading of the previous run (see :func:`port_memory`).

* ``ib.port_down`` (critical): the port's state is known and not ``ACTIVE`` (``DOWN``,
  ``INIT``/``ARMED``: no subnet manager has brought it up). A down port may still print a
  rate; it is not judged.
* ``ib.port_unused`` (info): with no ports named in ``[fabric] ports``, a ``DOWN`` port
  with no link partner (physical state ``Polling``, ``Sleep`` or ``Disabled``) that shows
  no sign of ever having been used (:func:`ever_used`) is taken as a port nobody cabled
  (the second port of a dual-port HCA, a spare NIC), not as a fault. LBNL NHC and GPUd
  judge only the ports and rates the operator names; gpuguard judges every port by
  default, so it must not drain a node for a port that was never up. A port seen
  ``ACTIVE`` by an earlier run, or whose counters show traffic or a link-down since the
  driver loaded, is judged ``ib.port_down`` as before; a port named in ``[fabric] ports``
  always is.
* ``ib.rate_degraded`` (critical): an ACTIVE port below its reference rate: the highest
  of ``[fabric] expected_rate_gbps``, the highest rate this port had before, and the
  highest rate of the node's other ACTIVE ports of the same HCA type and link layer (a
  4X HDR cable trained at 2X or at EDR halves the node's fabric bandwidth).
* ``ib.link_flapping`` (warning): ``link_downed`` grew since the last run.
* ``ib.errors_rising`` (warning): an error counter grew by at least its threshold
  (:data:`ERROR_THRESHOLDS`, :data:`HW_ERROR_THRESHOLDS`).
* ``ib.counter_saturated`` (warning): an error counter is at its PortCounters maximum: a
  lower bound, growth unknown (clear with ``perfquery -R``), never read as "no growth".
* ``ib.errors_present`` (info): first reading of a port (no previous run, or a pasted
  ``perfquery``) with error counters at or above their threshold.
* ``ib.unreadable`` (warning): the port's state could not be read: unknown, not healthy.

A counter lower than last time was reset (``perfquery -R``, driver reload): a new start.
"""

from __future__ import annotations

from typing import Any

from gpuguard.model import Finding
from gpuguard.net.ib_model import IbPort, counter_max

#: Minimum growth between two runs that counts, per PortCounters counter. Our choice,
#: from the counters' meaning (IBTA vol. 1 PortCounters): integrity, recovery, overrun
#: and remote physical errors should not happen on a good link (1); symbol and receive
#: errors occur at a low rate on healthy links whose FEC corrects them (10); transmit
#: discards also count congestion and port-down drops (100).
ERROR_THRESHOLDS = {
    "symbol_error": 10, "port_rcv_errors": 10, "link_error_recovery": 1, "local_link_integrity_errors": 1,
    "excessive_buffer_overrun_errors": 1, "port_rcv_remote_physical_errors": 1, "port_xmit_discards": 100,
}
#: mlx5 ``hw_counters`` that count transport errors (NVIDIA MLNX_OFED "Understanding
#: mlx5 Linux Counters"); our choice of thresholds: completion errors and ACK timeouts
#: fail NCCL operations (1); sequence errors and out-of-buffer drops happen under load
#: and only matter in numbers (1000).
HW_ERROR_THRESHOLDS = {
    "local_ack_timeout_err": 1, "req_cqe_error": 1, "resp_cqe_error": 1, "req_remote_access_errors": 1,
    "req_remote_invalid_request": 1, "resp_local_length_error": 1, "rnr_nak_retry_err": 1,
    "packet_seq_err": 1000, "out_of_sequence": 1000, "out_of_buffer": 1000,
}


def _lanes(p: IbPort) -> str:
    parts = [x for x in (p.width, p.speed) if x]
    return f" ({' '.join(parts)})" if parts else ""


def _reference_rate(p: IbPort, ports: list[IbPort], prev: dict[str, Any], expected: float) -> float | None:
    refs = [expected] if expected > 0 else []
    if isinstance(prev.get("max_rate_gbps"), (int, float)):
        refs.append(float(prev["max_rate_gbps"]))
    refs += [q.rate_gbps for q in ports if q is not p and q.state == "ACTIVE" and q.rate_gbps
             and q.hca_type == p.hca_type and q.link_layer == p.link_layer]
    return max(refs) if refs else None


def _counter_findings(p: IbPort, prev: dict[str, Any] | None, now: float) -> list[Finding]:
    out: list[Finding] = []
    rising: dict[str, Any] = {}
    present: dict[str, int] = {}
    saturated: dict[str, int] = {}
    flaps = None
    dt = now - prev["at"] if prev and isinstance(prev.get("at"), (int, float)) and now > prev["at"] else None
    for group, table in (("counters", ERROR_THRESHOLDS), ("hw_counters", HW_ERROR_THRESHOLDS)):
        cur_all = getattr(p, group)
        old_all = (prev or {}).get(group, {})
        for name in sorted(set(cur_all) & (set(table) | {"link_downed"})):
            cur = cur_all[name]
            mx = counter_max(name) if group == "counters" and not p.wide_counters else None
            if mx is not None and cur >= mx:
                saturated[name] = cur
                continue
            old = old_all.get(name)
            if not isinstance(old, int):
                if cur >= table.get(name, 1):
                    present[name] = cur
                continue
            grew = cur - old
            if name == "link_downed" and grew > 0:
                flaps = grew
            elif name in table and grew >= table[name]:
                rising[name] = {"increase": grew, "per_hour": round(grew * 3600 / dt, 2) if dt else None}
    if flaps:
        out.append(Finding("ib.link_flapping", "warning", f"{p.name} link went down {flaps} time(s) since the last run",
                           evidence={"port": p.name, "link_downed_increase": flaps}))
    if rising:
        out.append(Finding("ib.errors_rising", "warning", f"{p.name} errors rising: "
                           + ", ".join(f"{k}+{v['increase']}" for k, v in rising.items()),
                           evidence={"port": p.name, "increase": rising, "since_s": dt}))
    if saturated:
        out.append(Finding("ib.counter_saturated", "warning", f"{p.name} counter(s) stuck at maximum, growth unknown: "
                           + ", ".join(f"{k}={v}" for k, v in saturated.items()),
                           evidence={"port": p.name, "saturated": saturated}))
    if present:
        out.append(Finding("ib.errors_present", "info", f"{p.name} error counters (first reading): "
                           + ", ".join(f"{k}={v}" for k, v in present.items()),
                           evidence={"port": p.name, "counters": present}))
    return out


#: Physical states of a port with no link partner: nothing at the other end of the cable,
#: no cable, or the port administratively disabled (IBTA PortPhysicalState).
_NO_PARTNER = ("Polling", "Sleep", "Disabled")
#: Counters that are non-zero once a port has carried traffic or lost a link since the
#: driver loaded (sysfs ``counters/``, IBTA PortCounters).
_USE_COUNTERS = ("port_xmit_data", "port_rcv_data", "port_xmit_packets", "port_rcv_packets", "link_downed")


def ever_used(p: IbPort, prev: dict[str, Any] | None) -> bool:
    """Whether ``p`` shows a sign of having been used: an earlier run saw it ``ACTIVE``
    (``prev``, its :func:`port_memory`), or its counters show traffic or a link-down since
    the driver loaded."""
    if prev and (prev.get("used") or prev.get("state") == "ACTIVE"
                 or isinstance(prev.get("max_rate_gbps"), (int, float))):
        return True
    return any(p.counters.get(c, 0) > 0 for c in _USE_COUNTERS)


def judge_ports(ports: list[IbPort], previous: dict[str, dict[str, Any]], now: float,
                expected_rate_gbps: float = 0.0, *, listed: bool = False) -> list[Finding]:
    """Findings for ``ports`` given ``previous`` (port name -> :func:`port_memory` of the
    last run; empty on a first run or for a pasted output). ``listed``: the ports are
    those the operator named (``[fabric] ports``): a port down is ``ib.port_down`` even
    if it was never used."""
    out: list[Finding] = []
    for p in ports:
        prev = previous.get(p.name)
        if not p.has_state:
            pass  # a counters-only source (perfquery)
        elif p.state is None:
            out.append(Finding("ib.unreadable", "warning", f"{p.name} state unknown: "
                               + ("; ".join(p.problems) or "not reported"), evidence={"port": p.name, "problems": p.problems}))
        elif (p.state == "DOWN" and p.phys_state in _NO_PARTNER and not listed
              and not ever_used(p, prev)):
            out.append(Finding("ib.port_unused", "info",
                               f"{p.name} port DOWN, physical state {p.phys_state}, no sign of use (never seen ACTIVE, "
                               "no traffic counted): taken as a port nobody cabled (name the ports jobs need in "
                               "[fabric] ports to have it judged)",
                               evidence={"port": p.name, "state": p.state, "phys_state": p.phys_state,
                                         "link_layer": p.link_layer}))
        elif p.state != "ACTIVE":
            phys = p.phys_state or "unknown"
            why = " (not ACTIVE: no subnet manager has brought it up)" if p.state in ("INIT", "ARMED") else ""
            out.append(Finding("ib.port_down", "critical", f"{p.name} port {p.state}, physical state {phys}{why}",
                               evidence={"port": p.name, "state": p.state, "phys_state": p.phys_state,
                                         "link_layer": p.link_layer, "rate_printed_gbps": p.rate_gbps}))
        else:
            ref = _reference_rate(p, ports, prev or {}, expected_rate_gbps)
            if p.rate_gbps is not None and ref is not None and p.rate_gbps < ref:
                out.append(Finding("ib.rate_degraded", "critical",
                                   f"{p.name} at {p.rate_gbps:g} Gb/s{_lanes(p)}, expected {ref:g} Gb/s",
                                   evidence={"port": p.name, "rate_gbps": p.rate_gbps, "expected_gbps": ref,
                                             "width": p.width, "speed": p.speed}))
        out.extend(_counter_findings(p, prev, now))
    return out


def port_memory(p: IbPort, prev: dict[str, Any] | None, now: float) -> dict[str, Any]:
    """What is stored for the next run: counters, time, and the highest rate seen ACTIVE."""
    best = (prev or {}).get("max_rate_gbps")
    if p.state == "ACTIVE" and p.rate_gbps is not None:
        best = max(p.rate_gbps, best) if isinstance(best, (int, float)) else p.rate_gbps
    return {"at": now, "state": p.state, "counters": p.counters, "hw_counters": p.hw_counters,
            "max_rate_gbps": best, "used": p.state == "ACTIVE" or ever_used(p, prev)}
