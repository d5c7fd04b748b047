"""What ``pip install .`` puts on a node: every module and data file of the source tree.

The tests run from an editable install, which maps whole directories, so a package left
out of ``setup.cfg`` still imports here and is missing only where operators install
(``pip install .``, README). These checks read ``setup.cfg`` as setuptools does."""

from __future__ import annotations

import configparser
import fnmatch
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _options() -> tuple[list[str], dict[str, str], dict[str, list[str]]]:
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    packages = cfg.get("options", "packages").split()
    package_dir = dict(line.split("=", 1) for line in cfg.get("options", "package_dir").split("\n") if "=" in line)
    package_dir = {k.strip(): v.strip() for k, v in package_dir.items()}
    data = {k: [g.strip() for g in v.split(",")] for k, v in cfg.items("options.package_data")}
    return packages, package_dir, data


def _source_dirs(package_dir: dict[str, str]) -> dict[str, str]:
    """dotted package -> its directory, for every directory of the mapped trees."""
    out: dict[str, str] = {}
    for dotted, rel in package_dir.items():
        top = os.path.join(ROOT, rel)
        for d, subdirs, _files in os.walk(top):
            subdirs[:] = [s for s in subdirs if s != "__pycache__"]
            name = os.path.relpath(d, top)
            out[dotted if name == "." else f"{dotted}.{name.replace(os.sep, '.')}"] = d
    return out


def test_every_directory_with_python_modules_is_a_listed_package():
    packages, package_dir, _data = _options()
    dirs = _source_dirs(package_dir)
    with_modules = sorted(p for p, d in dirs.items() if any(f.endswith(".py") for f in os.listdir(d)))
    assert "gpuguard.net" in with_modules  # the package a non-editable install once lacked
    assert [p for p in with_modules if p not in packages] == []


def test_every_data_file_is_listed_package_data():
    packages, package_dir, data = _options()
    missing = []
    for pkg, d in _source_dirs(package_dir).items():
        for f in os.listdir(d):
            path = os.path.join(d, f)
            if not os.path.isfile(path) or f.endswith((".py", ".pyc")):
                continue
            if pkg not in packages or not any(fnmatch.fnmatch(f, g) for g in data.get(pkg, [])):
                missing.append(os.path.relpath(path, ROOT))
    assert missing == []
