"""Hardware families declare their finding codes once (severity, default action, source);
the policy table reads the declarations; clock-event reason groups and the findings /
events rows are defined once."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

import gpuguard.checks as checks_pkg
from gpuguard import policy
from gpuguard.model import (
    CLOCK_EVENT_REASONS,
    FINDING_CODES,
    HARD_SLOWDOWN_REASONS,
    HW_SLOWDOWN_REASONS,
    SLOWDOWN_REASONS,
    Finding,
    declare_codes,
    reasons_mask,
)
from gpuguard.rows import event_row, finding_row

CHECKS_DIR = pathlib.Path(checks_pkg.__file__).parent
FINDING_RE = re.compile(r'Finding\(\s*"([a-z_.]+)",\s*"(info|warning|critical)"')


def test_every_family_declares_what_its_checks_emit():
    """Each ``Finding("code", "severity"`` written in a check module is declared by that
    module's family with the same severity."""
    checks_pkg.load_all()
    seen = 0
    for path in sorted(CHECKS_DIR.glob("*.py")):
        for code, severity in FINDING_RE.findall(path.read_text()):
            declared = FINDING_CODES.get(code)
            assert declared is not None, f"{path.name}: {code} not declared"
            assert declared.severity == severity, code
            assert path.stem in ("count", "ecc", "pcie", "nvlink", "thermal", "inventory", "idle")
            seen += 1
    assert seen >= 23


def test_policy_table_is_the_declarations():
    table = policy.default_actions()
    assert table["nvlink.link_down"] == ("drain", "DCGM health watch NVLINK: a down link fails the GPU")
    assert table["verdict.memory_leak"][0] == "record"
    assert {c.family for c in FINDING_CODES.values()} >= {"gpu", "ecc", "thermal", "pcie", "nvlink", "inventory",
                                                          "baseline", "verdict"}
    assert policy.action_for(Finding("throttle.hw_slowdown_idle", "critical", "m")) == "drain"


def test_declaring_a_code_twice_differently_is_an_error():
    with pytest.raises(ValueError, match="finding code gpu.lost declared twice"):
        declare_codes("other", {"gpu.lost": ("warning", "alert", "x")})
    with pytest.raises(ValueError, match="bad severity 'fatal'"):
        declare_codes("other", {"other.x": ("fatal", "alert", "x")})


def test_clock_event_groups():
    assert set(HW_SLOWDOWN_REASONS) < set(HARD_SLOWDOWN_REASONS) < set(SLOWDOWN_REASONS) <= set(CLOCK_EVENT_REASONS)
    assert "sw_power_cap" in SLOWDOWN_REASONS and "sw_power_cap" not in HARD_SLOWDOWN_REASONS
    assert reasons_mask(SLOWDOWN_REASONS) == 0x4 | 0x8 | 0x20 | 0x40 | 0x80


def test_rows():
    f = Finding("ecc.uncorrectable_volatile", "critical", "gpu1 2 errors", gpu_index=1, gpu_uuid="GPU-1",
                evidence={"b": 2, "a": 1})
    assert finding_row(f, "drain", node="n1", at=5.0, job_id="7", run_id=3) == {
        "run_id": 3, "node": "n1", "at": 5.0, "job_id": "7", "code": "ecc.uncorrectable_volatile",
        "severity": "critical", "action": "drain", "gpu_index": 1, "gpu_uuid": "GPU-1", "message": "gpu1 2 errors",
        "evidence": json.dumps({"a": 1, "b": 2})}

    class G:
        index, uuid, pci_bus_id = 2, "GPU-2", "0000:3a:00.0"

    r = event_row(node="n1", at=1.0, kind="xid", source="kernel_log", message="m", code=79, gpu=G(),
                  raw="x" * 3000)
    assert (r["gpu_index"], r["gpu_uuid"], r["pci_bus_id"], len(r["raw"])) == (2, "GPU-2", "0000:3a:00.0", 2000)
    r = event_row(node="n1", at=1.0, kind="collector_died", source="epilog", message="m", pid=9)
    assert (r["gpu_index"], r["pid"], r["raw"], r["code"]) == (None, 9, None, None)


def test_verdict_codes_agree_with_the_cause_table():
    """The verdict's finding codes are declared in gpuguard.epilog.finding_codes (action,
    source) and its cause table carries their severity: the two must not drift."""
    from gpuguard.epilog.decide import CAUSE_TABLE

    for c in CAUSE_TABLE:
        declared = FINDING_CODES[f"verdict.{c.name.replace('-', '_')}"]
        assert (declared.family, declared.severity) == ("verdict", c.severity), c.name
