"""The runtime's target cache: attention K/V that grows without a copy per forward, and recurrent states
that roll back per row.

Attention layers: ``DynamicLayer.update`` concatenates, so every forward copies each layer's whole
K/V, a cost that grows with the context. Here each layer writes new columns into a buffer with spare
capacity (grown by doubling) and hands attention a view of the filled part; ``crop`` and batch
selection keep the buffer. Keys and values are the same tensors a ``DynamicCache`` would return, so
outputs are bit-identical (tested). Rejected drafts stay behind as masked holes (``decode/runtime.py``), and
sliding-window layers forget leading columns no query reaches any more (``drop_front``; which ones:
``targets/attention.WindowTrim``, by position, since holes make a count wrong).

Linear-attention layers (Qwen3-Next / Qwen3.5 gated delta nets, Kimi-Linear's KDA) hold a recurrent
state and a short-convolution window instead, and a state that absorbed a rejected draft cannot be
masked. So a verify forward records the state after every one of its columns (HF's past recording:
the block's tokens run through the per-token recurrence) and ``rollback`` hands each row the state and
window at its own last accepted token -- vLLM's design (one state per draft position), not a replay.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicIndexedLayer, DynamicLayer, LinearAttentionLayer

from specdraft.errors import SpecdraftError

_Layer = TypeVar("_Layer", bound=DynamicLayer)

#: Columns a layer's buffer holds beyond what it needs when it (re)allocates: the verify blocks of a few rounds.
SPARE_COLUMNS = 64


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys/values are views into buffers [B, H, capacity, D], columns ``start`` to ``start +
    length``: ``drop_front`` moves ``start`` (a sliding-window layer forgetting columns no query will attend again)
    without a copy, and a regrow copies only the live columns, so such a layer's memory stays bounded by its window."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self._start = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        key_buffer, value_buffer = self._key_buffer, self._value_buffer
        if (
            key_buffer is None
            or value_buffer is None
            or self._start + length + key_states.shape[-2] > key_buffer.shape[-2]
            or not self._holds_views(key_buffer, value_buffer)
        ):
            keys, values = self._filled()
            key_buffer = self._key_buffer = _regrow(keys, key_states, length, length + key_states.shape[-2])
            value_buffer = self._value_buffer = _regrow(values, value_states, length, length + key_states.shape[-2])
            self._start = 0
        begin, end = self._start + length, self._start + length + key_states.shape[-2]
        key_buffer[..., begin:end, :] = key_states
        value_buffer[..., begin:end, :] = value_states
        self.keys = key_buffer[..., self._start : end, :]
        self.values = value_buffer[..., self._start : end, :]
        return self.keys, self.values

    def drop_front(self, columns: int) -> None:
        """Forget the first ``columns`` columns (every row's), keeping the rest in place."""
        if columns:
            keys, values = self._filled()
            self.keys, self.values = keys[..., columns:, :], values[..., columns:, :]
            self._start += columns

    def _filled(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values, which HF types as optional: they are None only before ``lazy_initialization``."""
        if self.keys is None or self.values is None:
            raise SpecdraftError("GrowingLayer read before its first update: it holds no keys/values yet")
        return self.keys, self.values

    def _holds_views(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor) -> bool:
        """Whether keys/values are still views of the buffers (a crop keeps them; other HF code may have replaced them)."""
        keys, values = self._filled()
        return all(
            t.numel() == 0 or t.data_ptr() == buffer[..., self._start :, :].data_ptr()
            for t, buffer in ((keys, key_buffer), (values, value_buffer))
        )

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


class RecurrentLayer(LinearAttentionLayer):
    """HF's linear-attention cache layer, plus batch selection and a per-row rollback after a recorded forward."""

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        # HF annotates torch.LongTensor, a legacy class no tensor is an instance of; any int64 index tensor is what it takes
        self.reorder_cache(indices)  # type: ignore[arg-type]

    def state_bytes(self) -> int:
        """Bytes of this layer's conv windows and recurrent states (all rows), as held between forwards."""
        tensors = [*self.conv_states.values(), *self.recurrent_states.values()]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def rollback(self, kept: torch.Tensor, new: int) -> None:
        """After a recorded forward of ``new`` columns, keep the first ``kept[r]`` of them in row ``r`` (0: none):
        its recurrent state is the one recorded after that column, its conv window the last ``kernel`` inputs
        up to it. The history is dropped and recording ends."""
        rows = torch.arange(kept.shape[0], device=kept.device)
        for i in range(self.number_of_states):
            if self.is_conv_states_initialized[i]:
                full, width = self.conv_states[i], self.conv_kernel_size[i]  # [R, C, width + new]
                if full is None or width is None:
                    raise SpecdraftError(f"linear-attention layer marks conv state {i} initialized but holds no state or kernel size")
                if full.shape[-1] != width + new:
                    raise SpecdraftError(
                        f"linear-attention conv state holds {full.shape[-1]} columns, expected {width} + {new} after a recorded forward"
                    )
                index = (kept.to(full.device)[:, None] + torch.arange(width, device=full.device)[None])[:, None, :]
                self.conv_states[i] = full.gather(-1, index.expand(full.shape[0], full.shape[1], width)).contiguous()
            if self.is_recurrent_states_initialized[i]:
                last = self.recurrent_states[i]
                if last is None:
                    raise SpecdraftError(f"linear-attention layer marks recurrent state {i} initialized but holds none")
                history = [*self.recurrent_states_history[i], last]  # the state before the forward, then after each column
                if len(history) != new + 1:
                    raise SpecdraftError(f"linear-attention layer recorded {len(history) - 1} states for a {new}-column forward")
                self.recurrent_states[i] = torch.stack(history)[kept.to(history[0].device), rows.to(history[0].device)]
                self.recurrent_states_history[i] = []
        self.cumulative_length_linear.sub_(new - int(kept.max()))
        self.record_past = False


#: HF layer types whose cache is not plain K/V columns, and the layer that holds it: a recurrent state (+ conv window),
#: or K/V plus the sparse-attention indexer's keys (GLM-5 / DeepSeek-V3.2 DSA; cropped with the K/V, holes masked in both)
SPECIAL_LAYERS: dict[str, type] = {"linear_attention": RecurrentLayer, "indexed_attention": DynamicIndexedLayer}


class GrowingCache(DynamicCache):
    """A ``DynamicCache`` (models that check the type still see one): ``GrowingLayer``s for attention and, given a
    config whose ``layer_types`` name them, ``SPECIAL_LAYERS`` for linear-attention and indexed-attention layers."""

    def __init__(self, config: Any = None) -> None:
        types = list(getattr(config, "layer_types", None) or []) if config is not None else []
        if not set(SPECIAL_LAYERS) & set(types):
            Cache.__init__(self, layer_class_to_replicate=GrowingLayer)
            return
        Cache.__init__(self, layers=[SPECIAL_LAYERS.get(t, GrowingLayer)() for t in types])

    @property
    def recurrent(self) -> list[RecurrentLayer]:
        return [layer for layer in self.layers if isinstance(layer, RecurrentLayer)]

    def record(self, columns: int) -> None:
        """Before a forward of ``columns`` new columns that ``rollback`` may shorten: recurrent layers record the
        state after each column (HF runs those columns through the per-token recurrence)."""
        for layer in self.recurrent:
            layer.activate_past_recording(recurrent_states_to_keep=columns)

    def drop_front(self, layers: list[int], columns: int) -> None:
        """Forget the first ``columns`` columns of attention ``layers`` (sliding-window ones no query reaches back to)."""
        for i in layers:
            if columns and i < len(self.layers):
                layer = _layer_as(GrowingLayer, self.layers[i], i)
                if layer.is_initialized:  # a layer that shares another's K/V holds none
                    layer.drop_front(columns)

    def rollback(self, kept: torch.Tensor, new: int) -> None:
        """Keep the first ``kept[r]`` of the last forward's ``new`` columns in row ``r``: attention layers drop the
        columns no row kept (the rest of a shorter row's are masked holes), recurrent layers go back per row."""
        longest = int(kept.max())
        for i, layer in enumerate(self.layers):
            if isinstance(layer, RecurrentLayer):
                layer.rollback(kept, new)
            elif longest < new:
                _layer_as(DynamicLayer, layer, i).crop(longest - new)


def _layer_as(kind: type[_Layer], layer: object, index: int) -> _Layer:
    """``layer`` (HF types a cache's layers as a union) as the ``kind`` of attention layer ``GrowingCache`` built there."""
    if not isinstance(layer, kind):
        raise SpecdraftError(f"target cache layer {index} is a {type(layer).__name__}, not a {kind.__name__}")
    return layer
