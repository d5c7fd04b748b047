"""Memory errors: ECC counters, retired pages, row remapping.

Sources: NVIDIA "GPU Memory Error Management" (A100/H100 row remapping: a pending remap
needs a GPU reset to take effect; a remapping failure means the GPU should be replaced),
NVIDIA "Dynamic Page Retirement" (pages pending retirement are retired at the next driver
reload), DCGM health watch ``DCGM_HEALTH_WATCH_MEM`` (volatile DBE = failure).
"""

from __future__ import annotations

from gpuguard.checks import CheckContext, check, gpu_label
from gpuguard.model import Finding, declare_codes


#: The memory/ECC family's finding codes: code -> (severity, default action, source).
CODES = declare_codes("ecc", {
    "ecc.uncorrectable_volatile": ("critical", "drain",
        "DCGM health watch MEM: volatile DBE = fail; XID 48 action reset GPU"),
    "ecc.uncorrectable_aggregate": ("warning", "alert",
        "lifetime count grew: already drained via the volatile count if current"),
    "ecc.disabled": ("warning", "alert",
        "ECC off on a data-center GPU is a configuration drift"),
    "ecc.sram_threshold_exceeded": ("warning", "alert",
        "NVML nvmlEccSramErrorStatus_v1_t.bThresholdExceeded; DCGM diag checkForSramThreshold: "
        "DCGM_FR_SRAM_THRESHOLD = WARN; NV XID catalog WORKFLOW_XID_48: flag set after reset -> "
        "run field diagnostics. Disputed: a site that pulls such GPUs sets drain"),
    "ecc.retired_pages_pending": ("critical", "drain",
        "NVIDIA Dynamic Page Retirement: pending pages retire at the next reset"),
    "ecc.row_remap_pending": ("critical", "drain",
        "NVIDIA GPU Memory Error Management: a pending remap needs a GPU reset"),
    "ecc.row_remap_failure": ("critical", "drain",
        "NVIDIA GPU Memory Error Management: remap failure = replace the GPU (XID 64)"),
    "ecc.repair_pending": ("critical", "drain",
        "NVML nvmlDeviceGetRepairStatus (R575, Blackwell): a channel/TPC repair applies at the next GPU reset"),
    "ecc.unrepairable_memory": ("critical", "drain",
        "NVML nvmlDeviceGetUnrepairableMemoryFlag: no repair left for the fault: replace the GPU"),
})


@check("ecc")
def ecc(ctx: CheckContext) -> list[Finding]:
    """``ecc.uncorrectable_volatile`` (critical): uncorrectable errors since the last
    driver load (DCGM health watch MEM, ``MonitorMemVolatileDbes``: "Fail for any
    volatile DBEs"; the count includes SRAM errors an XID 94 contained, and it clears
    only with the GPU reset/driver reload that is the documented remedy);
    ``ecc.uncorrectable_aggregate`` (warning): lifetime uncorrectable count grew since the
    last run; ``ecc.sram_threshold_exceeded`` (warning): the driver's SRAM error threshold
    flag, which outlives a reset (DCGM diag rates it WARN; NVIDIA's XID 48 workflow: run
    field diagnostics); ``ecc.disabled`` (warning) when ECC mode is off on a GPU that
    reports it."""
    out = []
    for g in ctx.snapshot.gpus:
        prev = ctx.previous.get(g.uuid or "", {})
        v = g.ecc_volatile_uncorrected
        if v is not None and v > 0:
            before = prev.get("ecc_volatile_uncorrected")
            new = v - before if isinstance(before, int) and before <= v else v
            out.append(Finding("ecc.uncorrectable_volatile", "critical",
                               f"{gpu_label(g)} {v} uncorrectable ECC error(s) since driver load ({new} new)",
                               g.index, g.uuid, {"volatile_uncorrected": v, "new": new, "previous": before}))
        a = g.ecc_aggregate_uncorrected
        before_a = prev.get("ecc_aggregate_uncorrected")
        if a is not None and isinstance(before_a, int) and a > before_a:
            out.append(Finding("ecc.uncorrectable_aggregate", "warning",
                               f"{gpu_label(g)} lifetime uncorrectable ECC rose {before_a} -> {a}",
                               g.index, g.uuid, {"aggregate_uncorrected": a, "previous": before_a}))
        if g.sram_threshold_exceeded:
            out.append(Finding("ecc.sram_threshold_exceeded", "warning",
                               f"{gpu_label(g)} SRAM uncorrectable ECC errors exceeded the driver's threshold "
                               "(run field diagnostics)", g.index, g.uuid,
                               {"aggregate_uncorrected": a, "volatile_uncorrected": v}))
        if g.ecc_enabled is False:
            out.append(Finding("ecc.disabled", "warning", f"{gpu_label(g)} ECC mode is disabled",
                               g.index, g.uuid, {}))
    return out


@check("retired_pages")
def retired_pages(ctx: CheckContext) -> list[Finding]:
    """``ecc.retired_pages_pending`` (critical): a page is waiting to be retired, which
    happens only at the next driver reload / GPU reset (Dynamic Page Retirement)."""
    out = []
    for g in ctx.snapshot.gpus:
        if g.retired_pages_pending:
            out.append(Finding("ecc.retired_pages_pending", "critical",
                               f"{gpu_label(g)} page retirement pending (reset the GPU)",
                               g.index, g.uuid, {"sbe": g.retired_pages_sbe, "dbe": g.retired_pages_dbe}))
    return out


@check("row_remap")
def row_remap(ctx: CheckContext) -> list[Finding]:
    """``ecc.row_remap_failure`` (critical, RMA) and ``ecc.row_remap_pending`` (critical:
    a remap waits for a GPU reset; XID 63 is its kernel-log twin)."""
    out = []
    for g in ctx.snapshot.gpus:
        ev = {"correctable": g.remapped_rows_correctable, "uncorrectable": g.remapped_rows_uncorrectable}
        if g.remapped_rows_failure:
            out.append(Finding("ecc.row_remap_failure", "critical",
                               f"{gpu_label(g)} row remapping failed (GPU needs replacement)", g.index, g.uuid, ev))
        if g.remapped_rows_pending:
            out.append(Finding("ecc.row_remap_pending", "critical",
                               f"{gpu_label(g)} row remap pending (reset the GPU to apply)", g.index, g.uuid, ev))
    return out


@check("memory_repair")
def memory_repair(ctx: CheckContext) -> list[Finding]:
    """Blackwell's repair state (R575+ drivers; NVML ``nvmlDeviceGetRepairStatus`` and
    ``nvmlDeviceGetUnrepairableMemoryFlag_v1``, nvidia-smi ``ECC Errors > Channel Repair
    Pending`` / ``TPC Repair Pending`` / ``Unrepairable Memory``): ``ecc.unrepairable_memory``
    (critical, RMA) and ``ecc.repair_pending`` (critical: the repair waits for a GPU
    reset, as a pending row remap does). Not reported (None): nothing."""
    out = []
    for g in ctx.snapshot.gpus:
        if g.unrepairable_memory:
            out.append(Finding("ecc.unrepairable_memory", "critical",
                               f"{gpu_label(g)} memory fault the GPU can no longer repair (replace the GPU)",
                               g.index, g.uuid, {"unrepairable_memory": True}))
        pending = [n for n, v in (("channel", g.channel_repair_pending), ("TPC", g.tpc_repair_pending)) if v]
        if pending:
            out.append(Finding("ecc.repair_pending", "critical",
                               f"{gpu_label(g)} {' and '.join(pending)} repair pending (reset the GPU to apply)",
                               g.index, g.uuid, {"channel_repair_pending": g.channel_repair_pending,
                                                 "tpc_repair_pending": g.tpc_repair_pending}))
    return out
