"""PCIe link: width/generation below the maximum, replay counter growth.

Idle GPUs lower their PCIe *generation* to save power (NVIDIA nvidia-smi docs: "the
current link generation may be reduced when the GPU is not in use"), so a low generation
is only reported when ``[checks] pcie_require_max_link`` is set. A narrower *width* does
not come from power management and is always reported.
"""

from __future__ import annotations

from gpuguard.checks import CheckContext, check, gpu_label
from gpuguard.model import Finding, declare_codes


#: The PCIe family's finding codes: code -> (severity, default action, source).
CODES = declare_codes("pcie", {
    "pcie.width_degraded": ("warning", "alert",
        "link width does not drop for power saving: degraded slot/riser"),
    "pcie.gen_degraded": ("warning", "alert",
        "idle GPUs downshift the PCIe generation; opt-in check"),
    "pcie.replay_growth": ("warning", "alert",
        "replays are retransmissions: a marginal link, watch the trend"),
})

#: Replays since the last run that make a warning. Site-tunable via the policy; chosen
#: well above the steady trickle seen on healthy H100s in the corpus (58-120 since boot).
REPLAY_GROWTH_WARN = 100


@check("pcie_link")
def pcie_link(ctx: CheckContext) -> list[Finding]:
    """``pcie.width_degraded`` (warning) and ``pcie.gen_degraded`` (warning, opt-in)."""
    out = []
    for g in ctx.snapshot.gpus:
        if g.pcie_width_current is not None and g.pcie_width_max and g.pcie_width_current < g.pcie_width_max:
            out.append(Finding("pcie.width_degraded", "warning",
                               f"{gpu_label(g)} PCIe link x{g.pcie_width_current} of x{g.pcie_width_max}",
                               g.index, g.uuid, {"width": g.pcie_width_current, "width_max": g.pcie_width_max}))
        if (ctx.setting("pcie_require_max_link") and g.pcie_gen_current is not None and g.pcie_gen_max
                and g.pcie_gen_current < g.pcie_gen_max):
            out.append(Finding("pcie.gen_degraded", "warning",
                               f"{gpu_label(g)} PCIe gen {g.pcie_gen_current} of {g.pcie_gen_max}",
                               g.index, g.uuid, {"gen": g.pcie_gen_current, "gen_max": g.pcie_gen_max}))
    return out


@check("pcie_replay")
def pcie_replay(ctx: CheckContext) -> list[Finding]:
    """``pcie.replay_growth`` (warning): the replay counter rose by at least
    :data:`REPLAY_GROWTH_WARN` since the last run (link-level retransmissions: a marginal
    riser, slot or cable)."""
    out = []
    for g in ctx.snapshot.gpus:
        before = ctx.previous.get(g.uuid or "", {}).get("pcie_replay_count")
        now = g.pcie_replay_count
        if isinstance(before, int) and now is not None and now - before >= REPLAY_GROWTH_WARN:
            out.append(Finding("pcie.replay_growth", "warning",
                               f"{gpu_label(g)} PCIe replays rose {before} -> {now}",
                               g.index, g.uuid, {"replays": now, "previous": before}))
    return out
