"""Per-draft-position accuracy, shared by all methods."""

from __future__ import annotations

import torch


def position_metrics(correct: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """correct, valid: bool [R, K] (R chains, K draft positions, position k uses earlier ones).

    Returns (acc [K], cond_acc [K], count [K]): accuracy over valid labels, accuracy at k among
    chains whose positions < k were all valid and correct (what acceptance length depends on),
    and the number of valid labels at k.
    """
    correct = correct & valid
    prefix_ok = torch.cumprod(correct.int(), dim=1).bool()
    before_ok = torch.cat([torch.ones_like(prefix_ok[:, :1]), prefix_ok[:, :-1]], dim=1) & valid
    count = valid.sum(0).float()
    acc = correct.sum(0).float() / count.clamp(min=1)
    cond = (correct & before_ok).sum(0).float() / before_ok.sum(0).float().clamp(min=1)
    return acc, cond, count
