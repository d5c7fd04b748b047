"""A job's *template*: the name under which runs of the same kind share a baseline.

Named by the user: ``sbatch --comment="gpuguard:template=NAME"`` — our key anywhere in
the comment, other text allowed (``"nightly gpuguard:template=llama-7b ckpt=3"``). The
Prolog and Epilog see the comment as ``SLURM_JOB_COMMENT`` (unset when the job has
none: SLURM-FACTS.md §4); ``sacct -o Comment`` has it afterwards.

Otherwise derived from what makes runs comparable: partition, GPU type, GPUs per node,
node count and job name, e.g. ``gpu.h100-80gb-hbm3.x8.n2.train-llama``. The Epilog does
not see ``SLURM_JOB_NAME`` (SLURM-FACTS.md §4), so the name comes from Slurm
(:meth:`gpuguard.slurm.SlurmCli.show_job`: ``squeue``, read so that no user text forges
another field).

Names are sanitised to ``[A-Za-z0-9._-]{1,64}``: every other character becomes ``-``,
and a name longer than 64 characters keeps its first 55 characters, a ``-`` and an
8-hex-digit hash of the whole name, so that two long names stay distinct.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuguard.hookenv import read_hook_env

NAME_MAX = 64
_KEY_RE = re.compile(r"(?:^|[\s,;])gpuguard:template=(\S+)")
_BAD = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class Template:
    """A template name and where it came from: ``source`` is ``comment`` or ``derived``."""

    name: str
    source: str


def sanitize(name: str) -> str | None:
    """Map ``name`` into ``[A-Za-z0-9._-]{1,64}``; ``None`` when nothing usable is left
    (empty, or only separators)."""
    s = _BAD.sub("-", name.strip()).strip("-.")
    if not s:
        return None
    if len(s) > NAME_MAX:
        digest = hashlib.sha256(s.encode()).hexdigest()[:8]
        s = s[: NAME_MAX - 9].rstrip("-.") + "-" + digest
    return s


def from_comment(comment: str | None) -> str | None:
    """The sanitised ``gpuguard:template=NAME`` value in a job comment, or ``None``.

    Only our key is read; the first occurrence wins. A value ends at whitespace, ``,``,
    ``;`` or ``|`` (``"gpuguard:template=a,b"`` -> ``a``); surrounding quotes are dropped.
    The one parser for the key: the reports read sacct's Comment with it too.
    """
    if not comment:
        return None
    m = _KEY_RE.search(comment)
    if not m:
        return None
    value = re.split(r"[,;|]", m.group(1), maxsplit=1)[0].strip("'\"")
    return sanitize(value)


@functools.lru_cache(maxsize=8192)  # as reports.sacct_fields.VALUE_CACHE
def _named(comment: str | None) -> str | None:
    return from_comment(comment)


def template_of(comment: str | None, admin_comment: str | None = None) -> str | None:
    """A finished job's template as its verdict has it, from sacct's ``Comment`` and
    ``AdminComment``: the one the comment names (:func:`from_comment`), else the one the
    job judge derived and wrote into the AdminComment
    (:func:`gpuguard.epilog.admincomment.template_in`), else None (never judged). The
    reports read it so: the comment alone left every derived-template job without a
    template in the reports while its verdict, ``job show`` and baseline had one."""
    from gpuguard.epilog.admincomment import template_in

    return _named(comment) or template_in(admin_comment)


def gpu_type_of(name: str | None) -> str | None:
    """Short GPU type from an NVML product name: ``"NVIDIA H100 80GB HBM3"`` ->
    ``"h100-80gb-hbm3"``, ``"Tesla V100-SXM2-32GB"`` -> ``"v100-sxm2-32gb"``."""
    if not name:
        return None
    s = re.sub(r"^(nvidia|tesla|geforce|quadro)\s+", "", name.strip(), flags=re.I)
    s = re.sub(r"^(nvidia|tesla)\s+", "", s, flags=re.I)
    return sanitize(s.lower().replace(" ", "-"))


def _gpus_from_tres(tres: str | None) -> tuple[str | None, int | None]:
    """``TresPerNode`` (``squeue -o %b``, as ``scontrol show job`` names it): ``gres:gpu:h100:4`` / ``gres/gpu:4`` /
    ``gres/gpu=4`` -> (type or None, count or None)."""
    if not tres:
        return None, None
    for part in tres.split(","):
        m = re.search(r"gres[:/]gpu(?::([A-Za-z0-9_.-]+))?[:=](\d+)$", part.strip())
        if m:
            return m.group(1), int(m.group(2))
    return None, None


def inventory_gpu_name(store: Any, node: str) -> str | None:
    """``node``'s NVML GPU product name from its store's inventory (its lowest-indexed GPU
    with a name), or None: a derived template's GPU type when Slurm's gres names none
    (the ``gpu_name`` of :func:`job_template`). Never raises: the name only refines a
    derived template."""
    try:
        rows = store.query("select name from inventory where node = ? and name is not null "
                           "order by gpu_index limit 1", [node])
    except Exception:
        return None
    return rows[0]["name"] if rows else None


def gpus_allocated(job_gpus_raw: str | None) -> int | None:
    """GPUs Slurm allocated the job on this node: the entries of ``SLURM_JOB_GPUS``
    (indices or UUIDs, as given; SLURM-FACTS.md §4), ``None`` when it is unset or empty.

    The one count of a derived template's ``xGPUS``, node side and controller side: the
    node's Epilog puts it in its part (``job.gpus``) and :func:`gpuguard.epilog.judge`
    derives from it. The allocation is what makes runs comparable; the GPUs the collector
    sampled are not (0 on a MIG node, whose GPUs are never sampled, and fewer when a GPU
    fell off the bus), so counting those gave the same job two templates."""
    n = len([x for x in (job_gpus_raw or "").split(",") if x.strip()])
    return n or None


def derive(partition: str | None, gpu_type: str | None, gpus_per_node: int | None,
           nodes: int | None, job_name: str | None) -> str:
    """``PARTITION.GPUTYPE.xGPUS.nNODES.JOBNAME`` with ``_`` for an unknown part,
    sanitised. Always returns a valid name."""
    parts = [
        partition or "_",
        gpu_type or "_",
        f"x{gpus_per_node}" if gpus_per_node is not None else "x_",
        f"n{nodes}" if nodes is not None else "n_",
        job_name or "_",
    ]
    return sanitize(".".join(_BAD.sub("-", p) for p in parts)) or "unnamed"


def job_template(env: Mapping[str, str], *, job_info: Mapping[str, str] | None = None,
                 slurm: Any = None, gpu_name: str | None = None) -> Template:
    """The template of the job described by the hook environment ``env``.

    ``job_info``: the job's Slurm fields (the names :meth:`~gpuguard.slurm.SlurmCli.show_job`
    returns) if the caller already has them; else,
    when a name must be derived, ``slurm.show_job(SLURM_JOB_ID)`` is called (``slurm`` a
    :class:`gpuguard.slurm.SlurmCli`); its :class:`~gpuguard.slurm.SlurmError` is caught
    and the derived name then has ``_`` for the job name. ``gpu_name``: this node's NVML
    product name (from the inventory) when Slurm's gres has no type.

    Never raises: a template is always returned.
    """
    henv = read_hook_env(env)
    named = from_comment(henv.job_comment)
    if named:
        return Template(named, "comment")
    info: Mapping[str, str] = job_info or {}
    if not info and slurm is not None and henv.job_id:
        try:
            info = slurm.show_job(henv.job_id)
        except Exception:  # Slurm unreachable: derive from what the environment has
            info = {}
    named = from_comment(info.get("Comment"))
    if named:
        return Template(named, "comment")
    partition = henv.job_partition or info.get("Partition")
    gres_type, gres_count = _gpus_from_tres(info.get("TresPerNode"))
    gpus = gpus_allocated(henv.job_gpus_raw) or gres_count
    nodes_s = henv.job_num_nodes or info.get("NumNodes")
    try:
        nodes = int(str(nodes_s).split("-")[0]) if nodes_s else None
    except ValueError:
        nodes = None
    gtype = sanitize(gres_type.lower()) if gres_type else gpu_type_of(gpu_name)
    return Template(derive(partition, gtype, gpus, nodes, info.get("JobName") or henv.job_name),
                    "derived")
