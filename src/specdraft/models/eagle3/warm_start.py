"""EAGLE-3's init from target: its one layer reads [embed; feature] (2D wide), so the target layer's q/k/v go
into the feature half and the embedding half is zeroed: at step 0 the layer computes exactly the target layer
on the fused feature; the zeroed half still gets gradients (its inputs are not zero). Its ``hidden_norm`` (the
feature's norm) takes the target layer's input-norm gain."""

from __future__ import annotations

from typing import Any

import torch

from specdraft.errors import SpecdraftError
from specdraft.models.base import WarmStartData
from specdraft.models.common.warm_start import copied_layers, copy_layer, family_mismatch, report_kept, target_layers, target_tensor


def _feature_half(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    """EAGLE-3 q/k/v [out, 2D] <- target [out, D]: zero on the embedding half, target on the feature half."""
    d = theirs.shape[-1]
    if ours.shape != (theirs.shape[0], 2 * d):
        return False
    ours.zero_()
    ours[:, d:].copy_(theirs.to(ours.dtype))
    return True


def init_eagle3_layer(drafter: Any, inputs: WarmStartData) -> list[str]:
    layers = target_layers(inputs.target)
    (t,) = copied_layers(len(layers), len(drafter.layers))
    if family_mismatch(drafter, inputs, [t]):
        return []
    layer = drafter.layers[0]
    special = {f"self_attn.{p}_proj.weight": _feature_half for p in "qkv"}
    # The embedding norm feeds the zeroed half: it keeps its fresh gain of 1.
    copied, kept = copy_layer(
        layer,
        layers[t],
        prefix="layers.0",
        source_name=f"target.layers.{t}",
        special=special,
        skip=("input_layernorm.weight", "hidden_norm.weight"),
    )
    gain = target_tensor(layers[t], "input_layernorm.weight")
    if gain is None:
        raise SpecdraftError(f"target {inputs.target.name}: layer {t} has no input_layernorm to start the EAGLE-3 hidden_norm from")
    layer.hidden_norm.weight.copy_(gain.to(layer.hidden_norm.weight.dtype))
    copied.append(f"layers.0.hidden_norm.weight<-target.layers.{t}.input_layernorm.weight")
    kept.remove("layers.0.hidden_norm.weight")
    report_kept(kept)
    return copied
