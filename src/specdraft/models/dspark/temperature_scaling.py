"""Sequential Temperature Scaling (DSpark paper): calibrate the confidence head for the scheduler.

The scheduler ranks draft prefixes by their survival a_j = prod_{i<=j} c_i, so what must be
calibrated is the *cumulative product*, not each c_k alone. For k = 1..B in order, one temperature
T_k is grid-searched to minimise the expected calibration error (ECE) of prod_{i<=k} sigmoid(z_i/T_i)
against the observed survival prod_{i<=k} accept_i, with T_1..T_{k-1} already fixed.

Worked example (B = 2): T_1 is chosen on ECE(sigmoid(z_1/T_1), acc_1); then, keeping T_1, T_2 on
ECE(sigmoid(z_1/T_1) * sigmoid(z_2/T_2), acc_1 * acc_2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdraft.errors import SpecdraftError

DEFAULT_GRID = tuple(round(0.25 * 1.1**i, 4) for i in range(40))  # 0.25 .. ~10, geometric


def expected_calibration_error(predicted: torch.Tensor, observed: torch.Tensor, *, bins: int = 15) -> float:
    """Equal-width-bin ECE: sum_b |bin| / n * |mean(predicted) - mean(observed)| over [0, 1] bins."""
    if predicted.numel() == 0:
        return 0.0
    index = (predicted.clamp(0, 1) * bins).long().clamp(max=bins - 1)
    count = torch.bincount(index, minlength=bins).float()
    pred_sum = torch.bincount(index, weights=predicted.double(), minlength=bins)
    obs_sum = torch.bincount(index, weights=observed.double(), minlength=bins)
    gap = (pred_sum - obs_sum).abs()  # = count * |mean pred - mean obs|
    return float(gap.sum() / count.sum())


@dataclass(frozen=True)
class CalibrationResult:
    temperatures: list[float]  # T_k per block position
    ece_before: list[float]  # ECE of the cumulative product per position, all T = 1
    ece_after: list[float]
    counts: list[int]  # blocks whose prefix up to position k is supervised

    def to_json(self) -> dict:
        return {"temperatures": self.temperatures, "ece_before": self.ece_before, "ece_after": self.ece_after, "counts": self.counts}


def sequential_temperature_scaling(
    *, logits: torch.Tensor, accept: torch.Tensor, valid: torch.Tensor, grid: tuple[float, ...] = DEFAULT_GRID, bins: int = 15
) -> CalibrationResult:
    """logits, accept, valid: [N, B] -> per-position temperatures (see module docstring).

    ``accept`` is 0/1 (greedy verification) or an acceptance probability (sampling); ``valid`` marks
    supervised positions (a prefix of each block). Positions with no data keep T = 1. NaN or inf at a supervised
    position is refused: the ECE bins would index with it (a bare ``bincount`` error), and no temperature fits it.
    """
    bad = valid.bool() & ~(torch.isfinite(logits) & torch.isfinite(accept))
    if bad.any():
        block, position = (int(x) for x in bad.nonzero()[0])
        raise SpecdraftError(
            f"{int(bad.sum())} supervised confidence logit(s) or acceptance(s) are NaN or inf (the first at "
            f"block {block}, draft position {position + 1}): the drafter's confidence head gave them, so no "
            "temperature can be fitted"
        )
    logits, accept = logits.double(), accept.double()
    temps: list[float] = []
    before: list[float] = []
    after: list[float] = []
    counts: list[int] = []
    survival_cal = torch.ones(logits.shape[0], dtype=torch.float64)
    survival_raw = torch.ones_like(survival_cal)
    observed = torch.ones_like(survival_cal)
    for k in range(logits.shape[1]):
        rows = valid[:, : k + 1].all(dim=1)
        observed = observed * accept[:, k]
        raw = survival_raw * torch.sigmoid(logits[:, k])
        counts.append(int(rows.sum()))
        if not rows.any():
            temps.append(1.0)
            before.append(0.0)
            after.append(0.0)
        else:
            before.append(expected_calibration_error(raw[rows], observed[rows], bins=bins))
            scores = [
                expected_calibration_error((survival_cal * torch.sigmoid(logits[:, k] / t))[rows], observed[rows], bins=bins) for t in grid
            ]
            best = min(range(len(grid)), key=lambda i: (scores[i], abs(grid[i] - 1.0)))
            temps.append(float(grid[best]))
            after.append(scores[best])
        survival_cal = survival_cal * torch.sigmoid(logits[:, k] / temps[-1])
        survival_raw = raw
    return CalibrationResult(temps, before, after, counts)
