"""Training forwards: packing never leaks across segments, and tiny drafters overfit a few samples."""

from __future__ import annotations

import math

import pytest
import torch

from specdraft.models import METHODS, DrafterBatch
from specdraft.models.common.anchors import sample_anchors
from specdraft.models.common.vocab import draft_ids
from test_models_support import VOCAB, make_batch, pad_batch

SMALL = {
    "eagle3": {"draft_vocab_size": 64, "ttt_steps": 3},
    "dflash": {"block_size": 4, "num_layers": 1},
    "dflash2": {"block_size": 4, "num_layers": 1, "selector_rank": 16, "selector_top_k": 8},
    "dspark": {"block_size": 4, "num_layers": 1, "markov_rank": 16},
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


def _build(method, target, **overrides):
    spec = METHODS.get(method)
    torch.manual_seed(0)
    data = make_batch(target, method, count=4, length=24)
    counts = torch.bincount(data.token_ids.flatten(), minlength=VOCAB)
    return spec.build(spec.config_cls(**{**SMALL[method], **overrides}), target, counts=counts)


def _split(batch: DrafterBatch, length: int) -> DrafterBatch:
    """Undo 2-way packing: row r's two segments become rows 2r and 2r+1."""
    return DrafterBatch(**{k: v.reshape(v.shape[0] * 2, length, *v.shape[2:]) for k, v in vars(batch).items()})


def test_eagle3_packing_and_padding_do_not_leak(target):
    model = _build("eagle3", target)
    packed = make_batch(target, "eagle3", count=4, length=12, pack=2)
    separate = _split(packed, 12)
    separate.segment_ids = torch.zeros_like(separate.segment_ids)
    with torch.no_grad():
        a = model.ttt_hidden(pad_batch(packed, 3))
        b = model.ttt_hidden(separate)
    for j, (step_a, step_b) in enumerate(zip(a, b)):
        # Compare where step j's input token t+1+j lies inside the sample (elsewhere it is unused).
        keep = 12 - 1 - j
        torch.testing.assert_close(step_a[:, :24].reshape(4, 12, -1)[:, :keep], step_b[:, :keep], atol=1e-5, rtol=1e-5)
    out_p, out_s = model.training_forward(pad_batch(packed, 3)), model.training_forward(separate)
    torch.testing.assert_close(out_p.loss, out_s.loss, atol=1e-5, rtol=1e-5)
    assert out_p.position_count.tolist() == out_s.position_count.tolist()
    # step j at t is supervised iff t+2+j is a response token (rows 4..11) of the same sample:
    # t in [2-j, 9-j], 8 positions per sample for j <= 2
    assert out_s.position_count.tolist() == [32.0, 32.0, 32.0]


@pytest.mark.parametrize("method", ["dflash", "dflash2", "dspark"])
def test_block_forward_packing_does_not_leak(target, method):
    model = _build(method, target)
    packed = make_batch(target, method, count=2, length=12, pack=2)
    separate = _split(packed, 12)
    with torch.no_grad():
        a = model.forward_blocks(pad_batch(packed, 2), torch.tensor([[5, 8, 12 + 4, 12 + 9]]))[0]
        b = model.forward_blocks(separate, torch.tensor([[5, 8], [4, 9]]))
    torch.testing.assert_close(a, b.flatten(0, 1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["dflash", "dflash2", "dspark"])
def test_block_labels_stop_at_segment_and_prompt(target, method):
    model = _build(method, target)
    batch = make_batch(target, method, count=2, length=12, pack=2)
    out = model.block_loss(batch, torch.tensor([[9, 12 + 4]]), model.forward_blocks(batch, torch.tensor([[9, 12 + 4]])))
    # anchor 9 of sample 0: labels at rows 10, 11 exist, 12 is the next sample -> cut there.
    k = model.label_offsets().numel()
    expected = [1 + 1 if i < 2 else 1 for i in range(k)] if not model.sample_from_anchor else [2 if i < 2 else 1 for i in range(k)]
    assert out.position_count.tolist() == [float(x) for x in expected]
    assert torch.isfinite(out.loss)


@pytest.mark.slow
@pytest.mark.parametrize(
    "method,steps,overrides",
    [
        ("eagle3", 150, {"ttt_steps": 4}),
        ("dflash", 120, {}),
        ("dspark", 250, {}),
        # reduced draft vocabulary chosen by coverage of the batch's own tokens (every label reachable)
        ("dflash", 120, {"draft_vocab_coverage": 1.0}),
        ("dspark", 300, {"draft_vocab_coverage": 1.0}),
        ("dflash", 120, {"position_weighting": "dpace"}),
        ("dspark", 250, {"position_weighting": "dpace"}),
    ],
    ids=["eagle3", "dflash", "dspark", "dflash-draft-vocab", "dspark-draft-vocab", "dflash-dpace", "dspark-dpace"],
)
def test_tiny_drafter_overfits(target, method, steps, overrides):
    model = _build(method, target, **overrides)
    if "draft_vocab_coverage" in overrides:
        assert 1 < model.config.draft_vocab_size < VOCAB and model.lm_head.weight.requires_grad
    batch = make_batch(target, method, count=4, length=24, pack=2)
    params = [p for p in model.parameters() if p.requires_grad]
    assert not any(p is model.embed_tokens.weight or p is model.verifier_lm_head.weight for p in params)
    frozen = model.verifier_lm_head.weight.clone()
    opt = torch.optim.AdamW(params, lr=3e-3)
    # decayed to 0 as training recipes do: at a constant 3e-3 AdamW spikes now and then (dspark-dpace: accuracy 0.97 at
    # step 200, 0.84 at 250, 0.99 at 300), so where the last step lands would decide the test, not whether it learns
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 - step / steps)
    first = None
    torch.manual_seed(0)
    for _ in range(steps):
        out = model.training_forward(batch)
        first = first if first is not None else float(out.loss.detach())
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        decay.step()
    with torch.no_grad():
        out = model.training_forward(batch)
    assert float(out.loss) < 0.5 * first
    assert float(out.position_acc[0]) > 0.9, out.position_acc
    assert out.position_cond_acc.shape == out.position_acc.shape == out.position_count.shape
    assert torch.equal(frozen, model.verifier_lm_head.weight)


def test_block_labels_stop_at_first_invalid_label():
    from specdraft.models.common.anchors import block_labels

    tokens = torch.arange(10)[None]
    seg = torch.zeros(1, 10, dtype=torch.int32)
    mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)  # a non-response token at 4
    labels, valid, _ = block_labels(tokens, seg, mask, torch.tensor([[2, 6, -1]]), torch.arange(1, 4))
    assert labels[0, 0].tolist() == [3, 4, 5]
    assert valid[0].tolist() == [[True, False, False], [True, True, True], [False, False, False]]


def test_sample_anchors_respects_segments_and_limit():
    from specdraft.models.common.anchors import candidate_anchors, sample_anchors

    seg = torch.tensor([[0] * 8 + [1] * 8 + [-1] * 2], dtype=torch.int32)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1] * 2 + [0, 0]], dtype=torch.bool)
    ok = candidate_anchors(seg, mask)
    assert torch.nonzero(ok[0]).flatten().tolist() == [2, 3, 4, 5, 6, 10, 11, 12, 13, 14]
    anchors = sample_anchors(seg, mask, max_per_segment=3, generator=torch.Generator().manual_seed(0))
    chosen = anchors[0][anchors[0] >= 0]
    assert chosen.numel() == 6 and bool(ok[0, chosen].all()) and chosen.tolist() == sorted(chosen.tolist())
    assert int((chosen < 8).sum()) == 3


@pytest.mark.parametrize("method,overrides", [("eagle3", {}), ("dspark", {}), ("dspark", {"draft_vocab_size": 24})])
def test_loss_chunking_changes_nothing(target, method, overrides):
    whole = _build(method, target, loss_chunk_rows=0, **overrides)
    chunked = _build(method, target, loss_chunk_rows=5, **overrides)
    batch = make_batch(target, method, count=2, length=16)
    torch.manual_seed(3)
    out_w = whole.training_forward(batch)
    torch.manual_seed(3)
    out_c = chunked.training_forward(batch)
    torch.testing.assert_close(out_w.loss, out_c.loss)
    out_w.loss.backward()
    out_c.loss.backward()
    torch.testing.assert_close(whole.fc.weight.grad, chunked.fc.weight.grad)


@pytest.mark.parametrize("method", ["eagle3", "dflash", "dspark"])
def test_batch_without_response_tokens_backpropagates_zero(target, method):
    model = _build(method, target)
    batch = make_batch(target, method, count=2, length=10)
    batch.loss_mask[:] = False
    out = model.training_forward(batch)
    assert float(out.loss.detach()) == 0.0 and out.position_count.sum() == 0
    out.loss.backward()  # a labelless packed row must not crash the trainer
    assert model.fc.weight.grad is not None and not model.fc.weight.grad.any()


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_labels_outside_draft_vocab_get_no_ce_and_count_as_misses(target, method):
    batch = make_batch(target, method, count=2, length=16)
    counts = torch.ones(VOCAB, dtype=torch.int64)
    counts[batch.token_ids.unique()] = 0  # the draft vocabulary holds none of the batch's tokens
    spec = METHODS.get(method)
    model = spec.build(spec.config_cls(**SMALL[method], draft_vocab_size=16), target, counts=counts)
    anchors = torch.tensor([[5, 9], [4, 8]])
    out = model.block_loss(batch, anchors, model.forward_blocks(batch, anchors))
    assert float(out.position_count.sum()) > 0 and float(out.position_acc.sum()) == 0.0
    assert out.metrics["ce"] == 0.0
    if method == "dspark":  # p_t restricted to the draft ids still supervises the distribution
        assert out.metrics["l1"] > 0.0 and float(out.loss.detach()) > 0.0
    out.loss.backward()


def test_confidence_records_use_the_full_target_distribution(target):
    """Calibration measures runtime acceptance: draft mass is zero off the draft ids, so the soft
    acceptance can never exceed the target's mass on them (no renormalisation here)."""
    model = _build("dspark", target, draft_vocab_size=24)
    batch = make_batch(target, "dspark", count=2, length=16)
    records = model.confidence_records(batch, generator=torch.Generator().manual_seed(0))
    anchors = sample_anchors(
        batch.segment_ids, batch.loss_mask, max_per_segment=model.config.max_anchors, generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        tf = model.teacher_forced_blocks(batch, anchors, model.forward_blocks(batch, anchors))
        p_t = torch.softmax(model.target_logits(tf["target_hidden"]), -1)
    inside = p_t[..., model.draft_target_ids()].sum(-1)
    assert records["soft_accept"].shape == inside.shape
    assert bool((records["soft_accept"] <= inside + 1e-6).all()) and float(inside.min()) < 0.999


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_position_weighting_reaches_the_block_loss(target, method):
    """dpace and exp weigh the same per-slot terms differently: at init (q ~ 0) dpace puts more of the
    loss on the first slot, so the two losses differ while every unweighted term is the same."""
    batch = make_batch(target, method, count=2, length=16)
    anchors = torch.tensor([[2, 6], [3, 7]])
    losses = {}
    for weighting in ("exp", "dpace"):
        model = _build(method, target, position_weighting=weighting)
        out = model.block_loss(batch, anchors, model.forward_blocks(batch, anchors))
        losses[weighting] = float(out.loss.detach())
    assert all(map(math.isfinite, losses.values())) and losses["exp"] != pytest.approx(losses["dpace"], rel=1e-4)


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_frozen_draft_head_stays_the_target_rows_and_round_trips(target, method, tmp_path):
    batch = make_batch(target, method, count=2, length=16)
    heads = {}
    for train_head in (True, False):
        model = _build(method, target, draft_vocab_size=24, train_draft_head=train_head)
        start = model.lm_head.weight.detach().clone()
        torch.testing.assert_close(start, model.verifier_lm_head.weight[draft_ids(model.d2t)])
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(3):
            opt.zero_grad()
            model.training_forward(batch).loss.backward()
            opt.step()
        heads[train_head] = bool(torch.equal(start, model.lm_head.weight))
    assert heads == {True: False, False: True}
    model.save_pretrained(tmp_path / "c")
    loaded = METHODS.get(method).model_cls.from_pretrained(tmp_path / "c", target=target)
    assert loaded.config.train_draft_head is False and not loaded.lm_head.weight.requires_grad
