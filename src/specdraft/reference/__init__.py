"""Reference drafters shipped inside the package, one per embedded target.

Each is a complete speculators-format checkpoint directory (``config.json``, ``model.safetensors``,
``MODEL_CARD.md`` with its data, budget and measured acceptance), built reproducibly by
``scripts/build_reference_drafter.py``. ``--drafters reference`` in ``specdraft eval`` (and the
quickstart) resolves to the one for the target being evaluated.
"""

from __future__ import annotations

from pathlib import Path

from specdraft.errors import SpecdraftError
from specdraft.registry import Registry

REFERENCE_DRAFTERS: Registry[str] = Registry("reference drafter")  # embedded target name -> directory name here
REFERENCE_DRAFTERS.register("smollm2-135m")("smollm2-135m-dspark")


def reference_drafter(target: str) -> Path:
    """The shipped drafter directory for the embedded ``target``; a clear error when there is none."""
    if target not in REFERENCE_DRAFTERS:
        raise SpecdraftError(
            f"no reference drafter ships for target {target!r} (available for: {', '.join(REFERENCE_DRAFTERS.names())}); "
            "train one with `specdraft train` and pass its directory instead"
        )
    path = Path(__file__).with_name(REFERENCE_DRAFTERS.get(target))
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise SpecdraftError(f"the reference drafter for {target!r} is missing from this installation ({path}); reinstall specdraft")
    return path
