"""Policy: finding -> action, and the hook's decision (DESIGN.md, "Detection is separate
from decision").

Actions, mildest first: ``record`` (store only), ``alert`` (store and report to the
operator), ``fail-job`` (the prolog notes the reason in the job's AdminComment and
cancels the job; the node stays up), ``drain`` (``scontrol update state=drain`` with a ``gpuguard:``
reason, then the prolog exits non-zero so Slurm requeues the job).

:data:`DEFAULT_ACTIONS` holds the shipped default for every finding code, each with its
source; ``[policy]`` in the config overrides per code and ``[policy.xid]`` per XID number.
XID findings (``xid.N``/``sxid.N``) default to the XID catalog's action.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from gpuguard.model import SEVERITY_RANK, Finding

ACTION_RANK = {"record": 0, "alert": 1, "fail-job": 2, "drain": 3}

#: code -> (default action, source of the default)
DEFAULT_ACTIONS: dict[str, tuple[str, str]] = {
    "gpu.driver_unusable": ("drain", "DCGM/NHC: a node whose GPU driver does not answer fails its health check"),
    "gpu.none": ("record", "a node without GPUs is not a fault"),
    "gpu.count_mismatch": ("drain", "NHC check_nv_gpu_count / DCGM: fewer GPUs than configured = failed node"),
    "gpu.count_unexpected": ("alert", "more GPUs than configured: config out of date, not a broken node"),
    "gpu.lost": ("drain", "NVML_ERROR_GPU_IS_LOST: GPU off the bus or inaccessible; XID 79 action is reboot"),
    "gpu.recovery_action.gpu_reset": ("drain", "NVML GPU recovery action 1 (GPU reset); DCGM health watch fails on it, as on XID 154 -> reset"),
    "gpu.recovery_action.node_reboot": ("drain", "NVML GPU recovery action 2 (node reboot); DCGM health watch fails on it"),
    "gpu.recovery_action.drain_and_reset": ("drain", "NVML GPU recovery action 4 (drain and reset); DCGM health watch fails on it"),
    "gpu.recovery_action.drain_p2p": ("alert", "NVML GPU recovery action 3 (drain P2P); DCGM health watch warns on it"),
    "gpu.read_error": ("alert", "a single failed read is not proof of a broken GPU"),
    "ecc.uncorrectable_volatile": ("drain", "DCGM health watch MEM: volatile DBE = fail; XID 48 action reset GPU"),
    "ecc.uncorrectable_aggregate": ("alert", "lifetime count grew: already drained via the volatile count if current"),
    "ecc.disabled": ("alert", "ECC off on a data-center GPU is a configuration drift"),
    "ecc.retired_pages_pending": ("drain", "NVIDIA Dynamic Page Retirement: pending pages retire at the next reset"),
    "ecc.row_remap_pending": ("drain", "NVIDIA GPU Memory Error Management: a pending remap needs a GPU reset"),
    "ecc.row_remap_failure": ("drain", "NVIDIA GPU Memory Error Management: remap failure = replace the GPU (XID 64)"),
    "pcie.width_degraded": ("alert", "link width does not drop for power saving: degraded slot/riser"),
    "pcie.gen_degraded": ("alert", "idle GPUs downshift the PCIe generation; opt-in check"),
    "pcie.replay_growth": ("alert", "replays are retransmissions: a marginal link, watch the trend"),
    "nvlink.link_down": ("drain", "DCGM health watch NVLINK: a down link fails the GPU"),
    "nvlink.errors_rising": ("alert", "DCGM health watch NVLINK warns on CRC/replay/recovery error growth"),
    "nccl.busbw_low": ("drain", "consecutive re-measured low NCCL probes ([nccl] consecutive_low); Azure HPC node health checks fail a node below its per-SKU NCCL all-reduce busbw"),
    "nccl.busbw_low_pending": ("alert", "one low reading is not a fault yet (azurehpc-health-checks #628/#690: single low readings drained healthy nodes)"),
    "nccl.errors": ("drain", "#wrong > 0 is data corruption on the GPU/NVLink/NIC path; a failed NCCL test fails the node in Azure HPC health checks"),
    "nccl.warn": ("alert", "NCCL warned but the probe completed with correct data: look, do not drain"),
    "nccl.output_unreadable": ("alert", "a saved nccl-tests log that cannot be read is not evidence of health"),
    "nccl.probe_failed": ("record", "the probe itself failed (binary missing, hang, unreadable output): gpuguard's or the install's fault, never a drain"),
    "ib.port_down": ("drain", "LBNL NHC check_hw_ib / GPUd: an InfiniBand/RoCE port not ACTIVE fails the node for multi-node jobs"),
    "ib.rate_degraded": ("drain", "LBNL NHC check_hw_ib RATE: a port below its rate halves the node's fabric bandwidth"),
    "ib.errors_rising": ("alert", "IBTA PortCounters: symbol/receive/integrity errors rising = a marginal cable or transceiver, watch"),
    "ib.link_flapping": ("alert", "link_downed rising: the link went down and retrained (GPUd flags port flaps); it carries traffic again, so watch rather than drain"),
    "ib.counter_saturated": ("alert", "IBTA PortCounters saturate at their maximum: growth is unknown until the counters are reset"),
    "ib.errors_present": ("record", "error counts seen on a first reading: history, not proof of a current fault"),
    "ib.unreadable": ("alert", "a port whose state cannot be read is unknown, not healthy"),
    "nvlink.errors_present": ("record", "totals on a first reading: history for the operator, growth is judged from the next run"),
    "thermal.near_slowdown": ("alert", "idle GPU close to its own slowdown threshold: cooling problem"),
    "throttle.hw_slowdown_idle": ("drain", "HW slowdown/power brake at idle: board, cooling or power fault (GPUd)"),
    "throttle.sw_thermal_idle": ("alert", "SW thermal slowdown at idle: cooling problem"),
    "config.persistence_off": ("alert", "NVIDIA driver persistence docs: enable on compute nodes"),
    "inventory.changed": ("record", "change log context for verdicts"),
    "inventory.new_gpu": ("record", "change log context for verdicts"),
    "baseline.idle_temp_up": ("alert", "GPU idles >=10 C above its own idle median (robust z >= 3.5): cooling fault before it throttles in jobs"),
    "baseline.idle_power_up": ("alert", "idle power >=30 % above the GPU's own median: clocks not dropping at idle or a board fault"),
    "verdict.straggler_gpu": ("alert", "one GPU far below its peers in a job; 3 jobs on the same GPU in 24 h escalate to drain (DESIGN.md)"),
    "verdict.straggler_node": ("alert", "one node far behind the others in a job; escalates like straggler_gpu"),
    "verdict.gpu_throttling": ("alert", "SM clock down with slowdown reasons active for a sustained window"),
    "verdict.communication": ("alert", "communication share up with a slowdown: fabric or NCCL problem to look at"),
    "verdict.hardware_fault": ("record", "explains the job; the XID/ECC finding itself carries the drain"),
    "verdict.memory_leak": ("record", "a leak in the user's code is not a node fault"),
    "verdict.data_pipeline": ("record", "the user's data loader or storage; shown in job show"),
    "verdict.job_changed": ("record", "the job itself differs; no operator action"),
}


@dataclass
class Decision:
    """The hook's decision.

    ``outcome`` is ``proceed``, ``drain`` or ``fail-job``; ``reason`` is the drain reason
    (starts with ``gpuguard:``, at most :data:`REASON_MAX` characters) or the fail-job
    message; ``actions`` pairs each finding with its action.
    """

    outcome: str
    reason: str = ""
    actions: list[tuple[Finding, str]] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """Prolog exit status: 1 for drain (Slurm requeues the job elsewhere), else 0
        (``fail-job`` cancels the job through Slurm: a non-zero exit would drain)."""
        return 1 if self.outcome == "drain" else 0


#: ``sinfo -R -o %E`` shows the whole reason; keep it one readable line.
REASON_MAX = 200


def action_for(f: Finding, policy: dict[str, str] | None = None, xid_policy: dict[int, str] | None = None) -> str:
    """The action for finding ``f``: config override by code, then (XID) by number, then
    the shipped default; an unknown code falls back by severity (critical -> alert,
    never drain: a new code must be given a drain action on purpose)."""
    action = _configured_action(f, policy or {}, xid_policy or {})
    if f.evidence.get("untrusted_source") and ACTION_RANK[action] > ACTION_RANK["alert"]:
        # read from a text file any user can write to (logger -t kernel): never drain on it
        return "alert"
    return action


def _configured_action(f: Finding, policy: dict[str, str], xid_policy: dict[int, str]) -> str:
    if f.code in policy:
        return policy[f.code]
    if f.code.startswith(("xid.", "sxid.")):
        if f.code.startswith("xid."):
            try:
                n = int(f.code.split(".", 1)[1])
            except ValueError:
                n = -1
            if n in xid_policy:
                return xid_policy[n]
        return f.evidence.get("catalog_action", "alert")
    if f.code in DEFAULT_ACTIONS:
        return DEFAULT_ACTIONS[f.code][0]
    return "alert" if SEVERITY_RANK[f.severity] >= SEVERITY_RANK["warning"] else "record"


def decide(findings: Iterable[Finding], policy: dict[str, str] | None = None,
           xid_policy: dict[int, str] | None = None) -> Decision:
    """Map findings to actions and pick the strongest: drain > fail-job > proceed.

    The drain reason names the code, the GPU and the evidence of the first (most severe)
    draining finding, e.g. ``gpuguard: xid.79 gpu2 XID 79 GPU has fallen off the bus``,
    plus ``(+N more)`` when several findings drain.
    """
    acts = [(f, action_for(f, policy, xid_policy)) for f in findings]
    acts.sort(key=lambda fa: (-ACTION_RANK[fa[1]], -SEVERITY_RANK[fa[0].severity]))
    for outcome in ("drain", "fail-job"):
        hits = [f for f, a in acts if a == outcome]
        if hits:
            return Decision(outcome, format_reason(hits), acts)
    return Decision("proceed", "", acts)


def format_reason(hits: list[Finding]) -> str:
    """``gpuguard: CODE MESSAGE [(+N more)]`` cut to :data:`REASON_MAX` characters.

    Characters Slurm or a shell could mangle (newlines, ``"``) are replaced: the reason is
    passed as one argv element, but it is echoed by sinfo/scontrol in one line."""
    first = hits[0]
    more = f" (+{len(hits) - 1} more)" if len(hits) > 1 else ""
    text = f"gpuguard: {first.code} {first.message}"
    # Control characters (NUL, ESC...) could come from a replay file or a kernel line;
    # NUL would even make the scontrol argv invalid and lose the drain.
    text = "".join(" " if ord(c) < 32 or ord(c) == 127 else c for c in text)
    text = " ".join(text.replace('"', "'").split())
    if len(text) + len(more) > REASON_MAX:
        text = text[: REASON_MAX - len(more) - 3] + "..."
    return text + more


def summarize(decision: Decision) -> dict[str, Any]:
    """JSON-ready form of a decision."""
    return {
        "outcome": decision.outcome,
        "reason": decision.reason,
        "findings": [dict(f.to_dict(), action=a) for f, a in decision.actions],
    }
