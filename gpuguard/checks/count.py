"""GPU presence: the driver answers, every GPU the node should have is there and alive."""

from __future__ import annotations

from gpuguard.checks import CheckContext, check, gpu_label
from gpuguard.model import Finding, declare_codes


#: The GPU core family's finding codes: code -> (severity, default action, source).
CODES = declare_codes("gpu", {
    "gpu.driver_unusable": ("critical", "drain",
        "DCGM/NHC: a node whose GPU driver does not answer fails its health check"),
    "gpu.none": ("info", "record",
        "a node without GPUs is not a fault"),
    "gpu.count_mismatch": ("critical", "drain",
        "NHC check_nv_gpu_count / DCGM: fewer GPUs than configured = failed node"),
    "gpu.count_unexpected": ("warning", "alert",
        "more GPUs than configured: config out of date, not a broken node"),
    "gpu.lost": ("critical", "drain",
        "NVML_ERROR_GPU_IS_LOST: GPU off the bus or inaccessible; XID 79 action is reboot"),
    "gpu.recovery_action.gpu_reset": ("critical", "drain",
        "NVML GPU recovery action 1 (GPU reset); DCGM health watch fails on it, as on XID 154 -> reset"),
    "gpu.recovery_action.node_reboot": ("critical", "drain",
        "NVML GPU recovery action 2 (node reboot); DCGM health watch fails on it"),
    "gpu.recovery_action.drain_and_reset": ("critical", "drain",
        "NVML GPU recovery action 4 (drain and reset); DCGM health watch fails on it"),
    "gpu.recovery_action.drain_p2p": ("warning", "alert",
        "NVML GPU recovery action 3 (drain P2P); DCGM health watch warns on it"),
    "gpu.read_error": ("warning", "alert",
        "a single failed read is not proof of a broken GPU"),
})


@check("driver")
def driver_usable(ctx: CheckContext) -> list[Finding]:
    """``gpu.driver_unusable`` (critical) when the GPU source failed on a node that is
    expected to have GPUs (DCGM/NHC treat a node whose driver does not answer as failed);
    ``gpu.none`` (info) when it failed on a node with no sign of GPUs."""
    snap = ctx.snapshot
    if not snap.error:
        return []
    if ctx.gpu_nodes_expected:
        return [Finding("gpu.driver_unusable", "critical", f"GPU driver/NVML unusable: {snap.error}",
                        evidence={"error": snap.error, "source": snap.source})]
    return [Finding("gpu.none", "info", f"no GPUs on this node ({snap.error})", evidence={"error": snap.error})]


@check("gpu_count")
def gpu_count(ctx: CheckContext) -> list[Finding]:
    """``gpu.count_mismatch`` (critical) when fewer GPUs answer than ``[node] gpu_count``,
    or a GPU index of the job's gres (``SLURM_JOB_GPUS``) is missing. More GPUs than
    configured is a warning (a config out of date, not a broken node). The job's gres
    indices are not compared when a GPU is in MIG mode, or its MIG mode could not be read
    (:attr:`~gpuguard.model.GpuState.mig_or_unknown`; the read error is its own
    ``gpu.read_error`` finding): each MIG instance is then a gres device of its own (Slurm
    gres.conf(5), MIG: ``AutoDetect=nvml``), so a node with 7 instances per GPU hands out
    gres indices far above NVML's GPU indices, and a healthy node would be drained for
    its job's second instance."""
    snap = ctx.snapshot
    if snap.error:
        return []  # reported by the driver check
    seen = len(snap.gpus)
    out: list[Finding] = []
    exp = ctx.expected_gpu_count
    if exp:
        if seen < exp:
            out.append(Finding("gpu.count_mismatch", "critical", f"{seen} GPUs visible, node configured for {exp}",
                               evidence={"visible": seen, "expected": exp}))
        elif seen > exp:
            out.append(Finding("gpu.count_unexpected", "warning", f"{seen} GPUs visible, node configured for {exp}",
                               evidence={"visible": seen, "expected": exp}))
    if ctx.job_gpu_indices and not any(g.mig_or_unknown for g in snap.gpus):
        indices = {g.index for g in snap.gpus}
        missing = [i for i in ctx.job_gpu_indices if i not in indices]
        if missing and not any(f.code == "gpu.count_mismatch" for f in out):
            out.append(Finding("gpu.count_mismatch", "critical",
                               f"job's GPU(s) {','.join(map(str, missing))} not visible ({seen} GPUs visible)",
                               evidence={"visible": seen, "job_gpus": ctx.job_gpu_indices, "missing": missing}))
    return out


@check("gpu_lost")
def gpu_lost(ctx: CheckContext) -> list[Finding]:
    """``gpu.lost`` (critical) for a GPU whose reads returned ``GpuIsLost``, ``Unknown`` or
    hung past the call timeout (NVML API reference: NVML_ERROR_GPU_IS_LOST means the GPU
    fell off the bus or is otherwise inaccessible); other read errors are
    ``gpu.read_error`` warnings."""
    out = []
    for g in ctx.snapshot.gpus:
        if not g.read_errors:
            continue
        if g.lost:
            out.append(Finding("gpu.lost", "critical",
                               f"{gpu_label(g)} lost or hung: " + ", ".join(f"{k}={v}" for k, v in sorted(g.read_errors.items())),
                               g.index, g.uuid, {"read_errors": g.read_errors}))
        else:
            out.append(Finding("gpu.read_error", "warning",
                               f"{gpu_label(g)} read errors: " + ", ".join(f"{k}={v}" for k, v in sorted(g.read_errors.items())),
                               g.index, g.uuid, {"read_errors": g.read_errors}))
    return out


#: nvmlDeviceGpuRecoveryAction_t value -> finding code suffix (0 = none: no finding)
RECOVERY_CODES = {1: "gpu_reset", 2: "node_reboot", 3: "drain_p2p", 4: "drain_and_reset"}


@check("gpu_recovery_action")
def gpu_recovery_action(ctx: CheckContext) -> list[Finding]:
    """``gpu.recovery_action.<action>`` for a GPU whose driver asks for a recovery action
    (NVML ``nvmlDeviceGpuRecoveryAction_t``, nvidia-smi ``GPU Recovery Action``; R550+):
    ``gpu_reset``, ``node_reboot``, ``drain_and_reset`` critical (drain), ``drain_p2p``
    warning (alert); the same mapping as XID 154 (DCGM health watch: fail on reset /
    reboot / drain-and-reset, warn on drain P2P). ``None`` (0) or unreported: nothing."""
    from gpuguard.xid.catalog import RECOVERY_ACTIONS

    out = []
    for g in ctx.snapshot.gpus:
        code = RECOVERY_CODES.get(g.recovery_action or 0)
        if code is None:
            continue
        name, _action = RECOVERY_ACTIONS[g.recovery_action]
        out.append(Finding(f"gpu.recovery_action.{code}", CODES[f"gpu.recovery_action.{code}"].severity,
                           f"{gpu_label(g)} driver requests recovery action 0x{g.recovery_action:x} {name}",
                           g.index, g.uuid, {"recovery_action": g.recovery_action, "name": name,
                                             "pci_bus_id": g.pci_bus_id}))
    return out
