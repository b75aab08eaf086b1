"""Drawing draft tokens, and what a drafter hands the verifier."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdraft.errors import SpecdraftError


@dataclass
class DraftProposal:
    """One round of draft tokens for one sequence.

    tokens:      [K] int64   target-vocabulary ids, in order
    probs:       [K, V] float | None  the exact distribution each token was drawn from; rejection sampling
                              divides the target's probabilities by these. None at T=0: each token is an
                              argmax, a point mass, as a lookup's drafts are (``Draft.probs``), so a greedy
                              round builds no full-vocabulary tables
    confidences: [K] float | None  DSpark's c_k = P(x_k accepted | earlier accepted)
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None
    confidences: torch.Tensor | None = None


def _check_finite(logits: torch.Tensor) -> None:
    """NaN or +inf logits, or a row with no finite one (a drafter whose activations overflow), are an error, not a
    crash in ``multinomial`` or a garbage argmax; -inf alone marks ids outside a draft vocabulary."""
    if bool(torch.isnan(logits).any() | torch.isposinf(logits).any() | torch.isneginf(logits).all(-1).any()):
        raise SpecdraftError(
            "the drafter produced non-finite logits (NaN/inf): its weights are broken or its activations overflow in this "
            "dtype; decode in float32, use an earlier checkpoint or retrain it"
        )


def sample_token(logits: torch.Tensor, *, temperature: float, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [V] -> (token [] int64, probs [V]); at T <= 0 the argmax and None (a point mass)."""
    _check_finite(logits)
    if temperature <= 0:
        return logits.argmax(-1), None
    probs = F.softmax(logits.float() / temperature, dim=-1)
    token = torch.multinomial(probs, 1, generator=generator)[0]
    return token, probs


def sample_tokens(logits: torch.Tensor, *, temperature: float, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Independent draws from each row: logits [K, V] -> (tokens [K], probs [K, V] | None); at T <= 0 one argmax
    over the block."""
    if temperature <= 0:
        _check_finite(logits)
        return logits.argmax(-1), None
    drawn = [sample_token(row, temperature=temperature, generator=generator) for row in logits]
    return torch.stack([t for t, _ in drawn]), torch.stack([p for _, p in drawn])


def stacked(probs: list[torch.Tensor | None]) -> torch.Tensor | None:
    """Per-token distributions [K, V] of a chain drawn with ``sample_token``, or None where they were argmaxes."""
    return None if not probs or probs[0] is None else torch.stack(probs)
