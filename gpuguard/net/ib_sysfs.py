"""Read InfiniBand/RoCE ports from sysfs: ``{root}/<device>/ports/<n>/{state, phys_state,
rate, link_layer, counters/*, hw_counters/*}`` (root ``/sys/class/infiniband`` by
default, ``[fabric] sysfs_root``; tests point it at recorded trees).

A missing root means no RDMA devices (``[]``). A file that cannot be read (EINVAL from
a virtual function's ``rate``, EIO from a counter) is noted in :attr:`IbPort.problems`
and its value left None: unknown, not zero and not healthy.
"""

from __future__ import annotations

import os

from gpuguard.net.ib_model import IbPort, parse_phys_state, parse_rate, parse_state

_MAX_READ = 4096


def _read(path: str) -> str:
    """Small sysfs/recorded file; raises OSError."""
    with open(path, "rb") as fh:
        return fh.read(_MAX_READ).decode("ascii", "replace").strip()


def _counters(dirpath: str, port: IbPort, what: str) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        names = sorted(os.listdir(dirpath))
    except OSError:
        return out
    for n in names:
        p = os.path.join(dirpath, n)
        if not os.path.isfile(p) or n == "lifespan":
            continue
        try:
            out[n] = int(_read(p))
        except (OSError, ValueError) as e:
            port.problems.append(f"{what}/{n} unreadable: {getattr(e, 'strerror', None) or e}")
    return out


def read_port(root: str, device: str, port_no: int) -> IbPort:
    """Read one port (never raises for a file; see the module docstring)."""
    base = os.path.join(root, device, "ports", str(port_no))
    port = IbPort(device, port_no)
    try:
        port.hca_type = _read(os.path.join(root, device, "hca_type")) or None
    except OSError:
        pass  # hca_type is informational (not every driver has it)
    for name, parse in (("state", parse_state), ("phys_state", parse_phys_state)):
        try:
            setattr(port, name, parse(_read(os.path.join(base, name))))
        except OSError as e:
            port.problems.append(f"{name} unreadable: {e.strerror}")
    try:
        port.link_layer = _read(os.path.join(base, "link_layer")) or None
    except OSError:
        port.link_layer = None
    try:
        port.rate_gbps, port.width, port.speed = parse_rate(_read(os.path.join(base, "rate")))
    except (OSError, ValueError) as e:
        port.problems.append(f"rate unreadable: {getattr(e, 'strerror', None) or e}")
    port.counters = _counters(os.path.join(base, "counters"), port, "counters")
    port.hw_counters = _counters(os.path.join(base, "hw_counters"), port, "hw_counters")
    return port


def read_ports(root: str, only: list[str] | None = None) -> list[IbPort]:
    """Every port under ``root`` (sorted by device and port), or those named in ``only``
    (``"mlx5_0/1"``). A missing root gives ``[]``; raises nothing."""
    try:
        devices = sorted(os.listdir(root))
    except OSError:
        return []
    out = []
    for dev in devices:
        try:
            ports = sorted(int(p) for p in os.listdir(os.path.join(root, dev, "ports")) if p.isdigit())
        except OSError:
            continue
        for p in ports:
            if only and f"{dev}/{p}" not in only:
                continue
            out.append(read_port(root, dev, p))
    return out
