"""Integrations plug in from above: the lower layers define the interfaces and registries (regeneration and
extraction engines, producers, hidden-state backends) and the modules here register into them when loaded.

:func:`load` loads them all; the CLI calls it, and the ``specdraft.plugins`` entry point names it, so a library
lookup that misses loads them too (``registry.load_plugins``). Importing this package registers nothing (vLLM
imports ``vllm.connector`` through it), and loading imports neither vLLM nor Mooncake.
"""


def load() -> None:
    """Register every integration (idempotent: a module registers once, when first imported)."""
    from specdraft.integrations.mooncake import backend  # noqa: F401  (hidden-state backend "mooncake")
    from specdraft.integrations.vllm import extract, generate, producer  # noqa: F401  (the "vllm" engines of extract, prepare, serve-hidden-states)
