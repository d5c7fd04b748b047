"""Regenerate the command-line reference in README.md from the click commands themselves
(tests/test_cli_docs.py checks that the README matches), so the table cannot drift from
``--help``: one row per leaf command with its usage and the first sentence of its help."""

from __future__ import annotations

import configparser
import importlib
import pathlib
import re
import sys

import click

ROOT = pathlib.Path(__file__).resolve().parent.parent
START = "<!-- cli-reference:start (generated: python scripts/regen_cli_docs.py) -->\n"
END = "<!-- cli-reference:end -->"


def _first_sentence(text: str | None) -> str:
    para = (text or "").strip().split("\n\n")[0]
    para = " ".join(para.split()).replace("\b", "").strip()
    para = re.sub(r"^(``[^`]+``( / ``[^`]+``)?:\s*)", "", para)  # a hook's "``name``: " lead
    m = re.match(r"(.+?)\.(\s|$)", para)
    return (m.group(1) if m else para).rstrip(".").replace("|", "\\|")


def _leaves(cmd: click.Command, path: tuple[str, ...]):
    if isinstance(cmd, click.Group):
        for name in sorted(cmd.commands):
            yield from _leaves(cmd.commands[name], (*path, name))
    else:
        yield path, cmd


def _usage(path: tuple[str, ...], cmd: click.Command) -> str:
    ctx = click.Context(cmd, info_name=" ".join(path))
    pieces = " ".join(cmd.collect_usage_pieces(ctx))
    return f"`{' '.join(path)} {pieces}`".replace("|", "\\|")


def _hooks() -> list[tuple[str, str]]:
    cp = configparser.ConfigParser()
    cp.read(ROOT / "setup.cfg")
    out = []
    for line in cp["options.entry_points"]["console_scripts"].strip().splitlines():
        name, target = (s.strip() for s in line.split("="))
        if name == "gpuguard":
            continue
        mod = importlib.import_module(target.split(":")[0])
        out.append((name, _first_sentence(mod.__doc__)))
    return out


def reference_markdown() -> str:
    """The generated section: the ``gpuguard`` commands, then the hook programs."""
    from gpuguard.cli import main

    rows = ["| command | what it does |", "|---|---|"]
    rows += [f"| {_usage(('gpuguard', *p), c)} | {_first_sentence(c.help)} |" for p, c in _leaves(main, ())]
    rows += ["", "| program (Slurm hook, HealthCheckProgram, MailProg) | what it does |", "|---|---|"]
    rows += [f"| `{n}` | {d} |" for n, d in _hooks()]
    return "\n".join(rows) + "\n"


def regenerate(text: str) -> str:
    """``text`` (the README) with the section between the markers regenerated."""
    if START not in text or END not in text:
        raise SystemExit("README.md: cli-reference markers not found")
    head, rest = text.split(START, 1)
    _old, tail = rest.split(END, 1)
    return head + START + reference_markdown() + END + tail


if __name__ == "__main__":
    readme = ROOT / "README.md"
    readme.write_text(regenerate(readme.read_text()))
    print("regenerated README.md command-line reference", file=sys.stderr)
