"""DFlash loss: hard-label cross-entropy over the block's draft slots, weighted per position
(``models/common/weights.py``) and normalised by the weight sum."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def ce_rows(*, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-row hard-label cross-entropy, logits [R, V], labels [R] -> [R]."""
    return F.cross_entropy(logits.float(), labels, reduction="none")


def weighted_mean(values: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """sum(w * v) / sum(w) over valid entries; values/valid [..., K], weights [K] or [..., K]."""
    w = weights * valid.to(weights.dtype)
    return (values * w).sum() / w.sum().clamp(min=math.ulp(1.0))
