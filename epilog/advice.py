"""Per-cause advice for the job page and end-of-job mail, as data (TOML).

The shipped table is ``gpuguard/data/advice.toml`` (one table per verdict cause plus
``idle-gpus``: ``who`` = ``you`` | ``admins``, ``check`` = list of lines, ``docs`` = URL);
a site's ``[job_page] advice_file`` is merged over it cause by cause, as Princeton
jobstats lets sites write their own job notes.
"""

from __future__ import annotations

import tomllib
from importlib import resources
from typing import Any


class AdviceError(ValueError):
    """The advice file cannot be read or has the wrong shape; one line naming it."""


def _check(doc: dict[str, Any], src: str) -> dict[str, dict[str, Any]]:
    out = {}
    for cause, entry in doc.items():
        if not isinstance(entry, dict):
            raise AdviceError(f"{src}: [{cause}] must be a table")
        if not isinstance(entry.get("check", []), list) or not all(isinstance(c, str) for c in entry.get("check", [])):
            raise AdviceError(f"{src}: [{cause}] check must be a list of strings")
        for k in ("who", "docs"):
            if k in entry and not isinstance(entry[k], str):
                raise AdviceError(f"{src}: [{cause}] {k} must be a string")
        if "docs" in entry and not entry["docs"].startswith(("https://", "http://")):
            raise AdviceError(f"{src}: [{cause}] docs must be an http(s) link")  # it becomes an <a href>
        if entry.get("who", "you") not in ("you", "admins"):
            raise AdviceError(f"{src}: [{cause}] who must be \"you\" or \"admins\"")
        unknown = set(entry) - {"who", "check", "docs"}
        if unknown:
            raise AdviceError(f"{src}: [{cause}] unknown key(s) {', '.join(sorted(unknown))} (expected who, check, docs)")
        out[cause] = {"who": entry.get("who", "you"), "check": list(entry.get("check", [])), "docs": entry.get("docs")}
    return out


def load_advice(path: str = "") -> dict[str, dict[str, Any]]:
    """The shipped advice, with ``path``'s tables merged over it (empty: shipped only).
    Raises :class:`AdviceError`."""
    shipped = resources.files("gpuguard").joinpath("data/advice.toml").read_text(encoding="utf-8")
    advice = _check(tomllib.loads(shipped), "gpuguard/data/advice.toml")
    if path:
        try:
            with open(path, "rb") as fh:
                site = tomllib.load(fh)
        except OSError as e:
            raise AdviceError(f"{path}: cannot read: {e.strerror or e}") from None
        except tomllib.TOMLDecodeError as e:
            raise AdviceError(f"{path}: bad TOML: {e}") from None
        advice.update(_check(site, path))
    return advice
