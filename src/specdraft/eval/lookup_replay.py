"""Lookup drafting replayed on greedy text: the exact greedy tau of a lookup setting without a target forward.

Under greedy verification the committed text is the target's greedy continuation whatever is drafted, and a round
commits the longest common prefix of the proposal and that continuation plus one token (the correction or bonus).
A lookup proposal (prompt lookup, suffix drafting: ``decode/proposers/ngram.Lookup``) depends only on committed
tokens, so replaying a known greedy continuation round by round gives the very rounds the runtime would run --
``tests/test_corpus.py`` checks this against the runtime -- in microseconds a round instead of a target forward.
``benchmarks/lookup_sim.py`` sweeps the corpus' thresholds and the draft length with it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ReplayRound:
    proposed: int  # tokens the lookup proposed (the verify forward takes proposed + 1)
    accepted: int  # of them, the prefix equal to the greedy continuation


def replay(lookup: Callable, ids: np.ndarray, start: int, stop: int, max_tokens: int) -> list[ReplayRound]:
    """The rounds of decoding ``ids[start:stop]`` greedily after ``ids[:start]`` with ``lookup`` drafting at most
    ``max_tokens`` a round. As in the runtime, the prefill commits ``ids[start]`` (no round), and a round never drafts
    past the last token to generate."""
    import torch

    context = torch.as_tensor(np.asarray(ids, dtype=np.int64))
    rounds, at = [], start + 1
    while at < stop:
        proposal, _ = lookup(context[:at], min(max_tokens, stop - at - 1))
        proposal = proposal.numpy()
        same = proposal == np.asarray(ids[at : at + len(proposal)])
        accepted = len(proposal) if same.all() else int(np.argmin(same))
        rounds.append(ReplayRound(len(proposal), accepted))
        at += accepted + 1
    return rounds


@dataclass(frozen=True)
class ReplaySummary:
    tokens: int
    rounds: int
    tau: float  # committed tokens per round (bonus included)
    drafted_share: float  # rounds that verified a proposal
    mean_proposed: float  # proposal length, over those rounds
    accepted_per_proposed: float
    speedup_est: float  # autoregressive time / replayed time, both priced by ``cost_ms``


def summarize(rounds: Sequence[ReplayRound], cost_ms: dict[int, float]) -> ReplaySummary:
    """Tau and the speed-up the rounds would give if a forward of k tokens costs ``cost_ms[k]`` (capped at the
    table's largest k; e.g. ``benchmarks/forward_path.py``'s measured table), the lookup itself costing nothing."""
    if not rounds:
        raise ValueError("no rounds to summarize")
    tokens = sum(r.accepted + 1 for r in rounds)
    widest = max(cost_ms)
    spent = sum(cost_ms[min(r.proposed + 1, widest)] for r in rounds)
    drafted = [r for r in rounds if r.proposed]
    return ReplaySummary(
        tokens=tokens,
        rounds=len(rounds),
        tau=tokens / len(rounds),
        drafted_share=len(drafted) / len(rounds),
        mean_proposed=float(np.mean([r.proposed for r in drafted])) if drafted else 0.0,
        accepted_per_proposed=sum(r.accepted for r in drafted) / max(1, sum(r.proposed for r in drafted)),
        speedup_est=tokens * cost_ms[1] / spent,
    )
