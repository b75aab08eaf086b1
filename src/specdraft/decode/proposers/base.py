"""The interface between the decoding runtime and anything that proposes draft tokens.

Each round the runtime hands a proposer a :class:`ProposalInput` and verifies the returned
:class:`Draft` with one target forward. Proposers that read target features (EAGLE-3, DFlash,
DSpark) declare the ``LayerSlot``s they need in ``layer_slots``; the runtime captures exactly those
slots during its own target forwards and passes on the ones for *newly verified* positions, so a
drafter can extend its draft KV cache incrementally (reference behaviour in all three papers:
"the accepted tokens' target features are appended each round").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specdraft.decode.sampling import SamplingConfig
from specdraft.hidden_states.layers import LayerSlot
from specdraft.registry import Registry


@dataclass
class ProposalInput:
    """One round's view of the R active requests (rows), in batch order.

    Shape symbols: R active requests, N_r positions new to the target cache for row r, S slots
    (``Proposer.layer_slots`` order), D target hidden size.

    row_ids:    R request indices (stable across rounds; finished requests disappear)
    tokens:     R tensors [L_r] int64: every committed token of the request, prompt included. The
                last one is the *anchor*: committed but not yet run through the target; drafts
                continue after it.
    new_hidden: R tensors [N_r, S, D], or None when the proposer asked for no slots: target hidden
                states of positions new_start[r] .. new_start[r] + N_r - 1 (the whole prompt on
                the first round, then the previous anchor plus the drafts accepted after it)
    new_start:  R ints, the position (index into ``tokens``) of new_hidden[r][0]
    max_draft:  [R] int64 the most drafts the runtime will verify for each row this round
    sampling:   the transform the target uses; a sampling drafter must draw from the same one
    generator:  the runtime's random generator (keeps seeded runs reproducible)
    """

    row_ids: list[int]
    tokens: list[torch.Tensor]
    new_hidden: list[torch.Tensor] | None
    new_start: list[int]
    max_draft: torch.Tensor
    sampling: SamplingConfig
    generator: torch.Generator


@dataclass
class Draft:
    """Proposed tokens for R rows.

    Shape symbols: R rows, K drafted positions (any K >= 0; the runtime verifies at most
    ``max_draft``), V target vocabulary.

    tokens:      [R, K] int64 draft tokens in *target* vocabulary ids (entries past lengths[r] are ignored)
    lengths:     [R] int64 valid drafts per row
    probs:       [R, K, V] float, the distribution each token was sampled from (after the
                 sampling transform), or None when proposals are deterministic (a point mass)
    confidences: [R, K] float in [0, 1], c_{r,j} = P(x_j accepted | earlier accepted), computed
                 without looking at x_j; None when the proposer has no confidence head
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    probs: torch.Tensor | None = None
    confidences: torch.Tensor | None = None

    @classmethod
    def empty(cls, rows: int, device: torch.device | str = "cpu") -> Draft:
        return cls(
            tokens=torch.zeros((rows, 0), dtype=torch.long, device=device), lengths=torch.zeros(rows, dtype=torch.long, device=device)
        )


class Proposer(ABC):
    """Proposes draft tokens; see the module docstring for the contract."""

    layer_slots: tuple[LayerSlot, ...] = ()  # target hidden states it reads (captured by the runtime)
    provides_confidences: bool = False  # fills Draft.confidences (needed by the threshold/scheduled policies)
    confidences_calibrated: bool = False  # those confidences went through `specdraft calibrate`
    block_length: int | None = None  # drafts per round fixed by the model (a DFlash/DSpark block); None: config.num_draft_tokens

    @abstractmethod
    def propose(self, inputs: ProposalInput) -> Draft:
        """Draft up to ``inputs.max_draft[r]`` tokens for every row."""

    def release(self, row_ids: Sequence[int]) -> None:
        """Forget per-request state (draft KV caches) of finished requests; stateless proposers keep nothing."""


ProposerFactory = Callable[..., Proposer]
"""``factory(config: DecodeConfig, target: Target | None) -> Proposer`` (model-free proposers accept None)."""

PROPOSERS: Registry[ProposerFactory] = Registry("drafter")
