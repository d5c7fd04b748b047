"""What it takes to bring a drained node back, per finding code: the "needs reset/RMA"
attribute of the policy table and the XID catalog.

Every code gets one recovery kind:

* ``auto``   the fault is a *state* every health run re-reads (a missing GPU, a GPU that
             throttles at idle...). When the checks pass ``[health]
             resume_after_clean_runs`` times in a row, ``gpuguard health`` may resume a
             node it drained for it.
* ``reset``  the GPU must be reset (``nvidia-smi -r`` or a reboot) before it is trusted.
* ``reboot`` the node must be rebooted / power-cycled.
* ``rma``    the part must be replaced.
* ``manual`` a human looks first (drains by hand, escalated verdicts, unknown codes).

Only ``auto`` is ever resumed by gpuguard; every other kind stays drained until a human
resumes it (``gpuguard node resume``). An *event* (an XID read from the kernel log) is seen
once: the next run reads no new line, which says nothing about the GPU, so no XID that
drains is ``auto``.

Sources (abbreviations as in :mod:`gpuguard.xid.catalog`): ``NV`` = NVIDIA XID catalog,
"immediate action" column (RESET_GPU, RESTART_BM = reboot, CONTACT_SUPPORT);
``MEM`` = NVIDIA "GPU Memory Error Management" (A100/H100): pending page retirement and
row remapping take effect at the next GPU reset; a row-remapping *failure* means the bank
has no spare rows left and the GPU is to be replaced.
"""

from __future__ import annotations

from typing import Any

RECOVERY_KINDS = ("auto", "reset", "reboot", "rma", "manual")

#: Human wording of each kind, for ``gpuguard node show``/``list``.
RECOVERY_TEXT = {
    "auto": "resumes by itself after clean health runs",
    "reset": "needs a GPU reset, then a resume by hand",
    "reboot": "needs a node reboot, then a resume by hand",
    "rma": "needs the GPU replaced (RMA), then a resume by hand",
    "manual": "needs a look and a resume by hand",
}

# fmt: off
#: finding code -> (recovery kind, source). Codes not listed: ``manual``.
FINDING_RECOVERY: dict[str, tuple[str, str]] = {
    "gpu.driver_unusable": ("auto", "NVML answering again is re-checked every run (NHC check_nv_healthmon resumes on pass)"),
    "gpu.count_mismatch": ("reboot", "a GPU missing from the bus comes back only after a reboot (NV XID 79: RESTART_BM)"),
    "gpu.lost": ("reboot", "NVML_ERROR_GPU_IS_LOST: GPU off the bus (NV XID 79: RESTART_BM)"),
    "ecc.uncorrectable_volatile": ("reset", "NV XID 48 RESET_GPU: the volatile DBE count clears only at a reset"),
    "ecc.retired_pages_pending": ("reset", "MEM: pending pages are retired at the next GPU reset"),
    "ecc.row_remap_pending": ("reset", "MEM: a pending row remap takes effect at the next GPU reset"),
    "ecc.row_remap_failure": ("rma", "MEM: remapping failed, no spare rows left: replace the GPU (NV XID 64)"),
    "ecc.repair_pending": ("reset", "NVML nvmlDeviceGetRepairStatus: a pending channel/TPC repair applies at the next GPU reset"),
    "ecc.unrepairable_memory": ("rma", "NVML nvmlDeviceGetUnrepairableMemoryFlag: nothing left to repair with: replace the GPU"),
    "nvlink.link_down": ("reset", "NV NVLink workflow: a link that dropped trains again only after a GPU reset"),
    "throttle.hw_slowdown_idle": ("auto", "HW slowdown/power brake is a live clock-event reason, re-read every run"),
    "pcie.width_degraded": ("auto", "link width is re-read every run"),
    "gpu.count_unexpected": ("auto", "GPU count is re-read every run"),
    "ib.port_down": ("auto", "the port state is re-read from sysfs every run (NHC check_hw_ib passes again once ACTIVE)"),
    "ib.rate_degraded": ("auto", "the port rate is re-read from sysfs every run"),
    "gpu.recovery_action.gpu_reset": ("reset", "NVML GPU recovery action 1: the driver asks for a GPU reset"),
    "fabric.registration_failed": ("reset", "Fabric Manager user guide (GPU reset): a GPU registers with the fabric again when it is reset with Fabric Manager running"),
    "fabric.unhealthy": ("manual", "route unhealthy / incorrect configuration point at the NVSwitch tray, its cabling or the partition set-up: a human looks first"),
    "fabric.not_registered": ("auto", "the fabric state is re-read every run (NVML / nvidia-smi Fabric): once Fabric Manager registers the GPU it reads Completed"),
    "gpu.recovery_action.node_reboot": ("reboot", "NVML GPU recovery action 2: the driver asks for a node reboot"),
    "gpu.recovery_action.drain_and_reset": ("reset", "NVML GPU recovery action 4: drain, then reset the GPU"),
    "nccl.busbw_low": ("auto", "the NCCL probe re-measures every [nccl] interval_s and its low reading stands until a probe passes"),
    "dcgm.diag_fail": ("manual", "a failed DCGM diagnostic's message decides (reset and rerun, field diagnostic, RMA): NVIDIA DCGM diagnostics guide"),
    "nccl.errors": ("manual", "wrong all-reduce results are data corruption somewhere on the GPU/NVLink/NIC path: find it first"),
    "manual": ("manual", "drained by hand: a human resumes it"),
}

#: XID -> (recovery kind, source) for the codes the catalog may drain on. Unknown: manual.
XID_RECOVERY: dict[int, tuple[str, str]] = {
    46: ("reset", "NV RESET_GPU"),
    48: ("reset", "NV RESET_GPU"),
    62: ("reset", "NV RESET_GPU"),
    63: ("reset", "NV / MEM: the remap takes effect after a GPU reset"),
    64: ("rma", "MEM: row-remapping failure = no spare rows: replace the GPU"),
    74: ("reset", "NV NVLink workflow: reset the GPU (reboot if it recurs)"),
    79: ("reboot", "NV RESTART_BM: GPU fell off the bus"),
    92: ("reset", "NV: high SBE rate; AZ drains and resets"),
    94: ("reset", "NV: contained ECC error; the page is retired at the next reset"),
    95: ("reset", "NV RESET_GPU"),
    109: ("reset", "NV RESET_GPU"),
    119: ("reset", "NV RESET_GPU (GSP timeout)"),
    120: ("reset", "NV RESET_GPU (GSP error)"),
    140: ("reset", "NV RESET_GPU"),
    143: ("rma", "NV CONTACT_SUPPORT: GPU failed to initialise, hardware inspection"),
    144: ("reset", "NV NVLink5 workflow"), 145: ("reset", "NV NVLink5 workflow"),
    146: ("reset", "NV NVLink5 workflow"), 147: ("reset", "NV NVLink5 workflow"),
    148: ("reset", "NV NVLink5 workflow"), 149: ("reset", "NV NVLink5 workflow"),
    150: ("reset", "NV NVLink5 workflow"),
    154: ("reset", "NV: the driver names a reset/reboot recovery action"),
    171: ("reset", "NV: detail of XID 48 (uncorrectable memory error): reset the GPU"),
    172: ("reset", "NV: detail of XID 48 (uncorrectable memory error): reset the GPU"),
    # Drained on Azure HPC's list; NVIDIA's catalog names no recovery for them: a human looks.
    **{x: ("manual", "AZ drains; no NVIDIA recovery action: a human looks first") for x in (56, 57, 58, 65, 69, 73, 80, 81)},
}
# fmt: on

#: Worst first: the kind of a drain with several findings is the most demanding one.
_RANK = {"rma": 4, "reboot": 3, "reset": 2, "manual": 1, "auto": 0}


def recovery_of(code: str) -> tuple[str, str]:
    """``(kind, source)`` for a finding code (``xid.79``, ``sxid.20034``,
    ``ecc.row_remap_failure``...). Unknown codes and NVSwitch SXids are ``manual``
    (our choice: an unknown fault is never resumed by itself)."""
    if code.startswith("xid."):
        try:
            return XID_RECOVERY.get(int(code[4:]), ("manual", "XID not in the recovery table"))
        except ValueError:
            return "manual", "malformed XID code"
    if code.startswith("sxid."):
        return "manual", "NVSwitch faults: Fabric Manager user guide (reset the switch tray / GPUs)"
    return FINDING_RECOVERY.get(code, ("manual", "code not in the recovery table"))


def worst(kinds: list[str]) -> str:
    """The most demanding kind of ``kinds`` (``auto`` for an empty list)."""
    return max(kinds, key=_RANK.__getitem__, default="auto")


def recovery_of_findings(findings: list[dict[str, Any]]) -> str:
    """Recovery kind of a drain caused by ``findings`` (dicts with ``code`` and
    ``action``): the worst kind among those whose action is ``drain``; ``manual`` when
    none of them drains (a drain nobody can explain is not resumed by itself)."""
    kinds = [recovery_of(f["code"])[0] for f in findings if f.get("action") == "drain"]
    return worst(kinds) if kinds else "manual"
