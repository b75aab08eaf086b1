"""EAGLE-3 draft vocabulary chosen by coverage, with the precedence DFlash/DSpark use."""

from __future__ import annotations

import pytest
import torch

from specdraft.errors import SpecdraftError
from specdraft.models import METHODS, load_drafter
from specdraft.models.eagle3.config import DEFAULT_DRAFT_VOCAB, Eagle3Config
from test_models_support import VOCAB


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


def test_eagle3_vocab_by_coverage_and_precedence(target, tmp_path):
    spec = METHODS.get("eagle3")
    counts = torch.zeros(VOCAB, dtype=torch.int64)
    counts[[7, 30, 50, 60]] = torch.tensor([60, 25, 10, 5])
    model = spec.build(Eagle3Config(ttt_steps=2, draft_vocab_coverage=0.9), target, counts=counts)
    # 60 + 25 + 10 = 95 of 100 occurrences: the smallest N covering 90% is 3, written back into the config.
    assert model.config.draft_vocab_size == 3 and model.draft_vocab_size() == 3
    assert (torch.arange(3) + model.d2t).tolist() == [7, 30, 50] and model.t2d.nonzero().flatten().tolist() == [7, 30, 50]
    assert torch.equal(model.lm_head.weight, model.verifier_lm_head.weight[[7, 30, 50]])
    model.save_pretrained(tmp_path / "c")
    assert load_drafter(tmp_path / "c", target=target).config.draft_vocab_size == 3

    # draft_vocab_size wins over draft_vocab_coverage; with neither, the reference default (capped at V) applies.
    fixed = spec.build(Eagle3Config(ttt_steps=2, draft_vocab_size=2, draft_vocab_coverage=0.9), target, counts=counts)
    assert (torch.arange(2) + fixed.d2t).tolist() == [7, 30]
    plain = spec.build(Eagle3Config(ttt_steps=2), target, counts=counts)
    assert plain.config.draft_vocab_size == min(DEFAULT_DRAFT_VOCAB, VOCAB) and not plain.use_draft_vocab

    with pytest.raises(SpecdraftError, match="draft_vocab_coverage=0.9 needs token counts"):
        spec.build(Eagle3Config(ttt_steps=2, draft_vocab_coverage=0.9), target)
    with pytest.raises(SpecdraftError, match="draft_vocab_coverage must be in"):
        Eagle3Config(draft_vocab_coverage=1.5)
