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
from gpuguard.model import Finding, declare_codes

#: The InfiniBand/RoCE family's finding codes: code -> (severity, default action, source).
CODES = declare_codes("ib", {
    "ib.port_down": ("critical", "drain",
        "LBNL NHC check_hw_ib / GPUd: an InfiniBand/RoCE port not ACTIVE fails the node for multi-node jobs"),
    "ib.port_unused": ("info", "record",
        "a port DOWN without link partner that was never used: nobody cabled it (NHC and GPUd judge only the "
        "ports the operator names); named in [fabric] ports it is judged ib.port_down"),
    "ib.rate_degraded": ("critical", "drain",
        "LBNL NHC check_hw_ib RATE: a port below its rate halves the node's fabric bandwidth"),
    "ib.errors_rising": ("warning", "alert",
        "IBTA PortCounters: symbol/receive/integrity errors rising = a marginal cable or transceiver, watch"),
    "ib.link_flapping": ("warning", "alert",
        "link_downed rising: the link went down and retrained (GPUd flags port flaps); it carries traffic again, "
        "so watch rather than drain"),
    "ib.counter_saturated": ("warning", "alert",
        "IBTA PortCounters saturate at their maximum: growth is unknown until the counters are reset"),
    "ib.errors_present": ("info", "record",
        "error counts seen on a first reading: history, not proof of a current fault"),
    "ib.unreadable": ("warning", "alert", "a port whose state cannot be read is unknown, not healthy"),
})


@check("ib")
def ib(ctx: CheckContext) -> list[Finding]:
    """``ib.port_down``, ``ib.port_unused``, ``ib.rate_degraded``, ``ib.errors_rising``, ``ib.link_flapping``,
    ``ib.counter_saturated`` (:mod:`gpuguard.net.ib_judge`). The live check runs without
    the store (no previous reading): a never-used port is then ``ib.port_unused`` on its
    own evidence; the run with the store judges it on its history too."""
    cfg = ctx.config
    if cfg is None or (ctx.hook == "check" and ctx.snapshot.source.startswith("nvidia-smi")):
        return []
    from gpuguard.net.fabric import fabric_rows, load_previous, read_fabric
    from gpuguard.net.ib_judge import judge_ports

    ports = read_fabric(cfg)
    if not ports:
        return []
    node = ctx.node or cfg.node_name
    previous: dict = {}
    history = ctx.store is not None
    if history:
        try:
            from gpuguard.net.schema import ensure

            ensure(ctx.store)
            previous = load_previous(ctx.store, node)
        except Exception:  # store trouble: judge the live state, keep nothing
            history = False
    now = ctx.snapshot.taken_at
    found = judge_ports(ports, previous, now, float(cfg.get("fabric", "expected_rate_gbps")),
                        listed=bool(cfg.get("fabric", "ports")))
    if history:
        ctx.records.setdefault("fabric_counters", []).extend(fabric_rows(node, ports, previous, now))
    return found
