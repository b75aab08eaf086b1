"""Cheap-compute warm starts (train/warm_start.py) and predictable anchor sampling, on tiny random models."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdraft.errors import SpecdraftError
from specdraft.models import METHODS
from specdraft.models.common.anchors import ANCHOR_SAMPLING, sample_anchors
from specdraft.models.common.warm_start import copied_layers, identity_slot, norm_gain
from specdraft.train.config import TrainConfig
from specdraft.train.warm_start import WarmStartInputs, apply_warm_start, check_warm_start
from test_models_support import make_batch, make_target
from test_train_methods import config, store_for, stores  # noqa: F401  (module fixture: tiny target + real stores)

SMALL = {
    "dspark": {"num_layers": 2, "block_size": 4, "max_anchors": 8, "markov_rank": 16},
    "dflash": {"num_layers": 2, "block_size": 4, "max_anchors": 8},
    "dflash2": {"num_layers": 2, "block_size": 4, "max_anchors": 8, "selector_rank": 16, "selector_top_k": 8},
    "eagle3": {"ttt_steps": 2},
}


def build(method: str, target, **overrides):
    spec = METHODS.get(method)
    torch.manual_seed(0)
    return spec.build(spec.config_cls(**{**SMALL[method], **overrides}), target)


def warm(drafter, method, target, rows=(), **switches):
    cfg = TrainConfig(method=method, **switches)
    return apply_warm_start(drafter, check_warm_start(cfg, method), WarmStartInputs(target=target, cfg=cfg, token_rows=lambda: list(rows)))


@pytest.fixture(scope="module")
def qwen3():
    return make_target(family="qwen3", num_layers=6)


@pytest.fixture(scope="module")
def llama():
    return make_target(num_layers=6)


@pytest.mark.parametrize("method", ["dspark", "dflash", "dflash2"])
def test_init_from_target_copies_the_last_layers(method, qwen3, llama):
    for target, has_qk_norm in ((qwen3, True), (llama, False)):
        drafter = build(method, target)
        done = warm(drafter, method, target, init_from_target=True)["init_from_target"]
        hf_layers = target.model.model.layers
        assert copied_layers(6, 2) == [4, 5]
        for i, t in enumerate([4, 5]):
            ours, theirs = drafter.layers[i], hf_layers[t]
            for name in (
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.o_proj",
                "mlp.gate_proj",
                "mlp.up_proj",
                "mlp.down_proj",
            ):
                assert torch.equal(ours.get_submodule(name).weight, theirs.get_submodule(name).weight), (i, name)
            for name in ("input_layernorm", "post_attention_layernorm"):
                assert torch.equal(ours.get_submodule(name).weight, theirs.get_submodule(name).weight)
            for name in ("q_norm", "k_norm"):
                want = getattr(theirs.self_attn, name).weight if has_qk_norm else torch.ones(32)
                assert torch.equal(getattr(ours.self_attn, name).weight, want)
        # 2 layers x (q/k/v/o + 3 MLP + 2 norms [+ q/k norms]) and nothing else
        assert len(done) == 2 * (9 + (2 if has_qk_norm else 0))
        assert all(d.startswith("layers.") for d in done)


@pytest.mark.parametrize(
    "change, why",
    [
        # GLM-4.5-style partial RoPE: the draft layers rotate whole heads, so a copied layer would read positions
        # differently from how it was trained
        (
            {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5}},
            "rotates 0.5 of each head (partial_rotary_factor)",
        ),
        # a hybrid's linear-attention layers (Qwen3.5, Kimi-Linear: a recurrent state) compute nothing a softmax draft
        # layer computes, whatever their MLP and norms share
        (
            {"layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 2},
            "it is a linear_attention layer (a recurrent state, not softmax attention)",
        ),
    ],
)
def test_init_from_target_is_off_where_the_target_layer_computes_something_else(change, why, caplog):
    """Nothing is copied and the log says why."""
    target = make_target(num_layers=6)
    for key, value in change.items():
        setattr(target.model.config, key, value)
    drafter = build("dflash", target)
    fresh = {k: v.clone() for k, v in drafter.state_dict().items()}
    with caplog.at_level("WARNING"):
        assert warm(drafter, "dflash", target, init_from_target=True)["init_from_target"] == []
    assert all(torch.equal(v, fresh[k]) for k, v in drafter.state_dict().items())
    assert why in caplog.text


def test_init_from_target_eagle3_feature_half(llama):
    drafter = build("eagle3", llama)
    fc_before = drafter.fc.weight.clone()
    done = warm(drafter, "eagle3", llama, init_from_target=True)["init_from_target"]
    layer, theirs = drafter.layers[0], llama.model.model.layers[5]
    for p in "qkv":
        w = getattr(layer.self_attn, f"{p}_proj").weight
        assert torch.equal(w[:, :64], torch.zeros_like(w[:, :64]))
        assert torch.equal(w[:, 64:], getattr(theirs.self_attn, f"{p}_proj").weight)
    assert torch.equal(layer.self_attn.o_proj.weight, theirs.self_attn.o_proj.weight)
    assert torch.equal(layer.mlp.down_proj.weight, theirs.mlp.down_proj.weight)
    assert torch.equal(layer.hidden_norm.weight, theirs.input_layernorm.weight)
    assert torch.equal(layer.input_layernorm.weight, torch.ones(64))
    assert not any("input_layernorm" in d.split("<-")[0] for d in done)
    assert torch.equal(drafter.fc.weight, fc_before)  # other pieces untouched


def test_norm_gain_is_exact_for_gemma_style_norms():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    norm = Gemma3RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    assert torch.equal(norm_gain(norm, 64), 1.0 + norm.weight)


def test_init_from_target_keeps_mismatched_shapes(llama):
    drafter = build("dspark", llama, intermediate_size=32)
    mlp_before = drafter.layers[0].mlp.up_proj.weight.clone()
    done = warm(drafter, "dspark", llama, init_from_target=True)["init_from_target"]
    assert torch.equal(drafter.layers[0].mlp.up_proj.weight, mlp_before)
    assert not any("mlp." in d for d in done) and any("o_proj" in d for d in done)


@pytest.mark.parametrize("method", ["dspark", "eagle3"])
def test_fc_identity_selects_the_stated_slot(method, llama):
    drafter = build(method, llama)
    warm(drafter, method, llama, fc_init="identity")
    slots = drafter.config.slots()
    j = identity_slot(slots, 6, len(drafter.layers))
    # dspark (2 draft layers): first copied layer 4 reads HF state 4 = output:3; eagle3 (1 layer): layer 5, nearest input:3
    assert str(slots[j]) == {"dspark": "output:3", "eagle3": "input:3"}[method]
    x = torch.randn(3, len(slots), 64)
    assert torch.allclose(drafter.fc(x.flatten(-2)), x[:, j], atol=0, rtol=0)


def bigram_corpus(vocab: int, *, seed: int = 0, length: int = 20000) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A chain where token t is followed by succ[t] 90% of the time (else a random token); a permutation
    has full rank, so the tests factorise at rank = vocabulary size."""
    g = np.random.default_rng(seed)
    succ = g.permutation(vocab)
    ids = [int(g.integers(vocab))]
    for _ in range(length - 1):
        ids.append(int(succ[ids[-1]]) if g.random() < 0.9 else int(g.integers(vocab)))
    ids = np.array(ids)
    mask = np.ones_like(ids, dtype=bool)
    mask[:5] = False
    return ids, mask, succ


def test_markov_bigram_ranks_the_true_successor_first(llama):
    ids, mask, succ = bigram_corpus(96)
    drafter = build("dspark", llama, markov_rank=96)
    warm(drafter, "dspark", llama, rows=[(ids[:10000], mask[:10000]), (ids[10000:], mask[10000:])], markov_init="bigram")
    head = drafter.markov_head
    with torch.no_grad():
        bias = head.markov_w2(head.prev_embeddings(torch.arange(96)))  # [prev, next]
    assert (bias.argmax(-1).numpy() == succ).mean() == 1.0
    top = bias.gather(1, torch.from_numpy(succ)[:, None])
    assert 1.0 < float(top.mean()) < 10.0  # a few logits: sensible next to LM-head logits


def test_markov_bigram_with_a_reduced_draft_vocabulary(llama):
    ids, mask, succ = bigram_corpus(96)
    counts = torch.bincount(torch.from_numpy(ids[1:]), minlength=96)
    spec = METHODS.get("dspark")
    torch.manual_seed(0)
    drafter = spec.build(spec.config_cls(**{**SMALL["dspark"], "markov_rank": 96, "draft_vocab_size": 48}), llama, counts=counts)
    warm(drafter, "dspark", llama, rows=[(ids, mask)], markov_init="bigram")
    head = drafter.markov_head
    assert head.markov_w2.weight.shape[0] == 48
    from specdraft.models.common.vocab import draft_ids

    members = draft_ids(drafter.d2t)
    with torch.no_grad():
        bias = head.markov_w2(head.prev_embeddings(torch.arange(96)))  # [prev, draft id]
    best = members[bias.argmax(-1)].numpy()
    # A previous token outside the draft vocabulary shares W1's one extra row (left at 0).
    reachable = np.isin(succ, members.numpy()) & np.isin(np.arange(96), members.numpy())
    assert reachable.sum() >= 10 and (best[reachable] == succ[reachable]).all()
    assert not head.markov_w1.weight[-1].any()


def test_markov_bigram_does_not_apply_to_eagle3_and_bad_values_fail(llama):
    with pytest.raises(
        SpecdraftError, match=r"markov_init=bigram does not apply to method 'eagle3' \(it applies to: dspark\).*--markov-init random"
    ):
        warm(build("eagle3", llama), "eagle3", llama, markov_init="bigram")
    with pytest.raises(SpecdraftError, match="fc_init must be one of random, identity"):
        TrainConfig(fc_init="mean")


def test_pieces_off_reproduce_todays_initialisation(llama):
    for method in ("dspark", "dflash", "dflash2", "eagle3"):
        a, b = build(method, llama), build(method, llama)
        assert warm(b, method, llama) == {}
        assert TrainConfig().init_from_target is False and TrainConfig().fc_init == "random" and TrainConfig().markov_init == "random"
        sa, sb = a.state_dict(), b.state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    seg = torch.zeros(2, 40, dtype=torch.int32)
    mask = torch.ones(2, 40, dtype=torch.bool)
    got = ANCHOR_SAMPLING.get("uniform")(seg, mask, max_per_segment=5, label_prob=None, generator=torch.Generator().manual_seed(3))
    assert torch.equal(got, sample_anchors(seg, mask, max_per_segment=5, generator=torch.Generator().manual_seed(3)))


def test_predictable_anchors_go_where_the_target_is_confident():
    seg = torch.zeros(4, 200, dtype=torch.int32)
    mask = torch.ones(4, 200, dtype=torch.bool)

    def label_prob(rows, positions):  # confident on the second half of every row
        return (positions >= 100).float() * 0.95

    g = torch.Generator().manual_seed(0)
    picked = torch.cat(
        [ANCHOR_SAMPLING.get("predictable")(seg, mask, max_per_segment=20, label_prob=label_prob, generator=g).flatten() for _ in range(10)]
    )
    uniform = torch.cat([sample_anchors(seg, mask, max_per_segment=20, generator=g).flatten() for _ in range(10)])
    assert picked.numel() == uniform.numel() == 800 and bool((picked >= 0).all())
    assert float((picked >= 100).float().mean()) > 0.8 > 0.6 > float((uniform >= 100).float().mean())


def test_predictable_sampling_trains_and_scores_with_the_target_head():
    target = make_target()
    batch = make_batch(target, "dspark", count=2, length=32)
    drafter = build("dspark", target, anchor_sampling="predictable")
    rows, pos = torch.tensor([0, 1]), torch.tensor([5, 9])
    p = drafter.target_label_prob(batch, rows, pos)
    want = torch.softmax(drafter.target_logits(batch.last_hidden[rows, pos]), -1)[torch.arange(2), batch.token_ids[rows, pos + 1]]
    assert torch.allclose(p, want, atol=1e-6)
    out = drafter.training_forward(batch)
    out.loss.backward()
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("method", ["dspark", "dflash", "dflash2"])
def test_held_out_evaluation_draws_anchors_uniformly_whatever_the_training_sampler(method, monkeypatch):
    """Validation estimates decode-time acceptance (every position is an anchor there): a predictable
    draw in eval mode would overstate tau by favouring easy positions."""
    target = make_target()
    batch = make_batch(target, method, count=2, length=32)
    drafter = build(method, target, anchor_sampling="predictable")
    scored = []
    real = drafter.target_label_prob
    monkeypatch.setattr(drafter, "target_label_prob", lambda *a: scored.append(1) or real(*a))
    drafter.train()
    drafter.training_forward(batch)
    assert scored, "training should score anchors with the target head"
    scored.clear()
    drafter.eval()
    with torch.no_grad():
        out = drafter.training_forward(batch)
    assert not scored and torch.isfinite(out.loss)


def test_fresh_run_warm_starts_and_resume_does_not(stores, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    import specdraft.train.trainer as trainer

    target, data = stores[0], store_for("dspark", stores)
    switches = dict(init_from_target=True, fc_init="identity", markov_init="bigram")
    out = tmp_path / "run"
    trainer.train(config("dspark", data, out, dry_run=True, **switches), target=target)
    state = load_file(str(out / "checkpoints/step-0/trainer_state.safetensors"))
    last = target.model.model.layers[-1]
    assert torch.equal(state["model.drafter.layers.0.self_attn.o_proj.weight"], last.self_attn.o_proj.weight)
    assert int((state["model.drafter.fc.weight"] != 0).sum()) == 64  # one identity block

    calls = []
    real = trainer.apply_warm_start
    monkeypatch.setattr(trainer, "apply_warm_start", lambda *a, **k: calls.append(1) or real(*a, **k))
    result = trainer.train(config("dspark", data, out, max_steps=2, **switches), target=target)  # resumes from step 0
    assert result.completed and calls == []
    fresh = trainer.train(config("dspark", data, tmp_path / "fresh", max_steps=2, **switches), target=target)
    assert fresh.completed and calls == [1]
    a, b = load_file(str(out / "final/model.safetensors")), load_file(str(tmp_path / "fresh/final/model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)  # dry run + resume == one fresh run


def test_recipe_defaults_and_flags_switch_each_piece_alone():
    import argparse
    import dataclasses

    from specdraft.cli import train as cli_train
    from specdraft.train.config import resolve_config
    from specdraft.train.warm_start import check_warm_start

    for recipe in ("dspark", "dflash", "eagle3"):
        cfg = resolve_config(recipe, {})
        # DFlash starts its draft layers at random (they cost it decoded tau on the embedded target)
        assert cfg.init_from_target == (recipe != "dflash") and cfg.fc_init == "random"
        assert cfg.markov_init == ("bigram" if recipe == "dspark" else "random")
        assert cfg.model.get("train_draft_head", True) == (recipe != "dflash")
        assert cfg.dtype == "auto" and cfg.model.get("anchor_sampling", "uniform") == ("predictable" if recipe == "dspark" else "uniform")
        check_warm_start(cfg, recipe)
    parser = argparse.ArgumentParser()
    cli_train.add_parser(parser.add_subparsers())
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    for flags, field, off in (
        (["--no-init-from-target"], "init_from_target", False),
        (["--fc-init", "identity"], "fc_init", "identity"),
        (["--markov-init", "random"], "markov_init", "random"),
        (["--model", "anchor_sampling=uniform"], "model", {"anchor_sampling": "uniform"}),
    ):
        args = parser.parse_args(["train", "--config", "dspark", *flags])
        cfg = resolve_config(args.config, {k: v for k, v in vars(args).items() if k in names})
        value = getattr(cfg, field)
        assert (value["anchor_sampling"] == off["anchor_sampling"]) if field == "model" else value == off
        others = {"init_from_target": True, "fc_init": "random", "markov_init": "bigram"}
        assert all(getattr(cfg, k) == v for k, v in others.items() if k != field)
