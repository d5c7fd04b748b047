"""NVLink: links down against the node's own link inventory, error counters as rates.

A link is *expected* up when it was seen up on this GPU before (``nvlink_ever_up`` in
the stored counters, :func:`gpuguard.checks.counters_of`), when it is up on every other
GPU of the same model on this node, or when ``[checks] nvlink_expected_links`` says the
SKU has that many. An expected link that is inactive is ``nvlink.link_down`` (DCGM
health watch NVLINK fails a GPU with a down link; NVIDIA/DCGM#198 shows all links down
passing diag, azhpc-images #443 NVLinks missing after boot). A link never up anywhere
on this node is inactive by design on the SKU (azurehpc-health-checks #162: H100 PCIe
on NCv5 wires 12 of 18 links) and is not a finding once the node has history. On the
GPU's first reading (:func:`gpuguard.checks.first_reading`: a new node, a wiped store, a
pasted ``dcgmi nvlink --link-status`` / ``nvidia-smi nvlink -s``) nothing tells the two
apart, and all links down is a known fault (NVIDIA/DCGM#198, whose diag passed): such
links are ``nvlink.inactive_first_reading`` (warning, once; later runs judge them by the
inventory). Not for a GPU with a link down (that finding names them too), nor in MIG
mode, whose links NVML reports down (DCGM treats them as disabled: DcgmTopology.cpp, bug
200682374), nor with ``nvlink_expected_links`` set (the links past it are then the
SKU's, by configuration).

Error counters are judged as growth since the previous reading (``at`` in the stored
counters): CRC flit/data errors by rate per second against ``nvlink_crc_rate_per_s``,
replay/recovery errors by count against ``nvlink_replay_recovery_max`` (DCGM
``dcgm_hardware_limits.h``). A counter lower than before means the driver reloaded: a
new start, not a finding. On a first reading (no previous counters, or a pasted
``nvidia-smi nvlink -e``) non-zero counters are shown as ``nvlink.errors_present``
(info). The check is a pure function of the readings: where they come
from (prolog snapshot, the collector's slow path) is the caller's business.
"""

from __future__ import annotations

from typing import Any

from gpuguard.checks import CheckContext, check, first_reading, gpu_label
from gpuguard.model import Finding, GpuState, declare_codes

#: The NVLink family's finding codes: code -> (severity, default action, source).
CODES = declare_codes("nvlink", {
    "nvlink.link_down": ("critical", "drain",
        "DCGM health watch NVLINK: a down link fails the GPU"),
    "nvlink.errors_rising": ("warning", "alert",
        "DCGM health watch NVLINK warns on CRC/replay/recovery error growth (CRC by rate: dcgm_hardware_limits.h)"),
    "nvlink.inactive_first_reading": ("warning", "alert",
        "DCGM health watch NVLINK fails any link reported Down (DCGM_FR_NVLINK_DOWN) but an unwired link on a "
        "PCIe SKU reads the same (azurehpc-health-checks #162): on a first reading, with no inventory or "
        "nvlink_expected_links to tell, alert, not drain (all links down: NVIDIA/DCGM#198)"),
    "nvlink.errors_present": ("info", "record",
        "totals on a first reading: history for the operator, growth is judged from the next run"),
})

_CRC = (("crc_flit", "crc_flit_errors"), ("crc_data", "crc_data_errors"))
_COUNTS = (("replay", "replay_errors"), ("recovery", "recovery_errors"))


def expected_links(g: GpuState, peers: list[GpuState], prev: dict[str, Any], configured: int) -> set[int]:
    """Links of ``g`` that must be up (see the module docstring)."""
    exp = {int(x) for x in prev.get("nvlink_ever_up", [])}
    exp |= {int(k) for k, v in prev.get("nvlinks", {}).items() if v.get("active")}
    if configured > 0:
        exp |= set(range(configured))
    others = [p for p in peers if p is not g and p.nvlinks and p.name == g.name]
    if others:
        up_everywhere = set.intersection(*({n.link for n in p.nvlinks if n.active} for p in others))
        exp |= up_everywhere
    return exp


def _growth(g: GpuState, prev: dict[str, Any], now: float, crc_rate: float, count_max: int) -> dict[str, Any]:
    links_prev = prev.get("nvlinks", {})
    at = prev.get("at")
    dt = now - at if isinstance(at, (int, float)) and now > at else None
    hits: dict[str, Any] = {}
    for n in g.nvlinks or []:
        p = links_prev.get(str(n.link), {})
        for key, attr in _CRC:
            v, b = getattr(n, attr), p.get(key)
            if isinstance(v, int) and isinstance(b, int) and v > b:
                rate = (v - b) / dt if dt else None
                if rate is None or rate >= crc_rate:
                    hits[f"link{n.link}.{key}"] = {"increase": v - b, "per_s": None if rate is None else round(rate, 3)}
        for key, attr in _COUNTS:
            v, b = getattr(n, attr), p.get(key)
            if isinstance(v, int) and isinstance(b, int) and v - b >= count_max > 0:
                hits[f"link{n.link}.{key}"] = {"increase": v - b,
                                               "per_s": None if not dt else round((v - b) / dt, 6)}
    return hits


def _present(g: GpuState, count_max: int) -> dict[str, int]:
    """Counters worth showing on a first reading (no previous run, or a pasted output):
    growth cannot be judged yet, but the totals are history an operator wants to see."""
    out = {}
    for n in g.nvlinks or []:
        for key, attr in _CRC + _COUNTS:
            v = getattr(n, attr)
            if isinstance(v, int) and v >= max(1, count_max):
                out[f"link{n.link}.{key}"] = v
    return out


@check("nvlink")
def nvlink(ctx: CheckContext) -> list[Finding]:
    """``nvlink.link_down`` (critical), ``nvlink.inactive_first_reading`` (warning),
    ``nvlink.errors_rising`` (warning), ``nvlink.errors_present`` (info)."""
    out = []
    gpus = ctx.snapshot.gpus
    configured = int(ctx.setting("nvlink_expected_links"))
    crc_rate = float(ctx.setting("nvlink_crc_rate_per_s"))
    count_max = int(ctx.setting("nvlink_replay_recovery_max"))
    for g in gpus:
        if not g.nvlinks:
            continue
        prev = ctx.previous.get(g.uuid or "", {})
        exp = expected_links(g, gpus, prev, configured)
        down = sorted(n.link for n in g.nvlinks if n.active is False and n.link in exp)
        if configured > 0:
            present = {n.link for n in g.nvlinks}
            down = sorted(set(down) | {k for k in range(configured) if k not in present})
        never = sorted(n.link for n in g.nvlinks if n.active is False and n.link not in exp)
        if down:
            out.append(Finding("nvlink.link_down", "critical",
                               f"{gpu_label(g)} NVLink link(s) {','.join(map(str, down))} down",
                               g.index, g.uuid, {"links_down": down, "never_up_by_design": never}))
        elif never and configured <= 0 and not g.mig_mode and first_reading(ctx, g, "nvlinks") \
                and first_reading(ctx, g, "nvlink_ever_up"):
            up = sum(1 for n in g.nvlinks if n.active)
            out.append(Finding("nvlink.inactive_first_reading", "warning",
                               f"{gpu_label(g)} NVLink link(s) {','.join(map(str, never))} inactive on the first "
                               f"reading ({up} up): down, or not wired on this SKU (no history to tell)",
                               g.index, g.uuid, {"links_inactive": never, "links_up": up}))
        if "nvlinks" not in prev:
            present = _present(g, count_max)
            if present:
                out.append(Finding("nvlink.errors_present", "info",
                                   f"{gpu_label(g)} NVLink error counters (first reading): "
                                   + ", ".join(f"{k}={v}" for k, v in sorted(present.items())),
                                   g.index, g.uuid, {"counters": present}))
            continue
        hits = _growth(g, prev, ctx.snapshot.taken_at, crc_rate, count_max)
        if hits:
            out.append(Finding("nvlink.errors_rising", "warning",
                               f"{gpu_label(g)} NVLink errors rising: "
                               + ", ".join(f"{k}+{v['increase']}" for k, v in sorted(hits.items())),
                               g.index, g.uuid, {"increase": hits}))
    return out
