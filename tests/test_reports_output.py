"""`-o FILE` (every command's, through gpuguard.inputs.write_output): a new file unless
--force; all or nothing through a temporary file and a rename; never through a symlink,
never to a FIFO/device/directory, never replacing a file the running user (root) does not
own. Reports run as root, often with -o in /tmp: every path here is under tmp_path."""

from __future__ import annotations

import errno
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


def _names(d):
    return sorted(os.listdir(d))


def test_new_file_mode_0644_and_no_temporary_file_left(tmp_path, umask022):
    p = tmp_path / "out.csv"
    write_output(str(p), "héllo\n" * 3)
    assert p.read_bytes() == "héllo\n".encode() * 3
    assert stat.S_IMODE(p.stat().st_mode) == 0o644
    assert _names(tmp_path) == ["out.csv"]


def test_existing_file_is_kept_without_force(tmp_path):
    p = tmp_path / "report.html"
    p.write_text("good report\n")
    with pytest.raises(InputError) as e:
        write_output(str(p), "new")
    assert str(e.value) == f"{p}: already exists; not replaced (--force replaces it)"
    assert p.read_text() == "good report\n"
    assert _names(tmp_path) == ["report.html"]


def test_force_replaces_by_rename_keeping_mode_and_group(tmp_path):
    p = tmp_path / "out.csv"
    p.write_text("old\n")
    os.chmod(p, 0o640)
    os.chown(p, -1, 4242) if os.geteuid() == 0 else None
    other = tmp_path / "hardlink"
    os.link(p, other)
    ino = p.stat().st_ino
    write_output(str(p), b"ab", force=True)
    assert p.read_bytes() == b"ab"
    st = p.stat()
    assert st.st_ino != ino  # a new file renamed into place, not the old one truncated
    assert other.read_text() == "old\n"  # another link to the old inode never written
    assert stat.S_IMODE(st.st_mode) == 0o640
    if os.geteuid() == 0:
        assert st.st_gid == 4242
    assert _names(tmp_path) == ["hardlink", "out.csv"]


def test_force_never_replaces_a_file_of_another_user(tmp_path, monkeypatch):
    """As root: a file not owned by root is not replaced, even with --force. Simulated for
    any user by the running euid differing from the file's owner."""
    p = tmp_path / "passwd"
    p.write_text("root:x:0:0\n")
    owner = p.stat().st_uid
    monkeypatch.setattr(inputs.os, "geteuid", lambda: owner + 1)
    with pytest.raises(InputError) as e:
        write_output(str(p), "pwned", force=True)
    assert str(e.value) == f"{p}: owned by uid {owner}, not by uid {owner + 1} running this; not replaced"
    assert p.read_text() == "root:x:0:0\n"
    assert _names(tmp_path) == ["passwd"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another uid")
def test_root_does_not_replace_a_users_file(tmp_path):
    p = tmp_path / "alice.csv"
    p.write_text("alice's\n")
    os.chown(p, 12345, 12345)
    with pytest.raises(InputError) as e:
        write_output(str(p), "x", force=True)
    assert str(e.value) == f"{p}: owned by uid 12345, not by uid 0 running this; not replaced"
    assert p.read_text() == "alice's\n"


@pytest.mark.parametrize("force", [False, True])
def test_symlink_is_refused_and_its_target_untouched(tmp_path, force):
    victim = tmp_path / "victim"
    victim.write_text("root:x:0:0\n")
    link = tmp_path / "report.html"
    link.symlink_to(victim)
    with pytest.raises(InputError) as e:
        write_output(str(link), "pwned", force=force)
    assert str(e.value) == f"{link}: is a symbolic link; refusing to write through it"
    assert victim.read_text() == "root:x:0:0\n" and link.is_symlink()
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "created-by-root")
    with pytest.raises(InputError, match="is a symbolic link"):
        write_output(str(dangling), "x", force=force)
    assert not (tmp_path / "created-by-root").exists()
    assert _names(tmp_path) == ["dangling", "report.html", "victim"]


def _plant_after_check(monkeypatch, plant):
    """The name is free when write_output looks, then an attacker creates it."""
    real = inputs._replaceable

    def check(path, name, dfd, force):
        got = real(path, name, dfd, force)
        plant()
        return got

    monkeypatch.setattr(inputs, "_replaceable", check)


def test_symlink_or_file_planted_after_the_check_is_not_replaced(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    link = tmp_path / "out"
    _plant_after_check(monkeypatch, lambda: link.symlink_to(victim))
    with pytest.raises(InputError) as e:
        write_output(str(link), "pwned", force=True)
    assert str(e.value) == f"{link}: appeared while it was written; not replaced"
    assert victim.read_text() == "keep" and link.is_symlink()
    assert _names(tmp_path) == ["out", "victim"]


def test_no_hard_links_falls_back_to_rename_after_a_second_look(tmp_path, monkeypatch):
    p = tmp_path / "out"

    def no_link(*a, **kw):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(inputs.os, "link", no_link)
    write_output(str(p), "x")
    assert p.read_text() == "x" and _names(tmp_path) == ["out"]
    q = tmp_path / "raced"
    _plant_after_check(monkeypatch, lambda: q.write_text("theirs"))
    with pytest.raises(InputError, match="appeared while it was written"):
        write_output(str(q), "mine")
    assert q.read_text() == "theirs"


def test_replaced_file_swapped_during_the_write_is_not_replaced(tmp_path, monkeypatch):
    p = tmp_path / "out"
    p.write_text("v1")

    def swap():  # another file renamed over it (a new inode: the old one is still there)
        q = tmp_path / "theirs"
        q.write_text("someone else's")
        q.rename(p)

    _plant_after_check(monkeypatch, swap)
    with pytest.raises(InputError) as e:
        write_output(str(p), "mine", force=True)
    assert str(e.value) == f"{p}: changed while it was written; not replaced"
    assert p.read_text() == "someone else's" and _names(tmp_path) == ["out"]


def test_a_failed_write_leaves_the_old_file_whole(tmp_path, monkeypatch):
    p = tmp_path / "report.html"
    p.write_text("good report\n")
    real_write = os.write
    calls = []

    def full_disk(fd, data):
        calls.append(len(data))
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, bytes(data[:10]))

    monkeypatch.setattr(inputs.os, "write", full_disk)
    with pytest.raises(InputError) as e:
        write_output(str(p), "x" * 1000, force=True)
    assert str(e.value) == f"{p}: cannot write: No space left on device"
    assert p.read_text() == "good report\n"
    assert _names(tmp_path) == ["report.html"]  # the temporary file is removed


@pytest.mark.parametrize("force", [False, True])
def test_fifo_device_and_directory_are_refused_without_hanging(tmp_path, force):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (str(fifo), "/dev/null", str(tmp_path / "sub"), f"{tmp_path}/"):
        os.makedirs(tmp_path / "sub", exist_ok=True)
        with pytest.raises(InputError) as e:
            write_output(path, "x", force=force)
        assert str(e.value) == f"{path}: not a regular file; refusing to write to it"
    assert _names(tmp_path) == ["fifo", "sub"]


def test_missing_directory_is_one_line_naming_the_file(tmp_path):
    p = tmp_path / "no" / "out.csv"
    with pytest.raises(InputError) as e:
        write_output(str(p), "x")
    assert str(e.value) == f"{p}: cannot write: No such file or directory"


def _synced(tmp_path):
    cfg = tmp_path / "gpuguard.toml"
    cfg.write_text(f'[paths]\nstore = "{tmp_path}/node.db"\n[reports]\ntimezone = "UTC"\n')
    env = {"GPUGUARD_CONFIG": str(cfg)}
    assert CliRunner().invoke(main, ["report", "sync", "--from-file", str(HANDMADE)], env=env).exit_code == 0
    return env


REPORT = ["report", "cost", "--since", "2025-03-01", "--until", "2025-04-01", "--format", "csv", "-o"]


def test_report_o_refuses_a_symlink(tmp_path):
    env = _synced(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    link = tmp_path / "cost.csv"
    link.symlink_to(victim)
    for extra in ([], ["--force"]):
        r = CliRunner().invoke(main, [*REPORT, str(link), *extra], env=env)
        assert (r.exit_code, r.output) == (2, f"Error: {link}: is a symbolic link; refusing to write through it\n")
    assert victim.read_text() == "precious\n"
    out = tmp_path / "real.csv"
    r = CliRunner().invoke(main, [*REPORT, str(out)], env=env)
    assert (r.exit_code, r.output) == (0, f"wrote {out}\n")
    assert out.read_text().splitlines()[-1].startswith("TOTAL,")


@pytest.mark.parametrize("name", ["cost", "wait", "failures", "efficiency", "all"])
def test_every_report_keeps_an_existing_file_unless_forced(tmp_path, name):
    env = _synced(tmp_path)
    out = tmp_path / "passwd"
    out.write_text("root:x:0:0\n")
    args = ["report", name, "--since", "2025-03-01", "--until", "2025-04-01", "--format", "html", "-o", str(out)]
    r = CliRunner().invoke(main, args, env=env)
    assert (r.exit_code, r.output) == (2, f"Error: {out}: already exists; not replaced (--force replaces it)\n")
    assert out.read_text() == "root:x:0:0\n"
    r = CliRunner().invoke(main, [*args, "--force"], env=env)
    assert (r.exit_code, r.output) == (0, f"wrote {out}\n")
    assert out.read_text().startswith("<!DOCTYPE html>")


def _commands(group, prefix=()):
    import click

    for name, cmd in sorted(group.commands.items()):
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*prefix, name))
        else:
            yield " ".join((*prefix, name)), cmd


def test_every_command_writing_a_file_goes_through_the_one_writer():
    """Every -o/--output FILE has --force (gpuguard.output.output_file_options), so its
    file is written by write_output_file; a command writing a named file another way fails
    here."""
    with_o = {}
    for name, cmd in _commands(main):
        opts = {o.name: o for o in cmd.params}
        if "output" in opts or any("-o" in o.opts for o in cmd.params):
            with_o[name] = "force" in opts and opts["output"].opts == ["-o", "--output"]
    assert with_o == {"gpu snapshot": True, "job show": True, "report all": True, "report cost": True,
                      "report efficiency": True, "report failures": True, "report wait": True}


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a symlink to another uid")
def test_root_does_not_write_through_a_users_directory_symlink(tmp_path):
    """alice's ~/reports -> /etc (here: a directory standing for it): root with --force
    must not replace the root-owned file alice pointed it at."""
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "passwd").write_text("root:x:0:0\n")
    home = tmp_path / "alice"
    home.mkdir()
    link = home / "reports"
    link.symlink_to(etc)
    os.lchown(link, 12345, 12345)
    target = link / "passwd"
    with pytest.raises(InputError) as e:
        write_output(str(target), "pwned", force=True)
    assert str(e.value) == (f"{target}: {link} is a symbolic link owned by uid 12345; root does not write "
                            "through another user's link")
    assert (etc / "passwd").read_text() == "root:x:0:0\n" and _names(etc) == ["passwd"]
    os.lchown(link, 0, 0)  # root's own link is followed: the path the operator typed
    write_output(str(link / "new.csv"), "x")
    assert (etc / "new.csv").read_text() == "x"
