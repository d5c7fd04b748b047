"""`-o FILE`: gpuguard.inputs.write_output never writes through a symlink or to anything
but a regular file (reports run as root, often with -o in /tmp)."""

from __future__ import annotations

import os
import stat

import pytest
from click.testing import CliRunner
from reports_helpers import HANDMADE

from gpuguard import inputs
from gpuguard.cli import main
from gpuguard.inputs import InputError, write_output


@pytest.fixture
def umask022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _lstat_sees_nothing(path, *a, **kw):
    """os.lstat as it was a moment before an attacker created ``path``."""
    raise FileNotFoundError(path)


def test_writes_text_and_bytes_mode_0644_and_truncates(tmp_path, umask022):
    p = tmp_path / "out.csv"
    write_output(str(p), "héllo\n" * 3)
    assert p.read_bytes() == "héllo\n".encode() * 3
    assert stat.S_IMODE(p.stat().st_mode) == 0o644
    write_output(str(p), b"ab")
    assert p.read_bytes() == b"ab"  # truncated, not overwritten in place


def test_symlink_is_refused_and_its_target_untouched(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("root:x:0:0\n")
    link = tmp_path / "report.html"
    link.symlink_to(victim)
    with pytest.raises(InputError) as e:
        write_output(str(link), "pwned")
    assert str(e.value) == f"{link}: is a symbolic link; refusing to write through it"
    assert victim.read_text() == "root:x:0:0\n"
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "created-by-root")
    with pytest.raises(InputError, match="is a symbolic link"):
        write_output(str(dangling), "x")
    assert not (tmp_path / "created-by-root").exists()


def test_symlink_planted_after_the_check_is_refused_by_o_nofollow(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    link = tmp_path / "out"
    link.symlink_to(victim)

    monkeypatch.setattr(inputs.os, "lstat", _lstat_sees_nothing)
    with pytest.raises(InputError) as e:
        write_output(str(link), "pwned")
    assert str(e.value) == f"{link}: is a symbolic link; refusing to write through it"
    assert victim.read_text() == "keep"


def test_fifo_device_and_directory_are_refused_without_hanging(tmp_path, monkeypatch):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (str(fifo), "/dev/null", str(tmp_path)):
        with pytest.raises(InputError) as e:
            write_output(path, "x")
        assert str(e.value) == f"{path}: not a regular file; refusing to write to it"
    # past the lstat check (a race): a FIFO without a reader fails to open (ENXIO), one
    # with a reader opens and is refused by fstat, nothing written
    monkeypatch.setattr(inputs.os, "lstat", _lstat_sees_nothing)
    with pytest.raises(InputError, match="not a regular file"):
        write_output(str(fifo), "x")
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with pytest.raises(InputError) as e:
            write_output(str(fifo), "x")
        assert str(e.value) == f"{fifo}: not a regular file; refusing to write to it"
        assert os.read(reader, 1) == b""  # the writer closed without writing a byte
    finally:
        os.close(reader)


def test_missing_directory_is_one_line_naming_the_file(tmp_path):
    p = tmp_path / "no" / "out.csv"
    with pytest.raises(InputError) as e:
        write_output(str(p), "x")
    assert str(e.value) == f"{p}: cannot write: No such file or directory"


def test_report_o_refuses_a_symlink(tmp_path):
    cfg = tmp_path / "gpuguard.toml"
    cfg.write_text(f'[paths]\nstore = "{tmp_path}/node.db"\n[reports]\ntimezone = "UTC"\n')
    env = {"GPUGUARD_CONFIG": str(cfg)}
    assert CliRunner().invoke(main, ["report", "sync", "--from-file", str(HANDMADE)], env=env).exit_code == 0
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    link = tmp_path / "cost.csv"
    link.symlink_to(victim)
    args = ["report", "cost", "--since", "2025-03-01", "--until", "2025-04-01", "--format", "csv", "-o"]
    r = CliRunner().invoke(main, [*args, str(link)], env=env)
    assert (r.exit_code, r.output) == (2, f"Error: {link}: is a symbolic link; refusing to write through it\n")
    assert victim.read_text() == "precious\n"
    out = tmp_path / "real.csv"
    r = CliRunner().invoke(main, [*args, str(out)], env=env)
    assert (r.exit_code, r.output) == (0, f"wrote {out}\n")
    assert out.read_text().splitlines()[-1].startswith("TOTAL,")
