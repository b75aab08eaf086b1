"""DFlash loss: hard-label cross-entropy with exponentially decaying position weights."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def position_weights(num: int, gamma: float, *, device=None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for draft positions k = 1..num -> [num]."""
    k = torch.arange(1, num + 1, dtype=torch.float32, device=device)
    return torch.exp(-(k - 1) / gamma)


def ce_rows(*, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-row hard-label cross-entropy, logits [R, V], labels [R] -> [R]."""
    return F.cross_entropy(logits.float(), labels, reduction="none")


def weighted_mean(values: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """sum(w * v) / sum(w) over valid entries; values/valid [..., K], weights [K]."""
    w = weights * valid.to(weights.dtype)
    return (values * w).sum() / w.sum().clamp(min=math.ulp(1.0))
