"""The package's dependency direction, read from its source: every import, at module level or inside a function, and
every registration into a registry.

Two rules: no import points up a layer, and no import circle between modules (a function-level import that closes
a circle only hides it). Imports under ``if TYPE_CHECKING:`` count too: they never run, but an annotation that names
a higher layer's type, or a module that imports this one, is the same dependency written where only a type checker
reads it.

Layers, lowest first: ``targets -> data -> hidden_states -> models -> decode -> train -> eval -> integrations ->
quickstart -> cli``, with ``errors``, ``registry``, ``utils``, ``tuning`` (measured machine choices), ``reference`` (shipped files) and
``tracking`` (``--report-to``: train and eval mirror their records to trackers) below them all. A module
may import its own layer and any lower one; an import that points up hides an import circle or a lower layer knowing
an integration, so it fails here with the file, line and imported module. ``decode`` sits below ``train``: the
decoding runtime needs only the drafters and the target, and training measures its drafter's decoded tau with it
(``train/decoded_tau.py``).

A registration is a dependency too: a lower layer's registry that holds an upper layer's code runs it. That is
allowed only where the registry is a designed seam, listed in :data:`SEAMS` with its reason, and the same holds for
what the ``specdraft.plugins`` entry points in ``pyproject.toml`` load (``specdraft.registry.load_plugins``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import tomllib

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "specdraft"
PYPROJECT = PACKAGE.parents[1] / "pyproject.toml"

BASE = ("errors", "registry", "utils", "tuning", "reference", "tracking")
LAYERS = ("targets", "data", "hidden_states", "models", "decode", "train", "eval", "integrations", "quickstart", "cli")

#: The registries a higher layer fills, by design: registry name -> (the layer that fills it, why it is a seam).
#: Every other registry is filled by its own layer only.
SEAMS = {
    "LAYER_PRESETS": (
        "models",
        "each method owns its layer slots; `extract --method NAME` asks for them by name, so "
        "extraction, below the models, runs for any method without knowing one",
    ),
    "REGENERATION_ENGINES": ("integrations", "vLLM regenerates replies; it is optional, so `prepare` runs on HF without it"),
    "SERVER_ENGINES": ("integrations", "a vLLM server for regeneration, optional like the engine"),
    "EXTRACT_ENGINES": ("integrations", "vLLM extracts hidden states; optional, `extract` runs on HF without it"),
    "PRODUCER_ENGINES": ("integrations", "vLLM produces hidden states for online training; optional, HF runs without it"),
    "BACKENDS": ("integrations", "Mooncake stores hidden states across hosts; optional, the file store runs without it"),
}


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
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
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


def _module_trees() -> dict[str, ast.Module]:
    return {module_name(path): ast.parse(path.read_text(), filename=str(path)) for path in sorted(PACKAGE.rglob("*.py"))}


def registries(trees: dict[str, ast.Module]) -> dict[str, str]:
    """Registry name -> the module defining it (a module-level ``NAME = Registry(...)``, annotated or not)."""
    found: dict[str, str] = {}
    for module, tree in trees.items():
        for node in tree.body:
            if isinstance(node, ast.AnnAssign):
                target, value = node.target, node.value
            elif isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], node.value
            else:
                continue
            if isinstance(target, ast.Name) and isinstance(value, ast.Call) and getattr(value.func, "id", None) == "Registry":
                assert target.id not in found, f"two registries named {target.id}: {found[target.id]} and {module}"
                found[target.id] = module
    return found


def registrations(trees: dict[str, ast.Module]) -> list[tuple[str, int, str]]:
    """(registering module, line, registry name) for every ``REGISTRY.register(...)``, import aliases resolved."""
    names = registries(trees)
    found = []
    for module, tree in trees.items():
        alias = {a.asname or a.name: a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for a in node.names}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "register"
                and isinstance(node.func.value, ast.Name)
            ):
                name = alias.get(node.func.value.id, node.func.value.id)
                if name in names:
                    found.append((module, node.lineno, name))
    return found


def upward_registrations(within: str = "specdraft") -> list[str]:
    """Registrations by modules under ``within`` into a lower layer's registry that :data:`SEAMS` does not list."""
    trees = _module_trees()
    home = registries(trees)
    violations = []
    for module, line, name in registrations(trees):
        if module != within and not module.startswith(within + "."):
            continue
        own, theirs = layer_of(module), layer_of(home[name])
        if own is not None and theirs is not None and own > theirs and SEAMS.get(name, ("",))[0] != LAYERS[own]:
            violations.append(f"{module}:{line} registers into {home[name]}.{name}")
    return violations


def plugin_entry_points() -> dict[str, str]:
    """The ``specdraft.plugins`` entry points of ``pyproject.toml``: name -> the module each loads."""
    points = tomllib.loads(PYPROJECT.read_text())["project"]["entry-points"]["specdraft.plugins"]
    return {name: value.partition(":")[0] for name, value in points.items()}


def test_every_module_has_a_layer():
    for path in PACKAGE.rglob("*.py"):
        layer_of(module_name(path))


def test_no_import_points_up():
    violations = upward_imports()
    assert not violations, "imports from a lower layer into a higher one:\n" + "\n".join(violations)


def test_no_import_circle():
    circles = import_circles()
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(circle) for circle in circles)


def test_no_registration_points_up_outside_the_seams():
    violations = upward_registrations()
    assert not violations, "a lower layer's registry holding an upper layer's code (list a designed seam in SEAMS):\n" + "\n".join(
        violations
    )


def test_every_seam_is_a_registry_filled_from_its_layer():
    trees = _module_trees()
    home = registries(trees)
    filled = {(name, LAYERS[layer_of(module)]) for module, _, name in registrations(trees) if layer_of(module) not in (None, -1)}
    stale = [name for name, (layer, _) in SEAMS.items() if name not in home or (name, layer) not in filled]
    assert not stale, f"SEAMS lists registries that no longer exist or are not filled from the layer named: {stale}"


def test_plugin_entry_points_register_only_through_seams():
    """What ``load_plugins`` loads from the entry points: an existing module, whose registrations into lower layers
    are the designed seams."""
    points = plugin_entry_points()
    missing = [f"{name} = {module}" for name, module in points.items() if not _is_module(module)]
    assert not missing, f"specdraft.plugins entry points in {PYPROJECT} naming no module: {missing}"
    violations = [v for module in points.values() for v in upward_registrations(module)]
    assert not violations, "entry points registering an upper layer's code outside the seams:\n" + "\n".join(violations)


def test_tests_neither_import_nor_run_benchmarks():
    """Benchmarks measure and may change freely; what a test checks lives in the package (or beside the tests)."""
    tests = Path(__file__).resolve().parent
    reaching = re.compile(r"""["']benchmarks["'/]""")  # a path into benchmarks/ in code (docstrings name it in ``...``)
    offenders = [
        path.name for path in sorted(tests.rglob("*.py")) if path != Path(__file__).resolve() and reaching.search(path.read_text())
    ]
    assert not offenders, f"tests that reach into benchmarks/: {offenders}"


if __name__ == "__main__":  # list the violations and count them (TYPE_CHECKING imports included): python tests/test_layering.py
    upward, circles, registered = upward_imports(), import_circles(), upward_registrations()
    print("\n".join(upward + [" <-> ".join(circle) for circle in circles] + registered) or "clean")
    print(f"upward {len(upward)}, circles {len(circles)} (type-only imports included), registrations outside the seams {len(registered)}")
    print("seams:\n" + "\n".join(f"  {name} (filled by {layer}): {why}" for name, (layer, why) in SEAMS.items()))
