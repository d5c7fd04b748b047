"""The one reader of the Slurm hook environment.

Prolog, Epilog, TaskProlog, EpilogSlurmctld and the collector launcher read Slurm's
variables through :func:`read_hook_env`, which range-checks each one: a value that fails
its check counts as unset and is named in :attr:`HookEnv.problems` (the hook logs those
as tool errors). What each hook actually receives is measured in SLURM-FACTS.md §3-4
(e.g. the Epilog gets no ``SLURM_JOB_NAME``; ``SLURM_JOB_EXIT_CODE`` is a raw wait
status).

Checks (sources: slurm.conf(5) "Prolog and Epilog Scripts"; Slurm keeps job ids, uids,
gids and exit codes as uint32):

* ``SLURM_JOB_ID``: 1 to 20 ASCII digits (``str.isdigit`` alone accepts ``'١٢٣'``);
* ``SLURM_JOB_UID`` / ``SLURM_JOB_GID``: ASCII digits, at most ``2**32 - 2``
  (``2**32 - 1`` is ``(uid_t) -1``, "no user");
* ``SLURM_JOB_EXIT_CODE``: ASCII digits, at most ``2**32 - 1``;
* ``SLURM_JOB_USER``, ``SLURMD_NODENAME``: printable, no whitespace, at most 255
  characters (what ``useradd``/hostnames allow, and what fits in one log field);
* ``SLURM_JOB_GPUS``: comma-separated GRES indices (``"0,1"``); non-numeric entries (UUIDs
  on some sites) are dropped; ``CUDA_VISIBLE_DEVICES`` is kept as given (it may carry
  UUIDs or MIG ids).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

#: Largest value of a Slurm uint32 field (exit code).
UINT32_MAX = 2**32 - 1
#: Largest valid uid/gid: ``2**32 - 1`` is ``(uid_t) -1``.
ID_MAX = 2**32 - 2
#: Longest user / node name accepted (our choice: a log field, a path part).
NAME_MAX = 255


def is_job_id(value: str | None) -> bool:
    """A Slurm job id as the hooks get it: 1 to 20 ASCII digits (``str.isdigit`` alone
    accepts other scripts' digits). Every hook and path builder checks ids with this."""
    return bool(value) and value.isascii() and value.isdigit() and len(value) <= 20


def parse_uint(value: str | None, maximum: int = UINT32_MAX) -> int | None:
    """``value`` as an int in ``0..maximum`` when it is 1 to 20 ASCII digits, else None."""
    if not value or not (value.isascii() and value.isdigit()) or len(value) > 20:
        return None
    n = int(value)
    return n if n <= maximum else None


#: Highest GRES GPU index taken from the hook environment (our choice: far above any
#: node's GPU count, which NVML reports in the tens). A larger index cannot name a GPU of
#: this node, so the whole value is rejected as a tool problem instead of being judged as
#: "the job's GPU is not visible", which would drain a healthy node.
MAX_GPU_INDEX = 1023


def parse_job_gpus(value: str | None) -> list[int] | None:
    """``SLURM_JOB_GPUS`` (``"0,1"``, GRES indices; SLURM-FACTS §4) -> ``[0, 1]``;
    unset/empty -> None. Non-numeric entries (UUIDs on some sites) are ignored. Raises
    ValueError when an index is above :data:`MAX_GPU_INDEX`."""
    if not value:
        return None
    digits = [x.strip() for x in value.split(",") if x.strip().isascii() and x.strip().isdigit()]
    # the length test first: int() of a 5,000-digit string raises its own ValueError
    if any(len(x) > len(str(MAX_GPU_INDEX)) or int(x) > MAX_GPU_INDEX for x in digits):
        raise ValueError(f"GPU index above {MAX_GPU_INDEX}")
    return [int(x) for x in digits] or None


def clean_env(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``env`` in which every value that is not valid UTF-8 has its bad bytes
    replaced by U+FFFD. Slurm passes job names, comments and accounts as the user's bytes;
    Python decodes the environment with ``surrogateescape``, and such a string cannot be
    written to SQLite or encoded as UTF-8 at all: a job named in a Latin-1 terminal
    (``caf\\xe9``) would never be judged (the cluster store's write raises). Every hook
    reads its environment through this."""
    out: dict[str, str] = {}
    for k, v in env.items():
        if isinstance(v, str) and not v.isascii():
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                try:
                    v = v.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
                except UnicodeEncodeError:  # a lone surrogate that is no escaped byte
                    v = v.encode("utf-8", "replace").decode("utf-8")
        out[k] = v
    return out


def _name(value: str | None) -> str | None:
    if not value or len(value) > NAME_MAX or not value.isprintable() or any(c.isspace() for c in value):
        return None
    return value


@dataclass(frozen=True)
class HookEnv:
    """Slurm's hook variables after their checks; None = unset or rejected.

    ``job_id`` (str), ``job_uid`` / ``job_gid`` / ``exit_status_raw`` (int),
    ``job_user`` / ``node_name`` / ``job_comment`` / ``job_partition`` /
    ``job_nodelist`` / ``job_name`` (str), ``job_num_nodes`` (int), ``job_gpus`` (GRES indices),
    ``job_gpus_raw`` / ``cuda_visible_devices`` (as given), ``problems`` (one line per
    rejected value, naming the variable and the value)."""

    job_id: str | None = None
    job_uid: int | None = None
    job_gid: int | None = None
    job_user: str | None = None
    node_name: str | None = None
    job_gpus: list[int] | None = None
    job_gpus_raw: str | None = None
    cuda_visible_devices: str | None = None
    exit_status_raw: int | None = None
    job_comment: str | None = None
    job_partition: str | None = None
    job_nodelist: str | None = None
    job_name: str | None = None
    job_num_nodes: int | None = None
    problems: tuple[str, ...] = field(default=())

    @property
    def gpus_spec(self) -> str | None:
        """The job's GPUs as the collector takes them: ``SLURM_JOB_GPUS``, else
        ``CUDA_VISIBLE_DEVICES``, else None."""
        return self.job_gpus_raw or self.cuda_visible_devices or None


def read_hook_env(env: Mapping[str, str] | None = None) -> HookEnv:
    """Read and check the Slurm hook variables of ``env`` (default ``os.environ``)."""
    env = clean_env(os.environ if env is None else env)
    problems: list[str] = []

    def checked(name: str, ok: object, what: str) -> None:
        if env.get(name) not in (None, "") and ok is None:
            problems.append(f"{name} {env[name][:80]!r} is not {what}")  # capped: one log line, not the variable

    job_id = env.get("SLURM_JOB_ID") or None
    if job_id is not None and not is_job_id(job_id):
        problems.append(f"SLURM_JOB_ID {job_id[:80]!r} is not a job id")
        job_id = None
    uid = parse_uint(env.get("SLURM_JOB_UID"), ID_MAX)
    checked("SLURM_JOB_UID", uid, "a uid")
    gid = parse_uint(env.get("SLURM_JOB_GID"), ID_MAX)
    checked("SLURM_JOB_GID", gid, "a gid")
    exit_raw = parse_uint(env.get("SLURM_JOB_EXIT_CODE"), UINT32_MAX)
    checked("SLURM_JOB_EXIT_CODE", exit_raw, "an exit status (0..2**32-1)")
    user = _name(env.get("SLURM_JOB_USER"))
    checked("SLURM_JOB_USER", user, "a user name")
    node = _name(env.get("SLURMD_NODENAME"))
    checked("SLURMD_NODENAME", node, "a node name")
    num_nodes = parse_uint(env.get("SLURM_JOB_NUM_NODES"), UINT32_MAX)
    checked("SLURM_JOB_NUM_NODES", num_nodes, "a node count")
    gpus_raw = env.get("SLURM_JOB_GPUS") or None
    try:
        job_gpus = parse_job_gpus(gpus_raw)
    except ValueError as e:
        problems.append(f"SLURM_JOB_GPUS {gpus_raw[:80]!r} is not a list of GPU indices ({e})")
        job_gpus = gpus_raw = None
    return HookEnv(
        job_id=job_id, job_uid=uid, job_gid=gid, job_user=user, node_name=node,
        job_gpus=job_gpus, job_gpus_raw=gpus_raw,
        cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES") or None, exit_status_raw=exit_raw,
        job_comment=env.get("SLURM_JOB_COMMENT") or None, job_partition=env.get("SLURM_JOB_PARTITION") or None,
        job_nodelist=env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or None,
        job_name=env.get("SLURM_JOB_NAME") or None, job_num_nodes=num_nodes, problems=tuple(problems),
    )
