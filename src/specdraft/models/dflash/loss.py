"""DFlash loss: hard-label cross-entropy over the block's draft slots, weighted per position
(``models/common/weights.py``) and normalised by the weight sum."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from specdraft.models.common.sequence import WHOLE_ROW


def ce_rows(*, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-row hard-label cross-entropy, logits [R, V], labels [R] -> [R]."""
    return F.cross_entropy(logits.float(), labels, reduction="none")


def weighted_mean(
    values: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor, *, total: Callable[[torch.Tensor], torch.Tensor] = WHOLE_ROW.total
) -> torch.Tensor:
    """sum(w * v) / sum(w) over valid entries; values/valid [..., K], weights [K] or [..., K]. ``total`` sums both
    over the ranks that share one sample (sequence parallelism), so the mean is the whole sample's."""
    w = weights * valid.to(weights.dtype)
    return total((values * w).sum()) / total(w.sum()).clamp(min=math.ulp(1.0))
