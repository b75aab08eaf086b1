"""Measured acceptance of proposals, learned from the tokens each row commits next.

A lookup (prompt lookup, suffix drafting) gives no confidences, but its proposals are point masses: a proposal's
j-th token matches what the row commits next exactly with its acceptance probability, whether or not it was
verified (greedy or sampled: the committed text is the target's own). So every proposal can be scored
against the row's next committed tokens, and acceptance measured per *bucket* (the lookup's match length,
or its corpus context and share) estimates the next proposal's: ``LookupScores``. The ``ngram`` and
``suffix`` proposers hand those estimates to the verify policy as confidences (``@scheduled`` prices each
row's verify length with them and the target's SPS profile); the hybrid prices its lookup branch with them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class AcceptanceStats:
    """Measured conditional acceptance per draft position j (P(x_j accepted | x_<j accepted)),
    shrunk towards ``prior`` by ``strength`` pseudo-rounds so that a few rounds do not swing it."""

    prior: float = 0.5
    strength: float = 2.0
    tried: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def rates(self, length: int) -> list[float]:
        """P(x_j accepted | x_<j accepted) for j = 1..length."""
        return [
            ((self.accepted[j] if j < len(self.accepted) else 0) + self.prior * self.strength)
            / ((self.tried[j] if j < len(self.tried) else 0) + self.strength)
            for j in range(length)
        ]

    def survival(self, length: int) -> list[float]:
        """a_1..a_length: the chance that the first j drafts are all accepted."""
        out, a = [], 1.0
        for rate in self.rates(length):
            a *= rate
            out.append(a)
        return out

    def record(self, *, tried: int, accepted: int) -> None:
        """A proposal whose first ``tried`` positions were judged and first ``accepted`` of them passed."""
        grow = tried - len(self.tried)
        if grow > 0:
            self.tried += [0] * grow
            self.accepted += [0] * grow
        for j in range(tried):
            self.tried[j] += 1
            self.accepted[j] += j < accepted


@dataclass
class Proposed:
    """A row's last proposal, scored against what was committed after it."""

    tokens: list[int]
    verified: int  # drafts sent to verification (the verify policy may have cut further)
    context: int  # committed tokens when it was proposed
    bucket: Hashable  # the lookup's bucket: its prompt match's length, or its corpus match's (context, share)


def score(proposed: Proposed, context: torch.Tensor, stats: AcceptanceStats, *, anywhere: bool) -> None:
    """Record how far ``proposed`` matched the tokens committed after it (``context`` is the row's committed
    tokens now): judged up to its whole length where a match means acceptance whether verified or not
    (``anywhere``), else up to what was verified."""
    committed = context[proposed.context :].tolist()
    judged = min(len(proposed.tokens), len(committed)) if anywhere else min(proposed.verified, len(committed))
    accepted = 0
    while accepted < judged and proposed.tokens[accepted] == committed[accepted]:
        accepted += 1
    stats.record(tried=min(judged, accepted + 1), accepted=accepted)


class LookupScores:
    """A lookup's acceptance per bucket (``prior`` before any is measured) and each row's last proposal."""

    def __init__(self, prior: float = 0.5):
        self.prior = prior
        self.by_bucket: dict[Hashable, AcceptanceStats] = {}
        self.last: dict[int, Proposed] = {}

    def stats(self, bucket: Hashable) -> AcceptanceStats:
        if bucket not in self.by_bucket:
            self.by_bucket[bucket] = AcceptanceStats(prior=self.prior)
        return self.by_bucket[bucket]

    def learn(self, row_id: int, context: torch.Tensor) -> None:
        """Score the row's last proposal against its committed tokens ``context``."""
        proposed = self.last.pop(row_id, None)
        if proposed is not None:
            score(proposed, context, self.stats(proposed.bucket), anywhere=True)

    def remember(self, row_id: int, proposed: Proposed) -> None:
        self.last[row_id] = proposed

    def release(self, row_ids: Sequence[int]) -> None:
        for rid in row_ids:
            self.last.pop(rid, None)
