"""Reduced draft vocabulary (EAGLE-3): the N most frequent response tokens.

Stored as vLLM/speculators expect: ``d2t`` int64[N] offsets with ``target_id = i + d2t[i]`` and
``t2d`` bool[V] membership. Draft ids are the selected target ids in ascending order, so both
tables are monotone and a draft id maps back with one addition.
"""

from __future__ import annotations

import torch

from specdraft.errors import SpecdraftError


def build_draft_vocab(counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the ``size`` most frequent ids of ``counts`` int64[V] (ties: lower id first).

    Returns (d2t int64[size], t2d bool[V]).
    """
    counts = torch.as_tensor(counts)
    if counts.ndim != 1:
        raise SpecdraftError(f"token counts must be a 1-D int64[V] table, got shape {tuple(counts.shape)}")
    vocab = counts.numel()
    if not 0 < size <= vocab:
        raise SpecdraftError(f"draft_vocab_size {size} must be in 1..{vocab} (the target vocabulary size)")
    # Stable sort on -count keeps lower ids first among equal counts.
    order = torch.sort(-counts.to(torch.int64), stable=True).indices[:size]
    ids = torch.sort(order).values
    d2t = ids - torch.arange(size, dtype=torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def draft_ids(d2t: torch.Tensor) -> torch.Tensor:
    """The target ids of the draft vocabulary, int64[N]."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


def check_vocab_tables(d2t: torch.Tensor, t2d: torch.Tensor, *, where: str) -> None:
    """Raise if ``d2t``/``t2d`` disagree (a corrupt or hand-edited checkpoint)."""
    ids = draft_ids(d2t)
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        raise SpecdraftError(f"{where}: d2t must be int64 and t2d bool, got {d2t.dtype} and {t2d.dtype}")
    if int(t2d.sum()) != d2t.numel() or ids.min() < 0 or ids.max() >= t2d.numel() or not bool(t2d[ids].all()):
        raise SpecdraftError(f"{where}: d2t and t2d describe different draft vocabularies; re-export the checkpoint")
