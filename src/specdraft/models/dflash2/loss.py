"""DFlash2's loss terms: the selector objective (speculators'
``selector_training_candidates`` + K-way cross-entropy)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def training_candidates(unary: torch.Tensor, labels: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """unary logits [R, V], labels [R] -> (candidates [R, k], label index [R], label in the unary top-k [R]).

    The candidates are the unary top-k the runtime reranks; where the label is missing it replaces the
    weakest, so every row has a K-way target without scoring the whole vocabulary. Such rows cannot be
    drafted correctly at decode time and count as misses in the accuracy.
    """
    candidates = unary.detach().topk(top_k, dim=-1).indices
    match = candidates == labels[:, None]
    found = match.any(-1)
    candidates[:, -1] = torch.where(found, candidates[:, -1], labels)
    index = torch.where(found, match.to(torch.int64).argmax(-1), top_k - 1)
    return candidates, index, found


def selector_ce(scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """scores [R, k], label index [R] -> per-row cross-entropy [R]."""
    return F.cross_entropy(scores.float(), index, reduction="none")
