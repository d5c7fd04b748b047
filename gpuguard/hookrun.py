"""What every Slurm hook of gpuguard shares: a hard time budget and a clean exit.

A hook's work runs in a daemon thread; the main thread waits at most the budget and the
process leaves through ``os._exit``, because a hung NVML or filesystem call cannot be
interrupted and must not keep the job (Prolog) or the node (Epilog) waiting. A crash or an
overrun is gpuguard's own fault: it is logged as a tool error and the hook returns
``fallback_rc`` (0), never a failure that would drain the node.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any


def is_job_id(value: str | None) -> bool:
    """A Slurm job id as the hooks get it: 1 to 20 ASCII digits (``str.isdigit`` alone
    accepts other scripts' digits). Every hook and path builder checks ids with this."""
    return bool(value) and value.isascii() and value.isdigit() and len(value) <= 20


def load_config() -> tuple[Any, str | None]:
    """``(config, None)``, or ``(the shipped defaults, the one-line error)`` when the
    config is broken, a dangling symlink or not found anywhere (hooks never run on silent
    defaults: :func:`gpuguard.config.load` with ``require``). A hook loads it once and hands it to its work."""
    from gpuguard import config as config_mod

    # a hook without SLURM_CONF (EpilogSlurmctld) runs scontrol/sacctmgr against the
    # slurm.conf its daemon was started with
    config_mod.export_slurm_conf()
    try:
        return config_mod.load(require=True), None
    except config_mod.ConfigError as e:
        return config_mod.from_dict({}), str(e)


def run_with_budget(work: Callable[[], int], budget: float, hook: str, fallback_rc: int = 0) -> int:
    """Run ``work()`` in a daemon thread; return its exit status, or ``fallback_rc`` when
    it raises or is still running after ``budget`` seconds (both logged)."""
    result: list[int] = []

    def target() -> None:
        try:
            result.append(work())
        except BaseException as e:  # a bug in gpuguard: log it, never fail the hook
            try:
                from gpuguard.log import LOG

                LOG.exception("tool error: %s crashed: %s", hook, e)
            finally:
                result.append(fallback_rc)

    t = threading.Thread(target=target, name=f"gpuguard-{hook}", daemon=True)
    t.start()
    t.join(budget)
    if not result:
        from gpuguard.log import LOG

        LOG.error("tool error: %s exceeded its time budget of %.1f s; exiting %d", hook, budget, fallback_rc)
        return fallback_rc
    return result[0]


def exit_hook(rc: int) -> None:
    """Flush and leave with ``os._exit(rc)`` (daemon threads stuck in C calls stay behind)."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(rc)
