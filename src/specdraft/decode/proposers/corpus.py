"""Lookup in the target's own answers: the continuation the target most often wrote after the context's last tokens.

Prompt lookup (``ngram.py``) only finds text the request already holds, so it is silent on open-ended answers.
The answers ``specdraft prepare`` had the target regenerate are a corpus of how *this* target writes: after
"Here is", after "```python\\n", after a list item's number. ``AnswerCorpus`` indexes every 2- to 4-token context
in them with the token that followed it most often and how often (its share of the context's continuations),
and ``propose`` chains those continuations while the context keeps matching. Like Arctic Inference's suffix
decoding (a tree over earlier outputs), and like prompt lookup it costs no model call: a few hash lookups.

Lossless: a proposal is a function of committed tokens and the fixed corpus only (a point mass), so rejection
sampling verifies it exactly as it does prompt lookup's.

Index: for each context length n, contexts are hashed (a polynomial in their token ids, wrapping int64) into
a sorted array beside the most frequent next token and its share; a lookup is a binary search. A hash
collision can only propose a wrong token, which verification rejects.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from specdraft.errors import SpecdraftError, setting

if TYPE_CHECKING:
    from specdraft.data.dataset import PreparedDataset


#: Context lengths indexed, longest tried first; a 1-token context predicts too little to be worth a verify slot.
CONTEXT_LENGTHS = (4, 3, 2)
#: A context seen fewer times than this proposes nothing. 1: a context the target wrote once still predicts its
#: next token often enough to pay a verify slot (``benchmarks/lookup_sim.py``, exact greedy replay: tau 1.324 -> 1.372 on
#: the quick suite, 1.506 -> 1.566 on held-out answers, against 2; docs/results/lookup_sim*.md).
MIN_OCCURRENCES = 1
#: Chaining stops at a continuation with a smaller share of its context's occurrences.
MIN_SHARE = 0.2
_MULTIPLIER = np.int64(1_000_003)


@dataclass(frozen=True)
class CorpusMatch:
    """A corpus proposal: ``tokens`` (may be empty), the context length that matched its first token and that
    token's share of the context's continuations (what the hybrid buckets acceptance by)."""

    tokens: list[int]
    context: int = 0
    share: float = 0.0

    @property
    def bucket(self) -> tuple[str, int, int]:
        """("corpus", context length, share in tenths): acceptance is measured per bucket."""
        return ("corpus", self.context, min(int(self.share * 10), 9))


def _hash(windows: np.ndarray) -> np.ndarray:
    """[N, n] int64 token windows -> [N] int64 hashes (wrapping arithmetic)."""
    h = np.zeros(windows.shape[0], dtype=np.int64)
    with np.errstate(over="ignore"):
        for column in windows.T:
            h = h * _MULTIPLIER + column + 1
    return h


class AnswerCorpus:
    """Most frequent continuation of every 2-4 token context in a set of answers; see the module docstring.

    The thresholds default to the module's constants; ``benchmarks/lookup_sim.py`` sweeps them."""

    def __init__(
        self,
        answers: Iterable[np.ndarray],
        *,
        source: str = "",
        context_lengths: tuple[int, ...] = CONTEXT_LENGTHS,
        min_occurrences: int = MIN_OCCURRENCES,
        min_share: float = MIN_SHARE,
    ):
        if not context_lengths or min(context_lengths) < 1 or min_occurrences < 1 or not 0.0 <= min_share <= 1.0:
            raise SpecdraftError(
                f"answer corpus: need context lengths >= 1, min_occurrences >= 1 and 0 <= min_share <= 1, got "
                f"{context_lengths}, {min_occurrences}, {min_share}"
            )
        self.source = source
        self.context_lengths = tuple(sorted(context_lengths, reverse=True))
        self.min_share = min_share
        self._tables: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        answers = [np.asarray(a, dtype=np.int64) for a in answers]
        self.tokens = int(sum(len(a) for a in answers))
        for n in self.context_lengths:
            keys, nexts = [], []
            for answer in answers:
                if len(answer) > n:
                    keys.append(_hash(np.lib.stride_tricks.sliding_window_view(answer[:-1], n)))
                    nexts.append(answer[n:])
            if not keys:
                self._tables[n] = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32))
                continue
            self._tables[n] = _most_frequent(np.concatenate(keys), np.concatenate(nexts), min_occurrences)

    @classmethod
    def from_prepared(cls, directory: str | os.PathLike, *, tokenizer_hash: str | None = None) -> AnswerCorpus:
        """The answers (loss-masked tokens) of a ``specdraft prepare`` output; refused when the dataset was
        tokenized for another tokenizer than the target's (``tokenizer_hash``)."""
        from specdraft.data.dataset import PreparedDataset

        dataset = PreparedDataset(directory)
        recorded = dataset.target_info.get("tokenizer_hash")
        if tokenizer_hash is not None and recorded != tokenizer_hash:
            raise SpecdraftError(
                f"{setting('lookup_corpus')} {directory}: prepared with tokenizer {recorded!r}, but "
                f"the target's is {tokenizer_hash!r}; "
                "prepare the corpus for this target"
            )
        corpus = cls(prepared_answers(dataset, range(len(dataset))), source=str(Path(directory)))
        if not corpus.tokens:
            raise SpecdraftError(f"{setting('lookup_corpus')} {directory}: the dataset holds no answer tokens (loss_mask is all 0)")
        return corpus

    def propose(self, context: list[int], max_tokens: int) -> CorpusMatch:
        """Up to ``max_tokens`` continuations chained from the end of ``context``."""
        tokens: list[int] = []
        longest = self.context_lengths[0]
        window = list(context[-longest:])
        first = (0, 0.0)
        while len(tokens) < max_tokens:
            found = self._continuation(window)
            if found is None:
                break
            token, n, share = found
            if tokens and share < self.min_share:
                break
            if not tokens:
                first = (n, share)
            tokens.append(token)
            window = window[1:] + [token] if len(window) >= longest else window + [token]
        return CorpusMatch(tokens, *first)

    def _continuation(self, window: list[int]) -> tuple[int, int, float] | None:
        """(next token, context length, share) of the longest indexed suffix of ``window``, or None."""
        for n in self.context_lengths:
            if len(window) < n:
                continue
            keys, nexts, shares = self._tables[n]
            key = _hash(np.asarray([window[-n:]], dtype=np.int64))[0]
            at = int(np.searchsorted(keys, key))
            if at < len(keys) and keys[at] == key:
                return int(nexts[at]), n, float(shares[at])
        return None


def _most_frequent(keys: np.ndarray, nexts: np.ndarray, min_occurrences: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per distinct key seen at least ``min_occurrences`` times: its most frequent next token and that token's share."""
    order = np.lexsort((nexts, keys))
    keys, nexts = keys[order], nexts[order]
    pair_start = np.flatnonzero(np.r_[True, (keys[1:] != keys[:-1]) | (nexts[1:] != nexts[:-1])])
    pair_count = np.diff(np.r_[pair_start, len(keys)])
    pair_key, pair_next = keys[pair_start], nexts[pair_start]
    key_start = np.flatnonzero(np.r_[True, pair_key[1:] != pair_key[:-1]])
    totals = np.add.reduceat(pair_count, key_start)
    best = np.maximum.reduceat(pair_count, key_start)
    # the first pair of each key with the best count (pairs are sorted by next token: ties go to the smaller id)
    is_best = pair_count == np.repeat(best, np.diff(np.r_[key_start, len(pair_key)]))
    first_best = np.minimum.reduceat(np.where(is_best, np.arange(len(pair_key)), len(pair_key)), key_start)
    keep = totals >= min_occurrences
    return pair_key[key_start][keep], pair_next[first_best][keep], (best / totals).astype(np.float32)[keep]


def prepared_answers(dataset: PreparedDataset, rows: Iterable[int]) -> list[np.ndarray]:
    """Every answer (run of loss-masked tokens: one per assistant turn) of the prepared ``rows``."""
    answers = []
    for i in rows:
        row = dataset[i]
        ids, mask = row["input_ids"].numpy(), row["loss_mask"].numpy().astype(bool)
        answers += [ids[lo:hi] for lo, hi in answer_runs(mask)]
    return answers


def answer_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[lo, hi) of every run of True in ``mask``."""
    edges = np.flatnonzero(np.diff(np.r_[0, mask.astype(np.int8), 0]))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))
