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
    probs:       [K, V] float the exact distribution each token was drawn from (one-hot at T=0);
                              rejection sampling divides the target's probabilities by these
    confidences: [K] float | None  DSpark's c_k = P(x_k accepted | earlier accepted)
    """

    tokens: torch.Tensor
    probs: torch.Tensor
    confidences: torch.Tensor | None = None


def sample_token(logits: torch.Tensor, *, temperature: float, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [V] -> (token [] int64, probs [V]); argmax with a one-hot distribution at T <= 0.

    NaN or +inf logits, or no finite one (a drafter whose activations overflow), are an error, not a
    crash in ``multinomial`` or a garbage argmax; -inf alone marks ids outside a draft vocabulary.
    """
    if bool(torch.isnan(logits).any() | torch.isposinf(logits).any() | torch.isneginf(logits).all()):
        raise SpecdraftError(
            "the drafter produced non-finite logits (NaN/inf): its weights are broken or its activations overflow in this "
            "dtype; decode in float32, use an earlier checkpoint or retrain it"
        )
    if temperature <= 0:
        token = logits.argmax(-1)
        return token, F.one_hot(token, logits.shape[-1]).to(torch.float32)
    probs = F.softmax(logits.float() / temperature, dim=-1)
    token = torch.multinomial(probs, 1, generator=generator)[0]
    return token, probs
