"""Large target vocabularies at the cost of small ones: per-step work bounded by the draft vocabulary,
checkpoints of trained tensors, the compact DSpark Markov W1, warm start only where it computes
what the target layer computes. Tiny random models (``benchmarks/vocab_scaling.py`` has the timings)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file

from specdraft.models import METHODS, load_drafter
from specdraft.models.common.checkpoint import write_checkpoint
from specdraft.models.common.vocab import draft_ids
from specdraft.train.config import TrainConfig
from specdraft.train.warm_start import WarmStartInputs, apply_warm_start, check_warm_start
from test_models_support import VOCAB, make_batch

DRAFT = 40
SMALL = {
    "eagle3": {"ttt_steps": 2},
    "dflash": {"num_layers": 2, "block_size": 4, "max_anchors": 8},
    "dspark": {"num_layers": 2, "block_size": 4, "max_anchors": 8, "markov_rank": 16},
}
COUNTS = torch.arange(VOCAB, dtype=torch.int64)  # draft vocabulary = the DRAFT highest ids


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


def build(method, target, **overrides):
    spec = METHODS.get(method)
    torch.manual_seed(0)
    return spec.build(spec.config_cls(**{**SMALL[method], **overrides}), target, counts=COUNTS)


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_predictable_anchor_scores_are_target_probabilities_over_the_draft_vocabulary(target, method):
    """p_t restricted to the draft ids before the softmax = the full p_t renormalised over them; a
    label outside the draft vocabulary scores 0; without a reduced vocabulary, the full p_t."""
    batch = make_batch(target, method, count=2, length=16)
    rows, positions = torch.tensor([0, 0, 1, 1, 1]), torch.tensor([3, 6, 4, 8, 12])
    labels = batch.token_ids[rows, positions + 1]
    for draft_vocab in (DRAFT, None):
        model = build(method, target, draft_vocab_size=draft_vocab)
        with torch.no_grad():
            full = torch.softmax(model.target_logits(batch.last_hidden[rows, positions]).double(), -1)
        ids = draft_ids(model.d2t) if draft_vocab else torch.arange(VOCAB)
        inside = torch.isin(labels, ids)
        want = torch.where(inside, full.gather(1, labels[:, None])[:, 0] / full[:, ids].sum(-1), torch.zeros(()))
        got = model.target_label_prob(batch, rows, positions)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)
        if draft_vocab:
            assert not inside.all() and inside.any()  # both cases exercised


def test_dspark_l1_target_is_the_full_target_distribution_renormalised_over_the_draft_ids(target):
    """The documented approximation: the L1/confidence terms compare p_d with p_t restricted to the
    draft ids before the softmax, which equals the full p_t renormalised over them."""
    from specdraft.models.dspark.loss import block_terms

    model = build("dspark", target, draft_vocab_size=DRAFT)
    h = torch.randn(6, target.hidden_size)
    draft_logits = torch.randn(6, DRAFT)
    with torch.no_grad():
        restricted = torch.nn.functional.linear(model.require_verifier()(h), model.draft_target_head())
        full = torch.softmax(model.target_logits(h).double(), -1)[:, draft_ids(model.d2t)]
    _, l1, _, _ = block_terms(
        draft_logits=draft_logits, target_logits=restricted, labels=torch.zeros(6, dtype=torch.long), confidence_logits=None
    )
    want = (torch.softmax(draft_logits.double(), -1) - full / full.sum(-1, keepdim=True)).abs().sum(-1)
    torch.testing.assert_close(l1.double(), want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "method,draft_vocab", [("eagle3", DRAFT), ("eagle3", None), ("dflash", DRAFT), ("dflash", None), ("dspark", DRAFT), ("dspark", None)]
)
def test_checkpoints_carry_only_trained_tensors(tmp_path, target, method, draft_vocab):
    """Trained tensors and the vocabulary tables; the one frozen exception is EAGLE-3's embedding,
    which speculators 0.9.0 cannot restore from the verifier (see ``models.common.drafter``)."""
    model = build(method, target, draft_vocab_size=draft_vocab)
    model.save_pretrained(tmp_path / "d")
    saved = load_file(str(tmp_path / "d/model.safetensors"))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert not any(k.startswith("verifier_") for k in saved)
    assert set(saved) - trained <= {"d2t", "t2d"} | ({"embed_tokens.weight"} if method == "eagle3" else set())
    loaded = load_drafter(tmp_path / "d", target=target)
    assert torch.equal(loaded.embed_tokens.weight, target.model.get_input_embeddings().weight)


def test_dspark_markov_w1_is_bounded_by_the_draft_vocabulary(tmp_path, target):
    """W1 holds N + 1 rows in memory (draft ids + one shared row), so the step's gradient and AdamW
    state are [N + 1, r]; the checkpoint still holds the format's [V, r] table, which computes the same."""
    model = build("dspark", target, draft_vocab_size=DRAFT)
    head = model.markov_head
    assert head.markov_w1.weight.shape == (DRAFT + 1, 16)
    with torch.no_grad():
        head.markov_w1.weight.normal_()
    batch = make_batch(target, "dspark", count=2, length=16)
    model.train().training_forward(batch).loss.backward()
    assert head.markov_w1.weight.grad.shape == (DRAFT + 1, 16)

    ids = draft_ids(model.d2t)
    others = torch.tensor([i for i in range(VOCAB) if i not in set(ids.tolist())])
    emb = head.prev_embeddings(torch.arange(VOCAB))
    assert torch.equal(emb[ids], head.markov_w1.weight[:DRAFT])
    assert torch.equal(emb[others], head.markov_w1.weight[DRAFT].expand(len(others), -1))

    model.eval().save_pretrained(tmp_path / "d")
    w1 = load_file(str(tmp_path / "d/model.safetensors"))["markov_head.markov_w1.weight"]
    assert torch.equal(w1, emb)  # the format's [V, r]: speculators / vLLM embed prev ids with it directly
    loaded = load_drafter(tmp_path / "d", target=target)
    assert loaded.markov_head.markov_w1.weight.shape == (DRAFT + 1, 16)
    assert torch.equal(loaded.markov_head.prev_embeddings(torch.arange(VOCAB)), emb)

    # A checkpoint trained elsewhere (distinct rows outside the draft vocabulary) keeps every row.
    tensors = load_file(str(tmp_path / "d/model.safetensors"))
    tensors["markov_head.markov_w1.weight"] = torch.randn(VOCAB, 16)
    write_checkpoint(tmp_path / "d", json.loads((tmp_path / "d/config.json").read_text()), tensors)
    foreign = load_drafter(tmp_path / "d", target=target)
    assert torch.equal(foreign.markov_head.prev_embeddings(torch.arange(VOCAB)), tensors["markov_head.markov_w1.weight"])


def gemma3_target():
    import transformers

    from specdraft.targets.base import Target

    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.config.architectures = [type(model).__name__]
    return Target(name="tiny-gemma3", path=None, model=model, tokenizer=None, fingerprint="fp-g", tokenizer_hash="none")


@pytest.mark.parametrize("method", ["dspark", "eagle3"])
def test_init_from_target_is_off_with_reasons_for_a_family_whose_layers_compute_otherwise(caplog, method):
    target = gemma3_target()
    model = build(method, target)
    before = {k: v.clone() for k, v in model.layers.state_dict().items()}
    cfg = TrainConfig(method=method, init_from_target=True)
    with caplog.at_level(logging.WARNING, logger="specdraft.models.common.warm_start"):
        done = apply_warm_start(model, check_warm_start(cfg, method), WarmStartInputs(target=target, cfg=cfg, token_rows=list))
    assert done == {"init_from_target": []}
    assert all(torch.equal(before[k], v) for k, v in model.layers.state_dict().items())
    text = caplog.text
    assert "init_from_target: off for target tiny-gemma3" in text
    for reason in ("activation is gelu_pytorch_tanh", "post-attention/post-FFN norms", "RoPE base is", "embeddings by 8"):
        assert reason in text, reason
