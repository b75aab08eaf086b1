"""Prompt-lookup (n-gram) drafting: no model, no training.

The last n tokens of the context are searched for earlier in the same context (prompt and output
so far); the tokens that followed the match are proposed. Strong on inputs that copy from the
prompt (summaries, code edits, extraction) and the baseline every learned drafter must beat.
Proposals are deterministic, so their draft distribution is a point mass (``Draft.probs=None``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdraft.decode.config import DecodeConfig
from specdraft.decode.proposers.base import PROPOSERS, Draft, ProposalInput, Proposer
from specdraft.decode.verification import PAD
from specdraft.targets.base import Target


@dataclass(frozen=True)
class LookupMatch:
    """A lookup's continuation and how long its match is.

    tokens:       [<= max_tokens] int64 the proposed continuation (empty: no match)
    match_length: how many context tokens before the continuation's source equal the context's
                  suffix (>= the n-gram that matched, at most ``MATCH_CAP``; 0 without a match):
                  a function of committed tokens only, so a choice made on it stays lossless
    """

    tokens: torch.Tensor
    match_length: int


#: Match lengths are counted up to this: beyond it a match is "long" and its acceptance no longer changes much.
MATCH_CAP = 16


def lookup(context: torch.Tensor, *, max_ngram: int, min_ngram: int, max_tokens: int) -> LookupMatch:
    """Continuation [<= max_tokens] of the longest suffix n-gram (max_ngram down to min_ngram) seen earlier.

    Among earlier matches of that n-gram, the most recent one that still has ``max_tokens``
    tokens after it wins (recent text predicts best); if none has, the one with the longest
    continuation (the earliest).

    Example: context [5 6 7 9 5 6], max_ngram 2, max_tokens 3: suffix [5 6] matches at 0, and
    the proposal is [7 9 5] (match length 2: nothing precedes position 0).
    """
    length = int(context.shape[0])
    if max_tokens <= 0:
        return LookupMatch(context[:0], 0)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        windows = context[:-1].unfold(0, n, 1)  # windows that end before the suffix's last token
        hits = (windows == context[-n:]).all(dim=1).nonzero().squeeze(1)
        if hits.numel() == 0:
            continue
        full = hits[length - (hits + n) >= max_tokens]
        hit = int(full[-1] if full.numel() else hits[0])
        matched = n
        while matched < MATCH_CAP and hit - (matched - n) - 1 >= 0 and int(context[hit - (matched - n) - 1]) == int(context[length - matched - 1]):
            matched += 1
        return LookupMatch(context[hit + n : hit + n + max_tokens], matched)
    return LookupMatch(context[:0], 0)


def prompt_lookup(context: torch.Tensor, *, max_ngram: int, min_ngram: int, max_tokens: int) -> torch.Tensor:
    """The continuation of :func:`lookup` alone."""
    return lookup(context, max_ngram=max_ngram, min_ngram=min_ngram, max_tokens=max_tokens).tokens


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
