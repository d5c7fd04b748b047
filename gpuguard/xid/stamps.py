"""The time stamps in a kernel-log line's prefix: ctime (``dmesg -T``), ISO 8601, epoch
(``journalctl -o short-unix``), the printk stamp ``[  123.456]`` and a saved /dev/kmsg
record's microseconds (:func:`prefix_times`)."""

from __future__ import annotations

import re
import time
from datetime import datetime

_MONTHS = "Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec"
_CTIME_RE = re.compile(
    rf"(?:^|\[|\s)(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) (?P<mon>{_MONTHS}) +(?P<day>\d{{1,2}}) "
    r"(?P<hms>\d\d:\d\d:\d\d) (?P<year>\d{4})(?:\]|\s|$)"
)
_EPOCH_RE = re.compile(r"^\s*(?:<\d{1,3}>)?(?P<epoch>\d{9,11}\.\d{1,9})(?=\s|$)")
_ISO_RE = re.compile(
    r"(?<!\d)(?P<iso>\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?)(?!\d)"
)
_MONO_RE = re.compile(r"\[\s*(?P<mono>\d+\.\d+)(?:\s*<[\s\d.]*>)?\]")
#: a saved /dev/kmsg record's header ``PRI,SEQ,USEC,FLAGS;`` (USEC: microseconds since boot)
_KMSG_HEAD_RE = re.compile(r"(?:^|\s)\d{1,4},\d+,(?P<usec>\d+),[^;\s]*;")


def prefix_times(prefix: str) -> tuple[float | None, float | None]:
    """(UTC epoch seconds or None, seconds since boot or None) read from a kernel-log line's
    ``prefix`` (the text before its marker; see :mod:`gpuguard.xid.parse` for which stamp
    gives which). Raises nothing."""
    timestamp: float | None = None
    m = _CTIME_RE.search(prefix)
    if m:
        try:  # an impossible date (Feb 30) loses the time, never the event
            timestamp = time.mktime(time.strptime(f"{m['year']} {m['mon']} {m['day']} {m['hms']}",
                                                  "%Y %b %d %H:%M:%S"))
        except (ValueError, OverflowError):
            timestamp = None
    else:
        m = _ISO_RE.search(prefix)
        if m:
            iso = m["iso"].replace(",", ".").replace("Z", "+00:00")
            try:
                dt = datetime.fromisoformat(iso)
            except ValueError:
                dt = None
            if dt is not None:
                timestamp = dt.timestamp() if dt.tzinfo else time.mktime(dt.timetuple()) + dt.microsecond / 1e6
    if timestamp is None:
        m = _EPOCH_RE.search(prefix)
        if m:
            timestamp = float(m["epoch"])
    mono = _MONO_RE.search(prefix)
    if mono:
        return timestamp, float(mono["mono"])
    kmsg = _KMSG_HEAD_RE.search(prefix)
    return timestamp, (int(kmsg["usec"]) / 1e6 if kmsg else None)
