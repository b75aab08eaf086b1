"""The distillation terms (models/common/distill_losses.py): zero exactly at q = p, hand-computed values, finite
gradients at the extremes, the flag's routing into each method's config, and a tiny drafter trained on each."""

from __future__ import annotations

import math

import pytest
import torch

from specdraft.errors import SpecdraftError
from specdraft.models import METHODS
from specdraft.models.common.distill_losses import DISTILL_LOSSES, Distributions
from test_models_support import VOCAB, make_batch

NAMES = DISTILL_LOSSES.names()


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


# p = [1/2, 1/2] (target), q = [1/4, 3/4] (draft); m = (p + q) / 2 = [3/8, 5/8]; alpha = sum min = 3/4.
P, Q = [0.5, 0.5], [0.25, 0.75]
KL_PQ = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
HAND = {
    "l1": 0.5,
    "tv": 0.25,
    "kl": KL_PQ,
    "soft_ce": -(0.5 * math.log(0.25) + 0.5 * math.log(0.75)),
    "reverse_kl": 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5),
    "jsd": 0.5 * (0.5 * math.log(0.5 / 0.375) + 0.5 * math.log(0.5 / 0.625))
    + 0.5 * (0.25 * math.log(0.25 / 0.375) + 0.75 * math.log(0.75 / 0.625)),
    "lk": -math.log(0.75),
    "lk_hybrid": math.exp(-3 * 0.75) * KL_PQ + (1 - math.exp(-3 * 0.75)) * 0.25,
}


def _pair(draft: torch.Tensor, target: torch.Tensor) -> Distributions:
    return Distributions(draft, target)


def test_every_registered_loss_has_a_hand_computed_value():
    assert set(NAMES) == set(HAND)


@pytest.mark.parametrize("name", NAMES)
def test_matches_the_hand_computed_value(name):
    draft, target = torch.tensor([Q]).log(), torch.tensor([P]).log() + 3.0  # logits: any offset is the same distribution
    got = DISTILL_LOSSES.get(name)(_pair(draft, target))
    assert got.shape == (1,) and got.dtype == torch.float32
    assert float(got) == pytest.approx(HAND[name], rel=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_zero_at_equal_distributions_and_positive_otherwise(name):
    g = torch.Generator().manual_seed(0)
    target = torch.randn(6, 40, generator=g) * 2
    same = DISTILL_LOSSES.get(name)(_pair(target + 1.5, target))
    if name == "soft_ce":  # -sum p log p: the target's entropy, the minimum over q
        torch.testing.assert_close(same, -(target.softmax(-1) * target.log_softmax(-1)).sum(-1))
    else:
        assert float(same.abs().max()) < 1e-5, same
    other = DISTILL_LOSSES.get(name)(_pair(torch.randn(6, 40, generator=g), target))
    assert bool((other > same + 1e-4).all()), (other, same)


@pytest.mark.parametrize("name", NAMES)
def test_gradients_are_finite_and_descend_even_with_disjoint_support(name):
    """Near-one-hot draft and target on different tokens (alpha ~ 0: lk's clamp) and an exact tie (l1's kink)."""
    target = torch.full((3, 16), -40.0)
    target[:, 0] = 40.0
    draft = torch.full((3, 16), -40.0)
    draft[0, 5] = draft[1, 0] = 40.0  # row 0 disjoint, row 1 agreeing
    draft[2] = target[2]  # row 2 equal
    draft.requires_grad_(True)
    DISTILL_LOSSES.get(name)(_pair(draft, target)).sum().backward()
    assert draft.grad is not None and bool(torch.isfinite(draft.grad).all())
    soft = torch.randn(4, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    loss = DISTILL_LOSSES.get(name)(_pair(soft, target[:1].expand(4, -1) / 20))
    loss.sum().backward()
    assert soft.grad is not None and bool(torch.isfinite(soft.grad).all()) and float(soft.grad.abs().sum()) > 0


def test_defaults_are_each_methods_published_term_and_dflash_refuses_one():
    defaults = {name: METHODS.get(name).config_cls().distill_loss for name in ("dspark", "dflash2", "eagle3", "dflash")}
    assert defaults == {"dspark": "l1", "dflash2": "kl", "eagle3": "soft_ce", "dflash": ""}
    with pytest.raises(SpecdraftError, match="hard labels only"):
        METHODS.get("dflash").config_cls(distill_loss="tv")
    with pytest.raises(SpecdraftError, match=r"distill-loss.*'l2'; choose one of: jsd"):
        METHODS.get("dspark").config_cls(distill_loss="l2")


def test_the_train_flag_sets_the_method_config_and_refuses_a_contradiction():
    from specdraft.train.config import resolve_config

    assert resolve_config("dspark", {"distill_loss": "lk"}).model["distill_loss"] == "lk"
    assert "distill_loss" not in resolve_config("dspark", {}).model  # unset: the method's own
    with pytest.raises(SpecdraftError, match="contradicts model.distill_loss 'jsd'"):
        resolve_config("dspark", {"distill_loss": "tv", "model": "distill_loss=jsd"})


@pytest.mark.parametrize("method", ["dspark", "dflash2", "eagle3"])
def test_the_method_loss_uses_the_configured_term(target, method):
    """The loss a method reports is its config's term: logged under the loss's name, and different per loss."""
    small = {
        "dspark": {"block_size": 4, "num_layers": 1, "markov_rank": 16},
        "dflash2": {"block_size": 4, "num_layers": 1, "selector_rank": 16, "selector_top_k": 8},
        "eagle3": {"draft_vocab_size": 64, "ttt_steps": 2},
    }[method]
    batch = make_batch(target, method, count=2, length=24, pack=2)
    losses = {}
    for name in ("tv", "jsd"):
        spec = METHODS.get(method)
        torch.manual_seed(0)
        counts = torch.bincount(batch.token_ids.flatten(), minlength=VOCAB)
        model = spec.build(spec.config_cls(**small, distill_loss=name), target, counts=counts)
        torch.manual_seed(0)
        with torch.no_grad():
            out = model.training_forward(batch)
        losses[name] = float(out.loss)
        if method != "eagle3":  # eagle3 logs per-step losses, the block drafters each term
            assert name in out.metrics
    assert losses["tv"] != losses["jsd"]


@pytest.mark.parametrize("name", NAMES)
def test_a_tiny_dspark_trains_with_each_loss(target, name):
    """40 AdamW steps on one packed batch: the loss halves and the distillation term falls, whatever the term."""
    spec = METHODS.get("dspark")
    batch = make_batch(target, "dspark", count=4, length=24, pack=2)
    torch.manual_seed(0)
    model = spec.build(spec.config_cls(block_size=4, num_layers=1, markov_rank=16, distill_loss=name), target)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    torch.manual_seed(0)
    first = model.training_forward(batch).metrics
    for _ in range(40):
        out = model.training_forward(batch)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    with torch.no_grad():
        last = model.training_forward(batch).metrics
    assert last["loss"] < 0.5 * first["loss"] and last[name] < first[name], (first, last)
