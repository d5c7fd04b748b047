"""The verdict's finding codes (``verdict.*``), declared like every family's
(:func:`gpuguard.model.declare_codes`): severity, default action and its source. The
policy table (:mod:`gpuguard.policy`) reads these declarations.
"""

from __future__ import annotations

from gpuguard.model import declare_codes

#: Verdict causes: code -> (severity, default action, source).
CODES = declare_codes("verdict", {
    "verdict.straggler_gpu": ("warning", "alert",
        "one GPU far below its peers in a job; 3 jobs on the same GPU in 24 h escalate to drain (DESIGN.md)"),
    "verdict.straggler_node": ("warning", "alert",
        "one node far behind the others in a job; escalates like straggler_gpu"),
    "verdict.gpu_throttling": ("warning", "alert",
        "SM clock down with slowdown reasons active for a sustained window"),
    "verdict.communication": ("warning", "alert",
        "communication share up with a slowdown: fabric or NCCL problem to look at"),
    "verdict.hardware_fault": ("critical", "record",
        "explains the job; the XID/ECC finding itself carries the drain"),
    "verdict.memory_leak": ("warning", "record", "a leak in the user's code is not a node fault"),
    "verdict.data_pipeline": ("info", "record", "the user's data loader or storage; shown in job show"),
    "verdict.job_changed": ("info", "record", "the job itself differs; no operator action"),
})
