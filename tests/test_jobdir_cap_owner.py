"""The job directory's size cap is enforced by the collector, which runs as root, in a
directory the job's user writes: it may only ever cut the user's own files."""

from __future__ import annotations

import os


def test_the_job_directory_cap_never_cuts_a_file_the_user_does_not_own(tmp_path):
    """The collector (root) caps the job directory; a hard link the user made there to a
    file of root's is neither counted nor cut."""
    from gpuguard.collector.jobdir_cap import enforce_cap

    victim = tmp_path / "shadow"
    victim.write_bytes(b"r" * 200_000)
    d = tmp_path / "job"
    d.mkdir(mode=0o700)
    (d / "rank0.jsonl").write_bytes(b"x" * 100_000)
    os.chown(d, 4242, 4242)
    os.chown(d / "rank0.jsonl", 4242, 4242)
    os.link(victim, d / "a-link.jsonl")  # name-ordered first: it would be kept, rank0 cut
    total, cut = enforce_cap(str(d), 50_000)
    assert (total, cut) == (100_000, ["rank0.jsonl"])
    assert victim.read_bytes() == b"r" * 200_000
    assert (d / "rank0.jsonl").stat().st_size == 50_000
