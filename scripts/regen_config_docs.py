"""Regenerate the config reference in README.md and slurm-conf-examples/gpuguard.toml
from gpuguard.config.SCHEMA (tests/test_config.py checks they match)."""

import pathlib
import re

from gpuguard.config import example_toml, reference_markdown

root = pathlib.Path(__file__).resolve().parent.parent
(root / "slurm-conf-examples" / "gpuguard.toml").write_text(example_toml())
readme = root / "README.md"
text = readme.read_text()
text = re.sub(r"(<!-- config-reference:start[^>]*-->\n).*?(<!-- config-reference:end -->)",
              lambda m: m.group(1) + reference_markdown() + m.group(2), text, flags=re.S)
readme.write_text(text)
print("regenerated README.md config reference and slurm-conf-examples/gpuguard.toml")
