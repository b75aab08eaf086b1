"""Drawing draft tokens, and what a drafter hands the verifier."""

from __future__ import annotations

from collections.abc import Callable
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


def sample_token(
    logits: torch.Tensor, *, temperature: float, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [V] -> (token [] int64, probs [V]); at T <= 0 the argmax and None (a point mass)."""
    if temperature <= 0:
        _check_finite(logits)
        return logits.argmax(-1), None
    return _draw(logits, temperature=temperature, generator=generator)


def _draw(logits: torch.Tensor, *, temperature: float, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample_token`` at T > 0, where there is always a distribution: (token [] int64, probs [V])."""
    _check_finite(logits)
    probs = F.softmax(logits.float() / temperature, dim=-1)
    token = torch.multinomial(probs, 1, generator=generator)[0]
    return token, probs


def sample_tokens(
    logits: torch.Tensor, *, temperature: float, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Independent draws from each row: logits [K, V] -> (tokens [K], probs [K, V] | None); at T <= 0 one argmax
    over the block."""
    if temperature <= 0:
        _check_finite(logits)
        return logits.argmax(-1), None
    drawn = [_draw(row, temperature=temperature, generator=generator) for row in logits]
    return torch.stack([t for t, _ in drawn]), torch.stack([p for _, p in drawn])


class Chain:
    """The draws of a chain drafter (each token conditions the next: DSpark's Markov steps, EAGLE-3's, DFlash2's
    selector). At T=0 each draw is an argmax and the finiteness check runs once over the whole chain in ``result``
    (a per-step check costs ~50 us a token here, 7 of them a DSpark block): a NaN step yields some id, never a crash,
    and the chain is refused before anything reads it. At T > 0 every draw is checked before ``multinomial``."""

    def __init__(self, *, temperature: float, generator: torch.Generator | None = None):
        self.temperature = temperature
        self.generator = generator
        self.tokens: list[torch.Tensor] = []
        self._seen: list[torch.Tensor] = []  # T=0: each step's logits, checked in ``result``
        self._probs: list[torch.Tensor] = []  # T>0: the distributions drawn from

    def draw(self, logits: torch.Tensor, *, probs_of: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Draw one token from ``logits`` [V] and keep it; ``probs_of`` maps the drawn distribution to what the
        chain reports (e.g. from a candidate set back to the vocabulary)."""
        if self.temperature <= 0:
            self._seen.append(logits)
            token = logits.argmax(-1)
        else:
            token, probs = _draw(logits, temperature=self.temperature, generator=self.generator)
            self._probs.append(probs if probs_of is None else probs_of(probs))
        self.tokens.append(token)
        return token

    def result(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(tokens [K], probs [K, V] | None: None at T=0, where every draw was a point mass)."""
        if self._seen:
            _check_finite(torch.stack(self._seen))
        return torch.stack(self.tokens), torch.stack(self._probs) if self._probs else None
