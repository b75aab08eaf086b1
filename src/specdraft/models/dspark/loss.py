"""DSpark loss terms (per block position), pure functions of logits.

L = ce_weight*CE(hard label) + l1_weight*D(p_d, p_t) + bce_weight*BCE(c_k, 1 - 0.5*||p_d - p_t||_1)
with p_d the Markov-corrected softmax at T=1 (teacher-forced previous tokens), D the config's ``distill_loss``
(``models/common/distill_losses.py``; the paper's ||p_d - p_t||_1 by default), the BCE target
detached, each term weighted per position (``models/common/weights.py``: exp(-k/gamma), or D-PACE with
q = 1 - 0.5*||p_d - p_t||_1, the slot's acceptance probability) and normalised by the weight sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdraft.models.common.distill_losses import DistillLoss, Distributions, l1_loss


def block_terms(
    *,
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    labels: torch.Tensor,
    confidence_logits: torch.Tensor | None,
    distill: DistillLoss = l1_loss,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """draft/target logits [..., V], labels [...], confidence logits [...] -> (ce, l1, distill, bce) each [...].
    ``l1`` feeds the acceptance estimate (BCE target, D-PACE weights) whatever ``distill`` is."""
    ce = F.cross_entropy(draft_logits.flatten(0, -2).float(), labels.flatten(), reduction="none").view_as(labels)
    pair = Distributions(draft_logits, target_logits)
    l1, div = pair.l1, distill(pair)
    if confidence_logits is None:
        return ce, l1, div, torch.zeros_like(l1)
    bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), soft_acceptance(l1), reduction="none")
    return ce, l1, div, bce


def soft_acceptance(l1: torch.Tensor) -> torch.Tensor:
    """1 - 0.5*||p_d - p_t||_1, detached: the slot's acceptance probability under rejection sampling."""
    return (1.0 - 0.5 * l1).detach().clamp(0.0, 1.0)
