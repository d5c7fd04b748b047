"""Which of the job's GPUs the collector may sample on a node with MIG (Multi-Instance GPU).

On a node where a GPU is in MIG mode, Slurm's GPU list for a job does not name NVML's
physical GPUs: with ``AutoDetect=nvml`` each MIG instance is a gres device of its own
(Slurm gres.conf(5), "MIG"), so ``SLURM_JOB_GPUS`` / ``SLURM_STEP_GPUS`` /
``GPU_DEVICE_ORDINAL`` count MIG devices, and ``CUDA_VISIBLE_DEVICES`` holds
``MIG-<uuid>`` (R470+ drivers) or ``MIG-GPU-<parent uuid>/<gi>/<ci>`` (R450/R460;
NVIDIA MIG user guide, "CUDA device enumeration"). Sampling NVML GPU ``i`` for such an
``i`` reads another tenant's GPU.

What the collector samples (our choice, stated in :func:`restrict`): a GPU that is not in
MIG mode, as before; nothing of a GPU in MIG mode. Its device-level readings (utilisation,
power, clocks, temperature, clock-event reasons, ECC/PCIe counters) belong to the whole
GPU and so to every tenant on it; NVML gives no per-instance utilisation (NVML API
reference, ``nvmlDeviceGetUtilizationRates``: not supported on MIG devices), and a row
is keyed by the physical GPU index, so a row of them would be attributed to the job
wrongly. Each entry left out gets one warning naming why (and the parent GPU where
the mapping is known).

A source tells the MIG layout through ``mig_layout() -> MigLayout | None`` (None: it
cannot tell); a source without it is asked for one ``snapshot()`` instead
(:func:`layout_from_snapshot`). Read once, at the first sample, so the per-tick cost of
a non-MIG node is unchanged.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class MigLayout(NamedTuple):
    """The node's GPUs as NVML numbers them and their MIG state.

    * ``gpus``: physical GPU index -> its ``GPU-`` UUID (or None, unreadable);
    * ``mig_gpus``: indices of GPUs in MIG mode, or whose MIG mode could not be read
      (unknown counts as MIG: its numbering cannot be trusted);
    * ``parents``: MIG device UUID, lower case -> the parent GPU's physical index;
    * ``lists_mig_devices``: whether ``parents`` is the node's full list (False: a layout
      from a snapshot, which has each GPU's MIG mode but not its MIG devices).
    """

    gpus: dict[int, str | None]
    mig_gpus: frozenset[int]
    parents: dict[str, int]
    lists_mig_devices: bool = True


def layout_from_snapshot(snap: Any, parents: dict[str, int] | None = None) -> MigLayout | None:
    """The layout a :class:`~gpuguard.model.NodeSnapshot` tells: GPUs whose ``mig_mode`` is
    true, or whose MIG mode could not be read, count as in MIG mode
    (:attr:`~gpuguard.model.GpuState.mig_or_unknown`; an unrecorded mode, ``None``, without
    a read error is not: nvidia-smi prints ``N/A`` for GPUs without MIG); MIG devices only
    from ``parents`` (None: not known). None for a snapshot with an error (no GPUs read)."""
    if getattr(snap, "error", None):
        return None
    return MigLayout({g.index: g.uuid for g in snap.gpus}, frozenset(g.index for g in snap.gpus if g.mig_or_unknown),
                     dict(parents or {}), parents is not None)


def parse_mig_entries(value: str | None) -> list[str]:
    """The ``MIG-...`` entries of a comma-separated GPU list, as given (stripped);
    ``None``/empty -> ``[]``. ``"0,MIG-ab,GPU-cd"`` -> ``["MIG-ab"]``."""
    return [s for s in (x.strip() for x in (value or "").split(",")) if s.upper().startswith("MIG-")]


def mig_parent_uuid(entry: str) -> str | None:
    """The parent GPU's UUID a pre-R470 MIG id carries: ``"MIG-GPU-<uuid>/1/0"`` ->
    ``"GPU-<uuid>"``; None for a ``MIG-<uuid>`` (R470+) id, which names no parent."""
    if entry[4:8].upper() != "GPU-":
        return None
    return entry[4:].split("/", 1)[0]


def _index_of(layout: MigLayout, uuid: str) -> int | None:
    """The physical index of the GPU with ``GPU-`` UUID ``uuid`` (any case), or None."""
    want = uuid.lower()
    return next((i for i, u in layout.gpus.items() if (u or "").lower() == want), None)


def _parent_of(layout: MigLayout, entry: str) -> int | None:
    parent = mig_parent_uuid(entry)
    return layout.parents.get(entry.lower()) if parent is None else _index_of(layout, parent)


def restrict(layout: MigLayout | None, indices: list[int], uuids: list[str],
             migs: list[str]) -> tuple[list[int], list[str], list[str]]:
    """The job's ``indices`` / ``uuids`` the collector may sample, and one warning line per
    reason something is left out: ``(indices, uuids, warnings)``.

    * ``layout`` None (the source cannot tell): indices and UUIDs as given; each MIG entry
      cannot be mapped, so is not sampled.
    * a GPU in MIG mode on the node: no index is sampled (Slurm's index counts MIG devices,
      not NVML's GPUs, so ``i`` may be another tenant's GPU).
    * a ``GPU-`` UUID naming a GPU in MIG mode, and every MIG entry: not sampled (the GPU's
      readings are shared with its other MIG tenants; module docstring), the parent GPU
      named when known.
    """
    warnings: list[str] = []
    if layout is None:
        if migs:
            warnings.append(f"MIG device(s) {','.join(migs)}: this GPU source cannot map MIG devices to their "
                            "GPU: not sampled")
        return indices, uuids, warnings
    if indices and layout.mig_gpus:
        warnings.append(f"job GPU index(es) {','.join(map(str, indices))}: GPU(s) "
                        f"{','.join(map(str, sorted(layout.mig_gpus)))} of this node are in MIG mode (or their "
                        "MIG mode is unreadable), where Slurm's GPU index counts MIG devices, not NVML's GPUs: "
                        "not sampled")
        indices = []
    keep: list[str] = []
    for u in uuids:
        i = _index_of(layout, u)
        if i is not None and i in layout.mig_gpus:
            warnings.append(f"job GPU {u} (GPU {i}) is in MIG mode: its device-level readings are shared with "
                            "its MIG tenants: not sampled")
        else:
            keep.append(u)
    for m in migs:
        i = _parent_of(layout, m)
        if i is None and not layout.lists_mig_devices and mig_parent_uuid(m) is None:
            warnings.append(f"MIG device {m}: this GPU source cannot map MIG devices to their GPU: not sampled")
        elif i is None:
            warnings.append(f"MIG device {m}: not found on any GPU of this node: not sampled")
        else:
            warnings.append(f"MIG device {m} is on GPU {i} ({layout.gpus.get(i) or 'UUID unknown'}): "
                            "the GPU's device-level readings are shared with its other MIG instances: not sampled")
    return indices, keep, warnings
