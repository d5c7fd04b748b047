"""The ``replay`` GPU source: recorded snapshots and scenarios, or real nvidia-smi dumps.

Two inputs:

* gpuguard's own snapshot file (written by ``gpuguard gpu snapshot``)::

    {"format": "gpuguard-snapshot/1",
     "t0": 1764470000.0,                 # optional; default: the file's mtime
     "snapshot": {<NodeSnapshot.to_dict()>},
     "steps": [                          # optional timed changes (a scenario)
        {"after_s": 30, "gpus": {"1": {"sm_clock_mhz": 990,
                                       "clock_event_reasons": ["hw_thermal_slowdown"]}}}
     ]}

  At wall time ``now`` every step with ``after_s <= now - t0`` is applied in order, each
  setting the named GPU fields (keys are GPU indices as strings). This is how a test makes
  an ECC count rise or a GPU throttle in the middle of a job.

* a real ``nvidia-smi -q`` text or ``nvidia-smi -q -x`` XML dump (see
  :mod:`gpuguard.gpu.nvsmi`), read as a fixed snapshot.

Errors are :class:`ReplayError` (one line naming the file and the problem).
"""

from __future__ import annotations

import copy
import json
import os
import time
from typing import Any

from gpuguard.inputs import json_loads
from gpuguard.metrics import GPU_SAMPLED, GPU_SLOW
from gpuguard.model import GpuState, NodeSnapshot, check_field

#: GpuState fields behind the metric table's sampled metrics (the mask is kept as names).
TELEMETRY_FIELDS = tuple("clock_event_reasons" if m.name == "clock_event_mask" else m.name for m in GPU_SAMPLED)
SLOW_FIELDS = tuple(m.name for m in GPU_SLOW)

FORMAT = "gpuguard-snapshot/1"


class ReplayError(Exception):
    """A replay file that cannot be read or understood."""


def dump_snapshot(snap: NodeSnapshot, steps: list[dict[str, Any]] | None = None,
                  t0: float | None = None) -> str:
    """Serialise ``snap`` (plus optional ``steps``) in the replay snapshot format."""
    doc: dict[str, Any] = {"format": FORMAT, "snapshot": snap.to_dict()}
    if steps:
        doc["steps"] = steps
    if t0 is not None:
        doc["t0"] = t0
    return json.dumps(doc, indent=2, sort_keys=True)


class ReplaySource:
    """GPU source reading ``path`` (snapshot JSON or an nvidia-smi dump).

    ``snapshot(now=None)`` returns the state at ``now`` (epoch seconds, default the
    current time). The file is read once, at construction; raises :class:`ReplayError`.
    """

    name = "replay"

    def __init__(self, path: str):
        self.path = path
        from gpuguard.inputs import InputError, read_input

        try:
            raw = read_input(path)
            mtime = os.stat(path).st_mtime
        except InputError as e:
            raise ReplayError(f"cannot read replay file {e}") from None
        except OSError as e:
            raise ReplayError(f"{path}: cannot read replay file: {e.strerror or e}") from None
        text = raw.decode("utf-8", errors="replace")
        self._steps: list[dict[str, Any]] = []
        #: MIG device UUID (lower case) -> parent GPU index (the JSON's ``mig_devices``)
        self._mig_parents: dict[str, int] = {}
        self._t0 = mtime
        if text.lstrip().startswith("{"):
            self._base = self._load_json(text)
        else:
            from gpuguard.gpu.nvsmi import NvsmiParseError, parse_nvidia_smi

            try:
                self._base = parse_nvidia_smi(text, taken_at=mtime, where=path)
            except NvsmiParseError as e:
                raise ReplayError(str(e)) from None
            self._base.source = "replay:" + self._base.source

    def _load_json(self, text: str) -> NodeSnapshot:
        try:
            doc = json_loads(text)
        except json.JSONDecodeError as e:
            raise ReplayError(f"{self.path}: invalid JSON: {e}") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ReplayError(f"{self.path}: not a gpuguard snapshot (format must be {FORMAT!r})")
        try:
            snap = NodeSnapshot.from_dict(doc["snapshot"])
        except (KeyError, TypeError, ValueError) as e:
            raise ReplayError(f"{self.path}: bad snapshot: {e}") from None
        steps = doc.get("steps") or []
        if not isinstance(steps, list):
            raise ReplayError(f"{self.path}: steps must be a list")
        fields = set(GpuState.__dataclass_fields__)
        for i, st in enumerate(steps):
            if not isinstance(st, dict) or not isinstance(st.get("after_s"), (int, float)):
                raise ReplayError(f"{self.path}: steps[{i}] needs a numeric after_s")
            gpus = st.get("gpus") or {}
            if not isinstance(gpus, dict):
                raise ReplayError(f"{self.path}: steps[{i}].gpus must be an object of GPU index -> fields")
            for gi, changes in gpus.items():
                if not str(gi).isascii() or not str(gi).isdigit():
                    raise ReplayError(f"{self.path}: steps[{i}].gpus: key {gi!r} is not a GPU index")
                if not isinstance(changes, dict):
                    raise ReplayError(f"{self.path}: steps[{i}].gpus.{gi} must be an object")
                bad = set(changes) - fields
                if bad:
                    raise ReplayError(f"{self.path}: steps[{i}].gpus.{gi}: unknown field(s) {sorted(bad)}")
                for k, v in changes.items():
                    try:
                        check_field(k, v)
                    except ValueError as e:
                        raise ReplayError(f"{self.path}: steps[{i}].gpus.{gi}: {e}") from None
        self._steps = sorted(steps, key=lambda s: s["after_s"])
        migs = doc.get("mig_devices") or {}
        if not isinstance(migs, dict) or not all(isinstance(v, int) and not isinstance(v, bool) for v in migs.values()):
            raise ReplayError(f"{self.path}: mig_devices must be an object of MIG device UUID -> GPU index")
        self._mig_parents = {str(k).lower(): v for k, v in migs.items()}
        if isinstance(doc.get("t0"), (int, float)):
            self._t0 = float(doc["t0"])
        snap.source = "replay"
        return snap

    def snapshot(self, now: float | None = None) -> NodeSnapshot:
        """The node state at ``now`` with every due step applied."""
        now = time.time() if now is None else now
        snap = copy.deepcopy(self._base)
        snap.taken_at = now
        elapsed = now - self._t0
        by_index = {g.index: g for g in snap.gpus}
        for st in self._steps:
            if st["after_s"] > elapsed:
                break
            for gi, changes in (st.get("gpus") or {}).items():
                g = by_index.get(int(gi))
                if g is None:
                    continue
                for k, v in changes.items():
                    setattr(g, k, v)
        return snap

    def telemetry(self, indices: list[int], uuids: list[str], slow: bool, now: float | None = None) -> NodeSnapshot:
        """The collector's per-interval read: the named GPUs only, only the sampled fields
        (:data:`gpuguard.metrics.GPU_SAMPLED`; :data:`~gpuguard.metrics.GPU_SLOW` when
        ``slow``), without copying the whole recorded snapshot."""
        now = time.time() if now is None else now
        want_u = {u.lower() for u in uuids}
        fields = TELEMETRY_FIELDS + (SLOW_FIELDS if slow else ())
        out = NodeSnapshot(taken_at=now, source="replay")
        elapsed = now - self._t0
        for base in self._base.gpus:
            if base.index not in indices and (base.uuid or "").lower() not in want_u:
                continue
            g = GpuState(index=base.index, uuid=base.uuid, pci_bus_id=base.pci_bus_id)
            for f in fields:
                setattr(g, f, getattr(base, f))
            for st in self._steps:
                if st["after_s"] > elapsed:
                    break
                for k, v in ((st.get("gpus") or {}).get(str(base.index)) or {}).items():
                    if k in fields:
                        setattr(g, k, v)
            out.gpus.append(g)
        return out

    def mig_layout(self) -> Any:
        """The recorded node's MIG layout (:class:`gpuguard.collector.mig.MigLayout`): GPUs
        whose ``mig_mode`` is true, MIG devices from the JSON's optional ``mig_devices``
        (``{"MIG-<uuid>": parent GPU index}``; without it MIG devices cannot be mapped). A GPU
        without a recorded mode is not MIG."""
        from gpuguard.collector.mig import layout_from_snapshot

        return layout_from_snapshot(self._base, self._mig_parents or None)

    def close(self) -> None:
        """Nothing to release (interface parity with the NVML source)."""
