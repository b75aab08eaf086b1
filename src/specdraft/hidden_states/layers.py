"""What a stored hidden state *is*: a decoder layer index plus "input" or "output".

HF convention (``output_hidden_states=True``): ``hidden_states[i]`` is the input of decoder layer
``i`` (``hidden_states[0]`` = embeddings) and ``hidden_states[i + 1]`` its output, except the last
entry, which is *after* the final norm. A ``LayerSlot`` never uses HF indices; it names the layer
and the side, so ``LayerSlot(3, "output") == LayerSlot(4, "input")`` in value but not in meaning
(they compare unequal on purpose: the manifest keeps what was asked for).

Worked example for a 30-layer target (SmolLM2-135M):
  EAGLE-3 preset  -> inputs of layers 2, 15, 27      (HF indices 2, 15, 27)
  DFlash preset   -> outputs of layers 1, 8, 14, 20, 27 (HF indices 2, 9, 15, 21, 28)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from specdraft.errors import SpecdraftError
from specdraft.registry import Registry

Side = Literal["input", "output"]


@dataclass(frozen=True, order=True)
class LayerSlot:
    layer: int
    side: Side

    def __post_init__(self) -> None:
        if self.side not in ("input", "output"):
            raise SpecdraftError(f"layer side must be 'input' or 'output', got {self.side!r}")

    def hf_index(self, num_layers: int) -> int:
        """Index into HF ``output_hidden_states`` (valid except for the last layer's output)."""
        self.check(num_layers)
        return self.layer if self.side == "input" else self.layer + 1

    def check(self, num_layers: int) -> None:
        if not 0 <= self.layer < num_layers:
            raise SpecdraftError(
                f"layer index {self.layer} is out of range: the target has {num_layers} decoder layers (0..{num_layers - 1})"
            )

    def to_json(self) -> dict:
        return {"layer": self.layer, "side": self.side}

    @classmethod
    def from_json(cls, obj: dict) -> LayerSlot:
        return cls(int(obj["layer"]), obj["side"])

    def __str__(self) -> str:
        return f"{self.side}:{self.layer}"


def parse_slots(text: str, num_layers: int | None = None) -> list[LayerSlot]:
    """Parse ``"output:1,output:8"`` or ``"in:2,out:15"``; a bare number means the layer's output."""
    slots = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        side, _, index = part.rpartition(":")
        side = {"": "output", "in": "input", "out": "output"}.get(side, side)
        try:
            slot = LayerSlot(int(index), side)  # type: ignore[arg-type]  # user text: LayerSlot refuses a wrong side
        except ValueError:
            raise SpecdraftError(f"cannot parse layer slot {part!r}: expected e.g. 'output:8' or 'input:2'") from None
        if num_layers is not None:
            slot.check(num_layers)
        slots.append(slot)
    if not slots:
        raise SpecdraftError(f"no layer slots in {text!r}")
    return slots


#: ``extract --method`` name -> slots for a target's layer count; each family registers its own from above
#: (``models/<method>/__init__.py``), as its ``MethodSpec.layer_slots``.
LAYER_PRESETS: Registry[Callable[[int], list[LayerSlot]]] = Registry("layer preset")


def spread_output_slots(num_layers: int, count: int = 5) -> list[LayerSlot]:
    """DFlash reference: outputs of ``count`` layers spread uniformly from layer 1 to L-3."""
    need_layers(num_layers, 4, "dflash/dspark")
    start, end = 1, num_layers - 3
    if count == 1:
        return [LayerSlot(start, "output")]
    ids = sorted({round(start + i * (end - start) / (count - 1)) for i in range(count)})
    return [LayerSlot(i, "output") for i in ids]


def need_layers(num_layers: int, minimum: int, preset: str) -> None:
    if num_layers < minimum:
        raise SpecdraftError(f"the {preset} layer preset needs a target with >= {minimum} layers, this one has {num_layers}")
