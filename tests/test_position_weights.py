"""Per-position loss weights of the block drafters (models/common/weights.py)."""

from __future__ import annotations

import math

import pytest
import torch

from specdraft.errors import SpecdraftError
from specdraft.models.common.weights import POSITION_WEIGHTS, dpace_weights, exp_weights


def test_exp_weights_decay_from_the_first_draft_slot():
    w = exp_weights(torch.zeros(2, 3, 4), torch.ones(2, 3, 4, dtype=torch.bool), gamma=4.0, alpha=0.5)
    assert w.shape == (2, 3, 4)
    torch.testing.assert_close(w[1, 2], torch.tensor([math.exp(-k / 4) for k in range(4)]))


def test_dpace_is_the_gradient_of_the_expected_accepted_length():
    """alpha -> 0: w_k = d E[accepted] / d log q_k, E[accepted] = sum_j prod_{i<=j} q_i (autograd)."""
    torch.manual_seed(0)
    q = torch.rand(5, 6) * 0.9 + 0.05
    log_q = q.log().requires_grad_()
    torch.cumprod(log_q.exp(), -1).sum().backward()
    w = dpace_weights(q, torch.ones_like(q, dtype=torch.bool), gamma=4.0, alpha=1e-12)
    torch.testing.assert_close(w, log_q.grad)
    assert bool((w[:, :-1] >= w[:, 1:]).all())  # an earlier slot never weighs less


def test_dpace_spends_an_untrained_drafters_loss_on_the_first_slots():
    hit = torch.ones(1, 4, dtype=torch.bool)
    w = dpace_weights(torch.zeros(1, 4), hit, gamma=4.0, alpha=0.5)
    torch.testing.assert_close(w, torch.tensor([[0.9375, 0.4375, 0.1875, 0.0625]]))
    # a drafter that hits every slot: every slot unlocks the rest of the block
    torch.testing.assert_close(dpace_weights(torch.ones(1, 4), hit, gamma=4.0, alpha=0.5), torch.tensor([[4.0, 3.0, 2.0, 1.0]]))


def test_dpace_slot_without_a_label_weighs_nothing_and_stops_acceptance():
    """An unreachable label (outside a reduced draft vocabulary) counts as q = 0 in the product; slots
    past a sample's end are unlabelled and carry nothing."""
    q = torch.ones(2, 4)
    hit = torch.tensor([[True, False, True, True], [True, True, False, False]])
    w = dpace_weights(q, hit, gamma=4.0, alpha=0.5)
    torch.testing.assert_close(w, torch.tensor([[1.0 + 0.5 + 0.5, 0.0, 1.0, 0.5], [2.0, 1.0, 0.0, 0.0]]))


def test_unknown_weighting_and_bad_alpha_are_named():
    from specdraft.models.dflash.config import DFlashConfig

    assert POSITION_WEIGHTS.names() == ["dpace", "exp"]
    with pytest.raises(SpecdraftError, match="unknown position weighting 'linear'"):
        DFlashConfig(position_weighting="linear")
    with pytest.raises(SpecdraftError, match="dpace_alpha must be in \\(0, 1\\], got 0.0"):
        DFlashConfig(dpace_alpha=0.0)
