"""Fields every drafter config shares, and their resolution against a target.

A config is created from user values (CLI/YAML); fields left ``None`` are the draft layers' shape,
copied from the target by ``resolve(target)`` (the drafter's decoder layers mirror the target's
attention/MLP shape, as in the EAGLE-3 and DFlash references). A resolved config fully describes
the network, and it is what ``config.json`` records under ``specdraft.config``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from specdraft.errors import SpecdraftError, setting
from specdraft.hidden_states.layers import LAYER_PRESETS, LayerSlot, parse_slots
from specdraft.targets.base import Target
from specdraft.utils.config import config_field, require_finite

# Target-derived fields: None until ``resolve``.
SHAPE_FIELDS = (
    "hidden_size",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "num_target_layers",
)


@dataclass(frozen=True)
class DraftDims:
    """A resolved config's shape fields (``DraftConfig`` keeps them optional until ``resolve``)."""

    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int


@dataclass
class DraftConfig:
    """Shape of the draft network; subclasses add the method's own fields."""

    method: ClassVar[str] = ""
    #: The method's own distillation term (``models/common/distill_losses.py``); None: it trains on hard labels only.
    distill_default: ClassVar[str | None] = None

    num_layers: int = config_field(1, help="number of draft decoder layers")
    layers: str = config_field(
        "", help="target hidden states to read, e.g. 'input:2,input:15,input:27' ('' = the method's reference preset)"
    )
    distill_loss: str = config_field(
        "",
        help="divergence between the drafter's and the target's next-token distributions, a key of DISTILL_LOSSES "
        "(models/common/distill_losses.py; '' = the method's own: dspark l1, dflash2 kl, eagle3 soft_ce; dflash has none)",
        metadata={"added_later": True},  # checkpoints from before it were trained with their method's own term
    )
    loss_chunk_rows: int = config_field(1024, help="rows per LM-head chunk in the loss (bounds [rows x vocab] memory; 0 = one chunk)")
    hidden_size: int | None = config_field(None, help="draft hidden size (default: the target's)")
    vocab_size: int | None = config_field(None, help="target vocabulary size (default: the target's)")
    num_attention_heads: int | None = config_field(None, help="draft attention heads (default: the target's)")
    num_key_value_heads: int | None = config_field(None, help="draft key/value heads (default: the target's)")
    head_dim: int | None = config_field(None, help="draft head dim (default: the target's)")
    intermediate_size: int | None = config_field(None, help="draft MLP width (default: the target's)")
    rms_norm_eps: float | None = config_field(None, help="RMSNorm epsilon (default: the target's)")
    rope_theta: float | None = config_field(None, help="RoPE base (default: the target's)")
    max_position_embeddings: int | None = config_field(None, help="longest position (default: the target's)")
    num_target_layers: int | None = config_field(None, help="decoder layers of the target (default: the target's)")

    def __post_init__(self) -> None:
        require_finite(self)
        if self.num_layers < 1:
            raise SpecdraftError(f"{self.method} config: num_layers must be >= 1, got {self.num_layers}")
        for name in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise SpecdraftError(f"{self.method} config: {name} must be >= 1, got {value}")
        if self.num_attention_heads and self.num_key_value_heads and self.num_attention_heads % self.num_key_value_heads:
            raise SpecdraftError(
                f"{self.method} config: num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.layers:
            parse_slots(self.layers, self.num_target_layers)
        self.distill_loss = self.distill_loss or self.distill_default or ""
        if self.distill_loss:
            from specdraft.models.common.distill_losses import DISTILL_LOSSES

            if self.distill_default is None:
                raise SpecdraftError(
                    f"{self.method} config: {setting('distill_loss')} {self.distill_loss!r} given, but {self.method} trains "
                    "on hard labels only (no distillation term); it applies to the methods that distil the target's distribution"
                )
            if self.distill_loss not in DISTILL_LOSSES:
                raise SpecdraftError(
                    f"{setting('distill_loss')}: unknown distillation loss {self.distill_loss!r}; "
                    f"choose one of: {', '.join(DISTILL_LOSSES.names())}"
                )

    @property
    def resolved(self) -> bool:
        return all(getattr(self, f) is not None for f in SHAPE_FIELDS if f != "num_target_layers") and bool(self.layers)

    def require_resolved(self) -> None:
        if not self.resolved:
            missing = [f for f in SHAPE_FIELDS if getattr(self, f) is None and f != "num_target_layers"]
            raise SpecdraftError(f"{self.method} config is not resolved against a target (missing {missing}); use MethodSpec.build")

    def dims(self) -> DraftDims:
        """The resolved shape fields, typed as set: what the network is built from."""
        self.require_resolved()
        return DraftDims(**{f: getattr(self, f) for f in SHAPE_FIELDS if f != "num_target_layers"})

    def slots(self) -> list[LayerSlot]:
        return parse_slots(self.layers, self.num_target_layers)

    def resolve(self: ConfigT, target: Target) -> ConfigT:
        """A copy with every unset shape field taken from ``target`` (a ``Target``)."""
        tc = target.text_config
        rope = getattr(tc, "rope_parameters", None) or {}
        heads = int(tc.num_attention_heads)
        derived: dict[str, Any] = {
            "hidden_size": int(tc.hidden_size),
            "vocab_size": int(tc.vocab_size),
            "num_attention_heads": heads,
            "num_key_value_heads": int(getattr(tc, "num_key_value_heads", None) or heads),
            "head_dim": int(getattr(tc, "head_dim", None) or tc.hidden_size // heads),
            "intermediate_size": int(tc.intermediate_size),
            "rms_norm_eps": float(getattr(tc, "rms_norm_eps", 1e-6)),
            "rope_theta": float(rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0))),
            "max_position_embeddings": int(getattr(tc, "max_position_embeddings", 4096)),
            "num_target_layers": int(tc.num_hidden_layers),
        }
        values = {k: v for k, v in derived.items() if getattr(self, k) is None}
        if values.get("hidden_size", self.hidden_size) != int(tc.hidden_size):
            raise SpecdraftError(
                f"{self.method} config: hidden_size {self.hidden_size} differs from the target's {tc.hidden_size}; "
                "the drafter reads target hidden states and must share their width"
            )
        if values.get("vocab_size", self.vocab_size) != int(tc.vocab_size):
            raise SpecdraftError(f"{self.method} config: vocab_size {self.vocab_size} differs from the target's {tc.vocab_size}")
        if not self.layers:
            num = derived["num_target_layers"] if self.num_target_layers is None else self.num_target_layers
            values["layers"] = ",".join(str(s) for s in LAYER_PRESETS.get(self.method)(num))
        values.update(self._resolve_method(target))
        return dataclasses.replace(self, **values)

    def _resolve_method(self, target: Target) -> dict[str, Any]:
        """Method-specific values that depend on the target (overridden by subclasses)."""
        return {}

    def compared_value(self, name: str) -> Any:
        """Field ``name`` in the form the speculators fields and the ``specdraft`` block of a checkpoint are compared in."""
        return getattr(self, name)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls: type[ConfigT], obj: dict, *, where: str) -> ConfigT:
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(obj) - names)
        if unknown:
            raise SpecdraftError(f"{where}: unknown {cls.method} config fields {unknown}")
        return cls(**obj)


ConfigT = TypeVar("ConfigT", bound=DraftConfig)


def shape_from_layer_config(tlc: dict, *, where: str) -> dict[str, Any]:
    """Our shape fields from a speculators ``transformer_layer_config`` dict."""
    try:
        heads = int(tlc["num_attention_heads"])
        rope = tlc.get("rope_parameters") or {}
        return {
            "num_layers": int(tlc["num_hidden_layers"]),
            "hidden_size": int(tlc["hidden_size"]),
            "vocab_size": int(tlc["vocab_size"]),
            "num_attention_heads": heads,
            "num_key_value_heads": int(tlc.get("num_key_value_heads") or heads),
            "head_dim": int(tlc.get("head_dim") or int(tlc["hidden_size"]) // heads),
            "intermediate_size": int(tlc["intermediate_size"]),
            "rms_norm_eps": float(tlc.get("rms_norm_eps", 1e-6)),
            "rope_theta": float(rope.get("rope_theta", tlc.get("rope_theta", 10000.0))),
            "max_position_embeddings": int(tlc.get("max_position_embeddings", 4096)),
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecdraftError(f"{where}: transformer_layer_config is incomplete or malformed ({exc!r})") from None
