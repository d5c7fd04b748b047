"""List modules over 500 lines without a stated reason and functions over 80 lines.

The project's size rule (STYLE.md): small modules named for what they do, no module over
500 lines without a reason written at its top (a docstring line starting ``Size:``), no
function over 80 lines. Prints one line per offender; exit status 1 when there is one.

    .venv/bin/python scripts/check_size.py [PATH...]   (default: the package directories)
"""

from __future__ import annotations

import ast
import pathlib
import sys

MODULE_MAX = 500
FUNCTION_MAX = 80
DEFAULT_DIRS = ("gpuguard", "prolog", "epilog", "collector", "reports")


def offenders(path: pathlib.Path) -> list[str]:
    text = path.read_text()
    tree = ast.parse(text)
    out = []
    n = len(text.splitlines())
    doc = ast.get_docstring(tree) or ""
    if n > MODULE_MAX and "Size:" not in doc:
        out.append(f"{path}: module {n} lines (> {MODULE_MAX}, no 'Size:' reason in its docstring)")
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > FUNCTION_MAX:
                out.append(f"{path}:{node.lineno}: function {node.name} {length} lines (> {FUNCTION_MAX})")
    return out


def main(argv: list[str]) -> int:
    roots = [pathlib.Path(a) for a in argv] or [pathlib.Path(d) for d in DEFAULT_DIRS]
    found = []
    for root in roots:
        files = [root] if root.is_file() else sorted(root.rglob("*.py"))
        for f in files:
            found += offenders(f)
    print("\n".join(found) or "no offenders")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
