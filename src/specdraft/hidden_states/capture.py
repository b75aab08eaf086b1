"""Capture exactly the requested layer slots (and the final-norm input) from an HF decoder.

Why hooks rather than ``output_hidden_states``: HF's last ``hidden_states`` entry is *after* the
final norm, so "output of the last layer" is not in that tuple; and asking for all L+1 states
keeps L+1 full activations alive when only a few are needed. A forward pre-hook on layer ``i``
sees its input, a forward hook its output, a pre-hook on the final norm the last layer's raw
output (``last_hidden``). Only the decoder stack runs (no LM head: on small targets the vocab
projection is a large share of the compute and its logits are not stored).

Batches are right-padded with an attention mask; with causal attention a real token never
attends to the padding after it, so each sample's rows equal an unbatched run (up to float
rounding of different matmul shapes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from specdraft.errors import SpecdraftError
from specdraft.hidden_states.layers import LayerSlot
from specdraft.targets.families import family_of


def find_decoder(model: Any) -> tuple[torch.nn.Module, torch.nn.ModuleList, torch.nn.Module]:
    """(decoder stack, its layer list, its final norm), as the target's family defines them (``targets/families.py``)."""
    parts = family_of(model).decoder_parts(model)
    return parts.decoder, parts.layers, parts.norm


def pad_right(sequences: Sequence[torch.Tensor], *, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack 1-D id tensors into ``input_ids`` [B, T_max] and ``attention_mask`` [B, T_max]."""
    if not sequences:
        raise SpecdraftError("cannot capture hidden states of an empty batch")
    longest = max(int(s.shape[0]) for s in sequences)
    ids = torch.full((len(sequences), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), longest), dtype=torch.long)
    for i, s in enumerate(sequences):
        if s.dim() != 1 or s.shape[0] == 0:
            raise SpecdraftError(f"sequence {i} of the batch must be a non-empty 1-D tensor of token ids, got shape {list(s.shape)}")
        ids[i, : s.shape[0]] = s
        mask[i, : s.shape[0]] = 1
    return ids, mask


class HiddenStateCapture:
    """Runs a target's decoder and returns, per sample, ``hidden_states`` [T, S, D] and ``last_hidden`` [T, D].

    Slot ``s`` of ``hidden_states`` is ``slots[s]`` in the order given. Results stay on the
    model's device and dtype; :class:`~specdraft.hidden_states.payload.HiddenStatePayload`
    casts them for storage.
    """

    def __init__(self, model: Any, slots: Sequence[LayerSlot]):
        self.model = model
        self.decoder, self.layers, self.norm = find_decoder(model)
        if not slots:
            raise SpecdraftError("no layer slots requested")
        for slot in slots:
            slot.check(len(self.layers))
        self.slots = list(slots)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def __call__(self, sequences: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        ids, mask = pad_right(sequences)
        captured: dict[Any, torch.Tensor] = {}
        with record_slots(self.layers, self.slots, captured, final_norm=self.norm):
            self.decoder(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False)
        if "last" not in captured:
            raise SpecdraftError(f"the final norm of {type(self.model).__name__} was never called; cannot capture last_hidden")
        stacked = torch.stack([captured[s] for s in self.slots], dim=2)  # [B, T_max, S, D]
        lengths = [int(s.shape[0]) for s in sequences]
        return [(stacked[i, :n], captured["last"][i, :n]) for i, n in enumerate(lengths)]


@contextlib.contextmanager
def record_slots(
    layers: Sequence[Any] | torch.nn.ModuleList, slots: Sequence[LayerSlot], captured: dict, *, final_norm: Any = None
) -> Iterator[None]:
    """Hook decoder ``layers`` so that one forward pass stores each slot's tensor in ``captured``
    (pre-hook = the layer's input, hook = its output) and, with ``final_norm``, the norm's input under
    ``"last"``. The hooks are always removed afterwards."""
    handles = []

    def save(key: Any, value: Any) -> None:
        tensor = value[0] if isinstance(value, (tuple, list)) else value
        if key in captured:
            raise SpecdraftError(f"{key} was reached twice in one forward pass; this decoder is not supported")
        captured[key] = tensor.detach()

    def save_input(key: Any) -> Callable[[Any, tuple, dict], None]:
        return lambda module, args, kwargs: save(key, args[0] if args else kwargs["hidden_states"])

    for slot in dict.fromkeys(slots):
        if slot.side == "input":
            handles.append(layers[slot.layer].register_forward_pre_hook(save_input(slot), with_kwargs=True))
        else:
            handles.append(layers[slot.layer].register_forward_hook(lambda module, args, output, slot=slot: save(slot, output)))
    if final_norm is not None:
        handles.append(final_norm.register_forward_pre_hook(save_input("last"), with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
