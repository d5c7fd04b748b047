"""Recovery kinds: every finding code that drains by default has one, with a source."""

from __future__ import annotations

import pytest

from gpuguard.recovery import FINDING_RECOVERY, RECOVERY_KINDS, XID_RECOVERY, recovery_of, recovery_of_findings


def _declared():
    import gpuguard.epilog.finding_codes
    import gpuguard.net.dcgm_triage  # DCGM diag codes
    import gpuguard.net.nccl_check  # noqa: F401  (NCCL probe codes)
    from gpuguard.checks import load_all
    from gpuguard.model import FINDING_CODES

    load_all()
    return FINDING_CODES


def test_every_code_that_drains_by_default_has_a_recovery_kind():
    missing = [c for c, fc in _declared().items() if fc.action == "drain" and c not in FINDING_RECOVERY]
    assert missing == []


def test_every_xid_the_catalog_drains_on_has_a_recovery_kind():
    from gpuguard.xid.catalog import XID_TABLE

    assert [x for x, row in XID_TABLE.items() if row.action == "drain" and x not in XID_RECOVERY] == []


def test_kinds_and_sources():
    for code, (kind, source) in [*FINDING_RECOVERY.items(), *XID_RECOVERY.items()]:
        assert kind in RECOVERY_KINDS and source, code


@pytest.mark.parametrize("code, kind", [
    ("xid.79", "reboot"), ("xid.64", "rma"), ("xid.48", "reset"), ("ecc.row_remap_failure", "rma"),
    ("ecc.row_remap_pending", "reset"), ("throttle.hw_slowdown_idle", "auto"), ("sxid.20034", "manual"),
    ("xid.999", "manual"), ("xid.x", "manual"), ("dcgm.diag_fail", "manual"), ("verdict.straggler_gpu", "manual"), ("nccl.busbw_low", "auto"),
])
def test_recovery_of(code, kind):
    assert recovery_of(code)[0] == kind


def test_a_drain_takes_its_most_demanding_finding():
    assert recovery_of_findings([{"code": "throttle.hw_slowdown_idle", "action": "drain"},
                                 {"code": "xid.64", "action": "drain"},
                                 {"code": "xid.79", "action": "alert"}]) == "rma"
    assert recovery_of_findings([{"code": "throttle.hw_slowdown_idle", "action": "drain"}]) == "auto"
    assert recovery_of_findings([]) == "manual"
