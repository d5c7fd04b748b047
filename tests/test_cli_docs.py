"""The README's command-line reference is generated from the click commands
(scripts/regen_cli_docs.py): a command added without regenerating fails here."""

from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _regen():
    spec = importlib.util.spec_from_file_location("regen_cli_docs", ROOT / "scripts" / "regen_cli_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_command_reference_is_current():
    text = (ROOT / "README.md").read_text()
    assert _regen().regenerate(text) == text, "run: python scripts/regen_cli_docs.py"


def test_reference_names_every_hook_program():
    ref = _regen().reference_markdown()
    for prog in ("gpuguard-prolog", "gpuguard-epilog", "gpuguard-taskprolog", "gpuguard-epilog-slurmctld"):
        assert f"| `{prog}` |" in ref
