"""InfiniBand/RoCE ports: down / not ACTIVE, rate below reference, error counters
rising since the last run (rules and thresholds: :mod:`gpuguard.net.ib_judge`)."""

from __future__ import annotations

from gpuguard.checks import CheckContext, check
from gpuguard.model import Finding


@check("ib")
def ib(ctx: CheckContext) -> list[Finding]:
    """``ib.port_down``, ``ib.rate_degraded``, ``ib.errors_rising``, ``ib.link_flapping``, ``ib.counter_saturated``."""
    if not ctx.ib_ports:
        return []
    from gpuguard.net.ib_judge import judge_ports

    return judge_ports(ctx.ib_ports, ctx.previous_fabric, ctx.snapshot.taken_at,
                       float(ctx.fabric_expected_rate_gbps))
