"""GPU access behind one interface (DESIGN.md, "GPU access behind one interface").

A source has ``snapshot() -> NodeSnapshot`` and ``close()``. :func:`open_source` picks
one from the configuration: ``nvml`` (nvidia-ml-py, on real nodes) or ``replay``
(recorded snapshot/scenario files and real nvidia-smi dumps). Imports are lazy so the
prolog only pays for the source it uses.
"""

from __future__ import annotations

from typing import Any, Protocol

from gpuguard.model import NodeSnapshot


class GpuSource(Protocol):
    name: str

    def snapshot(self) -> NodeSnapshot: ...

    def close(self) -> None: ...


def open_source(kind: str, *, replay_path: str = "", call_timeout_s: float = 5.0,
                total_budget_s: float | None = None) -> Any:
    """Open the GPU source ``kind`` (``nvml`` or ``replay``).

    Raises ``ValueError`` for an unknown kind and
    :class:`gpuguard.gpu.replay.ReplayError` for an unreadable replay file. The NVML
    source never raises for a missing library or driver: its snapshot carries ``error``.
    """
    if kind == "replay":
        from gpuguard.gpu.replay import ReplaySource

        return ReplaySource(replay_path)
    if kind == "nvml":
        from gpuguard.gpu.nvml import NvmlSource

        return NvmlSource(call_timeout_s=call_timeout_s, total_budget_s=total_budget_s)
    raise ValueError(f"unknown GPU source {kind!r} (nvml | replay)")
