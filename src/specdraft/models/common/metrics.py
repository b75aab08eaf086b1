"""Per-draft-position accuracy, shared by all methods."""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdraft.models.common.sequence import WHOLE_ROW


def position_metrics(
    correct: torch.Tensor, valid: torch.Tensor, *, total: Callable[[torch.Tensor], torch.Tensor] = WHOLE_ROW.total
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """correct, valid: bool [R, K] (R chains, K draft positions, position k uses earlier ones).

    Returns (acc [K], cond_acc [K], count [K]): accuracy over valid labels, accuracy at k among
    chains whose positions < k were all valid and correct (what acceptance length depends on),
    and the number of valid labels at k. ``total`` sums the counts over the ranks sharing one sample.
    """
    correct = correct & valid
    prefix_ok = torch.cumprod(correct.int(), dim=1).bool()
    before_ok = torch.cat([torch.ones_like(prefix_ok[:, :1]), prefix_ok[:, :-1]], dim=1) & valid
    sums = total(torch.stack([valid.sum(0), correct.sum(0), (correct & before_ok).sum(0), before_ok.sum(0)]).float())
    count = sums[0]
    acc = sums[1] / count.clamp(min=1)
    cond = sums[2] / sums[3].clamp(min=1)
    return acc, cond, count
