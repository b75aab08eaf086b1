"""Reduced draft vocabulary (EAGLE-3, DFlash, DSpark): the N most frequent response tokens.

Stored as vLLM/speculators expect: ``d2t`` int64[N] offsets with ``target_id = i + d2t[i]`` and
``t2d`` bool[V] membership. Draft ids are the selected target ids in ascending order, so both
tables are monotone and a draft id maps back with one addition.

N is either given or chosen by coverage: the smallest N whose top-N ids account for at least a
fraction ``coverage`` of all counted response-token occurrences (``coverage_vocab_size``).
Both use one frequency order (``frequency_order``), so a coverage-chosen N selects exactly the
ids that covered the fraction.
"""

from __future__ import annotations

import torch

from specdraft.errors import SpecdraftError


def _check_counts(counts: torch.Tensor) -> torch.Tensor:
    counts = torch.as_tensor(counts)
    if counts.ndim != 1:
        raise SpecdraftError(f"token counts must be a 1-D int64[V] table, got shape {tuple(counts.shape)}")
    return counts.to(torch.int64)


def frequency_order(counts: torch.Tensor) -> torch.Tensor:
    """Target ids by decreasing count, ties broken by lower id first -> int64[V]."""
    return torch.sort(-_check_counts(counts), stable=True).indices


def coverage_vocab_size(counts: torch.Tensor, coverage: float) -> int:
    """Smallest N whose N most frequent ids hold >= ``coverage`` of all occurrences in ``counts``.

    Worked example: counts [5, 0, 3, 2] (10 occurrences), coverage 0.8 -> ids 0, 2 hold 8/10 -> N = 2.
    """
    counts = _check_counts(counts)
    if not 0.0 < coverage <= 1.0:
        raise SpecdraftError(f"draft_vocab_coverage {coverage} must be in (0, 1]")
    total = int(counts.sum())
    if total <= 0:
        raise SpecdraftError("token counts are all zero; cannot choose a draft vocabulary by coverage (is token_counts.safetensors empty?)")
    cumulative = torch.cumsum(counts[frequency_order(counts)], 0).double()
    # First index whose running total reaches the target share (searchsorted's left side).
    need = torch.tensor([coverage * total], dtype=torch.float64)
    return int(torch.searchsorted(cumulative, need)[0]) + 1


def build_draft_vocab(counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the ``size`` most frequent ids of ``counts`` int64[V] (ties: lower id first).

    Returns (d2t int64[size], t2d bool[V]).
    """
    counts = _check_counts(counts)
    vocab = counts.numel()
    if not 0 < size <= vocab:
        raise SpecdraftError(f"draft_vocab_size {size} must be in 1..{vocab} (the target vocabulary size)")
    ids = torch.sort(frequency_order(counts)[:size]).values
    d2t = ids - torch.arange(size, dtype=torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def draft_ids(d2t: torch.Tensor) -> torch.Tensor:
    """The target ids of the draft vocabulary, int64[N]."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


def target_to_draft(t2d: torch.Tensor, target_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Map target ids to draft ids: (draft ids, same shape, 0 where absent; bool in-vocab mask).

    Draft ids are the members of ``t2d`` in ascending order, so a member's draft id is the number
    of members below it.
    """
    rank = torch.cumsum(t2d.to(torch.int64), 0) - 1
    inside = t2d[target_ids]
    return torch.where(inside, rank[target_ids], torch.zeros_like(target_ids)), inside


def check_vocab_tables(d2t: torch.Tensor, t2d: torch.Tensor, *, where: str) -> None:
    """Raise if ``d2t``/``t2d`` disagree (a corrupt or hand-edited checkpoint)."""
    ids = draft_ids(d2t)
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        raise SpecdraftError(f"{where}: d2t must be int64 and t2d bool, got {d2t.dtype} and {t2d.dtype}")
    # Strictly increasing ids all inside t2d, as many as t2d holds: the same set, in the order
    # target_to_draft (and speculators' t2d-selected head rows) assume.
    increasing = bool((ids[1:] > ids[:-1]).all())
    if int(t2d.sum()) != d2t.numel() or not increasing or ids.min() < 0 or ids.max() >= t2d.numel() or not bool(t2d[ids].all()):
        raise SpecdraftError(f"{where}: d2t and t2d describe different draft vocabularies; re-export the checkpoint")


def install_draft_vocab(
    counts: torch.Tensor, size: int, *, d2t: torch.Tensor, t2d: torch.Tensor, head: torch.nn.Linear, target_head: torch.Tensor
) -> None:
    """Select a drafter's ``size`` draft ids from response-token ``counts`` int64[V] into its
    ``d2t``/``t2d`` buffers and start its draft head ``head`` [N, D] from the target head's rows
    for those ids (``target_head`` [V, D], the drafter's ``verifier_lm_head``), the reference initialisation."""
    new_d2t, new_t2d = build_draft_vocab(counts, size)
    if new_t2d.numel() != t2d.numel():
        raise SpecdraftError(f"token counts cover {new_t2d.numel()} ids but the target vocabulary has {t2d.numel()}")
    with torch.no_grad():
        d2t.copy_(new_d2t)
        t2d.copy_(new_t2d)
        head.weight.copy_(target_head[draft_ids(d2t)])
