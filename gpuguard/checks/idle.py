"""Node idle baseline: each idle GPU against its own idle history on this node ("this GPU
idles 12 °C hotter than it used to"), the early sign of a failing fan, dried thermal paste
or a GPU stuck in a high power state.

The Prolog (and ``gpuguard check``) runs the registered check ``idle_baseline``; the
Epilog does not (its GPUs have just finished a job, they are not idle). Readings are kept
in the ``node_idle`` table (node, GPU UUID, temperature, power, SM clock); a flagged
reading does not enter later baselines. Like every check it writes nothing itself: the
readings go into ``ctx.records`` and :func:`gpuguard.health.run_health` stores them with
the run.
"""

from __future__ import annotations

import time
from typing import Any

from gpuguard import robust
from gpuguard.checks import CheckContext, check, looks_idle
from gpuguard.config import from_dict
from gpuguard.model import Finding, NodeSnapshot, declare_codes


#: The idle baseline family's finding codes: code -> (severity, default action, source).
CODES = declare_codes("baseline", {
    "baseline.idle_temp_up": ("warning", "alert",
        "GPU idles >=10 C above its own idle median (robust z >= 3.5): cooling fault before it throttles in jobs"),
    "baseline.idle_power_up": ("warning", "alert",
        "idle power >=30 % above the GPU's own median: clocks not dropping at idle or a board fault"),
})

#: Hooks whose snapshot shows idle GPUs (taken before the job).
IDLE_HOOKS = ("prolog", "check")


def _settings(values: dict[str, dict[str, Any]]) -> dict[str, float]:
    b, v = values["baseline"], values["verdict"]
    if b["idle_min_readings"] < 1 or b["idle_readings"] < b["idle_min_readings"]:
        raise ValueError("baseline.idle_readings must be >= idle_min_readings >= 1")
    return {"readings": int(b["idle_readings"]), "min_readings": int(b["idle_min_readings"]),
            "temp_rise_c": float(b["idle_temp_rise_c"]), "power_rise_frac": float(b["idle_power_rise_frac"]),
            "z": float(v["z_threshold"]), "floor": float(v["mad_floor_frac"]),
            "idle_pct": float(values["checks"]["idle_util_pct"])}


def idle_findings(store: Any, node: str, snapshot: NodeSnapshot, values: dict[str, dict[str, Any]], *,
                  job_id: str | None = None, now: float | None = None) -> tuple[list[Finding], list[dict[str, Any]]]:
    """Compare each idle GPU of ``snapshot`` with its idle history on ``node``; return
    ``(findings, node_idle rows to store)``. ``values``: the config's sections
    (``Config.values``).

    A GPU counts as idle when its utilisation is known and below ``[checks]
    idle_util_pct`` (:func:`gpuguard.checks.looks_idle`); a GPU of unknown utilisation is
    neither judged nor recorded (its readings may be a job's). Findings (code, when):

    * ``baseline.idle_temp_up`` (warning): temperature at least ``[baseline]
      idle_temp_rise_c`` above the median of the GPU's last ``idle_readings`` unflagged
      readings and a robust z of at least ``[verdict] z_threshold``;
    * ``baseline.idle_power_up`` (warning): power at least ``idle_power_rise_frac``
      above its median, same z test.

    Needs ``idle_min_readings`` earlier readings of the GPU (by UUID) first. Raises
    :class:`gpuguard.store.StoreError`; ValueError for inconsistent settings.
    """
    s = _settings(values)
    now = time.time() if now is None else now
    findings: list[Finding] = []
    rows = []
    for g in snapshot.gpus:
        if not g.uuid or not looks_idle(g, s["idle_pct"]):
            continue
        hist = store.query(
            "select temp_c, power_w, sm_clock_mhz from node_idle where node = ? and uuid = ? and flagged = 0 "
            "order by at desc limit ?", [node, g.uuid, s["readings"]])
        found = _judge_gpu(g, hist, node, s) if len(hist) >= s["min_readings"] else []
        findings += found
        rows.append({"node": node, "uuid": g.uuid, "gpu_index": g.index, "at": now, "job_id": job_id,
                     "temp_c": g.temp_c, "power_w": g.power_w, "sm_clock_mhz": g.sm_clock_mhz,
                     "flagged": int(bool(found))})
    return findings, rows


def _judge_gpu(g: Any, hist: list[dict[str, Any]], node: str, s: dict[str, float]) -> list[Finding]:
    out = []
    for field_name, code, min_up in (("temp_c", "baseline.idle_temp_up", None),
                                     ("power_w", "baseline.idle_power_up", s["power_rise_frac"])):
        x = getattr(g, field_name)
        past = robust.clean(h[field_name] for h in hist)
        if x is None or len(past) < s["min_readings"]:
            continue
        med = robust.median(past)
        m = robust.mad(past, med)
        z, _ = robust.robust_z(x, med, m, s["floor"])  # type: ignore[arg-type]
        rise = x - med  # type: ignore[operator]
        enough = rise >= s["temp_rise_c"] if min_up is None else robust.rel_change(x, med) >= min_up
        if z >= s["z"] and enough:
            unit = "°C" if field_name == "temp_c" else "W"
            out.append(Finding(
                code, "warning",
                f"GPU {g.index} idles at {x:g} {unit}, {rise:+.1f} {unit} above its own median of "
                f"{med:g} {unit} over {len(past)} earlier idle readings",
                gpu_index=g.index, gpu_uuid=g.uuid,
                evidence={"node": node, "value": x, "median": med, "mad": m, "z": round(z, 2),
                          "readings": len(past), "field": field_name}))
    return out


def judge_idle(store: Any, node: str, snapshot: NodeSnapshot, *, cfg: Any = None, job_id: str | None = None,
               record: bool = True, now: float | None = None) -> list[Finding]:
    """:func:`idle_findings`, storing the readings in ``node_idle`` when ``record``
    (for callers outside a health run). Raises :class:`gpuguard.store.StoreError`."""
    values = (cfg if cfg is not None else from_dict({})).values
    findings, rows = idle_findings(store, node, snapshot, values, job_id=job_id, now=now)
    if record and rows:
        store.insert_many("node_idle", rows)
    return findings


def idle_history(store: Any, node: str | None = None) -> list[dict[str, Any]]:
    """Per node and GPU: readings, median idle temperature/power/SM clock (unflagged)."""
    where, params = ("where node = ?", [node]) if node else ("", [])
    rows = store.query(f"select * from node_idle {where} order by node, uuid, at", params)
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["node"], r["uuid"]), []).append(r)
    out = []
    for (n, u), rs in groups.items():
        ok = [r for r in rs if not r["flagged"]]
        out.append({"node": n, "uuid": u, "gpu_index": rs[-1]["gpu_index"], "readings": len(rs),
                    "temp_c": robust.median(r["temp_c"] for r in ok),
                    "power_w": robust.median(r["power_w"] for r in ok),
                    "sm_clock_mhz": robust.median(r["sm_clock_mhz"] for r in ok),
                    "last_at": rs[-1]["at"]})
    return out


@check("idle_baseline")
def idle_baseline(ctx: CheckContext) -> list[Finding]:
    """Idle GPU hotter or more power-hungry than its own idle history (prolog, check)."""
    if ctx.hook not in IDLE_HOOKS or ctx.store is None or ctx.config is None or not ctx.snapshot.gpus:
        return []
    findings, rows = idle_findings(ctx.store, ctx.node or "", ctx.snapshot, ctx.config.values, job_id=ctx.job_id)
    ctx.records.setdefault("node_idle", []).extend(rows)
    return findings
