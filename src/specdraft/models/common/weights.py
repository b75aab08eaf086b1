"""Per-position loss weights of the block drafters (DFlash, DSpark): ``POSITION_WEIGHTS``, the drafter
config's ``position_weighting``.

Each is ``(q, hit, *, gamma, alpha) -> weights``, all [..., K] over a block's draft slots in order:
``q`` the drafter's current, detached estimate that the slot is accepted, ``hit`` whether the slot
has a label it can be scored on. The losses normalise by the weight sum, so only ratios matter.

* ``exp``: w_k = exp(-(k-1)/gamma), the same for every block (the DFlash and DSpark papers).
* ``dpace``: w_k = sum_{j>=k} prod_{i<=j} s_i with s_i = (1-alpha) q_i + alpha (D-PACE; speculators'
  default for DFlash). With alpha 0 this is the gradient of the block's expected accepted length
  sum_j prod_{i<=j} q_i with respect to log q_k: a slot counts by how much acceptance it can still
  unlock, so an untrained drafter spends its loss on the first slots (~1, 1/2, 1/4, ... at q ~ 0 and
  alpha 1/2) and later slots gain weight as earlier ones start to be hit. A slot without a label
  scores q = 0 in the product (acceptance cannot pass it) and has no weight itself.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdraft.registry import Registry

PositionWeights = Callable[..., torch.Tensor]
POSITION_WEIGHTS: Registry[PositionWeights] = Registry("position weighting")


@POSITION_WEIGHTS.register("exp")
def exp_weights(q: torch.Tensor, hit: torch.Tensor, *, gamma: float, alpha: float) -> torch.Tensor:
    k = torch.arange(q.shape[-1], dtype=torch.float32, device=q.device)
    return torch.exp(-k / gamma).expand(q.shape)


@POSITION_WEIGHTS.register("dpace")
@torch.no_grad()
def dpace_weights(q: torch.Tensor, hit: torch.Tensor, *, gamma: float, alpha: float) -> torch.Tensor:
    q = q.float() * hit
    prefix = torch.cumprod((1.0 - alpha) * q + alpha, dim=-1)
    return (prefix * hit).flip(-1).cumsum(-1).flip(-1) * hit
