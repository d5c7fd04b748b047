"""The time stamps in a kernel-log line's prefix: an English month-name date with its
year (ctime as ``dmesg -T`` prints it, ``Dec 01 2026 10:00:00``, ``2026 Dec  1 10:00:00``),
ISO 8601 (with journalctl short-full's zone after it), epoch (``journalctl -o
short-unix``, syslog-ng ``ts-format(unix)``), the printk stamp ``[  123.456]`` (padded
either side) and a saved /dev/kmsg record's microseconds (:func:`prefix_times`)."""

from __future__ import annotations

import calendar
import re
import time
from datetime import datetime

_MONTHS = "Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec"
_WEEKDAYS = "Mon|Tue|Wed|Thu|Fri|Sat|Sun"
#: an English month-name date that holds its year: [WEEKDAY] [YEAR] MON DD [YEAR] TIME
#: [UTC|GMT] [YEAR] (the orders :data:`gpuguard.xid.prefix.TOKENS` reads: ctime as ``dmesg
#: -T`` prints it, ``Dec 01 2026 10:00:00``, syslog-ng ts-format(full) ``2026 Dec  1
#: 10:00:00``); without a year (RFC 3164) it gives no time
_DATE_RE = re.compile(
    rf"(?<![\w.])(?:(?:{_WEEKDAYS}),?\s+)?(?:(?P<y1>\d{{4}})\s+)?(?P<mon>{_MONTHS})\s+(?P<day>\d{{1,2}})"
    r"(?:\s+(?P<y2>\d{4}))?\s+(?P<hms>\d{1,2}:\d\d:\d\d)(?P<frac>[.,]\d+)?(?:\s+(?P<zone>UTC|GMT))?"
    r"(?:\s+(?P<y3>\d{4}))?(?=[\]\s]|$)"
)
_EPOCH_RE = re.compile(r"^\s*(?:<\d{1,3}>)?(?P<epoch>\d{9,11}(?:\.\d{1,9})?)(?=\s|$)")
_ISO_RE = re.compile(
    r"(?<!\d)(?P<iso>\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?)(?!\d)"
    r"(?:\s+(?:(?P<utc>UTC|GMT)|(?P<off>[+-]\d\d(?:\d\d)?))(?=\s|$))?"
)
#: the printk stamp, padded either side (``[ 12.5]``, ``[12345.678 ]``), with journalctl
#: -o short-delta's ``<delta>`` after it
_MONO_RE = re.compile(r"\[\s*(?P<mono>\d+\.\d+)\s*(?:<[\s\d.]*>\s*)?\]")
#: a saved /dev/kmsg record's header ``PRI,SEQ,USEC,FLAGS;`` (USEC: microseconds since boot)
_KMSG_HEAD_RE = re.compile(r"(?:^|\s)\d{1,4},\d+,(?P<usec>\d+),[^;\s]*;")


def _date_time(prefix: str) -> float | None:
    """UTC epoch seconds of the first English month-name date with a year in ``prefix``
    (local time unless ``UTC``/``GMT`` follows), or None."""
    for m in _DATE_RE.finditer(prefix):
        year = m["y1"] or m["y2"] or m["y3"]
        if not year:
            continue
        try:  # an impossible date (Feb 30) loses the time, never the event
            tm = time.strptime(f"{year} {m['mon']} {m['day']} {m['hms']}", "%Y %b %d %H:%M:%S")
            seconds = calendar.timegm(tm) if m["zone"] else time.mktime(tm)
        except (ValueError, OverflowError):
            return None
        return seconds + (float("0." + m["frac"][1:]) if m["frac"] else 0.0)
    return None


def _iso_time(prefix: str) -> float | None:
    """UTC epoch seconds of the first ISO 8601 stamp in ``prefix``: its offset, else a
    zone after it (``UTC``, ``+04``: journalctl -o short-full), else local time; or None."""
    m = _ISO_RE.search(prefix)
    if not m:
        return None
    iso = m["iso"].replace(",", ".").replace("Z", "+00:00")
    try:
        dt = datetime.fromisoformat(iso)
        if dt.tzinfo is None and (m["utc"] or m["off"]):
            dt = datetime.fromisoformat(iso + (m["off"] or "+00:00"))  # fromisoformat reads +HH, +HHMM
    except ValueError:
        return None
    return dt.timestamp() if dt.tzinfo else time.mktime(dt.timetuple()) + dt.microsecond / 1e6


def prefix_times(prefix: str) -> tuple[float | None, float | None]:
    """(UTC epoch seconds or None, seconds since boot or None) read from a kernel-log line's
    ``prefix`` (the text before its marker; see :mod:`gpuguard.xid.parse` for which stamp
    gives which). Raises nothing."""
    timestamp = _date_time(prefix)
    if timestamp is None:
        timestamp = _iso_time(prefix)
    if timestamp is None:
        m = _EPOCH_RE.search(prefix)
        if m:
            timestamp = float(m["epoch"])
    mono = _MONO_RE.search(prefix)
    if mono:
        return timestamp, float(mono["mono"])
    kmsg = _KMSG_HEAD_RE.search(prefix)
    return timestamp, (int(kmsg["usec"]) / 1e6 if kmsg else None)
