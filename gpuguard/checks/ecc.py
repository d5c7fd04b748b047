"""Memory errors: ECC counters, retired pages, row remapping.

Sources: NVIDIA "GPU Memory Error Management" (A100/H100 row remapping: a pending remap
needs a GPU reset to take effect; a remapping failure means the GPU should be replaced),
NVIDIA "Dynamic Page Retirement" (pages pending retirement are retired at the next driver
reload), DCGM health watch ``DCGM_HEALTH_WATCH_MEM`` (volatile DBE = failure).

Lifetime counts (InfoROM: they survive resets and reboots) are judged against the last
run's stored value (:func:`gpuguard.checks.counters_of`): growth is a finding, an
unchanged count is not. On a first reading (:func:`gpuguard.checks.first_reading`: a new
node or GPU, a wiped store, a one-off ``gpuguard check`` of a saved dump) a non-zero count
is reported once as a ``*_present`` warning, because nothing says whether it is new: the
aggregate uncorrectable ECC count, pages retired for DBEs, rows remapped for uncorrectable
errors, and banks with no spare row left. None of them drains: NVIDIA's error containment,
page retirement and row remapping keep such a GPU usable (GPU Memory Error Management;
Dynamic Page Retirement), and its RMA criterion is the remap-failure flag validated by
field diagnostics (GPU Memory Error Management, "RMA Policy"), which
``ecc.row_remap_failure`` reads.
"""

from __future__ import annotations

from gpuguard.checks import CheckContext, check, first_reading, gpu_label
from gpuguard.model import Finding, GpuState, declare_codes


#: The memory/ECC family's finding codes: code -> (severity, default action, source).
CODES = declare_codes("ecc", {
    "ecc.uncorrectable_volatile": ("critical", "drain",
        "DCGM health watch MEM: volatile DBE = fail; XID 48 action reset GPU"),
    "ecc.uncorrectable_aggregate": ("warning", "alert",
        "lifetime count grew: already drained via the volatile count if current"),
    "ecc.uncorrectable_aggregate_present": ("warning", "alert",
        "lifetime (InfoROM) count > 0 on a first reading: history, maybe recent. DCGM health watch MEM fails "
        "volatile DBEs only (MonitorMemVolatileDbes); NVIDIA GPU Memory Error Management: contained errors, "
        "page offlining and row remapping keep the GPU usable, RMA = remap failure flag"),
    "ecc.retired_pages_dbe_present": ("warning", "alert",
        "NVIDIA Dynamic Page Retirement: one DBE retires a page, kept in the InfoROM and blacklisted at every "
        "driver load (the GPU stays usable); > 0 on a first reading. DCGM health watch MEM fails only at 63 "
        "retired pages (DCGM_LIMIT_MAX_RETIRED_PAGES) or > 15 DBE pages growing > 1 a week"),
    "ecc.retired_pages_dbe_rising": ("warning", "alert",
        "NVIDIA Dynamic Page Retirement: a page retired for a DBE since the last run (not pending: "
        "ecc.retired_pages_pending drains for that); trend toward DCGM's 63-page limit"),
    "ecc.row_remap_uncorrectable_present": ("warning", "alert",
        "NVIDIA GPU Memory Error Management: a remap is permanent and the GPU keeps working (up to 512 remaps, "
        "8 uncorrectable rows a bank); > 0 on a first reading. DCGM health watch MEM warns only at 512 "
        "(DCGM_LIMIT_MAX_ROW_REMAP_UNCORRECTABLE); RMA = remap failure flag"),
    "ecc.row_remap_uncorrectable_rising": ("warning", "alert",
        "NVIDIA GPU Memory Error Management: rows remapped for uncorrectable errors since the last run, "
        "applied (not pending: ecc.row_remap_pending drains for that)"),
    "ecc.remap_banks_exhausted": ("warning", "alert",
        "NVML nvmlRowRemapperHistogramValues_t: 'None means that there are no reserved rows available' in "
        "a bank; GPU Memory Error Management RMA Policy: a remap of an uncorrectable error on a bank with 8 "
        "uncorrectable rows remapped sets the failure flag, which (with field diagnostics) is the RMA "
        "criterion: alert, not drain; reported on a first reading and when the count rises"),
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
    last run, ``ecc.uncorrectable_aggregate_present`` (warning) when it is above 0 on a
    first reading (module docstring); ``ecc.sram_threshold_exceeded`` (warning): the driver's SRAM error threshold
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
        life = lifetime_change(ctx, g, "ecc_aggregate_uncorrected")
        if life is not None and life[1] is None:
            out.append(Finding("ecc.uncorrectable_aggregate_present", "warning",
                               f"{gpu_label(g)} lifetime uncorrectable ECC count {a} (first reading, no earlier value)",
                               g.index, g.uuid, {"aggregate_uncorrected": a, "volatile_uncorrected": v,
                                                 "previous": None}))
        elif life is not None:
            out.append(Finding("ecc.uncorrectable_aggregate", "warning",
                               f"{gpu_label(g)} lifetime uncorrectable ECC rose {life[1]} -> {a}",
                               g.index, g.uuid, {"aggregate_uncorrected": a, "previous": life[1]}))
        if g.sram_threshold_exceeded:
            out.append(Finding("ecc.sram_threshold_exceeded", "warning",
                               f"{gpu_label(g)} SRAM uncorrectable ECC errors exceeded the driver's threshold "
                               "(run field diagnostics)", g.index, g.uuid,
                               {"aggregate_uncorrected": a, "volatile_uncorrected": v}))
        if g.ecc_enabled is False:
            out.append(Finding("ecc.disabled", "warning", f"{gpu_label(g)} ECC mode is disabled",
                               g.index, g.uuid, {}))
    return out


def lifetime_change(ctx: CheckContext, g: GpuState, key: str) -> tuple[int, int | None] | None:
    """``(value, None)`` when GPU ``g``'s lifetime count ``key`` is above 0 on a first
    reading (:func:`gpuguard.checks.first_reading`), ``(value, previous)`` when it grew
    since the last run's stored value, None otherwise (unchanged, lower, unread)."""
    v = getattr(g, key)
    if not isinstance(v, int) or v <= 0:
        return None
    if first_reading(ctx, g, key):
        return v, None
    before = ctx.previous.get(g.uuid or "", {}).get(key)
    return (v, before) if isinstance(before, int) and v > before else None


def _lifetime_finding(ctx: CheckContext, g: GpuState, key: str, code: str, what: str,
                      ev: dict[str, object]) -> Finding | None:
    """``CODE_present`` on a first reading or ``CODE_rising`` on growth of ``key`` (see
    :func:`lifetime_change`), ``what`` naming the count."""
    life = lifetime_change(ctx, g, key)
    if life is None:
        return None
    v, before = life
    if before is None:
        return Finding(f"{code}_present", "warning", f"{gpu_label(g)} {v} {what} (first reading, no earlier value)",
                       g.index, g.uuid, ev | {"previous": None})
    return Finding(f"{code}_rising", "warning", f"{gpu_label(g)} {what} rose {before} -> {v}",
                   g.index, g.uuid, ev | {"previous": before})


@check("retired_pages")
def retired_pages(ctx: CheckContext) -> list[Finding]:
    """``ecc.retired_pages_pending`` (critical): a page is waiting to be retired, which
    happens only at the next driver reload / GPU reset (Dynamic Page Retirement). Not
    pending: pages retired for double-bit errors above 0 on a first reading,
    ``ecc.retired_pages_dbe_present`` (warning), or more than at the last run,
    ``ecc.retired_pages_dbe_rising`` (warning); single-bit retirements are the driver
    catching weak cells before they fail (Dynamic Page Retirement) and give nothing."""
    out = []
    for g in ctx.snapshot.gpus:
        ev = {"sbe": g.retired_pages_sbe, "dbe": g.retired_pages_dbe}
        if g.retired_pages_pending:
            out.append(Finding("ecc.retired_pages_pending", "critical",
                               f"{gpu_label(g)} page retirement pending (reset the GPU)", g.index, g.uuid, ev))
            continue
        f = _lifetime_finding(ctx, g, "retired_pages_dbe", "ecc.retired_pages_dbe",
                              "page(s) retired for double-bit ECC errors", ev)
        if f is not None:
            out.append(f)
    return out


@check("row_remap")
def row_remap(ctx: CheckContext) -> list[Finding]:
    """``ecc.row_remap_failure`` (critical, RMA) and ``ecc.row_remap_pending`` (critical:
    a remap waits for a GPU reset; XID 63 is its kernel-log twin). Neither: rows remapped
    for uncorrectable errors above 0 on a first reading, ``ecc.row_remap_uncorrectable_present``
    (warning), or more than at the last run, ``ecc.row_remap_uncorrectable_rising``
    (warning). Without a failure: banks with no spare row left (``remap_banks_none``)
    above 0 on a first reading or more than at the last run, ``ecc.remap_banks_exhausted``
    (warning: the next uncorrectable error there may fail to remap)."""
    out = []
    for g in ctx.snapshot.gpus:
        ev = {"correctable": g.remapped_rows_correctable, "uncorrectable": g.remapped_rows_uncorrectable,
              "banks_none": g.remap_banks_none}
        if g.remapped_rows_failure:
            out.append(Finding("ecc.row_remap_failure", "critical",
                               f"{gpu_label(g)} row remapping failed (GPU needs replacement)", g.index, g.uuid, ev))
        if g.remapped_rows_pending:
            out.append(Finding("ecc.row_remap_pending", "critical",
                               f"{gpu_label(g)} row remap pending (reset the GPU to apply)", g.index, g.uuid, ev))
        if g.remapped_rows_failure:
            continue  # replace the GPU: the counts below add nothing to act on
        f = None if g.remapped_rows_pending else _lifetime_finding(
            ctx, g, "remapped_rows_uncorrectable", "ecc.row_remap_uncorrectable",
            "row(s) remapped for uncorrectable ECC errors", ev)
        if f is not None:
            out.append(f)
        banks = lifetime_change(ctx, g, "remap_banks_none")
        if banks is not None:
            when = "first reading, no earlier value" if banks[1] is None else f"was {banks[1]}"
            out.append(Finding("ecc.remap_banks_exhausted", "warning",
                               f"{gpu_label(g)} {banks[0]} memory bank(s) with no spare row left for remapping "
                               f"({when}; run field diagnostics)", g.index, g.uuid, ev | {"previous": banks[1]}))
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
