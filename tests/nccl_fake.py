"""A fake ``all_reduce_perf`` for tests: replays queued nccl-tests outputs, one per run.

``FakeProbe(dir).push(text)`` queues an output; ``push_hang()`` queues a run that never
ends; an empty queue exits 3 with a message (like a missing library).
"""

from __future__ import annotations

import os
from pathlib import Path

DATA = Path(__file__).parent / "data"
HEALTHY = "nccl-allreduce-h100-a3mega-16rank-2.2x.txt"

_SCRIPT = """#!/bin/sh
q='{queue}'
f=$(ls "$q" | sort | head -n 1)
if [ -z "$f" ]; then echo "fake all_reduce_perf: queue empty" >&2; exit 3; fi
case "$f" in
  *.hang) rm -f "$q/$f"; exec sleep 600 ;;
esac
cat "$q/$f"
rc=0
[ -f "$q/$f.rc" ] && rc=$(cat "$q/$f.rc")
rm -f "$q/$f" "$q/$f.rc"
exit $rc
"""


class FakeProbe:
    def __init__(self, root: Path):
        self.queue = root / "queue"
        self.queue.mkdir(parents=True, exist_ok=True)
        self.binary = root / "all_reduce_perf"
        self.binary.write_text(_SCRIPT.format(queue=self.queue))
        self.binary.chmod(0o755)
        self._n = 0

    def _name(self) -> str:
        self._n += 1
        return f"{self._n:04d}"

    def push(self, text: str, rc: int = 0) -> None:
        name = self._name()
        (self.queue / name).write_text(text)
        if rc:
            (self.queue / f"{name}.rc").write_text(str(rc))

    def push_hang(self) -> None:
        (self.queue / f"{self._name()}.hang").write_text("")

    def pending(self) -> int:
        return len([p for p in os.listdir(self.queue) if not p.endswith(".rc")])


def healthy_text() -> str:
    return (DATA / HEALTHY).read_text()


def scaled(text: str, factor: float) -> str:
    """``text`` with every result row's algbw/busbw multiplied by ``factor`` (and time
    divided), formatted as nccl-tests prints them."""
    out = []
    for line in text.splitlines():
        t = line.split()
        if len(t) == 13 and t[0].isdigit():
            for i in (6, 7, 10, 11):
                t[i] = f"{float(t[i]) * factor:6.2f}"
            for i in (5, 9):
                t[i] = f"{float(t[i]) / factor:7.1f}"
            line = "  ".join(t)
        elif line.startswith("# Avg bus bandwidth"):
            v = float(line.split(":")[1])
            line = f"# Avg bus bandwidth    : {v * factor:g} "
        out.append(line)
    return "\n".join(out) + "\n"
