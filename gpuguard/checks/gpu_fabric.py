"""NVLink fabric registration: a GPU on an NVSwitch / multi-node NVLink fabric (HGX/DGX
H100/H200/B200 with Fabric Manager, GB200 NVL72) that is not registered with its fabric.

What is read (:class:`~gpuguard.model.GpuState` ``fabric_*``, from NVML
``nvmlDeviceGetGpuFabricInfoV`` or nvidia-smi's ``Fabric`` block): the registration
*state* (Not Started -> In Progress -> Completed), its *status* (the registration's
error, "must be checked only if state returns complete": NVML API reference,
``nvmlGpuFabricInfo_v3_t``) and, on R550+ drivers, the fabric *health* (``healthMask``,
R570+ ``healthSummary``).

Judgement, per GPU:

* no state, or ``not_supported`` (nvidia-smi ``N/A`` / ``Not Supported``: a PCIe card, a
  single GPU, a GPU without NVSwitch; GPUd fabric-manager #1140/#1206 found such GPUs
  reporting ``Not Supported`` with any status): never a finding.
* ``not_started`` / ``in_progress``: Fabric Manager has not (yet) registered the GPU
  (DCGM's health watch: In Progress warns, Not Started fails; ``[checks]
  fabric_not_started_is_fault = false`` leaves Not Started alone where GPUs report it
  without a fabric to join).
  Within ``[checks] fabric_registration_grace_s`` of boot it is start-up (Fabric
  Manager trains the NVSwitch links and registers every GPU after the driver loads;
  DCGM's fabric-manager status "InProgress" is boot-time training, aws
  eks-node-monitoring-agent #145): ``fabric.registration_pending`` (warning, alert).
  Past it (or when this host's boot time cannot be read) the GPU cannot run CUDA/NCCL
  over the fabric: ``fabric.not_registered`` (critical, drain; NVSentinel #889: a node
  whose Fabric Manager died stayed ``In Progress`` for 20 days, its jobs failing).
* ``completed`` with a status other than ``Success`` (``Insufficient Resources``...):
  ``fabric.registration_failed`` (critical, drain; azhpc-images #506).
* ``completed`` / ``Success`` with health problems: summary ``unhealthy``, a route
  unhealthy or an incorrect configuration -> ``fabric.unhealthy`` (critical, drain;
  dra-driver-nvidia-gpu #626: Completed/Success yet Summary Unhealthy); summary
  ``limited_capacity``, bandwidth degraded, route or access-timeout recovery in progress
  -> ``fabric.degraded`` (warning, alert: the fabric carries traffic at reduced bandwidth
  or is recovering by itself).

A node in Fabric Manager's shared-NVSwitch mode (``FABRIC_MODE=1``) keeps GPUs outside an
active partition ``In Progress`` by design (NVIDIA gpu-driver-container #909): set
``[policy] "fabric.not_registered" = "alert"`` there, or disable the check. The boot time
(``btime`` of this host's ``/proc/stat``) is read only when some GPU is not registered:
the healthy path reads nothing but the snapshot. A saved dump (``check
--from-nvidia-smi``) is measured against this host's boot: one older than the boot, or
a boot time that cannot be read, counts as past the grace.
"""

from __future__ import annotations

from gpuguard.checks import CheckContext, check, gpu_label
from gpuguard.model import Finding, GpuState, declare_codes

#: The fabric family's finding codes: code -> (severity, default action, source).
CODES = declare_codes("fabric", {
    "fabric.registration_pending": ("warning", "alert",
        "Fabric Manager user guide: GPUs register with the NVLink fabric after the driver loads; In Progress "
        "within [checks] fabric_registration_grace_s of boot is start-up, not a fault (DCGM fabric status "
        "InProgress = boot-time training, aws eks-node-monitoring-agent #145)"),
    "fabric.not_registered": ("critical", "drain",
        "Fabric Manager user guide: a GPU not registered with the fabric cannot run CUDA/NCCL over NVLink; "
        "DCGM health watch fails on Not Started; In Progress past the grace = Fabric Manager down or stuck "
        "(NVSentinel #883, #889)"),
    "fabric.registration_failed": ("critical", "drain",
        "NVML nvmlGpuFabricInfo: status is the registration's error once state is complete; DCGM maps Completed "
        "with an error to DcgmFMStatusFailure and its health watch fails on it (azhpc-images #506)"),
    "fabric.unhealthy": ("critical", "drain",
        "NVML fabric health: summary Unhealthy, route unhealthy or incorrect configuration (GPUd "
        "fabric-manager marks the GPU unhealthy; dra-driver-nvidia-gpu #626)"),
    "fabric.degraded": ("warning", "alert",
        "NVML fabric health: Limited Capacity / bandwidth degraded, or route / access-timeout recovery in "
        "progress: traffic still flows (our choice: alert, not drain)"),
})

#: Health problems that make a registered GPU unusable (the rest degrade it).
_UNHEALTHY = ("route_unhealthy",)


def boot_time() -> float | None:
    """This host's boot time (:func:`gpuguard.drainq.boot_time`), imported on use."""
    from gpuguard.drainq import boot_time as bt

    return bt()


def _evidence(g: GpuState) -> dict[str, object]:
    return {"fabric_state": g.fabric_state, "fabric_status": g.fabric_status,
            "fabric_clique_id": g.fabric_clique_id, "fabric_cluster_uuid": g.fabric_cluster_uuid,
            "fabric_health_summary": g.fabric_health_summary, "fabric_health": g.fabric_health,
            "pci_bus_id": g.pci_bus_id}


def _finding(code: str, g: GpuState, what: str, extra: dict[str, object] | None = None) -> Finding:
    ev = _evidence(g) | (extra or {})
    return Finding(code, CODES[code].severity, f"{gpu_label(g)} {what}", g.index, g.uuid, ev)


def _unregistered(ctx: CheckContext, g: GpuState, since_boot_s: float | None) -> Finding:
    grace = float(ctx.setting("fabric_registration_grace_s"))
    state = (g.fabric_state or "?").replace("_", " ")
    ev: dict[str, object] = {"since_boot_s": None if since_boot_s is None else round(since_boot_s, 1),
                             "grace_s": grace}
    if since_boot_s is not None and since_boot_s < grace:
        return _finding("fabric.registration_pending", g, f"NVLink fabric registration {state} "
                        f"{since_boot_s:.0f} s after boot (within the {grace:.0f} s grace)", ev)
    when = "boot time unknown" if since_boot_s is None else f"past the {grace:.0f} s grace after boot"
    return _finding("fabric.not_registered", g,
                    f"NVLink fabric registration {state}, {when} (Fabric Manager down or stuck?)", ev)


@check("gpu_fabric")
def gpu_fabric(ctx: CheckContext) -> list[Finding]:
    """NVLink fabric registration not completed, failed, or its health flagged (NVML / nvidia-smi
    ``Fabric``); the rules are in the module docstring."""
    out: list[Finding] = []
    since_boot: list[float | None] = []
    for g in ctx.snapshot.gpus:
        if g.fabric_state in (None, "not_supported"):
            continue
        if g.fabric_state == "not_started" and not ctx.setting("fabric_not_started_is_fault"):
            continue
        if g.fabric_state in ("not_started", "in_progress"):
            if not since_boot:
                bt = boot_time()
                age = ctx.snapshot.taken_at - bt if bt is not None else None
                since_boot.append(age if age is not None and age >= 0 else None)
            out.append(_unregistered(ctx, g, since_boot[0]))
            continue
        if g.fabric_status is not None and g.fabric_status.casefold() != "success":
            out.append(_finding("fabric.registration_failed", g,
                                f"NVLink fabric registration failed: {g.fabric_status}"))
            continue
        health = g.fabric_health or []
        bad = [h for h in health if h in _UNHEALTHY or h.startswith("incorrect_configuration.")]
        if g.fabric_health_summary == "unhealthy" or bad:
            shown = ", ".join(h.replace("_", " ") for h in health) or "summary Unhealthy"
            out.append(_finding("fabric.unhealthy", g, f"NVLink fabric unhealthy: {shown}"))
        elif g.fabric_health_summary == "limited_capacity" or health:
            shown = ", ".join(h.replace("_", " ") for h in health) or "summary Limited Capacity"
            out.append(_finding("fabric.degraded", g, f"NVLink fabric degraded: {shown}"))
    return out
