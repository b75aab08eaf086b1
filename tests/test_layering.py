"""The package's dependency direction, read from its source: every import, at module level or inside a function.

Two rules: no import points up a layer, and no import circle between modules (a function-level import that closes
a circle only hides it). Imports under ``if TYPE_CHECKING:`` are for annotations and never run, so they do not count.

Layers, lowest first: ``targets -> data -> hidden_states -> models -> train -> decode -> eval -> integrations ->
quickstart -> cli``, with ``errors``, ``registry``, ``utils`` and ``reference`` (shipped files) below them all. A module
may import its own layer and any lower one; an import that points up hides an import circle or a lower layer knowing
an integration, so it fails here with the file, line and imported module. Integrations plug in from above by
registering into the registries the lower layers define (``specdraft/integrations/__init__.py``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "specdraft"

BASE = ("errors", "registry", "utils", "reference")
LAYERS = ("targets", "data", "hidden_states", "models", "train", "decode", "eval", "integrations", "quickstart", "cli")


def layer_of(module: str) -> int | None:
    """The layer index of a ``specdraft.*`` module (-1 for the base), None for the package root or outside it."""
    parts = module.split(".")
    if parts[0] != "specdraft" or len(parts) < 2:
        return None
    top = parts[1]
    if top in BASE:
        return -1
    if top in LAYERS:
        return LAYERS.index(top)
    raise AssertionError(f"specdraft.{top} belongs to no layer: add it to BASE or LAYERS in {__file__}")


def module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) for every import statement in ``path``, relative ones resolved."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in _executed(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            # ``from package import submodule`` imports the submodule
            found.extend((node.lineno, f"{target}.{alias.name}") for alias in node.names if _is_module(f"{target}.{alias.name}"))
    return found


def _executed(tree: ast.AST):
    """Every node except the bodies of ``if TYPE_CHECKING:`` (imports for annotations only, never run)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _is_module(module: str) -> bool:
    path = PACKAGE.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def module_graph() -> dict[str, set[str]]:
    """Module -> the specdraft modules it imports (the most specific existing module of each import)."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for _, target in imported_modules(path):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target not in (name, "specdraft"):
                deps.add(target)
        graph[name] = deps
    return graph


def import_circles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    graph = module_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def upward_imports() -> list[str]:
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        own = layer_of(module_name(path))
        if own is None:
            continue
        for line, target in imported_modules(path):
            other = layer_of(target)
            if other is not None and other > own:
                violations.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}")
    return violations


def test_every_module_has_a_layer():
    for path in PACKAGE.rglob("*.py"):
        layer_of(module_name(path))


def test_no_import_points_up():
    violations = upward_imports()
    assert not violations, "imports from a lower layer into a higher one:\n" + "\n".join(violations)


def test_no_import_circle():
    circles = import_circles()
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(circle) for circle in circles)


def test_tests_neither_import_nor_run_benchmarks():
    """Benchmarks measure and may change freely; what a test checks lives in the package (or beside the tests)."""
    tests = Path(__file__).resolve().parent
    reaching = re.compile(r"""["']benchmarks["'/]""")  # a path into benchmarks/ in code (docstrings name it in ``...``)
    offenders = [path.name for path in sorted(tests.rglob("*.py")) if path != Path(__file__).resolve() and reaching.search(path.read_text())]
    assert not offenders, f"tests that reach into benchmarks/: {offenders}"


if __name__ == "__main__":  # list the violations: python tests/test_layering.py
    found = upward_imports() + [" <-> ".join(circle) for circle in import_circles()]
    print("\n".join(found) or "clean")
