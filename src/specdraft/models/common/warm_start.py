"""Warm-start weight surgery shared by the families: target layers copied into draft layers, the fc as an identity.

Pure functions of a fresh drafter and the target (``models.base.WarmStartData``); each family lists the ones it
takes in its ``MethodSpec.warm_starts`` and ``train/warm_start.py`` (which owns the switches) calls them.

* init from target: draft decoder layer i starts as target decoder layer L - N + i (the last
  N layers, in order), only where that layer computes what the draft layer computes
  (``layer_mismatches``); otherwise nothing is copied and the reasons are logged. The drafter's
  output is decoded by the target's final norm + LM head (DFlash/DSpark share them; EAGLE-3's
  head starts from the target's rows), which were trained on the output of the target's last
  layer, so the last layers are the ones whose output space the head already reads. Tensors are copied where the
  shapes match (attention q/k/v/o, MLP, norm gains, Qwen3 q/k norms); norms the target lacks stay at 1
  (EAGLE-3's wider layer: ``models/eagle3/warm_start.py``).
* fc identity: the fc fusing the S captured slots (S*D -> D) starts as the identity on
  one slot and zero on the others: the slot nearest (in depth) to the input of the first copied
  target layer (L - N), i.e. the hidden state that layer was trained to read. With the DFlash
  preset on a 30-layer target and N = 2 it is exactly that layer's input (output of layer 27).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from specdraft.errors import SpecdraftError, setting
from specdraft.hidden_states.layers import LayerSlot
from specdraft.models.base import WarmStartData
from specdraft.targets.base import Target

log = logging.getLogger(__name__)

# Norm gains are read by running the target's norm on 1024 * ones: mean square 2^20 swamps eps and
# rsqrt(2^20) = 2^-10 is exact, so the output is the gain bit for bit whatever the convention
# (Llama ``w``, Gemma ``1 + w``).
_PROBE = 1024.0


# ----- which target layers ------------------------------------------------------------------


def copied_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layer each draft layer starts from: the last ``num_draft_layers``, in order."""
    if num_draft_layers > num_target_layers:
        raise SpecdraftError(
            f"init_from_target: the drafter has {num_draft_layers} layers but the target only {num_target_layers}; "
            f"lower {setting('model')} num_layers or set init_from_target: false"
        )
    return list(range(num_target_layers - num_draft_layers, num_target_layers))


def target_layers(target: Target) -> nn.ModuleList:
    model = target.model
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise SpecdraftError(f"target {target.name}: cannot find its decoder layers (expected model.get_decoder().layers)")
    return layers


def norm_gain(norm: nn.Module, dim: int) -> torch.Tensor:
    """The per-channel gain an RMSNorm-like module applies, float32 (exact, see ``_PROBE``)."""
    import copy

    probe = torch.full((dim,), _PROBE, dtype=torch.float32, device=next(norm.parameters()).device)
    return copy.deepcopy(norm).to(torch.float32)(probe).to(torch.float32)


# Where each of our DecoderLayer's tensors lives in an HF decoder layer, in order of preference
# (Gemma's pre-MLP norm is ``pre_feedforward_layernorm``; its ``post_attention_layernorm`` normalises
# the attention output, a different role).
_TARGET_NAMES = {"post_attention_layernorm.weight": ("pre_feedforward_layernorm.weight", "post_attention_layernorm.weight")}
_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight")


def target_tensor(layer: nn.Module, name: str) -> torch.Tensor | None:
    """Our tensor ``name``'s counterpart in the HF ``layer``: a weight, or a norm's gain."""
    params = dict(layer.named_parameters())
    for candidate in _TARGET_NAMES.get(name, (name,)):
        if candidate in params:
            if name in _NORMS:
                return norm_gain(layer.get_submodule(candidate.rsplit(".", 1)[0]), params[candidate].shape[-1])
            return params[candidate].detach()
    return None


def copy_layer(
    draft: nn.Module,
    source: nn.Module,
    *,
    prefix: str,
    source_name: str,
    special: Mapping[str, Callable[[torch.Tensor, torch.Tensor], bool]] | None = None,
    skip: tuple[str, ...] = (),
) -> tuple[list[str], list[str]]:
    """Copy ``source``'s tensors into ``draft`` where names and shapes match (``special`` copies a
    tensor whose shape differs: (ours, theirs) -> copied?; ``skip`` keeps ours). Returns (copied, kept) names."""
    copied, kept = [], []
    special = special or {}
    for name, param in draft.named_parameters():
        theirs = None if name in skip else target_tensor(source, name)
        if theirs is not None and theirs.shape == param.shape:
            param.copy_(theirs.to(param.dtype))
            done = True
        else:
            done = theirs is not None and name in special and special[name](param, theirs)
        if done:
            copied.append(f"{prefix}.{name}<-{source_name}.{name}")
        else:
            kept.append(f"{prefix}.{name}")
    return copied, kept


def layer_mismatches(target: Target, index: int, draft_layer: nn.Module, rope_theta: float) -> list[str]:
    """Why target layer ``index`` computes something other than ``draft_layer`` with its weights
    copied in ([] when it computes the same): our draft layers are pre-norm SwiGLU(silu) layers with
    plain RoPE at the drafter's ``rope_theta``, 1/sqrt(head_dim) attention and no biases, fed
    unscaled embeddings. Copying into a layer that differs in any of these (Gemma 3: gelu, post-
    attention/post-FFN norms, per-layer-type RoPE bases, a sqrt(D) embedding scale) matched the
    target layer no better than the identity map (issue 18: relative error 0.249 vs 0.2495). One
    difference is let through: q/k norms a Llama-style target lacks start at gain 1 in a q/k-norm
    (DFlash/DSpark) draft layer, per-head RMS normalisation of q and k that the recipes'
    init_from_target measurements on the embedded Llama target already include."""
    tc = target.text_config
    layer = target_layers(target)[index]
    params = dict(layer.named_parameters())
    reasons = []
    act = getattr(tc, "hidden_act", None) or getattr(tc, "hidden_activation", None)
    if act not in ("silu", "swish"):
        reasons.append(f"its MLP activation is {act}, the draft layer's is silu")
    extra = sorted(n.rsplit(".", 1)[0] for n in params if n.startswith(("pre_feedforward_layernorm.", "post_feedforward_layernorm.")))
    if extra:
        reasons.append(f"it has post-attention/post-FFN norms ({', '.join(extra)}) the draft layer lacks")
    if any(n.endswith(".bias") for n in params):
        reasons.append("it has biases the draft layer lacks")
    if "self_attn.q_norm.weight" in params and getattr(draft_layer.self_attn, "q_norm", None) is None:
        reasons.append("it normalises q/k per head, the draft layer does not")
    rope = getattr(tc, "rope_parameters", None) or {}
    layer_types = getattr(tc, "layer_types", None)
    if layer_types and layer_types[index] not in ("full_attention", "sliding_attention"):
        reasons.append(f"it is a {layer_types[index]} layer (a recurrent state, not softmax attention), the draft layer attends")
    if layer_types and isinstance(rope.get(layer_types[index]), dict):
        rope = rope[layer_types[index]]  # per-layer-type RoPE (Gemma 3: sliding vs full attention)
    theta = rope.get("rope_theta", getattr(tc, "rope_theta", None))
    if rope.get("rope_type", "default") != "default":
        reasons.append(f"its RoPE is {rope['rope_type']!r}, the draft layer's plain")
    partial = float(rope.get("partial_rotary_factor", getattr(tc, "partial_rotary_factor", None)) or 1.0)
    if partial != 1.0:  # GLM-4.5, Qwen3-Next, Gemma 4's full layers: a copied layer would see positions it was never trained on
        reasons.append(f"it rotates {partial:g} of each head (partial_rotary_factor), the draft layer all of it")
    if theta is not None and float(theta) != float(rope_theta):
        reasons.append(f"its RoPE base is {float(theta):g}, the drafter's {float(rope_theta):g}")
    scalar = getattr(tc, "query_pre_attn_scalar", None)
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    if scalar is not None and float(scalar) != float(head_dim):
        reasons.append(f"it scales attention by 1/sqrt({scalar:g}), the draft layer by 1/sqrt({head_dim})")
    scale = getattr(target.model.get_input_embeddings(), "embed_scale", None)
    if scale is not None and float(scale) != 1.0:
        reasons.append(f"the target scales its embeddings by {float(scale):g}, the drafter feeds them unscaled")
    return reasons


def family_mismatch(drafter: Any, inputs: WarmStartData, indices: list[int]) -> bool:
    """Log why init_from_target is off for this target, if it is (then nothing is copied)."""
    reasons = dict.fromkeys(
        r for i, t in enumerate(indices) for r in layer_mismatches(inputs.target, t, drafter.layers[i], drafter.config.rope_theta)
    )
    if reasons:
        log.warning(
            "init_from_target: off for target %s (the draft layers keep their fresh initialisation): target layer %s: %s",
            inputs.target.name,
            ", ".join(map(str, indices)),
            "; ".join(reasons),
        )
    return bool(reasons)


def report_kept(kept: list[str]) -> None:
    if kept:
        log.info("init_from_target: kept the fresh initialisation of %s (no same-shaped target tensor)", ", ".join(kept))


def init_block_layers(drafter: Any, inputs: WarmStartData) -> list[str]:
    """DFlash/DSpark: Qwen3-style layers, same shapes as the target's unless overridden."""
    layers = target_layers(inputs.target)
    indices = copied_layers(len(layers), len(drafter.layers))
    if family_mismatch(drafter, inputs, indices):
        return []
    copied, kept = [], []
    for i, t in enumerate(indices):
        c, k = copy_layer(drafter.layers[i], layers[t], prefix=f"layers.{i}", source_name=f"target.layers.{t}")
        copied += c
        kept += k
    report_kept(kept)
    return copied


# ----- fc identity --------------------------------------------------------------------------


def hidden_index(slot: LayerSlot) -> int:
    """Depth of a captured hidden state: HF ``hidden_states`` index (input of layer i = i, output = i + 1)."""
    return slot.layer if slot.side == "input" else slot.layer + 1


def identity_slot(slots: Sequence[LayerSlot], num_target_layers: int, num_draft_layers: int) -> int:
    """Index of the slot nearest the input of the first copied target layer (ties: the deeper one)."""
    want = copied_layers(num_target_layers, num_draft_layers)[0]
    return min(range(len(slots)), key=lambda i: (abs(hidden_index(slots[i]) - want), -hidden_index(slots[i])))


def init_fc_identity(drafter: Any, inputs: WarmStartData) -> list[str]:
    c = drafter.config
    slots = c.slots()
    j = identity_slot(slots, inputs.target.num_layers, len(drafter.layers))
    d = c.hidden_size
    weight = drafter.fc.weight  # [D, S*D]; the input is the slots flattened slot-major
    weight.zero_()
    weight[:, j * d : (j + 1) * d].copy_(torch.eye(d, dtype=weight.dtype))
    log.info("fc_init=identity: fc starts as the identity on slot %d (%s) of %s", j, slots[j], ", ".join(map(str, slots)))
    return [f"fc.weight=identity on slot {slots[j]}"]
