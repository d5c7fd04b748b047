"""The environment the Slurm commands run in: times always in Slurm's standard format."""

from __future__ import annotations

import os

from gpuguard.slurm import SlurmCli


def test_slurm_time_format_of_the_caller_is_not_inherited(tmp_path, monkeypatch):
    # SLURM_TIME_FORMAT=relative prints "Tomorr 12:00"/"12:34:56" (no date): every sacct
    # time of a live sync would be unreadable
    tool = tmp_path / "sacct"
    tool.write_text('#!/bin/sh\necho "$SLURM_TIME_FORMAT"\n')
    os.chmod(tool, 0o755)
    monkeypatch.setenv("SLURM_TIME_FORMAT", "relative")
    assert SlurmCli(str(tmp_path)).run("sacct") == "standard\n"
