"""The runtime's target KV cache: HF's ``DynamicCache`` semantics, without a copy of the whole cache per forward.

``DynamicLayer.update`` concatenates, so every forward copies each layer's whole K/V, a cost that
grows with the context. Here each layer writes new columns into a buffer with spare capacity
(grown by doubling) and hands attention a view of the filled part; ``crop`` and batch selection
keep the buffer. Keys and values are the same tensors a ``DynamicCache`` would return, so outputs
are bit-identical (tested).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

#: Columns a layer's buffer holds beyond what it needs when it (re)allocates: the verify blocks of a few rounds.
SPARE_COLUMNS = 64


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys/values are views into buffers [B, H, capacity, D] filled up to their length."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_buffer = self._value_buffer = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        end = length + key_states.shape[-2]
        if self._key_buffer is None or end > self._key_buffer.shape[-2] or not self._holds_views():
            self._key_buffer = _regrow(self.keys, key_states, length, end)
            self._value_buffer = _regrow(self.values, value_states, length, end)
        self._key_buffer[..., length:end, :] = key_states
        self._value_buffer[..., length:end, :] = value_states
        self.keys = self._key_buffer[..., :end, :]
        self.values = self._value_buffer[..., :end, :]
        return self.keys, self.values

    def _holds_views(self) -> bool:
        """Whether keys/values are still views of the buffers (a crop keeps them; other HF code may have replaced them)."""
        return (self.keys.numel() == 0 or self.keys.data_ptr() == self._key_buffer.data_ptr()) and (
            self.values.numel() == 0 or self.values.data_ptr() == self._value_buffer.data_ptr())

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)  # copies the kept rows out; the next update moves them into a new buffer
        self._key_buffer = self._value_buffer = None


def _regrow(filled: torch.Tensor, new: torch.Tensor, length: int, end: int) -> torch.Tensor:
    """A buffer shaped like ``new`` with room for max(2 * end, end + SPARE_COLUMNS) columns, holding ``filled[..., :length, :]``."""
    shape = list(new.shape)
    shape[-2] = max(2 * end, end + SPARE_COLUMNS)
    buffer = new.new_empty(shape)
    if length:
        buffer[..., :length, :] = filled[..., :length, :]
    return buffer


class GrowingCache(DynamicCache):
    """A ``DynamicCache`` (models that check the type still see one) whose layers are ``GrowingLayer``s."""

    def __init__(self) -> None:
        Cache.__init__(self, layer_class_to_replicate=GrowingLayer)
