"""Distillation terms between the drafter's next-token distribution q = p_d and the target's p = p_t:
``DISTILL_LOSSES``, the method config's ``distill_loss`` (``specdraft train --distill-loss NAME``).

Each entry maps a :class:`Distributions` pair (rows of logits [..., V]) to a per-row loss [...] in float32 that
is 0 exactly where q = p. Every method keeps its published term as its default (``l1`` for DSpark, ``kl`` for
DFlash2, ``soft_ce`` for EAGLE-3); the others are the candidates speculators 0.9.0 added
(``speculators/losses/eager.py``: ``tv_loss``, ``neg_log_acceptance_loss``, ``lk_hybrid_loss``,
``reverse_kl_div_loss``, ``js_div_loss``), measured against the defaults in ``docs/results/recipe_ablation.md``.

* ``l1``: sum_v |q - p| (= 2 TV).
* ``tv``: 0.5 sum_v |q - p| = 1 - alpha, alpha = sum_v min(p, q) the rejection-sampling acceptance probability:
  the loss is exactly one minus the slot's acceptance.
* ``kl``: KL(p || q), mass-covering.
* ``soft_ce``: -sum_v p log q = KL(p || q) + H(p): the same gradient as ``kl``, offset by the target's entropy.
* ``reverse_kl``: KL(q || p), mode-seeking.
* ``jsd``: 0.5 KL(p || m) + 0.5 KL(q || m), m = (p + q) / 2; symmetric, bounded by log 2.
* ``lk``: -log(alpha) (LK loss, Samarin et al., arXiv 2602.23881; speculators' ``neg_log_acceptance_loss``,
  alpha clamped at 1e-5): TV's gradient scaled by 1/alpha, so a cold drafter with little overlap still learns.
* ``lk_hybrid``: lambda KL(p || q) + (1 - lambda) TV with lambda = exp(-3 sg(alpha)) (the paper's hybrid at
  eta = 3; speculators' ``lk_hybrid_loss``): KL's strong pull while overlap is low, TV once it grows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cached_property

import torch
import torch.nn.functional as F

from specdraft.registry import Registry

__all__ = ["DISTILL_LOSSES", "Distributions"]

#: speculators' floor on alpha inside -log(alpha): a row with no overlap has a finite loss and gradient.
LK_MIN_ACCEPTANCE = 1e-5
#: lk_hybrid's blend temperature eta (the LK paper's best hybrid setting, speculators' default).
LK_HYBRID_ETA = 3.0


class Distributions:
    """One drafter/target pair of logit rows, with the softmaxes the losses share computed once (a method that
    also needs ||q - p||_1 itself, DSpark's acceptance estimate, reads :attr:`l1` without a second pass)."""

    def __init__(self, draft_logits: torch.Tensor, target_logits: torch.Tensor):
        self.draft_logits = draft_logits.float()
        self.target_logits = target_logits.float()

    @cached_property
    def draft(self) -> torch.Tensor:
        return F.softmax(self.draft_logits, -1)

    @cached_property
    def target(self) -> torch.Tensor:
        return F.softmax(self.target_logits, -1)

    @cached_property
    def draft_log(self) -> torch.Tensor:
        return F.log_softmax(self.draft_logits, -1)

    @cached_property
    def target_log(self) -> torch.Tensor:
        return F.log_softmax(self.target_logits, -1)

    @cached_property
    def l1(self) -> torch.Tensor:
        return (self.draft - self.target).abs().sum(-1)

    @cached_property
    def acceptance(self) -> torch.Tensor:
        """alpha = sum_v min(p, q) = 1 - 0.5 ||q - p||_1."""
        return torch.minimum(self.draft, self.target).sum(-1)


DistillLoss = Callable[[Distributions], torch.Tensor]
DISTILL_LOSSES: Registry[DistillLoss] = Registry("distillation loss")


def _kl(log_from: torch.Tensor, log_to: torch.Tensor) -> torch.Tensor:
    """KL(from || to) per row, both as log-probabilities."""
    return F.kl_div(log_to, log_from, reduction="none", log_target=True).sum(-1)


@DISTILL_LOSSES.register("l1")
def l1_loss(d: Distributions) -> torch.Tensor:
    return d.l1


@DISTILL_LOSSES.register("tv")
def tv_loss(d: Distributions) -> torch.Tensor:
    return 0.5 * d.l1


@DISTILL_LOSSES.register("kl")
def kl_loss(d: Distributions) -> torch.Tensor:
    return _kl(d.target_log, d.draft_log)


@DISTILL_LOSSES.register("soft_ce")
def soft_ce_loss(d: Distributions) -> torch.Tensor:
    return -(d.target * d.draft_log).sum(-1)


@DISTILL_LOSSES.register("reverse_kl")
def reverse_kl_loss(d: Distributions) -> torch.Tensor:
    return _kl(d.draft_log, d.target_log)


@DISTILL_LOSSES.register("jsd")
def jsd_loss(d: Distributions) -> torch.Tensor:
    log_mix = torch.logaddexp(d.draft_log, d.target_log) - math.log(2.0)
    return 0.5 * (_kl(d.target_log, log_mix) + _kl(d.draft_log, log_mix))


@DISTILL_LOSSES.register("lk")
def lk_loss(d: Distributions) -> torch.Tensor:
    return -torch.log(d.acceptance.clamp_min(LK_MIN_ACCEPTANCE))


@DISTILL_LOSSES.register("lk_hybrid")
def lk_hybrid_loss(d: Distributions) -> torch.Tensor:
    blend = torch.exp(-LK_HYBRID_ETA * d.acceptance.detach())
    return blend * kl_loss(d) + (1.0 - blend) * (1.0 - d.acceptance)
