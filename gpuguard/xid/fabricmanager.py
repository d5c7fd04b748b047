"""NVSwitch errors as nvidia-fabricmanager logs them (``/var/log/fabricmanager.log``).

The Fabric Manager daemon reports every NVSwitch error it handles as one line of its own
log, not as the driver's ``SXid`` line:

``[Jul 23 2024 07:53:55] [ERROR] [tid 841] detected NVSwitch fatal error 20034 on fid 0 on
NVSwitch pci bus id 00000000:86:00.0 physical id 3 port 33``

(``non-fatal`` for the others; lines as GPUd's fabric-manager component reads them,
leptonai/gpud components/accelerator/nvidia/fabric-manager). Such a line is an SXid event
(:func:`fabric_manager_sxid`): the code, the switch's PCI address, and a message that
starts with the flag the SXid catalog reads (``Fatal, port 33 ...`` / ``Non-fatal, ...``).
A file of these lines given to ``xid scan`` or ``[xid] kernel_log`` is therefore never "no
XID events" for a fatal NVSwitch error.

Only the log's own layout counts: the line starts with Fabric Manager's ``[Mon DD YYYY
HH:MM:SS] [LEVEL] [tid N]`` prefix, or with nothing (a pasted line). A structured kernel
source never holds Fabric Manager lines (it is a program, not the kernel), and any other
text before ``detected NVSwitch`` (``alice:``, a syslog ``host prog[pid]:`` that any user
can write with ``logger``) makes the line rejected, with its reason.
"""

from __future__ import annotations

import re
import time

#: The error line (Fabric Manager's ``detected NVSwitch ... error``).
_FM_RE = re.compile(
    r"detected NVSwitch (?P<sev>fatal|non-fatal) error (?P<code>\d+) on fid \d+ on NVSwitch pci bus id "
    r"(?P<pci>[0-9a-fA-F]{1,8}:[0-9a-fA-F]{1,2}:[0-9a-fA-F]{1,2}\.[0-7])(?P<rest>.*)$", re.IGNORECASE)
#: Fabric Manager's own line prefix: time (the host's local time), level, thread id.
_FM_PREFIX_RE = re.compile(
    r"\[(?P<when>[A-Z][a-z]{2} +\d{1,2} \d{4} \d\d:\d\d:\d\d)\] \[[A-Z]+\] \[tid \d+\] ")
#: What :func:`fabric_manager_sxid` returns for a line it reads: its fields.
FmFields = tuple[str, int, str, "float | None"]


def has_fm_marker(text: str) -> bool:
    """True when ``text`` holds a Fabric Manager NVSwitch error line."""
    return "detected NVSwitch" in text and _FM_RE.search(text) is not None


def fabric_manager_sxid(text: str, structured: bool) -> FmFields | str | None:
    """``(pci, code, message, timestamp or None)`` of a Fabric Manager NVSwitch error line,
    the one-line reason it is not accepted, or None when ``text`` is not one. The
    timestamp is the prefix's local time as UTC epoch seconds (Fabric Manager prints the
    host's local time, like ``dmesg -T``)."""
    if "detected NVSwitch" not in text:
        return None
    m = _FM_RE.search(text)
    if m is None:
        return None
    if structured:
        return "a Fabric Manager line in a kernel source (a program wrote it)"
    prefix = text[: m.start()]
    p = _FM_PREFIX_RE.fullmatch(prefix)
    if prefix.strip() and p is None:
        shown = prefix.strip()
        return f"not a Fabric Manager log prefix: {shown[:37] + '...' if len(shown) > 40 else shown!r}"
    timestamp = None
    if p is not None:
        try:
            timestamp = time.mktime(time.strptime(" ".join(p["when"].split()), "%b %d %Y %H:%M:%S"))
        except (ValueError, OverflowError):
            timestamp = None
    flag = "Fatal" if m["sev"].lower() == "fatal" else "Non-fatal"
    rest = m["rest"].strip()
    message = f"{flag}, {rest} (nvidia-fabricmanager)" if rest else f"{flag} (nvidia-fabricmanager)"
    return m["pci"], int(m["code"]), message, timestamp
