"""The forward paths by name: torch-free, so configs and ``--help`` list them without loading torch.

A path is a set of parts (``tuning/forward_path.py`` registers what each part does); every name a config accepts
comes from :data:`FORWARD_PATHS`, so a path registered here is accepted everywhere with no second list to keep equal.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdraft.registry import Registry

AUTO = "auto"
EAGER = "eager"


@dataclass(frozen=True)
class ForwardPath:
    """One way to execute a model's forward: the parts it switches on (eager: none; every other part is off)."""

    name: str
    parts: tuple[str, ...]


FORWARD_PATHS: Registry[ForwardPath] = Registry("forward path")
for _path in (
    ForwardPath(EAGER, ()),
    ForwardPath("prepacked", ("prepacked",)),
    ForwardPath("gqa", ("gqa",)),
    ForwardPath("prepacked+gqa", ("prepacked", "gqa")),
    ForwardPath("prepacked+streamed", ("prepacked", "streamed")),
    ForwardPath("prepacked+streamed+gqa", ("prepacked", "streamed", "gqa")),
):
    FORWARD_PATHS.register(_path.name)(_path)


def path_choices() -> list[str]:
    """What ``--forward-path`` accepts: ``auto`` and every registered path."""
    return [AUTO, *FORWARD_PATHS.names()]
