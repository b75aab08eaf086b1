"""Prompt-lookup (n-gram) drafting: no model, no training.

The last n tokens of the context are searched for earlier in the same context (prompt and output
so far); the tokens that followed the match are proposed. Strong on inputs that copy from the
prompt (summaries, code edits, extraction) and the baseline every learned drafter must beat.
``suffix`` drafting falls back, where the context holds no match, to what the target most often
wrote next in its own answers (``corpus.py``). Proposals are deterministic, so their draft
distribution is a point mass (``Draft.probs=None``). Their confidences are the acceptance measured so far
for proposals of the same bucket (``acceptance.LookupScores``): calibrated by construction, so
``ngram@scheduled`` / ``suffix@scheduled`` verify each row only as far as the target's measured step
costs say pays, where the default verifies every proposed token.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from specdraft.decode.config import DecodeConfig
from specdraft.decode.proposers.base import PROPOSERS, Draft, ProposalInput, Proposer
from specdraft.decode.proposers.corpus import AnswerCorpus
from specdraft.decode.proposers.lookup_scores import LookupScores, Proposed
from specdraft.decode.verification import PAD
from specdraft.errors import SpecdraftError, setting
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
        while (
            matched < MATCH_CAP
            and hit - (matched - n) - 1 >= 0
            and int(context[hit - (matched - n) - 1]) == int(context[length - matched - 1])
        ):
            matched += 1
        return LookupMatch(context[hit + n : hit + n + max_tokens], matched)
    return LookupMatch(context[:0], 0)


def prompt_lookup(context: torch.Tensor, *, max_ngram: int, min_ngram: int, max_tokens: int) -> torch.Tensor:
    """The continuation of :func:`lookup` alone."""
    return lookup(context, max_ngram=max_ngram, min_ngram=min_ngram, max_tokens=max_tokens).tokens


@dataclass(frozen=True)
class Lookup:
    """Prompt lookup, and where it finds nothing (and a ``corpus`` is given) the corpus' continuation."""

    max_ngram: int
    min_ngram: int
    corpus: AnswerCorpus | None = None

    def __call__(self, context: torch.Tensor, max_tokens: int) -> tuple[torch.Tensor, Hashable]:
        """(continuation [<= max_tokens], bucket): the prompt match's length, or the corpus match's ``bucket``;
        both functions of committed tokens only, so a choice made on them stays lossless."""
        match = lookup(context, max_ngram=self.max_ngram, min_ngram=self.min_ngram, max_tokens=max_tokens)
        if match.tokens.numel() or self.corpus is None or max_tokens <= 0:
            return match.tokens, match.match_length
        found = self.corpus.propose(context.tolist(), max_tokens)
        return torch.tensor(found.tokens, dtype=torch.long), found.bucket


class NgramProposer(Proposer):
    """Prompt lookup (with a corpus: suffix drafting) over each request's own tokens, with each proposal's measured
    per-bucket acceptance as its confidences."""

    provides_confidences = True
    confidences_calibrated = True  # measured acceptance rates, not a model's guess

    def __init__(self, *, max_ngram: int, min_ngram: int, corpus: AnswerCorpus | None = None):
        self.lookup = Lookup(max_ngram, min_ngram, corpus)
        self.scores = LookupScores()

    def propose(self, inputs: ProposalInput) -> Draft:
        rows = len(inputs.tokens)
        width = int(inputs.max_draft.max()) if rows else 0
        tokens = torch.full((rows, width), PAD, dtype=torch.long)
        confidences = torch.zeros((rows, width))
        lengths = torch.zeros(rows, dtype=torch.long)
        for i, (rid, context) in enumerate(zip(inputs.row_ids, inputs.tokens)):
            context = context.cpu()
            self.scores.learn(rid, context)
            found, bucket = self.lookup(context, int(inputs.max_draft[i]))
            k = found.numel()
            tokens[i, :k] = found
            confidences[i, :k] = torch.tensor(self.scores.stats(bucket).rates(k))
            lengths[i] = k
            self.scores.remember(rid, Proposed(found.tolist(), k, int(context.shape[0]), bucket))
        device = inputs.max_draft.device
        return Draft(tokens=tokens.to(device), lengths=lengths.to(device), confidences=confidences.to(device))

    def release(self, row_ids: Sequence[int]) -> None:
        self.scores.release(row_ids)


def answer_corpus(config: DecodeConfig, target: Target | None) -> AnswerCorpus:
    """``config.lookup_corpus``'s answers, for the target's tokenizer; a clear error when none is named."""
    if not config.lookup_corpus:
        raise SpecdraftError(
            f"{setting('drafter')} {config.drafter} drafts from the target's own answers: pass "
            f"{setting('lookup_corpus')} DATASET "
            "(a `specdraft prepare` output for this target, e.g. the quickstart's runs/NAME/data)"
        )
    return AnswerCorpus.from_prepared(config.lookup_corpus, tokenizer_hash=target.tokenizer_hash if target is not None else None)


@PROPOSERS.register("ngram")
def build_ngram(config: DecodeConfig, target: Target | None = None) -> Proposer:
    return NgramProposer(max_ngram=config.ngram_max, min_ngram=config.ngram_min)


@PROPOSERS.register("suffix")
def build_suffix(config: DecodeConfig, target: Target | None = None) -> Proposer:
    return NgramProposer(max_ngram=config.ngram_max, min_ngram=config.ngram_min, corpus=answer_corpus(config, target))
