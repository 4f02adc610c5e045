"""Write a unified diff that marks the lines of chosen functions as added (for ``mutmut run --use-patch-file``).

mutmut 2 mutates only the lines a patch adds; this turns a list of
functions into such a patch, so a run covers the security checks named in
``scripts/mutants.sh`` and not every line of their modules.  Docstring
lines are left out (mutating them changes nothing a test could see).

Usage: ``python scripts/mutants_select.py OUT.patch FILE::NAME [FILE::NAME ...]``
where ``NAME`` is a function, ``Class.method``, or ``*`` for the whole file.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict


def _ranges(path: str, names: list[str]) -> list[int]:
    tree = ast.parse(open(path).read(), path)
    found: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found[f"{node.name}.{sub.name}"] = sub
    lines: set[int] = set()
    for name in names:
        if name == "*":
            nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        elif name in found:
            nodes = [found[name]]
        else:
            raise SystemExit(f"mutants_select: {path} has no function {name}")
        for node in nodes:
            body = node.body  # type: ignore[attr-defined]
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                body = body[1:] or body
            lines.update(range(body[0].lineno, node.end_lineno + 1))  # type: ignore[attr-defined]
    return sorted(lines)


def main(argv: list[str]) -> int:
    out, specs = argv[0], argv[1:]
    by_file: dict[str, list[str]] = defaultdict(list)
    for spec in specs:
        path, _sep, name = spec.partition("::")
        by_file[path].append(name or "*")
    total = 0
    with open(out, "w") as f:
        for path, names in by_file.items():
            src = open(path).read().splitlines()
            f.write(f"Index: {path}\n{'=' * 67}\n--- {path}\n+++ {path}\n")
            for n in _ranges(path, names):  # one hunk per line keeps the diff trivially valid
                f.write(f"@@ -{n - 1},0 +{n},1 @@\n+{src[n - 1]}\n")
                total += 1
    print(f"mutants_select: {total} lines in {len(by_file)} files", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
