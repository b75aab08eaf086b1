"""EAGLE-3 loss: the config's ``distill_loss`` (default ``soft_ce``, soft cross-entropy against the target
distribution; ``models/common/distill_losses.py``) on the draft vocabulary, summed over unroll steps with these weights."""

from __future__ import annotations


def step_weights(steps: int, decay: float) -> list[float]:
    """decay**j for unroll step j = 0..steps-1 (the reference uses 0.8)."""
    return [decay**j for j in range(steps)]
