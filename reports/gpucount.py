"""How many GPUs a job held, from whichever accounting field carries it, and where from.

Slurm records GPUs in its TRES fields only when ``AccountingStorageTRES`` names
``gres/gpu`` (slurm.conf man page, AccountingStorageTRES); a cluster without it prints
AllocTRES like ``billing=1,cpu=1,mem=512M,node=1`` for a job that held four GPUs
(corpus ``sacct-json-23.11-gpus-not-in-tres.json``, skypilot-org/skypilot#10319). Reading
such a job as "0 GPUs" turns unknown usage into a false fact, so the count is taken from
the first field that carries one, in this order, and the field is recorded:

1. ``AllocTRES`` ``gres/gpu=N`` (typed ``gres/gpu:TYPE=N`` when the untyped entry is absent);
2. ``ReqTRES`` likewise (what the job asked for; allocation equals request for GPUs);
3. ``AllocGRES`` then ``ReqGRES`` (``gpu:2``, ``gpu:a100:2(IDX:0-1)``; Slurm before 19.05,
   and ``used_gres`` of ``sacct --json``);
4. jobstats' ``JS1:`` AdminComment (its ``gpus``).

When none carries a GPU entry the count is **0** only if the input had a TRES field and
nothing says the job asked for GPUs; it is **unknown** (None) when the input had no GPU
field at all (a ``sacct -P`` file saved without AllocTRES) or the job's ``SubmitLine``
asked for GPUs (``--gpus``, ``--gpus-per-*``, ``-G``, ``--gres=gpu...``,
``--tres-per-*=gres/gpu...``) that no TRES field shows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: sbatch/srun options that request GPUs (sbatch man page: --gpus/-G, --gpus-per-node,
#: --gpus-per-task, --gpus-per-socket, --gres, --tres-per-task).
_GPU_REQUEST = re.compile(r"(?:^|\s)(?:--gpus(?:-per-\w+)?[=\s]|-G\s*\S|--gres[=\s]\S*gpu|--tres-per-\w+[=\s]\S*gpu)")
_GRES_ITEM = re.compile(r"^gpu(?::([^:(]+))?(?::(\d+))?(?:\(.*\))?$")


@dataclass(frozen=True)
class GpuCount:
    """``gpus`` None = unknown; ``source`` the field it came from (``AllocTRES``,
    ``ReqTRES``, ``AllocGRES``, ``ReqGRES``, ``JS1``), or ``unknown: WHY`` / ``none: FIELD``
    (the field was there and held no GPU)."""

    gpus: int | None
    gpu_type: str | None
    source: str


def parse_gres(s: str | None) -> tuple[int, str | None] | None:
    """``gpu:2``, ``gpu:a100:2``, ``gpu:a100:2(IDX:0-1)``, several comma-separated GRES ->
    ``(gpus, type)``; None when the string names no GPU. A bare ``gpu`` counts 1 (Slurm's
    default count). Types are sorted and joined by ``,``."""
    if not s:
        return None
    total, types, seen = 0, set(), False
    # commas also separate IDX lists inside parentheses: drop those first
    for item in re.sub(r"\([^)]*\)", "", s).split(","):
        m = _GRES_ITEM.match(item.strip().removeprefix("gres/").replace("gres:", "", 1))
        if not m:
            continue
        a, b = m.groups()
        if a is not None and b is None and a.isdigit():
            a, b = None, a
        seen = True
        total += int(b) if b is not None else 1
        if a:
            types.add(a)
    return (total, ",".join(sorted(types)) or None) if seen else None


def asked_for_gpus(submit_line: str | None) -> bool:
    """Whether a SubmitLine requests GPUs (see the module docstring)."""
    return bool(submit_line) and _GPU_REQUEST.search(submit_line) is not None


def resolve(tres: dict[str, tuple[int, str | None] | None], gres: dict[str, str | None], *,
            js1_gpus: int | None = None, submit_line: str | None = None) -> GpuCount:
    """Pick the GPU count. ``tres``: ``{"AllocTRES": (gpus, type) | None, "ReqTRES": ...}``
    for the TRES fields the input had (``(0, None)`` when the field had no GPU entry,
    absent key when the input lacked the field; :func:`gpuguard.reports.sacct.parse_tres`
    gives the pair); ``gres``: raw ``AllocGRES``/``ReqGRES`` strings the input had."""
    for name in ("AllocTRES", "ReqTRES"):
        v = tres.get(name)
        if v is not None and v[0] > 0:
            return GpuCount(v[0], v[1], name)
    for name in ("AllocGRES", "ReqGRES"):
        v = parse_gres(gres.get(name))
        if v is not None:
            return GpuCount(v[0], v[1], name)
    if js1_gpus is not None:
        return GpuCount(js1_gpus, None, "JS1")
    had = [n for n in ("AllocTRES", "ReqTRES") if n in tres] + [n for n in ("AllocGRES", "ReqGRES") if n in gres]
    if not had:
        return GpuCount(None, None, "unknown: no AllocTRES/ReqTRES/GRES field")
    if asked_for_gpus(submit_line):
        return GpuCount(None, None, f"unknown: SubmitLine asks for GPUs, {had[0]} has no gres/gpu")
    return GpuCount(0, None, f"none: {had[0]}")
