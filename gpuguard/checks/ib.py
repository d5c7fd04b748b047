"""InfiniBand/RoCE ports: down / not ACTIVE, rate below reference, error counters
rising since the last run (rules and thresholds: :mod:`gpuguard.net.ib_judge`).

Reads ``[fabric] sysfs_root`` itself (cheap sysfs files); the previous reading comes
from the store when the run has one, and this run's reading is handed back in
``ctx.records["fabric_counters"]`` for the run to store. Skipped for a saved
nvidia-smi dump judged with ``gpuguard check`` (the fabric of the machine running the
command is not the dump's).
"""

from __future__ import annotations

from gpuguard.checks import CheckContext, check
from gpuguard.model import Finding


@check("ib")
def ib(ctx: CheckContext) -> list[Finding]:
    """``ib.port_down``, ``ib.rate_degraded``, ``ib.errors_rising``, ``ib.link_flapping``, ``ib.counter_saturated``."""
    cfg = ctx.config
    if cfg is None or (ctx.hook == "check" and ctx.snapshot.source.startswith("nvidia-smi")):
        return []
    from gpuguard.net.fabric import fabric_rows, load_previous, read_fabric
    from gpuguard.net.ib_judge import judge_ports

    ports = read_fabric(cfg)
    if not ports:
        return []
    node = ctx.node or cfg.node_name
    previous = load_previous(ctx.store, node) if ctx.store is not None else {}
    now = ctx.snapshot.taken_at
    found = judge_ports(ports, previous, now, float(cfg.get("fabric", "expected_rate_gbps")))
    if ctx.store is not None:
        ctx.records.setdefault("fabric_counters", []).extend(fabric_rows(node, ports, previous, now))
    return found
