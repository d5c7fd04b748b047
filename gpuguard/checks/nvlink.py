"""NVLink: links down and error counters rising since the last run.

A link counts as down when it is inactive while other links of the same GPU are active,
or when it was active at the last run (DCGM ``DCGM_HEALTH_WATCH_NVLINK`` treats a down link
as a failure; NVIDIA/DCGM#198 shows a node whose NVLinks were all down passing diag, which
is why the previous run's state is compared too).
"""

from __future__ import annotations

from gpuguard.checks import CheckContext, check, gpu_label
from gpuguard.model import Finding, declare_codes


#: The NVLink family's finding codes: code -> (severity, default action, source).
CODES = declare_codes("nvlink", {
    "nvlink.link_down": ("critical", "drain",
        "DCGM health watch NVLINK: a down link fails the GPU"),
    "nvlink.errors_rising": ("warning", "alert",
        "DCGM health watch NVLINK warns on CRC/replay/recovery error growth"),
})

_COUNTERS = (("replay", "replay_errors"), ("recovery", "recovery_errors"),
             ("crc_flit", "crc_flit_errors"), ("crc_data", "crc_data_errors"))


@check("nvlink")
def nvlink(ctx: CheckContext) -> list[Finding]:
    """``nvlink.link_down`` (critical) and ``nvlink.errors_rising`` (warning)."""
    out = []
    for g in ctx.snapshot.gpus:
        if not g.nvlinks:
            continue
        prev = ctx.previous.get(g.uuid or "", {}).get("nvlinks", {})
        any_active = any(n.active for n in g.nvlinks)
        down = [n.link for n in g.nvlinks
                if n.active is False and (any_active or prev.get(str(n.link), {}).get("active"))]
        if down:
            out.append(Finding("nvlink.link_down", "critical",
                               f"{gpu_label(g)} NVLink link(s) {','.join(map(str, down))} down",
                               g.index, g.uuid, {"links_down": down}))
        rising = {}
        for n in g.nvlinks:
            p = prev.get(str(n.link), {})
            for key, attr in _COUNTERS:
                v, b = getattr(n, attr), p.get(key)
                if isinstance(v, int) and isinstance(b, int) and v > b:
                    rising[f"link{n.link}.{key}"] = v - b
        if rising:
            out.append(Finding("nvlink.errors_rising", "warning",
                               f"{gpu_label(g)} NVLink errors rising: " + ", ".join(f"{k}+{v}" for k, v in sorted(rising.items())),
                               g.index, g.uuid, {"increase": rising}))
    return out
