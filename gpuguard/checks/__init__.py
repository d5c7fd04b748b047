"""Health checks: detection only (DESIGN.md, "Detection is separate from decision").

Each check is a small function ``fn(ctx: CheckContext) -> list[Finding]`` registered by
name with :func:`check`, one module per family (``count``, ``ecc``, ``pcie``, ``nvlink``,
``thermal``, ``inventory``, ``xid``, ``idle``, ``ib``, ``gpu_fabric``), switchable with ``[checks] disabled``. A
check never drains, never writes the store (rows it wants kept go into ``ctx.records``,
stored with the run) and never raises for a field that is ``None`` (unsupported). :func:`run_checks` runs them all and turns a crashing check into a tool
error, never into a finding.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpuguard.config import SCHEMA
from gpuguard.model import Finding, NodeSnapshot

CheckFn = Callable[["CheckContext"], list[Finding]]

REGISTRY: dict[str, CheckFn] = {}
_FAMILIES = ("count", "ecc", "pcie", "nvlink", "thermal", "inventory", "xid", "idle", "ib", "gpu_fabric")


def check(name: str) -> Callable[[CheckFn], CheckFn]:
    """Register ``fn`` as check ``name`` (unique)."""
    def deco(fn: CheckFn) -> CheckFn:
        if name in REGISTRY:
            raise ValueError(f"check {name!r} registered twice")
        REGISTRY[name] = fn
        return fn
    return deco


def load_all() -> dict[str, CheckFn]:
    """Import every check module (registering its checks) and return the registry."""
    for fam in _FAMILIES:
        importlib.import_module(f"gpuguard.checks.{fam}")
    return REGISTRY


@dataclass
class CheckContext:
    """What a check may look at.

    * ``snapshot``: the live GPU state.
    * ``previous``: ``uuid -> counters`` stored by the last run on this node (see
      :func:`counters_of`); empty on the first run or when the store is unavailable.
    * ``history``: True when ``previous`` is the node's stored history (the store was
      read); False when no history was consulted (the hooks' live pass, a store that
      could not be read). :func:`first_reading` reads it.
    * ``previous_inventory``: ``uuid -> inventory row`` from the store.
    * ``expected_gpu_count``: GPUs the node must show (config), or ``None``.
    * ``job_gpu_indices``: the job's gres GPU indices (``SLURM_JOB_GPUS``), or ``None``.
    * ``xid_events``: kernel-log events (:class:`gpuguard.xid.parse.XidEvent`) new since
      the stored cursor.
    * ``settings``: the ``[checks]`` config section.
    * ``gpu_nodes_expected``: True when this node is known to have GPUs (config count,
      job gres, or ``/dev/nvidia[0-9]*`` present) so an unusable driver is a fault.
    * ``hook``: ``prolog`` | ``epilog`` | ``check``; ``node``, ``job_id``: the run's.
    * ``store``: the node store for history reads (None when unavailable); ``config``:
      the whole :class:`gpuguard.config.Config` (None in unit tests).
    * ``records``: ``table -> rows`` a check wants stored with the run (written only
      when the run is recorded).
    """

    snapshot: NodeSnapshot
    previous: dict[str, dict[str, Any]] = field(default_factory=dict)
    history: bool = False
    previous_inventory: dict[str, dict[str, Any]] = field(default_factory=dict)
    expected_gpu_count: int | None = None
    job_gpu_indices: list[int] | None = None
    xid_events: list[Any] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    gpu_nodes_expected: bool = False
    hook: str = "check"
    node: str | None = None
    job_id: str | None = None
    store: Any = None
    config: Any = None
    records: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def setting(self, key: str) -> Any:
        return self.settings.get(key, SCHEMA["checks"][key][0])


#: Counter fields kept between runs to detect growth ("rising since the last run").
COUNTER_FIELDS = (
    "ecc_volatile_uncorrected", "ecc_aggregate_uncorrected", "pcie_replay_count",
    "retired_pages_sbe", "retired_pages_dbe", "remapped_rows_uncorrectable", "remap_banks_none",
)


def first_reading(ctx: CheckContext, g: Any, key: str) -> bool:
    """Whether this is GPU ``g``'s first reading of ``key`` (a key :func:`counters_of`
    stores: a lifetime count of :data:`COUNTER_FIELDS`, ``nvlinks``, ``nvlink_ever_up``): no earlier value is known, so its total is reported
    once (the next run compares against what this one stored, and stays silent while it
    is unchanged). True when the stored history was read (``ctx.history``) and holds no
    value for ``key`` on this GPU's UUID (a new node or GPU, a wiped store); also for a
    one-off ``gpuguard check`` (``hook == "check"``: a pasted nvidia-smi / DCGM output
    has no history, and the check reports what it is shown). False in the hooks' live
    pass (no history consulted: the pass with the store reports it, once) and for a GPU
    without a UUID there (nothing can be stored for it, so it would repeat every run)."""
    if ctx.hook != "check" and (not ctx.history or not g.uuid):
        return False
    return ctx.previous.get(g.uuid or "", {}).get(key) is None


def counters_of(snapshot: NodeSnapshot, previous: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """``uuid -> {counter: value, "at": taken_at, "nvlinks": {link: {...}},
    "nvlink_ever_up": [links]}`` for the store. A counter this snapshot could not read
    (None) keeps its value in ``previous``. ``nvlink_ever_up`` is the GPU's NVLink
    inventory baseline: every link seen active on it, carried over from ``previous``
    (the stored counters), so a link that was never up (inactive by design on the SKU)
    is told apart from one that went down."""
    out: dict[str, dict[str, Any]] = {}
    previous = previous or {}
    for g in snapshot.gpus:
        if not g.uuid:
            continue
        before = previous.get(g.uuid, {})
        # a failed read (None) keeps the last known value: a lifetime total is not "first
        # read" again, nor its growth missed, because one run could not read it
        c: dict[str, Any] = {k: getattr(g, k) if getattr(g, k) is not None else before.get(k)
                             for k in COUNTER_FIELDS}
        c["at"] = snapshot.taken_at
        ever = {int(x) for x in previous.get(g.uuid, {}).get("nvlink_ever_up", [])}
        if g.nvlinks:
            c["nvlinks"] = {str(n.link): {"active": n.active, "replay": n.replay_errors,
                                          "recovery": n.recovery_errors,
                                          "crc_flit": n.crc_flit_errors, "crc_data": n.crc_data_errors}
                            for n in g.nvlinks}
            ever |= {n.link for n in g.nvlinks if n.active}
        if ever:
            c["nvlink_ever_up"] = sorted(ever)
        out[g.uuid] = c
    return out


def run_checks(ctx: CheckContext, disabled: list[str] | None = None) -> tuple[list[Finding], list[str]]:
    """Run every enabled check. Returns ``(findings, tool_errors)``; a check that raises
    is reported in ``tool_errors`` (``"check NAME crashed: ..."``) and yields no finding."""
    findings: list[Finding] = []
    errors: list[str] = []
    off = set(disabled or [])
    for name, fn in load_all().items():
        if name in off:
            continue
        try:
            findings.extend(fn(ctx))
        except Exception as e:  # a bug in a check is our fault: never a drain
            errors.append(f"check {name} crashed: {type(e).__name__}: {e}")
    return findings, errors


def looks_idle(g: Any, idle_util_pct: float) -> bool:
    """Whether GPU ``g`` is judged idle: utilisation known and below ``idle_util_pct``.
    Unknown utilisation (a failed read, ``[N/A]``, an nvidia-smi CSV without the column, a
    GPU in MIG mode, where NVML gives none) is not idle: the GPU may be running a job, and
    its clock events, temperature and power are then no idle readings (a loaded GPU's HW
    slowdown read as "at idle" drains a healthy node; :func:`util_unknown` says when an
    idle judgement was skipped for that reason)."""
    u = g.gpu_util_pct
    return u is not None and u < idle_util_pct


def util_unknown(g: Any) -> str | None:
    """Why GPU ``g``'s utilisation is unknown (``"utilisation unknown"``, with ``" (MIG
    mode: NVML reports none)"`` for a GPU in MIG mode), or None when it is known."""
    if g.gpu_util_pct is not None:
        return None
    return "utilisation unknown" + (" (MIG mode: NVML reports none)" if g.mig_mode else "")


def gpu_label(g: Any) -> str:
    """``gpu3 (0000:91:00.0)``-style label for messages and drain reasons."""
    return f"gpu{g.index}" + (f" ({g.pci_bus_id})" if g.pci_bus_id else "")
