"""A target's attention layout (which layers see a sliding window, and how wide) and the masks that honour it.

Why the runtime builds its own masks: it keeps rejected drafts in the KV cache as masked-out holes
(``decode/runtime.py``), so a cache column's index is not its token's position. HF derives the
sliding window from cache indices (``kv_idx > q_idx - window``) and its sliding caches drop old
columns by count, so with holes a window would cover fewer real tokens than the target was
trained with. Here a column's position is the number of valid columns up to it minus one, and a
query at position ``p`` attends to valid columns at positions ``p - window < q <= p``: the same
tokens an unbatched, hole-free run attends to, in every layer.

Masks are boolean (1 byte a cell, True = attend) where the model runs HF's ``sdpa`` attention, which
hands them to torch's SDPA as they are; other implementations (eager: gpt-oss's sinks) add the mask to
the scores, so they get an additive float mask (4 bytes a cell). Either way a mask is R x Q x C: the
runtime bounds Q at prefill (``decode/runtime.py``), so a long prompt never builds a prompt-squared mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specdraft.errors import SpecdraftError

FULL = "full_attention"
SLIDING = "sliding_attention"
#: a linear-attention layer (gated delta net, KDA): no K/V columns; its mask is the new columns' [R, Q] validity,
#: which zeroes padding inputs so that they leave the recurrent state as it was (``decode/kv_cache.py`` rolls back the rest)
LINEAR = "linear_attention"
#: full attention over the columns a sparse indexer picks (GLM-5 DSA); the indexer masks its scores with the same mask
INDEXED = "indexed_attention"


@dataclass
class WindowTrim:
    """The columns sliding-window layers no longer hold: the first ``start`` cache columns (every row's), of which
    ``offset`` [R] were valid in each row (so positions of the held columns still count from the row's first token)."""

    start: int
    offset: torch.Tensor

    def advance(self, valid: torch.Tensor, next_positions: torch.Tensor, window: int) -> int:
        """How many more leading columns no future query reaches: queries come at positions >= ``next_positions`` [R]
        and attend keys at positions > query - ``window``, so a column is done in a row when it is a hole or padding,
        or its position is <= next - window; the run of columns done in every row is dropped. Returns that count."""
        held = valid[:, self.start :]
        positions = held.long().cumsum(1) - 1 + self.offset[:, None]
        done = ~held | (positions <= (next_positions - window)[:, None])
        columns = int(done.all(0).long().cumprod(0).sum())  # leading run only: later columns may still be needed
        if columns:
            self.offset = self.offset + held[:, :columns].sum(1)
            self.start += columns
        return columns

    def select(self, index: torch.Tensor) -> None:
        self.offset = self.offset[index]


@dataclass(frozen=True)
class AttentionLayout:
    """Per decoder layer: its HF layer type and its window in tokens (None = full attention)."""

    layer_types: tuple[str, ...]
    windows: dict[str, int | None]  # layer type -> window
    boolean: bool = False  # the model's attention takes boolean masks (HF sdpa), else additive float masks

    @classmethod
    def from_config(cls, text_config: Any) -> AttentionLayout:
        """Read ``layer_types`` + ``sliding_window`` (Gemma 3, Qwen3, ...) or, without ``layer_types``, one
        window for every layer when ``sliding_window`` is set (Mistral, Qwen3-MoE), else full attention."""
        layers = int(text_config.num_hidden_layers)
        window: Any = getattr(text_config, "sliding_window", None)  # an int > 0 wherever a layer slides (checked below)
        types = getattr(text_config, "layer_types", None)
        if types is None:
            types = [SLIDING if window is not None else FULL] * layers
        unknown = sorted(set(types) - {FULL, SLIDING, LINEAR, INDEXED})
        if unknown:
            raise SpecdraftError(
                f"{type(text_config).__name__}: layer types {unknown} are not supported "
                f"(specdraft handles {FULL!r}, {SLIDING!r}, {INDEXED!r} and {LINEAR!r} layers)"
            )
        if len(types) != layers:
            raise SpecdraftError(f"{type(text_config).__name__}: {len(types)} layer_types for {layers} layers")
        if SLIDING in types and not (isinstance(window, int) and window > 0):
            raise SpecdraftError(f"{type(text_config).__name__}: sliding-window layers but sliding_window={window!r}")
        boolean = getattr(text_config, "_attn_implementation", None) == "sdpa"
        return cls(tuple(types), {t: (int(window) if t == SLIDING else None) for t in set(types)}, boolean)

    @property
    def sliding_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == SLIDING]

    def window(self, layer: int) -> int | None:
        return self.windows[self.layer_types[layer]]

    def masks(
        self, valid: torch.Tensor, query_positions: torch.Tensor, dtype: torch.dtype, trimmed: WindowTrim | None = None
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """4-D masks [R, 1, Q, C] for queries at ``query_positions`` [R, Q] over cache columns ``valid`` [R, C] (the
        queries' own columns last): boolean (``self.boolean``) or additive in ``dtype``. One tensor when every layer
        has the same type (models such as Llama/Mistral take only that), else HF's per-layer-type dict (Gemma 3, Qwen3).
        A boolean row that allows no column (a padding query before its row's first token, at chunked prefill) allows
        them all instead: SDPA turns an empty row into NaN, which the cache would carry into that column's values.
        Linear-attention layers get the queries' own validity [R, Q] (HF zeroes the inputs it masks). Sliding-window
        layers whose first columns were dropped (``trimmed``) get a mask over the columns they still hold."""
        queries = query_positions[:, :, None]  # [R, Q, 1]
        seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        out = {}
        for kind, window in self.windows.items():
            if kind == LINEAR:
                out[kind] = valid[:, -query_positions.shape[1] :]
                continue
            start = trimmed.start if trimmed is not None and kind == SLIDING else 0
            if start not in seen:
                held = valid[:, start:]
                keys = (held.long().cumsum(1) - 1)[:, None, :]  # [R, 1, C] position of each valid column
                if start and trimmed is not None:  # start > 0 only for a trimmed sliding layer
                    keys = keys + trimmed.offset[:, None, None]  # valid columns before the ones held
                seen[start] = keys, held[:, None, :] & (keys <= queries)  # [R, Q, C], without a [R, Q, C] integer tensor
            keys, allowed = seen[start]
            keep = allowed if window is None else allowed & (keys > queries - window)
            if self.boolean:
                out[kind] = (keep | ~keep.any(-1, keepdim=True))[:, None]
            else:
                out[kind] = torch.zeros(keep.shape, dtype=dtype, device=valid.device).masked_fill_(~keep, torch.finfo(dtype).min)[:, None]
        return next(iter(out.values())) if len(out) == 1 else out
