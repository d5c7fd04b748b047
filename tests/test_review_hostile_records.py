"""Hostile but schema-valid training records (huge values) through the real Epilog: the
summary stays finite and the rest of the job's records are kept."""

import json

import pytest
from test_epilog_hook import ENV, EPILOG_ENV, needs_collector, node, step, summary  # noqa: F401

from gpuguard.collector.ingest import INT_MAX, MAX_COUNT, MAX_DURATION_S
from gpuguard.epilog import hook
from gpuguard.prolog import hook as prolog_hook


def run_epilog(node, monkeypatch, lines):  # noqa: F811
    monkeypatch.undo()
    monkeypatch.setenv("GPUGUARD_CONFIG", str(node["tmp"] / "gpuguard.toml"))
    assert prolog_hook.run(ENV) == 0
    jd = node["jobs"] / "42"
    (jd / "train.rank0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert hook.run(EPILOG_ENV) == 0
    assert "tool error" not in node["log"].read_text()
    assert node["calls"]() == []
    return summary(node["db"])


@needs_collector
@pytest.mark.parametrize("bad", [
    {"step_time_s": 1e308},
    {"step_time_s": MAX_DURATION_S * 2},
    {"phases": {"data_wait_s": 1e308, "fwd_bwd_s": 0.25, "comm_s": 1e308, "optim_s": 0.0}},
])
def test_huge_durations_are_malformed_lines_not_nan_shares(node, monkeypatch, bad):  # noqa: F811
    lines = [step(0, 1, 0.5), step(0, 2, 0.5, **bad), step(0, 3, 0.5, **bad), step(0, 4, 0.5)]
    s = run_epilog(node, monkeypatch, lines)
    assert (s["step_records"], s["malformed_records"]) == (2, 2)
    assert (s["data_wait_share_pct"], s["comm_share_pct"]) == (25.0, 12.5)


@needs_collector
def test_huge_sample_counts_are_malformed_lines_not_a_lost_summary(node, monkeypatch):  # noqa: F811
    # INT_MAX samples twice overflowed SQLite's integer sum(): "job summary read failed"
    lines = [step(0, 1, 0.5, samples=INT_MAX), step(0, 2, 0.5, tokens=INT_MAX),
             step(0, 3, 0.5, samples=MAX_COUNT + 1), step(0, 4, 0.5, samples=MAX_COUNT),
             step(0, 5, 0.5, samples=MAX_COUNT)]
    s = run_epilog(node, monkeypatch, lines)
    assert (s["step_records"], s["malformed_records"]) == (2, 3)
    assert s["throughput_samples_per_s"] == 2 * MAX_COUNT / 1.0
