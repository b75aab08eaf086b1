"""Prompt-lookup (n-gram) drafting: no model, no training.

The last n tokens of the context are searched for earlier in the same context (prompt and output
so far); the tokens that followed the match are proposed. Strong on inputs that copy from the
prompt (summaries, code edits, extraction) and the baseline every learned drafter must beat.
Proposals are deterministic, so their draft distribution is a point mass (``Draft.probs=None``).
"""

from __future__ import annotations

import torch

from specdraft.decode.config import DecodeConfig
from specdraft.decode.proposers.base import PROPOSERS, Draft, ProposalInput, Proposer
from specdraft.decode.verification import PAD
from specdraft.targets.base import Target


def prompt_lookup(context: torch.Tensor, *, max_ngram: int, min_ngram: int, max_tokens: int) -> torch.Tensor:
    """Continuation [<= max_tokens] of the longest suffix n-gram (max_ngram down to min_ngram) seen earlier.

    Among earlier matches of that n-gram, the most recent one that still has ``max_tokens``
    tokens after it wins (recent text predicts best); if none has, the one with the longest
    continuation (the earliest).

    Example: context [5 6 7 9 5 6], max_ngram 2, max_tokens 3: suffix [5 6] matches at 0, and
    the proposal is [7 9 5].
    """
    length = int(context.shape[0])
    if max_tokens <= 0:
        return context[:0]
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        windows = context[:-1].unfold(0, n, 1)  # windows that end before the suffix's last token
        hits = (windows == context[-n:]).all(dim=1).nonzero().squeeze(1)
        if hits.numel() == 0:
            continue
        full = hits[length - (hits + n) >= max_tokens]
        start = int(full[-1] if full.numel() else hits[0]) + n
        return context[start : start + max_tokens]
    return context[:0]


class NgramProposer(Proposer):
    """Prompt lookup over each request's own tokens; stateless."""

    def __init__(self, *, max_ngram: int, min_ngram: int):
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, inputs: ProposalInput) -> Draft:
        rows = len(inputs.tokens)
        width = int(inputs.max_draft.max()) if rows else 0
        tokens = torch.full((rows, width), PAD, dtype=torch.long)
        lengths = torch.zeros(rows, dtype=torch.long)
        for i, context in enumerate(inputs.tokens):
            found = prompt_lookup(context.cpu(), max_ngram=self.max_ngram, min_ngram=self.min_ngram, max_tokens=int(inputs.max_draft[i]))
            tokens[i, : found.numel()] = found
            lengths[i] = found.numel()
        device = inputs.max_draft.device
        return Draft(tokens=tokens.to(device), lengths=lengths.to(device))


@PROPOSERS.register("ngram")
def build_ngram(config: DecodeConfig, target: Target | None = None) -> Proposer:
    return NgramProposer(max_ngram=config.ngram_max, min_ngram=config.ngram_min)
