"""The speculators/vLLM checkpoint layout: config.json fields, tensor names, round trips, errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from specdraft.errors import SpecdraftError
from specdraft.models import METHODS, load_drafter
from specdraft.models.common.checkpoint import write_checkpoint
from specdraft.models.common.vocab import build_draft_vocab, coverage_vocab_size, target_to_draft
from specdraft.models.dflash.config import DFlashConfig, default_gamma
from specdraft.models.dspark.config import DSparkConfig
from test_models_support import VOCAB, make_batch, make_target

SMALL = {
    "eagle3": {"draft_vocab_size": 40, "ttt_steps": 3},
    "dflash": {"block_size": 4, "num_layers": 2},
    "dflash2": {"block_size": 4, "num_layers": 2, "selector_rank": 16, "selector_top_k": 8},
    "dspark": {"block_size": 4, "num_layers": 2, "markov_rank": 16, "markov_head": "gated"},
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


def rewrite_weights(directory, tensors):
    """Replace a checkpoint's weights, its recorded checksum updated (the content is what is under test)."""
    write_checkpoint(directory, json.loads((directory / "config.json").read_text()), tensors)


def _build(method, target, **overrides):
    spec = METHODS.get(method)
    torch.manual_seed(0)
    model = spec.build(spec.config_cls(**{**SMALL[method], **overrides}), target, counts=torch.arange(VOCAB, dtype=torch.int64))
    with torch.no_grad():  # move every trainable weight away from its initial value
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def _outputs(model, batch):
    with torch.no_grad():
        if model.method == "eagle3":
            return torch.stack(model.ttt_hidden(batch)), model.draft_logits(model.ttt_hidden(batch)[0])
        hidden = model.forward_blocks(batch, torch.tensor([[5, 9]]))
        return hidden, model.lm_logits(hidden)


@pytest.mark.parametrize("method", ["eagle3", "eagle3-3.1", "dflash", "dflash2", "dspark"])
def test_round_trip_gives_equal_outputs(tmp_path, target, method):
    """Eagle 3.1's variant (per-layer feature norms, normed output fed back) included: its norms are saved and read back."""
    method, overrides = ("eagle3", {"fc_norm": True, "norm_output": True}) if method == "eagle3-3.1" else (method, {})
    model = _build(method, target, **overrides)
    model.save_pretrained(tmp_path / "ckpt")
    loaded = METHODS.get(method).model_cls.from_pretrained(tmp_path / "ckpt", target=target)
    assert loaded.config == model.config
    batch = make_batch(target, method, count=1, length=14)
    for a, b in zip(_outputs(model, batch), _outputs(loaded, batch)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    if method == "dspark":
        out_a = model.draft_block(
            model.new_cache(),
            context_features=batch.aux_hidden[0, :6],
            context_positions=batch.position_ids[0, :6],
            anchor_token=3,
            anchor_position=6,
        )
        out_b = loaded.draft_block(
            loaded.new_cache(),
            context_features=batch.aux_hidden[0, :6],
            context_positions=batch.position_ids[0, :6],
            anchor_token=3,
            anchor_position=6,
        )
        assert torch.equal(out_a.tokens, out_b.tokens) and torch.equal(out_a.confidences, out_b.confidences)
    assert type(load_drafter(tmp_path / "ckpt", target=target)) is type(model)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "model.safetensors"]


def test_eagle3_layout(tmp_path, target):
    model = _build("eagle3", target)
    model.save_pretrained(tmp_path / "e")
    cfg = json.loads((tmp_path / "e/config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
    assert cfg["transformer_layer_config"]["model_type"] == "llama"
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == 40
    # EAGLE-3 reads the *inputs* of layers 2, L//2, L-3 (L = 8): vLLM ids are the HF indices.
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["specdraft"]["layer_slots"] == [{"layer": 2, "side": "input"}, {"layer": 4, "side": "input"}, {"layer": 5, "side": "input"}]
    spec_cfg = cfg["speculators_config"]
    assert spec_cfg["algorithm"] == "eagle3" and spec_cfg["default_proposal_method"] == "greedy"
    assert spec_cfg["proposal_methods"][0] == {
        "proposal_type": "greedy",
        "speculative_tokens": 3,
        "verifier_accept_k": 1,
        "accept_tolerance": 0.0,
    }
    assert spec_cfg["verifier"]["architectures"] == ["LlamaForCausalLM"]
    assert cfg["specdraft"]["target"]["fingerprint"] == target.fingerprint
    tensors = load_file(str(tmp_path / "e/model.safetensors"))
    assert tensors["d2t"].dtype == torch.int64 and tensors["d2t"].shape == (40,)
    assert tensors["t2d"].dtype == torch.bool and tensors["t2d"].shape == (VOCAB,)
    assert tensors["lm_head.weight"].shape == (40, 64) and tensors["embed_tokens.weight"].shape == (VOCAB, 64)
    assert tensors["layers.0.self_attn.q_proj.weight"].shape == (64, 128)  # q/k/v read 2D
    assert tensors["fc.weight"].shape == (64, 3 * 64)
    assert {"layers.0.hidden_norm.weight", "layers.0.input_layernorm.weight", "norm.weight"} <= set(tensors)
    assert not any(k.startswith("verifier_") for k in tensors)
    # d2t offsets map draft ids to target ids; t2d marks the same ids.
    ids = torch.arange(40) + tensors["d2t"]
    assert torch.equal(torch.nonzero(tensors["t2d"]).flatten(), ids)
    assert not any(cfg[flag] for flag in ("norm_before_fc", "fc_norm", "norm_output"))
    # Eagle 3.1's norms under speculators' (and vLLM's) names, their switches in config.json
    for flags, names in (
        ({"fc_norm": True, "norm_output": True}, {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"}),
        ({"norm_before_fc": True}, {"input_norm.weight"}),
    ):
        _build("eagle3", target, **flags).save_pretrained(tmp_path / "e31")
        cfg = json.loads((tmp_path / "e31/config.json").read_text())
        assert {flag: cfg[flag] for flag in ("norm_before_fc", "fc_norm", "norm_output")} == {
            flag: flags.get(flag, False) for flag in ("norm_before_fc", "fc_norm", "norm_output")
        }
        tensors = load_file(str(tmp_path / "e31/model.safetensors"))
        assert names <= set(tensors) and not ({"input_norm.weight", "fc_norm.0.weight"} - names) & set(tensors)


@pytest.mark.parametrize("method", ["dflash", "dflash2", "dspark"])
def test_block_drafter_layout(tmp_path, target, method):
    model = _build(method, target)
    model.save_pretrained(tmp_path / "d")
    cfg = json.loads((tmp_path / "d/config.json").read_text())
    assert cfg["architectures"] == [{"dflash": "DFlashSpeculator", "dflash2": "DFlash2DraftModel", "dspark": "DSparkSpeculator"}[method]]
    assert cfg["transformer_layer_config"]["model_type"] == "qwen3"
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 2
    # Outputs of layers 1..5 (L = 8) are HF indices 2..6; vLLM subtracts 1 again for DFlash.
    assert cfg["aux_hidden_state_layer_ids"] == [2, 3, 4, 5, 6]
    assert cfg["block_size"] == 4 and cfg["mask_token_id"] == VOCAB - 1
    assert cfg["sample_from_anchor"] is (method == "dspark")
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == (4 if method == "dspark" else 3)
    tensors = load_file(str(tmp_path / "d/model.safetensors"))
    assert "embed_tokens.weight" not in tensors and "lm_head.weight" not in tensors  # the target's own
    assert {
        "fc.weight",
        "hidden_norm.weight",
        "layers.1.self_attn.q_norm.weight",
        "layers.1.self_attn.k_norm.weight",
        "norm.weight",
    } <= set(tensors)
    if method == "dspark":
        assert cfg["markov_rank"] == 16 and cfg["markov_head_type"] == "gated"
        assert cfg["enable_confidence_head"] is True and cfg["confidence_head_with_markov"] is True
        assert tensors["markov_head.markov_w1.weight"].shape == (VOCAB, 16)
        assert tensors["markov_head.markov_w2.weight"].shape == (VOCAB, 16)
        assert tensors["markov_head.gate_proj.weight"].shape == (16, 64 + 16)
        assert tensors["confidence_head.proj.weight"].shape == (1, 64 + 16)
    if method == "dflash2":  # speculators 0.9.0's names, read by vLLM's qwen3_dflash2.py
        assert (cfg["conv_kernel_size"], cfg["conv_group_size"], cfg["selector_rank"], cfg["selector_top_k"]) == (2, 16, 16, 8)
        assert tensors["layers.1.attention_conv.base_kernel"].shape == tensors["layers.1.mlp_conv.base_kernel"].shape == (2, 2, 64)
        assert tensors["layers.1.mlp_conv.kernel_projection.weight"].shape == (2 * 2 * 4, 64)  # (side, tap, group) rows
        assert (
            tensors["candidate_selector.predecessor_codebook"].shape
            == tensors["candidate_selector.successor_codebook"].shape
            == (VOCAB, 16)
        )
        assert tensors["candidate_selector.hidden_projection.weight"].shape == (16, 64)


def test_config_errors():
    with pytest.raises(SpecdraftError, match="block_size"):
        DFlashConfig(block_size=1)
    with pytest.raises(SpecdraftError, match="mask_token_id 96 is outside the vocabulary"):
        DFlashConfig(vocab_size=96, mask_token_id=96)
    with pytest.raises(SpecdraftError, match="mask_token_id -1"):
        DSparkConfig(mask_token_id=-1)
    with pytest.raises(SpecdraftError, match="unknown markov head"):
        DSparkConfig(markov_head="lstm")
    with pytest.raises(SpecdraftError, match="num_layers must be 1"):
        METHODS.get("eagle3").config_cls(num_layers=2)
    with pytest.raises(SpecdraftError, match="norm_before_fc and fc_norm are exclusive"):
        METHODS.get("eagle3").config_cls(norm_before_fc=True, fc_norm=True)
    assert (
        default_gamma(16) == 7.0
        and default_gamma(10) == 5.0
        and default_gamma(8) == 4.0
        and default_gamma(12) == pytest.approx(5 + 2 / 6 * 2)
    )


def test_eagle3_reduced_vocab_needs_counts(target):
    spec = METHODS.get("eagle3")
    with pytest.raises(SpecdraftError, match="token counts"):
        spec.build(spec.config_cls(draft_vocab_size=10), target)


def test_build_draft_vocab_top_n():
    counts = torch.tensor([5, 0, 9, 9, 1, 7], dtype=torch.int64)
    d2t, t2d = build_draft_vocab(counts, 3)
    assert (torch.arange(3) + d2t).tolist() == [2, 3, 5]
    assert t2d.tolist() == [False, False, True, True, False, True]
    with pytest.raises(SpecdraftError, match="draft_vocab_size 7"):
        build_draft_vocab(counts, 7)


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_reduced_vocab_block_drafter_round_trip_and_layout(tmp_path, target, method):
    model = _build(method, target, draft_vocab_size=40)
    model.save_pretrained(tmp_path / "r")
    cfg = json.loads((tmp_path / "r/config.json").read_text())
    assert cfg["draft_vocab_size"] == 40 and cfg["transformer_layer_config"]["vocab_size"] == VOCAB
    tensors = load_file(str(tmp_path / "r/model.safetensors"))
    # vLLM's qwen3_dflash/qwen3_dspark read top-level lm_head.weight and d2t (-> draft_id_to_target_id).
    assert tensors["lm_head.weight"].shape == (40, 64) and "embed_tokens.weight" not in tensors
    assert tensors["d2t"].dtype == torch.int64 and tensors["d2t"].shape == (40,)
    assert tensors["t2d"].dtype == torch.bool and torch.equal(torch.nonzero(tensors["t2d"]).flatten(), torch.arange(40) + tensors["d2t"])
    # counts = arange(V): the 40 most frequent ids are the top 40, and the head starts from their target rows
    assert (torch.arange(40) + tensors["d2t"]).tolist() == list(range(VOCAB - 40, VOCAB))
    if method == "dspark":
        assert tensors["markov_head.markov_w1.weight"].shape == (VOCAB, 16)
        assert tensors["markov_head.markov_w2.weight"].shape == (40, 16)
    loaded = METHODS.get(method).model_cls.from_pretrained(tmp_path / "r", target=target).eval()
    assert loaded.config == model.config
    batch = make_batch(target, method, count=1, length=14)
    for a, b in zip(_outputs(model, batch), _outputs(loaded, batch)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    kwargs = dict(context_features=batch.aux_hidden[0, :6], context_positions=batch.position_ids[0, :6], anchor_token=3, anchor_position=6)
    out_a = model.draft_block(model.new_cache(), **kwargs)
    out_b = loaded.draft_block(loaded.new_cache(), **kwargs)
    assert torch.equal(out_a.tokens, out_b.tokens) and out_a.probs is None and out_b.probs is None  # greedy: point masses
    assert bool(torch.isin(out_a.tokens, model.draft_target_ids()).all())


def test_fresh_reduced_head_starts_from_target_rows(target):
    model = METHODS.get("dspark").build(
        DSparkConfig(block_size=4, num_layers=1, markov_rank=16, draft_vocab_size=40), target, counts=torch.arange(VOCAB)
    )
    ids = model.draft_target_ids()
    assert torch.equal(model.lm_head.weight, model.verifier_lm_head.weight[ids]) and model.lm_head.weight.requires_grad
    full = METHODS.get("dflash").build(DFlashConfig(block_size=4, num_layers=1, draft_vocab_size=VOCAB), target, counts=torch.arange(VOCAB))
    assert full.lm_head is None and full.d2t is None and full.config.draft_vocab_size is None


@pytest.mark.parametrize("table", ["t2d", "d2t"])
def test_inconsistent_vocab_tables_are_refused(tmp_path, target, table):
    _build("dflash", target, draft_vocab_size=40).save_pretrained(tmp_path / "r")
    tensors = load_file(str(tmp_path / "r/model.safetensors"))
    if table == "t2d":
        tensors["t2d"][0] = True  # 41 members for 40 draft ids
    else:
        tensors["d2t"][3] -= 1  # draft id 3 now names a target id outside t2d
    rewrite_weights(tmp_path / "r", tensors)
    with pytest.raises(SpecdraftError, match="d2t and t2d describe different draft vocabularies"):
        METHODS.get("dflash").model_cls.from_pretrained(tmp_path / "r", target=target)


def test_coverage_chooses_smallest_covering_vocab():
    counts = torch.tensor([5, 0, 3, 2, 0, 10], dtype=torch.int64)  # 20 occurrences: 10, 5, 3, 2
    assert coverage_vocab_size(counts, 0.5) == 1
    assert coverage_vocab_size(counts, 0.51) == 2
    assert coverage_vocab_size(counts, 0.75) == 2
    assert coverage_vocab_size(counts, 0.76) == 3
    assert coverage_vocab_size(counts, 1.0) == 4  # every id that occurs, no more
    for bad in (0.0, 1.5):
        with pytest.raises(SpecdraftError, match="draft_vocab_coverage"):
            coverage_vocab_size(counts, bad)
    with pytest.raises(SpecdraftError, match="all zero"):
        coverage_vocab_size(torch.zeros(4, dtype=torch.int64), 0.9)
    d2t, t2d = build_draft_vocab(counts, coverage_vocab_size(counts, 0.76))
    assert (torch.arange(3) + d2t).tolist() == [0, 2, 5]
    draft, inside = target_to_draft(t2d, torch.tensor([5, 1, 2, 0]))
    assert draft.tolist() == [2, 0, 1, 0] and inside.tolist() == [True, False, True, True]


def test_block_drafter_vocab_by_coverage_and_precedence(target):
    spec = METHODS.get("dspark")
    counts = torch.zeros(VOCAB, dtype=torch.int64)
    counts[[7, 30, 50, 60]] = torch.tensor([60, 25, 10, 5])
    small = dict(block_size=4, num_layers=1, markov_rank=16)
    model = spec.build(DSparkConfig(**small, draft_vocab_coverage=0.9), target, counts=counts)
    assert model.config.draft_vocab_size == 3 and model.draft_target_ids().tolist() == [7, 30, 50]
    assert model.markov_head.markov_w2.weight.shape == (3, 16)
    # draft_vocab_size wins over draft_vocab_coverage; the saved config keeps the chosen N.
    fixed = spec.build(DSparkConfig(**small, draft_vocab_size=2, draft_vocab_coverage=0.9), target, counts=counts)
    assert fixed.draft_target_ids().tolist() == [7, 30]
    with pytest.raises(SpecdraftError, match="needs token counts"):
        spec.build(DSparkConfig(**small, draft_vocab_coverage=0.9), target)
    with pytest.raises(SpecdraftError, match="draft_vocab_coverage must be in"):
        DSparkConfig(draft_vocab_coverage=0.0)
    with pytest.raises(SpecdraftError, match="exceeds the target vocabulary"):
        DFlashConfig(vocab_size=VOCAB, draft_vocab_size=VOCAB + 1)


@pytest.fixture
def saved(tmp_path, target):
    model = _build("dflash", target)
    model.save_pretrained(tmp_path / "c")
    return tmp_path / "c"


def test_missing_and_misshapen_tensors_are_named(saved, target):
    cls = METHODS.get("dflash").model_cls
    tensors = load_file(str(saved / "model.safetensors"))
    del tensors["layers.1.mlp.up_proj.weight"]
    rewrite_weights(saved, tensors)
    with pytest.raises(SpecdraftError, match="'layers.1.mlp.up_proj.weight' is missing"):
        cls.from_pretrained(saved, target=target)
    tensors["layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    rewrite_weights(saved, tensors)
    with pytest.raises(SpecdraftError, match=r"'layers.1.mlp.up_proj.weight' has shape \(3, 3\)"):
        cls.from_pretrained(saved, target=target)


def test_config_weight_disagreement_is_reported(saved, target):
    cfg = json.loads((saved / "config.json").read_text())
    cfg["specdraft"]["config"]["num_layers"] = 3
    cfg["transformer_layer_config"]["num_hidden_layers"] = 3  # consistent config, weights for 2 layers
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecdraftError, match="'layers.2."):
        METHODS.get("dflash").model_cls.from_pretrained(saved, target=target)


def test_refuses_pickle_and_wrong_kind(saved, target, tmp_path):
    (saved / "model.safetensors").rename(saved / "pytorch_model.bin")
    with pytest.raises(SpecdraftError, match="pickle weights \\(pytorch_model.bin\\)"):
        load_drafter(saved, target=target)
    (saved / "pytorch_model.bin").rename(saved / "model.safetensors")
    with pytest.raises(SpecdraftError, match="speculators_model_type is 'dflash', expected 'eagle3'"):
        METHODS.get("eagle3").model_cls.from_pretrained(saved, target=target)
    with pytest.raises(SpecdraftError, match="pass target="):
        load_drafter(saved)
    with pytest.raises(SpecdraftError, match="fingerprint"):
        load_drafter(saved, target=make_target(seed=1))
    with pytest.raises(SpecdraftError, match="not a directory"):
        load_drafter(tmp_path / "nope")


def test_save_replaces_directory_atomically(saved, target):
    model = METHODS.get("dflash").model_cls.from_pretrained(saved, target=target)
    with torch.no_grad():
        model.norm.weight.fill_(2.0)
    model.save_pretrained(saved)
    assert sorted(p.name for p in saved.parent.iterdir()) == ["c"]
    assert torch.all(load_file(str(saved / "model.safetensors"))["norm.weight"] == 2.0)


def test_eagle3_loads_for_inference_without_target(tmp_path, target):
    model = _build("eagle3", target)
    model.save_pretrained(tmp_path / "e")
    loaded = load_drafter(tmp_path / "e")
    batch = make_batch(target, "eagle3", count=1, length=10)
    with torch.no_grad():
        torch.testing.assert_close(loaded.ttt_hidden(batch)[0], model.ttt_hidden(batch)[0])
    with pytest.raises(SpecdraftError, match="no target attached"):
        loaded.training_forward(batch)
    assert loaded.config == model.config


def test_batch_with_wrong_slots_is_refused(target):
    model = _build("dflash", target)
    batch = make_batch(target, "eagle3", count=1, length=10)  # 3 slots, DFlash reads 5
    with pytest.raises(SpecdraftError, match="reads 5 hidden-state slots"):
        model.training_forward(batch)


def test_mask_token_checked_against_target_vocab(target):
    spec = METHODS.get("dflash")
    with pytest.raises(SpecdraftError, match=f"mask_token_id {VOCAB} is outside the vocabulary 0..{VOCAB - 1}"):
        spec.build(DFlashConfig(mask_token_id=VOCAB, num_layers=1, block_size=3), target)
    with pytest.raises(SpecdraftError, match="hidden_size 32 differs from the target's 64"):
        spec.build(DFlashConfig(hidden_size=32), target)


def test_checkpoints_from_before_a_field_existed_load_with_its_default(saved, target):
    """Fields marked added_later (training-only, e.g. position_weighting) may be absent from older
    checkpoints, which were trained with the default; any other missing field stays an error."""
    cfg = json.loads((saved / "config.json").read_text())
    for name in ("position_weighting", "dpace_alpha", "train_draft_head"):
        del cfg["specdraft"]["config"][name]
    (saved / "config.json").write_text(json.dumps(cfg))
    model = METHODS.get("dflash").model_cls.from_pretrained(saved, target=target)
    assert model.config.position_weighting == "exp" and model.config.dpace_alpha == 0.5 and model.config.train_draft_head
    del cfg["specdraft"]["config"]["anchor_sampling"]
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecdraftError, match="specdraft.config lacks anchor_sampling"):
        METHODS.get("dflash").model_cls.from_pretrained(saved, target=target)


def test_eagle3_checkpoints_from_before_eagle31_load_without_its_norms(tmp_path, target):
    """An EAGLE-3 checkpoint saved before the Eagle 3.1 switches existed has none of them in specdraft.config: it loads
    with all three off (its architecture then), and config.json's own switches still have to agree."""
    model = _build("eagle3", target)
    model.save_pretrained(tmp_path / "e")
    cfg = json.loads((tmp_path / "e/config.json").read_text())
    for name in ("norm_before_fc", "fc_norm", "norm_output"):
        del cfg["specdraft"]["config"][name]
    (tmp_path / "e/config.json").write_text(json.dumps(cfg))
    loaded = METHODS.get("eagle3").model_cls.from_pretrained(tmp_path / "e", target=target)
    assert not (loaded.config.norm_before_fc or loaded.config.fc_norm or loaded.config.norm_output)
    cfg["norm_output"] = True  # the speculators side says otherwise: refused, not decoded wrongly
    (tmp_path / "e/config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecdraftError, match="norm_output"):
        METHODS.get("eagle3").model_cls.from_pretrained(tmp_path / "e", target=target)
