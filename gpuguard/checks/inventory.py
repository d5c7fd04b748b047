"""Inventory: driver, CUDA, VBIOS, InfoROM, serial or the GPU itself changed since the
last run. Informational: the change log is context for later verdicts."""

from __future__ import annotations

from gpuguard.checks import CheckContext, check, gpu_label
from gpuguard.model import Finding, declare_codes


#: The inventory family's finding codes: code -> (severity, default action, source).
CODES = declare_codes("inventory", {
    "inventory.changed": ("info", "record",
        "change log context for verdicts"),
    "inventory.new_gpu": ("info", "record",
        "change log context for verdicts"),
})

TRACKED = ("driver_version", "cuda_version", "vbios_version", "inforom_version", "serial", "pci_bus_id", "name")


@check("inventory")
def inventory(ctx: CheckContext) -> list[Finding]:
    """``inventory.changed`` (info) per changed field; ``inventory.new_gpu`` (info) for a
    UUID not seen before on a node that has history."""
    out = []
    if not ctx.previous_inventory:
        return out
    for g in ctx.snapshot.gpus:
        old = ctx.previous_inventory.get(g.uuid or "")
        if old is None:
            out.append(Finding("inventory.new_gpu", "info", f"{gpu_label(g)} new GPU {g.uuid} (serial {g.serial})",
                               g.index, g.uuid, {"serial": g.serial}))
            continue
        for f in TRACKED:
            new = getattr(g, f)
            if new is not None and old.get(f) not in (None, new):
                out.append(Finding("inventory.changed", "info", f"{gpu_label(g)} {f} {old.get(f)} -> {new}",
                                   g.index, g.uuid, {"field": f, "old": old.get(f), "new": new}))
    return out
