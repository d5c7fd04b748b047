"""A node's NCCL baseline and the fleet's, and how a reading is judged against them.

Per node, probe configuration (:func:`config_key`) and message size: the median and MAD
of busbw over the node's last ``[nccl] baseline_probes`` healthy probes. Per GPU model:
the fleet median, the median over nodes of each node's own median, from whatever store
holds probes of several nodes (the cluster store; in single-host mode the node store).

A reading is *low* against a reference when the median over judged sizes of
``busbw / reference`` is at or below ``1 - low_frac`` and, for the node's own baseline,
the robust z of those sizes is at or below -3.5 (Iglewicz & Hoaglin's modified z-score
cut-off, as ``[verdict] z_threshold``), so a node with a noisy history is not flagged
for its usual spread. The MAD is floored at 1 % of the median (our choice: busbw of
one node repeats to about 1 % on an idle machine).
"""

from __future__ import annotations

import hashlib
import statistics
from dataclasses import dataclass, field
from typing import Any

from gpuguard.net.nccl_parse import NcclLog

Z_CUTOFF = 3.5
MAD_FLOOR_FRAC = 0.01
#: Fleet medians are taken over the last 30 days of probes (our choice: long enough for
#: nodes probed every few hours, short enough to follow driver/NCCL upgrades).
FLEET_WINDOW_S = 30 * 86400


def config_key(argv: list[str]) -> str:
    """Stable id of a probe command: a baseline is only comparable under the same sizes,
    GPU count and binary."""
    return hashlib.sha256("\0".join(argv).encode()).hexdigest()[:16]


def judged_sizes(log: NcclLog, min_bytes: int) -> dict[int, float]:
    """``size_b -> busbw_gbs`` for rows at least ``min_bytes`` large (size-0 rows and
    latency-bound small messages say nothing about bandwidth). When a size repeats (two
    tables), the last reading wins. Rounded to 0.1 MB/s: nccl-tests prints 0.01 GB/s, the
    mean of two placements needs one more digit, the rest is float noise."""
    return {r.size_b: round(r.busbw_gbs, 4) for r in log.rows if r.size_b >= max(1, min_bytes)}


@dataclass
class Reference:
    """busbw reference per size: ``size_b -> (median_gbs, mad_gbs, n)``."""

    kind: str  # "node" or "fleet"
    by_size: dict[int, tuple[float, float, int]] = field(default_factory=dict)


@dataclass
class Judgement:
    """``low``: the reading is low against at least one reference; ``against``: which
    (``node``/``fleet``); ``ratio``: median busbw/reference over judged sizes, by kind."""

    low: bool
    against: list[str]
    ratio: dict[str, float]
    sizes: dict[str, dict[str, float]]


def _mad(xs: list[float]) -> float:
    m = statistics.median(xs)
    return statistics.median([abs(x - m) for x in xs])


def node_reference(store: Any, node: str, key: str, n: int) -> Reference:
    """The node's baseline from its last ``n`` probes in state ``ok``."""
    ids = [r["id"] for r in store.query(
        "select id from nccl_probes where node = ? and config_key = ? and state = 'ok' order by at desc limit ?",
        [node, key, n])]
    ref = Reference("node")
    if not ids:
        return ref
    marks = ",".join("?" * len(ids))
    by: dict[int, list[float]] = {}
    for r in store.query(f"select size_b, busbw_gbs from nccl_busbw where probe_id in ({marks})", ids):
        by.setdefault(r["size_b"], []).append(r["busbw_gbs"])
    ref.by_size = {s: (statistics.median(v), _mad(v), len(v)) for s, v in by.items()}
    return ref


def fleet_reference(store: Any, gpu_model: str | None, key: str, exclude_node: str, now: float,
                    min_nodes: int) -> Reference:
    """Median over other nodes (same GPU model and probe) of each node's median busbw per
    size, from healthy probes of the last :data:`FLEET_WINDOW_S`; sizes with fewer than
    ``min_nodes`` nodes are left out."""
    ref = Reference("fleet")
    if not gpu_model:
        return ref
    rows = store.query(
        "select p.node, b.size_b, b.busbw_gbs from nccl_probes p join nccl_busbw b on b.probe_id = p.id "
        "where p.gpu_model = ? and p.config_key = ? and p.state = 'ok' and p.node != ? and p.at >= ?",
        [gpu_model, key, exclude_node, now - FLEET_WINDOW_S])
    per: dict[int, dict[str, list[float]]] = {}
    for r in rows:
        per.setdefault(r["size_b"], {}).setdefault(r["node"], []).append(r["busbw_gbs"])
    for size, nodes in per.items():
        if len(nodes) >= min_nodes:
            meds = [statistics.median(v) for v in nodes.values()]
            ref.by_size[size] = (statistics.median(meds), _mad(meds), len(meds))
    return ref


def judge(reading: dict[int, float], refs: list[Reference], low_frac: float, fleet_low_frac: float,
          min_probes: int) -> Judgement:
    """Judge ``reading`` (``size_b -> busbw_gbs``) against each usable reference; see the
    module docstring for the rule. A node reference needs ``min_probes`` readings per size."""
    against: list[str] = []
    ratios: dict[str, float] = {}
    sizes: dict[str, dict[str, float]] = {}
    for ref in refs:
        common = [s for s in reading if s in ref.by_size and (ref.kind == "fleet" or ref.by_size[s][2] >= min_probes)]
        common = [s for s in common if ref.by_size[s][0] > 0]
        if not common:
            continue
        rs = [reading[s] / ref.by_size[s][0] for s in common]
        ratio = statistics.median(rs)
        ratios[ref.kind] = round(ratio, 4)
        zs = []
        for s in common:
            med, mad, _n = ref.by_size[s]
            scale = 1.4826 * max(mad, MAD_FLOOR_FRAC * med)
            zs.append((reading[s] - med) / scale)
            sizes.setdefault(str(s), {})[f"{ref.kind}_median_gbs"] = round(med, 3)
            sizes[str(s)]["busbw_gbs"] = round(reading[s], 3)
        frac = low_frac if ref.kind == "node" else fleet_low_frac
        low = ratio <= 1 - frac
        if ref.kind == "node":
            low = low and statistics.median(zs) <= -Z_CUTOFF
        if low:
            against.append(ref.kind)
    return Judgement(bool(against), against, ratios, sizes)


def consecutive_low(store: Any, node: str, key: str, limit: int) -> int:
    """Low probes in a row at the end of the node's history (``low`` counts; ``failed``
    and ``low_unconfirmed`` neither count nor break the run; anything else ends it)."""
    n = 0
    for r in store.query("select state from nccl_probes where node = ? and config_key = ? order by at desc, id desc "
                         "limit ?", [node, key, max(limit * 4, 20)]):
        if r["state"] == "low":
            n += 1
        elif r["state"] in ("failed", "low_unconfirmed"):
            continue
        else:
            break
    return n


def record_probe(store: Any, row: dict[str, Any], reading: dict[int, float], algbw: dict[int, float]) -> int:
    """Insert one probe and its per-size busbw in one transaction; returns the probe id.
    Raises :class:`gpuguard.store.StoreError`."""
    def go() -> int:
        with store.tx():
            pid = store.db["nccl_probes"].insert(row).last_rowid
            store.db["nccl_busbw"].insert_all(
                [{"probe_id": pid, "node": row["node"], "at": row["at"], "size_b": s, "busbw_gbs": b,
                  "algbw_gbs": algbw.get(s)} for s, b in sorted(reading.items())])
            return pid
    return store._guard("insert into nccl_probes", go)
