"""Which rows of a sample this process trains on: the hook that lets one long sample be split across ranks.

The block drafters' forwards take a :class:`SequenceShard`. The base class is the whole row (one process,
N = 1): every method returns its input, so the single-process path runs exactly the operations it always did.
Sequence parallelism (``train/sequence_parallel.py``) subclasses it with torch.distributed collectives; the
model code is the same for both, and it calls the hooks at the only places a block depends on other rows:

* ``context_kv``: the draft layers' injected context K/V, [N, G, M, E] of this rank's rows -> all M of the row
  (a block attends to every context key before its anchor, wherever that key lives);
* ``segment_ids`` / ``loss_mask``: the whole row's metadata, [N, T] (anchor sampling and the attention mask
  read the row, never its hidden states);
* ``own``: this rank's rows of a per-token tensor, dropping the halo (the local batch carries ``halo`` extra
  rows of tokens, labels and ``last_hidden`` after its own, so a block anchored near the shard's end finds its
  labels);
* ``anchors``: the whole row's anchors (sampled identically on every rank) -> this rank's, as local rows;
* ``total``: a sum over the ranks of a loss numerator, denominator or metric count, so a loss normalised by
  the whole row's weight sum is N = 1's.

Shape symbols: N batch rows, T rows of the whole sample, G key/value heads, E head dim, A anchors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

KV = tuple[torch.Tensor, torch.Tensor]
LabelProb = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class SequenceShard:
    """The whole row (N = 1). Subclasses hold 1/N of it; see the module docstring."""

    start: int = 0  # the whole row's index of this rank's first row

    def own(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token tensor [N, T_local (+ halo), ...] -> this rank's rows [N, T_local, ...]."""
        return x

    def segment_ids(self, local: torch.Tensor) -> torch.Tensor:
        """The whole row's segment ids [N, T] (``local``: this rank's batch field)."""
        return local

    def loss_mask(self, local: torch.Tensor) -> torch.Tensor:
        """The whole row's loss mask [N, T]."""
        return local

    def anchors(self, anchors: torch.Tensor) -> torch.Tensor:
        """The whole row's anchors int64 [N, A] (-1 = none) -> this rank's, as local rows, [N, A'] (-1 = none)."""
        return anchors

    def global_anchors(self, anchors: torch.Tensor) -> torch.Tensor:
        """Local anchors [N, A] (-1 = none) -> their rows in the whole sample (what the attention mask compares with)."""
        return anchors

    def context_kv(self, kv: KV) -> KV:
        """This rank's context (k, v) [N, G, T_local, E] -> the whole row's [N, G, T, E] (gradients flow back)."""
        return kv

    def total(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks (gradients flow back); the identity for one process."""
        return x

    def label_prob(self, fn: LabelProb) -> LabelProb:
        """``fn(rows, local positions)`` -> the same over the whole row's positions (every rank gets every value)."""
        return fn


WHOLE_ROW = SequenceShard()
