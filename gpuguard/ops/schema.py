"""Store tables of the operations side: the ``ops`` migration set (requires ``core``),
registered when :mod:`gpuguard.ops` is imported.

* ``node_actions``: every drain and resume gpuguard made, refused or observed, by whom
  (``health``, ``prolog``, ``epilog``, ``hand``), with the reason, the reason exactly as
  Slurm shows it afterwards (``slurm_reason``, with its ``[user@time]`` stamp: how a later
  resume tells our drain from an admin's re-drain), the recovery kind
  (:mod:`gpuguard.recovery`) and the findings as evidence (JSON).
  ``policy_decision`` (step ``node_action_policy``): what the rules decided, when
  maintenance or a dry run held it back (``action`` ``suppressed`` / ``dry-run``).
* ``health_steps``: the last result of each rate-limited health step (``every_s``), so a
  step that is not due re-reports its last findings instead of counting as clean.
* ``alerts``: one row per de-duplication group (code, node, GPU within the window) with
  its occurrence count and the count already notified.
* ``alert_deliveries``: one row per (alert notification, sink) with its attempts, next
  retry time and outcome.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuguard.store import MigrationSet, register_set

if TYPE_CHECKING:  # annotations only: the hooks do not import sqlite-utils (gpuguard.store)
    import sqlite_utils

MIGRATIONS = register_set(MigrationSet("ops", requires=("core",)))


@MIGRATIONS(name="node_actions")
def _node_actions(db: sqlite_utils.Database) -> None:
    db["node_actions"].create(
        {"id": int, "node": str, "at": float, "action": str, "by": str, "user": str, "outcome": str,
         "why": str, "reason": str, "slurm_reason": str, "recovery": str, "evidence": str,
         "run_id": int},
        pk="id",
    )
    db["node_actions"].create_index(["node", "at"])
    db["health_steps"].create(
        {"node": str, "name": str, "at": float, "findings": str, "error": str},
        pk=("node", "name"),
    )


@MIGRATIONS(name="alerts")
def _alerts(db: sqlite_utils.Database) -> None:
    db["alerts"].create(
        {"id": int, "key": str, "node": str, "code": str, "gpu_index": int, "severity": str,
         "first_at": float, "last_at": float, "count": int, "notified_count": int,
         "notified_at": float, "message": str, "evidence": str, "source": str},
        pk="id",
    )
    db["alerts"].create_index(["key", "first_at"])
    db["alert_deliveries"].create(
        {"id": int, "alert_id": int, "sink": str, "created_at": float, "kind": str, "count": int,
         "status": str, "attempts": int, "next_at": float, "sent_at": float, "error": str,
         "payload": str},
        pk="id",
    )
    db["alert_deliveries"].create_index(["status", "next_at"])
    db["alert_deliveries"].create_index(["sink", "sent_at"])


@MIGRATIONS(name="node_action_policy")
def _node_action_policy(db: sqlite_utils.Database) -> None:
    """``node_actions.policy_decision``: what gpuguard's rules decided (``drain``,
    ``fail-job``, ``resume``) beside ``action``, what was done: ``drain`` | ``resume`` |
    ``suppressed`` (maintenance held it back) | ``dry-run`` (``[slurm] drain = false``
    held it back; recorded as ``drain``/``refused`` by ``gpuguard health`` and not at all
    by the hooks before this step). An escalated fail-job reads ``drain`` / ``fail-job``.
    NULL on rows recorded before this step and on drains and resumes by hand."""
    db.conn.execute("alter table node_actions add column policy_decision text")
