"""DSpark's Markov head from bigram statistics (the ``markov_init=bigram`` warm start).

W1 (Embedding(V, r), or its compact [N + 1, r] form) and W2 (Linear(r, N)) start from a rank-r truncated SVD of
the smoothed bigram log-odds log P(next | prev) - log P(next) of the training split's response tokens,
restricted to the most frequent tokens that have a W1 row / a draft id; see ``bigram_log_odds``. Memory: the
table is at most ``BIGRAM_MAX_TOKENS`` squared and everything else is per pair or per target id, never [V, V].
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from specdraft.errors import SpecdraftError
from specdraft.models.base import WarmStartData

log = logging.getLogger(__name__)

# Bigram statistics: at most this many prev / next tokens (the most frequent) get a factorised
# bias; rarer ones get 0. 4096^2 float32 = 64 MB.
BIGRAM_MAX_TOKENS = 4096
# Additive smoothing towards the unigram: P(n|p) = (c(p,n) + ALPHA * P(n)) / (c(p) + ALPHA), so a
# previous token seen a few times moves the bias only a little.
BIGRAM_ALPHA = 4.0
# The log-odds are the full correction for a backbone that predicts only the unigram; the backbone
# already sees the context, so the bias starts at half of it (a few logits for strong bigrams,
# next to LM-head logits spread over ~10).
BIGRAM_SCALE = 0.5


def bigram_counts(rows: Sequence[tuple[np.ndarray, np.ndarray]], vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prev ids int64[P], next ids int64[P], counts int64[P]) of the pairs (x_t, x_{t+1}) with
    x_{t+1} a response token: what the Markov head sees (x_{k-1}, the anchor included, -> x_k)."""
    keys = []
    for ids, mask in rows:
        ids = np.asarray(ids, dtype=np.int64)
        mask = np.asarray(mask, dtype=bool)
        if ids.size < 2:
            continue
        keep = mask[1:]
        keys.append(ids[:-1][keep] * vocab_size + ids[1:][keep])
    if not keys:
        raise SpecdraftError("markov_init=bigram: the training split holds no response-token pairs; set markov_init: random")
    uniq, counts = np.unique(np.concatenate(keys), return_counts=True)
    return uniq // vocab_size, uniq % vocab_size, counts


def bigram_log_odds(prev: np.ndarray, nxt: np.ndarray, counts: np.ndarray, *, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Smoothed, row-centred log P(next | prev) - log P(next) over the ``rows`` x ``cols`` token ids
    (float32 [R, C]); pairs outside them are ignored. Row centring drops what a softmax ignores."""
    ri, ci = _positions(prev, rows), _positions(nxt, cols)
    keep = (ri >= 0) & (ci >= 0)
    table = torch.zeros(len(rows), len(cols), dtype=torch.float32)
    table.index_put_((torch.from_numpy(ri[keep]), torch.from_numpy(ci[keep])), torch.from_numpy(counts[keep]).float(), accumulate=True)
    unigram = (table.sum(0) + 1.0) / (table.sum() + len(cols))  # P(next) over the columns, add-one
    cond = (table + BIGRAM_ALPHA * unigram) / (table.sum(1, keepdim=True) + BIGRAM_ALPHA)
    odds = cond.log() - unigram.log()
    return odds - odds.mean(1, keepdim=True)


def _positions(ids: np.ndarray, members: torch.Tensor) -> np.ndarray:
    """Index of each id in the sorted ``members``, -1 where absent."""
    lookup = np.full(max(int(ids.max()), int(members.max())) + 1, -1, dtype=np.int64)
    lookup[members.numpy()] = np.arange(members.numel())
    return lookup[ids]


def _frequent(ids: np.ndarray, counts: np.ndarray, among: torch.Tensor, limit: int) -> torch.Tensor:
    """The ``limit`` most frequent ids of ``among`` (frequency = ``counts`` summed per id) that occur, sorted."""
    total = np.bincount(ids, weights=counts, minlength=int(among.max()) + 1)
    freq = torch.from_numpy(total[among.numpy()])
    seen = among[freq > 0]
    top = torch.argsort(freq[freq > 0], descending=True, stable=True)[:limit]
    return torch.sort(seen[top]).values


def init_markov_bigram(drafter: Any, inputs: WarmStartData) -> list[str]:
    from specdraft.models.common.vocab import draft_ids

    head = drafter.markov_head
    w1, w2 = head.markov_w1.weight, head.markov_w2.weight  # [V or N + 1, r], [N, r]
    vocab, rank = drafter.config.vocab_size, w1.shape[1]
    d2t = getattr(drafter, "d2t", None)
    out_ids = draft_ids(d2t).cpu() if d2t is not None else torch.arange(w2.shape[0])  # target id of each W2 row
    if out_ids.numel() != w2.shape[0]:
        raise SpecdraftError(f"markov_init=bigram: the drafter's d2t has {out_ids.numel()} entries but W2 has {w2.shape[0]} rows")
    # Previous tokens with a W1 row of their own: the draft ids when W1 is compact (the shared row
    # of all other ids stays 0), else every target id.
    own = out_ids if head.row_of is not None else torch.arange(vocab)
    prev, nxt, counts = bigram_counts(inputs.token_rows(), vocab)
    rows = _frequent(prev, counts, own, BIGRAM_MAX_TOKENS)
    cols = _frequent(nxt, counts, out_ids, BIGRAM_MAX_TOKENS)
    if rows.numel() == 0 or cols.numel() == 0:
        raise SpecdraftError(
            "markov_init=bigram: no bigram of the training split falls in the drafter's vocabulary; set markov_init: random"
        )
    odds = bigram_log_odds(prev, nxt, counts, rows=rows, cols=cols)
    k = min(rank, *odds.shape)
    with torch.random.fork_rng(devices=[]):  # svd_lowrank draws a random basis: the same on every rank
        torch.manual_seed(int(inputs.seed))
        u, s, v = torch.svd_lowrank(odds, q=k, niter=4)
    root = (s * BIGRAM_SCALE).sqrt()
    w1.zero_()
    w2.zero_()
    w1[rows if head.row_of is None else head.row_of[rows].cpu(), :k] = (u * root).to(w1.dtype)
    row_of = torch.full((int(out_ids.max()) + 1,), -1, dtype=torch.int64)
    row_of[out_ids] = torch.arange(out_ids.numel())
    w2[row_of[cols], :k] = (v * root).to(w2.dtype)
    log.info(
        "markov_init=bigram: rank-%d factorisation of the bigram log-odds over %d prev x %d next tokens (%d pairs)",
        k,
        rows.numel(),
        cols.numel(),
        int(counts.sum()),
    )
    return ["markov_head.markov_w1.weight", "markov_head.markov_w2.weight"]
