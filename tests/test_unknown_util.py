"""Unknown utilisation, memory use or power is unknown: never read as 0 % (idle). A GPU
whose utilisation is unknown (an nvidia-smi CSV without the column, ``[N/A]``, a failed
NVML read, MIG mode) is neither idle nor busy; each decision that needs the value is
skipped or reported as not judged, with the reason. Exact findings and decisions."""

from __future__ import annotations

import csv
import dataclasses
import io
import time

import numpy as np
import pytest
from conftest import node_snapshot

from gpuguard import config as config_mod
from gpuguard.checks import CheckContext, looks_idle, run_checks, util_unknown
from gpuguard.checks.idle import idle_findings
from gpuguard.gpu.nvsmi_csv import parse_query_csv
from gpuguard.policy import decide
from gpuguard.store import open_store

CSV = "tests/data/nvsmi-query-gpu-csv-rtx2080s-471.11-full.csv"  # RTX 2080 SUPER, driver 471.11
#: the corpus row with HW Slowdown active as well as Idle (mask 0x1 | 0x8)
HW_SLOWDOWN = {"clocks_throttle_reasons.active": "0x0000000000000009", "clocks_throttle_reasons.hw_slowdown": "Active"}


def csv_variant(util: str | None, **cols: str) -> str:
    """The corpus CSV with ``utilization.gpu [%]`` set to ``util`` (None: the column
    dropped) and other columns (by header name) replaced."""
    rows = list(csv.reader(io.StringIO(open(CSV).read()), skipinitialspace=True))
    head, row = rows[0], rows[1]
    vals = dict(zip(head, row, strict=True))
    vals.update(cols)
    if util is None:
        del vals["utilization.gpu [%]"]
    else:
        vals["utilization.gpu [%]"] = util
    return ", ".join(vals) + "\n" + ", ".join(vals.values()) + "\n"


def throttle_findings(snap):
    findings, errors = run_checks(CheckContext(snapshot=snap, job_gpu_indices=None, hook="prolog",
                                               gpu_nodes_expected=True))
    assert errors == []
    return findings, [(f.code, f.severity, f.message) for f in findings if f.code.startswith("throttle.")]


@pytest.mark.parametrize("util", [None, "[N/A]"])
def test_hw_slowdown_on_a_gpu_of_unknown_utilisation_is_not_judged_idle(util):
    snap = parse_query_csv(csv_variant(util, **HW_SLOWDOWN), CSV, 0.0)
    (g,) = snap.gpus
    assert (g.gpu_util_pct, g.mig_mode, g.clock_event_reasons) == (None, None, ["gpu_idle", "hw_slowdown"])
    findings, got = throttle_findings(snap)
    assert got == [("throttle.idle_not_judged", "info",
                    "gpu0 (0000:0c:00.0) hw_slowdown active, utilisation unknown: idle throttle not judged")]
    assert decide(findings).outcome == "proceed"


def test_the_same_gpu_at_a_known_0_percent_is_still_judged():
    snap = parse_query_csv(csv_variant("0", **HW_SLOWDOWN), CSV, 0.0)
    findings, got = throttle_findings(snap)
    assert got == [("throttle.hw_slowdown_idle", "critical", "gpu0 (0000:0c:00.0) hw_slowdown active while idle")]
    assert decide(findings).outcome == "drain"


def test_near_slowdown_temperature_is_not_judged_without_utilisation():
    hot = {"temp_c": 86.0, "clock_event_reasons": []}
    findings, _ = throttle_findings(node_snapshot(1, gpu0=dict(hot, gpu_util_pct=None)))
    assert [f.code for f in findings if f.code.startswith("thermal.")] == []
    findings, _ = throttle_findings(node_snapshot(1, gpu0=dict(hot, gpu_util_pct=0.0)))
    assert [f.code for f in findings if f.code.startswith("thermal.")] == ["thermal.near_slowdown"]


def test_looks_idle_and_the_reason():
    plain, mig = node_snapshot(2, gpu0={"gpu_util_pct": None}, gpu1={"gpu_util_pct": None, "mig_mode": True}).gpus
    assert (looks_idle(plain, 5.0), looks_idle(mig, 5.0)) == (False, False)
    assert (util_unknown(plain), util_unknown(mig)) == ("utilisation unknown",
                                                        "utilisation unknown (MIG mode: NVML reports none)")
    known = node_snapshot(1, gpu0={"gpu_util_pct": 4.9}).gpus[0]
    assert (looks_idle(known, 5.0), util_unknown(known)) == (True, None)


def test_an_unknown_utilisation_adds_no_idle_baseline_reading(tmp_path):
    store = open_store(str(tmp_path / "node.db"))
    try:
        values = config_mod.from_dict({}).values
        snap = node_snapshot(2, gpu1={"gpu_util_pct": None, "power_w": 350.0})
        findings, rows = idle_findings(store, "n1", snap, values, now=1767225600.0)
        assert (findings, [(r["gpu_index"], r["power_w"]) for r in rows]) == ([], [(0, 70.0)])
    finally:
        store.close()


@pytest.mark.parametrize(("over", "why"), [
    ({"gpu_util_pct": None}, "GPU 1: utilisation unknown"),
    ({"mem_used_mib": None}, "GPU 1: memory use unknown"),
    ({"mem_total_mib": None}, "GPU 1: memory use unknown"),
    ({"gpu_util_pct": None, "mem_used_mib": None}, "GPU 1: utilisation and memory use unknown"),
])
def test_the_nccl_probe_does_not_take_a_gpu_not_known_to_be_idle(over, why):
    from gpuguard.net import health_step
    from gpuguard.ops.steps import Skip, StepContext

    cfg = config_mod.from_dict({"nccl": {"command": ["/bin/false"]}})
    snap = node_snapshot(2, gpu1=over)
    assert health_step.gpus_busy(snap, cfg) == []
    with pytest.raises(Skip) as e:
        health_step.nccl_probe(StepContext(cfg, None, cfg.node_name, snap, time.monotonic() + 40.0))
    assert str(e.value) == f"not judged idle ({why})"
    assert health_step.gpus_unknown(snap) == [(1, why.split(": ")[1].removesuffix(" unknown"))]


def test_a_sample_of_unknown_utilisation_is_not_a_busy_clock_reading():
    import gpuguard.epilog.baseline  # noqa: F401  (peers is imported through it; alone it is a cycle)
    from gpuguard.epilog.peers import _busy_clock

    class G:
        def __init__(self):
            self.cols = {"util": np.array([np.nan, np.nan, 90.0, 95.0]),
                         "clock": np.array([300.0, 300.0, 1900.0, 1980.0])}

        def span(self, a, b):
            return 0, 4

        def array(self, name):
            return self.cols[name]

    assert _busy_clock(G())(0.0, 4.0) == 1940.0
    g = G()
    g.cols = {"util": np.array([np.nan] * 4), "clock": np.array([300.0] * 4)}
    assert _busy_clock(g)(0.0, 4.0) is None


def test_mig_dump_unknown_utilisation_is_recorded_not_judged():
    from gpuguard.gpu.nvsmi import load_nvidia_smi

    snap = load_nvidia_smi("tests/data/nvsmi-qx-a100-mig-510.47.03.xml")
    snap = dataclasses.replace(snap, gpus=[dataclasses.replace(g, clock_event_reasons=["hw_slowdown"])
                                           for g in snap.gpus])
    findings, got = throttle_findings(snap)
    assert [(c, s) for c, s, _ in got] == [("throttle.idle_not_judged", "info")]
    assert got[0][2].endswith("hw_slowdown active, utilisation unknown (MIG mode: NVML reports none): "
                              "idle throttle not judged")
    assert decide(findings).outcome == "proceed"
