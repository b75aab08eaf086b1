"""Print the longest functions and files of the package: the N longest functions overall, the longest in ``train/``,
and the N longest modules.

A function's length is its source lines (``def`` to its last line, nested functions included), so a
long function that hides its work in closures still counts as long; a module's is its line count
(``wc -l``). Run it on any checkout to compare:  ``python scripts/longest_functions.py [SRC_ROOT] [--top N]``.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path


def functions(root: Path) -> list[tuple[int, str, str]]:
    """(length, qualified name, file:line) of every function and method under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        stack: list[tuple[ast.AST, str]] = [(tree, "")]
        while stack:
            node, prefix = stack.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = f"{prefix}{child.name}"
                    if not isinstance(child, ast.ClassDef):
                        found.append((child.end_lineno - child.lineno + 1, name, f"{path.relative_to(root.parent)}:{child.lineno}"))
                    stack.append((child, name + "."))
                else:
                    stack.append((child, prefix))
    return sorted(found, key=lambda f: (-f[0], f[2]))


def files(root: Path) -> list[tuple[int, str, str]]:
    """(lines, path relative to ``root``, "") of every module under ``root``, longest first."""
    found = [(len(path.read_text().splitlines()), str(path.relative_to(root)), "") for path in sorted(root.rglob("*.py"))]
    return sorted(found, key=lambda f: (-f[0], f[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "src",
        nargs="?",
        default=str(Path(__file__).resolve().parent.parent / "src" / "specdraft"),
        help="the package directory (default: this checkout's src/specdraft)",
    )
    parser.add_argument("--top", type=int, default=5, help="how many of the package's longest functions and files to list")
    args = parser.parse_args()
    root = Path(args.src)
    every = functions(root)
    train = [f for f in every if f[2].startswith(f"{root.name}/train/")]
    sections = (
        (f"longest {args.top} in {root.name}", every[: args.top]),
        (f"longest in {root.name}/train", train[:1]),
        (f"longest {args.top} files in {root.name}", files(root)[: args.top]),
    )
    for title, rows in sections:
        print(title)
        for length, name, where in rows:
            print(f"  {length:4d}  {name:40s} {where}")


if __name__ == "__main__":
    main()
