"""EAGLE-3 loss: soft cross-entropy against the target distribution on the draft vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def soft_ce_rows(*, draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Per-row -sum_v p_t(v) log p_d(v); both [R, Vd] over the draft vocabulary -> [R]."""
    target = F.softmax(target_logits.float(), dim=-1)
    return -(target * F.log_softmax(draft_logits.float(), dim=-1)).sum(-1)


def step_weights(steps: int, decay: float) -> list[float]:
    """decay**j for unroll step j = 0..steps-1 (the reference uses 0.8)."""
    return [decay**j for j in range(steps)]
