"""Rows of the core's ``findings`` and ``events`` tables, each built by one function, so
that every writer (health runs, the verdict, the collector, the epilog) stores the same
columns with the same meaning. Times are UTC epoch seconds.
"""

from __future__ import annotations

import json
from typing import Any

from gpuguard.model import Finding

#: Longest kernel-log line kept in ``events.raw`` (our choice: a full NVRM line is under
#: 500 characters; more is a flood we do not want in every row).
RAW_MAX = 2000


def finding_row(f: Finding, action: str, *, node: str, at: float, job_id: str | None,
                run_id: int | None = None) -> dict[str, Any]:
    """One ``findings`` row: the finding, the action the policy gave it, where and when.
    ``run_id``: the health run it belongs to (None for a verdict finding)."""
    return {"run_id": run_id, "node": node, "at": at, "job_id": job_id, "code": f.code, "severity": f.severity,
            "action": action, "gpu_index": f.gpu_index, "gpu_uuid": f.gpu_uuid, "message": f.message,
            "evidence": json.dumps(f.evidence, default=str, sort_keys=True)}


def event_row(*, node: str, at: float, kind: str, source: str, message: str, job_id: str | None = None,
              code: int | None = None, gpu: Any = None, gpu_index: int | None = None, pci_bus_id: str | None = None,
              pid: int | None = None, process: str | None = None, action: str | None = None,
              raw: str | None = None) -> dict[str, Any]:
    """One ``events`` row. ``kind``: ``xid`` | ``sxid`` | ``collector_died`` | ...;
    ``source``: ``kernel_log`` | ``nvml`` | ``epilog`` ...; ``code``: the XID/SXid number;
    ``gpu``: the GPU it maps to (anything with ``index``, ``uuid``, ``pci_bus_id``), else
    ``gpu_index``/``pci_bus_id`` as known; ``action``: the catalog's default action."""
    return {"node": node, "at": at, "kind": kind, "code": code,
            "gpu_index": gpu.index if gpu is not None else gpu_index,
            "gpu_uuid": gpu.uuid if gpu is not None else None,
            "pci_bus_id": pci_bus_id if pci_bus_id is not None else (gpu.pci_bus_id if gpu is not None else None),
            "pid": pid, "process": process, "message": message, "action": action, "job_id": job_id,
            "source": source, "raw": raw[:RAW_MAX] if raw else None}
