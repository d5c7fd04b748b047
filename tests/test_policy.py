from gpuguard.model import Finding
from gpuguard.policy import DEFAULT_ACTIONS, REASON_MAX, action_for, decide


def F(code, sev="critical", gpu=None, msg="m", **ev):
    return Finding(code, sev, msg, gpu, None, ev)


def test_every_default_has_a_source_and_valid_action():
    for code, (action, source) in DEFAULT_ACTIONS.items():
        assert action in ("record", "alert", "drain", "fail-job"), code
        assert len(source) > 10, code


def test_action_precedence():
    f = F("pcie.width_degraded", "warning")
    assert action_for(f) == "alert"
    assert action_for(f, {"pcie.width_degraded": "drain"}) == "drain"
    x = F("xid.63", "warning", catalog_action="alert")
    assert action_for(x) == "alert"
    assert action_for(x, xid_policy={63: "drain"}) == "drain"
    assert action_for(x, {"xid.63": "record"}, {63: "drain"}) == "record"  # code beats number
    # unknown codes never drain by default
    assert action_for(F("new.thing", "critical")) == "alert"
    assert action_for(F("new.thing", "info")) == "record"


def test_decide_drain_beats_fail_job_and_reason_format():
    fs = [F("config.persistence_off", "warning", 0, "gpu0 persistence mode off"),
          F("gpu.lost", "critical", 3, 'gpu3 (0000:91:00.0) lost or hung: temp_c=GpuIsLost'),
          F("ecc.row_remap_pending", "critical", 1, "gpu1 row remap pending (reset the GPU to apply)")]
    d = decide(fs, {"config.persistence_off": "fail-job"})
    assert d.outcome == "drain"
    assert d.exit_code == 1
    assert d.reason == "gpuguard: gpu.lost gpu3 (0000:91:00.0) lost or hung: temp_c=GpuIsLost (+1 more)"
    assert [a for _, a in d.actions] == ["drain", "drain", "fail-job"]


def test_decide_fail_job_and_proceed():
    d = decide([F("config.persistence_off", "warning", 0, "gpu0 persistence mode off")],
               {"config.persistence_off": "fail-job"})
    assert (d.outcome, d.reason, d.exit_code) == ("fail-job", "gpuguard: config.persistence_off gpu0 persistence mode off", 0)
    d = decide([F("pcie.width_degraded", "warning")])
    assert (d.outcome, d.reason, d.exit_code) == ("proceed", "", 0)


def test_reason_is_one_line_and_capped():
    d = decide([F("gpu.lost", "critical", 0, 'bad "quote"\nnext line ' + "x" * 500)])
    assert "\n" not in d.reason and '"' not in d.reason
    assert len(d.reason) == REASON_MAX
    assert d.reason.startswith("gpuguard: gpu.lost bad 'quote' next line x")
    assert d.reason.endswith("...")


def test_control_characters_never_reach_scontrol():
    d = decide([F("throttle.hw_slowdown_idle", "critical", 2, "gpu2 (0000:75:00.0\x00evil\x1b[2J) hw_slowdown")])
    assert d.reason == "gpuguard: throttle.hw_slowdown_idle gpu2 (0000:75:00.0 evil [2J) hw_slowdown"


def test_after_job_flags_the_alerted_fail_job_on_the_decision():
    from gpuguard.policy import AFTER_JOB_NOTE, after_job

    fs = [F("config.persistence_off", "warning", 0, "gpu0 persistence mode off")]
    d = after_job(decide(fs, {"config.persistence_off": "fail-job"}))
    assert (d.outcome, d.reason, d.policy_outcome, d.decided, d.fail_job_alerted) == (
        "proceed", "gpuguard: config.persistence_off gpu0 persistence mode off" + AFTER_JOB_NOTE, "fail-job",
        "fail-job", True)
    assert [a for _, a in d.actions] == ["alert"]
    # a decision whose reason merely ends with the note is not flagged
    plain = after_job(decide(fs, {"config.persistence_off": "alert"}))
    plain.reason = "gpuguard: x" + AFTER_JOB_NOTE
    assert (plain.outcome, plain.policy_outcome, plain.fail_job_alerted) == ("proceed", "", False)
    drain = after_job(decide(fs, {"config.persistence_off": "drain"}))
    assert (drain.outcome, drain.decided, drain.fail_job_alerted) == ("drain", "drain", False)
