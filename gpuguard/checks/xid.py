"""XID / SXid events from the kernel log, classified by the catalog
(:mod:`gpuguard.xid.catalog`, NVIDIA's XID table with its sources)."""

from __future__ import annotations

from gpuguard.checks import CheckContext, check
from gpuguard.model import Finding, pci_key


@check("xid")
def xid(ctx: CheckContext) -> list[Finding]:
    """One finding per (GPU, code) among the new kernel-log events, code ``xid.N``
    (``sxid.N`` for NVSwitch); severity from the catalog; evidence holds the count, the
    pids/processes and the deciding event's message. The policy's action comes from the catalog
    unless ``[policy.xid]`` overrides it.

    Where the catalog reads the message (NVLink5 Fatal/Nonfatal, SXid Fatal/Non-fatal,
    XID 154's new recovery action), the events of one (GPU, code) can differ in action:
    the finding takes the strongest one (a Fatal row after Nonfatal rows drains), except
    for XID 154, whose *last* event names the GPU's current recovery action (the driver
    prints each change, so an earlier ``to 0x2`` followed by ``to 0x0`` is done). The
    message evidence is the deciding event's."""

    by_pci = ctx.snapshot.by_pci()
    grouped: dict[tuple[str, str, int, str | None], list] = {}
    for ev in ctx.xid_events:
        untrusted = getattr(ev, "untrusted_source", None)
        grouped.setdefault((ev.kind, ev.pci_bus_id or "", ev.xid, untrusted), []).append(ev)
    out = []
    for (kind, pci, code, untrusted), evs in grouped.items():
        first, c = _deciding(evs)
        try:
            g = by_pci.get(pci_key(pci)) if pci and kind != "sxid" else None
        except ValueError:
            g = None
        prefix = "sxid" if kind == "sxid" else "xid"
        if g:
            where = f"gpu{g.index} ({pci})"
        elif kind == "sxid":
            where = f"NVSwitch {pci}"
        else:
            # Not a visible GPU: possibly the very GPU that fell off the bus, so the
            # catalog's action stands; the message says so.
            where = f"{pci or 'unknown device'} (not among the {len(ctx.snapshot.gpus)} visible GPUs)"
        # read from a file any user can write to: the alert it gets is its severity too
        severity = "warning" if untrusted and c.severity == "critical" else c.severity
        out.append(Finding(
            f"{prefix}.{code}", severity,
            f"{'SXid' if kind == 'sxid' else 'XID'} {code} {c.name} on {where}" + (f" x{len(evs)}" if len(evs) > 1 else "")
            + (f" (read from {untrusted}, which can hold user messages: alert only)" if untrusted else ""),
            g.index if g else None, g.uuid if g else None,
            {"xid": code, "kind": kind, "pci_bus_id": pci, "count": len(evs),
             "catalog_action": ("alert" if untrusted and c.action == "drain" else c.action),
             "untrusted_source": untrusted,
             "meaning": c.meaning, "source": c.source,
             "pids": sorted({e.pid for e in evs if e.pid is not None}),
             "processes": sorted({e.process for e in evs if e.process}),
             "message": first.message[:200]},
        ))
    return out


def _deciding(evs: list) -> tuple:
    """(event, classification) that decides a (GPU, code) group; see :func:`xid`."""
    from gpuguard.policy import ACTION_RANK
    from gpuguard.xid.catalog import classify

    if evs[0].kind == "xid" and evs[0].xid == 154:
        return evs[-1], classify(evs[-1])
    best = None
    for ev in evs:
        c = classify(ev)
        if best is None or ACTION_RANK[c.action] > ACTION_RANK[best[1].action]:
            best = (ev, c)
    return best
