"""Run as root, a gpuguard.toml another user could have written is refused: it names the
programs root runs (the NCCL probe, the mail program) and the drain policy."""

from __future__ import annotations

import os

import pytest

from gpuguard.config import ConfigError, load

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the owner rule applies to root only")


def _cfg(tmp_path, mode, uid=0, gid=0):
    p = tmp_path / "gpuguard.toml"
    p.write_text('[nccl]\nbinary = "/tmp/evil"\n')
    os.chown(p, uid, gid)
    os.chmod(p, mode)
    return str(p)


def test_root_owned_and_not_writable_by_others_is_read(tmp_path):
    assert load(_cfg(tmp_path, 0o644)).get("nccl", "binary") == "/tmp/evil"
    assert load(_cfg(tmp_path, 0o664, gid=0)).get("nccl", "binary") == "/tmp/evil"  # root's group


@pytest.mark.parametrize(("mode", "uid", "gid", "why"), [
    (0o666, 0, 0, "writable by others (mode 0666)"),
    (0o664, 0, 4242, "writable by group 4242 (mode 0664)"),
    (0o644, 4242, 0, "belongs to uid 4242, not root"),
])
def test_a_config_another_user_could_write_is_refused(tmp_path, mode, uid, gid, why):
    path = _cfg(tmp_path, mode, uid, gid)
    with pytest.raises(ConfigError) as e:
        load(path)
    assert str(e.value).startswith(f"{path}: {why}")


def test_dev_null_reads_as_the_defaults():
    assert load("/dev/null").get("nccl", "binary") == "/usr/local/bin/all_reduce_perf"
