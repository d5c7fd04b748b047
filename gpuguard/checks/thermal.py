"""Temperature and clock-event (throttle) reasons on an idle GPU, persistence mode.

At idle (utilisation known and below ``[checks] idle_util_pct``; :func:`gpuguard.checks.looks_idle`)
no slowdown should be active: HW slowdown, HW power brake and HW thermal slowdown at idle
point at the board, its cooling or the node's power delivery (GPUd flags HW slowdown the same way; NVML
``nvmlClocksEventReasonHwPowerBrakeSlowdown`` is asserted by an external power-brake
signal). SW power cap at idle is normal and ignored. A GPU whose utilisation is unknown
is neither idle nor busy: a HW/SW-thermal slowdown on it is ``throttle.idle_not_judged``
(info) with the reason, never a drain.
"""

from __future__ import annotations

from gpuguard.checks import CheckContext, check, gpu_label, looks_idle, util_unknown
from gpuguard.model import HW_SLOWDOWN_REASONS, Finding, declare_codes


#: The thermal/power/clocks family's finding codes: code -> (severity, default action, source).
CODES = declare_codes("thermal", {
    "thermal.near_slowdown": ("warning", "alert",
        "idle GPU close to its own slowdown threshold: cooling problem"),
    "throttle.hw_slowdown_idle": ("critical", "drain",
        "HW slowdown/power brake at idle: board, cooling or power fault (GPUd)"),
    "throttle.sw_thermal_idle": ("warning", "alert",
        "SW thermal slowdown at idle: cooling problem"),
    "throttle.idle_not_judged": ("info", "record",
        "our choice: a slowdown on a GPU of unknown utilisation may be a job's load, so it is recorded, not judged"),
    "config.persistence_off": ("warning", "alert",
        "NVIDIA driver persistence docs: enable on compute nodes"),
})

_HW_REASONS = HW_SLOWDOWN_REASONS


def _idle(ctx: CheckContext, g) -> bool:
    return looks_idle(g, ctx.setting("idle_util_pct"))


@check("temperature")
def temperature(ctx: CheckContext) -> list[Finding]:
    """``thermal.near_slowdown`` (warning): idle temperature within ``temp_margin_c`` of
    the GPU's own slowdown threshold."""
    out = []
    margin = ctx.setting("temp_margin_c")
    for g in ctx.snapshot.gpus:
        if g.temp_c is None or g.temp_slowdown_c is None or not _idle(ctx, g):
            continue
        if g.temp_c >= g.temp_slowdown_c - margin:
            out.append(Finding("thermal.near_slowdown", "warning",
                               f"{gpu_label(g)} idle at {g.temp_c:g} C, slowdown at {g.temp_slowdown_c:g} C",
                               g.index, g.uuid, {"temp_c": g.temp_c, "slowdown_c": g.temp_slowdown_c}))
    return out


@check("idle_throttle")
def idle_throttle(ctx: CheckContext) -> list[Finding]:
    """``throttle.hw_slowdown_idle`` (critical) for HW slowdown / HW thermal slowdown /
    HW power brake active while idle; ``throttle.sw_thermal_idle`` (warning);
    ``throttle.idle_not_judged`` (info) for either kind active on a GPU of unknown
    utilisation (:func:`gpuguard.checks.util_unknown`)."""
    out = []
    for g in ctx.snapshot.gpus:
        reasons = g.clock_event_reasons or []
        if not reasons:
            continue
        if not _idle(ctx, g):
            why = util_unknown(g)
            active = [r for r in (*_HW_REASONS, "sw_thermal_slowdown") if r in reasons]
            if why and active:
                out.append(Finding("throttle.idle_not_judged", "info",
                                   f"{gpu_label(g)} {'+'.join(active)} active, {why}: idle throttle not judged",
                                   g.index, g.uuid, {"reasons": active, "why": why}))
            continue
        hw = [r for r in _HW_REASONS if r in reasons]
        if hw:
            out.append(Finding("throttle.hw_slowdown_idle", "critical",
                               f"{gpu_label(g)} {'+'.join(hw)} active while idle",
                               g.index, g.uuid, {"reasons": hw, "power_w": g.power_w, "temp_c": g.temp_c,
                                                 "sm_clock_mhz": g.sm_clock_mhz}))
        if "sw_thermal_slowdown" in reasons:
            out.append(Finding("throttle.sw_thermal_idle", "warning",
                               f"{gpu_label(g)} SW thermal slowdown active while idle",
                               g.index, g.uuid, {"temp_c": g.temp_c}))
    return out


@check("persistence")
def persistence(ctx: CheckContext) -> list[Finding]:
    """``config.persistence_off`` (warning): persistence mode off makes every job pay the
    driver initialisation and lets the GPU state reset between jobs (NVIDIA driver
    persistence documentation recommends the persistence daemon on compute nodes)."""
    return [Finding("config.persistence_off", "warning", f"{gpu_label(g)} persistence mode off", g.index, g.uuid, {})
            for g in ctx.snapshot.gpus if g.persistence_mode is False]
