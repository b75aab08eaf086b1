"""DFlash2 (models/dflash2): its convolution, identity start, training, checkpoint format and the
distribution its drafts are drawn from (greedy decoding exactness runs in test_decode_drafters.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy import stats

from specdraft.decode.verification import verify_rejection
from specdraft.errors import SpecdraftError
from specdraft.models import METHODS
from specdraft.models.common.anchors import sample_anchors
from specdraft.models.common.drafter import load_drafter
from specdraft.models.dflash.model import DFlashDrafter
from specdraft.models.dflash2.layers import block_conv
from test_models_support import VOCAB, make_batch

SMALL = {"block_size": 4, "num_layers": 1, "selector_rank": 16, "selector_top_k": 8}


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


def build(target, seed=0, **overrides):
    spec = METHODS.get("dflash2")
    torch.manual_seed(seed)
    return spec.build(spec.config_cls(**{**SMALL, **overrides}), target)


def test_block_conv_is_causal_inside_each_block_only():
    """out[t] = sum_tap (base[tap] + delta[t, tap]) * x[t - tap] with t - tap in t's block, written out slot by slot."""
    g = torch.Generator().manual_seed(0)
    n, blocks, b, d, taps, groups = 2, 3, 4, 8, 3, 2
    x, delta, base = (
        torch.randn(n, blocks * b, d, generator=g),
        torch.randn(n, blocks * b, taps, groups, generator=g),
        torch.randn(taps, d, generator=g),
    )
    want = torch.zeros_like(x)
    for t in range(blocks * b):
        for tap in range(taps):
            if t % b >= tap:
                want[:, t] += (base[tap] + delta[:, t, tap].repeat_interleave(d // groups, -1)) * x[:, t - tap]
    torch.testing.assert_close(block_conv(x, delta, base, block_size=b), want)


def test_fresh_dflash2_computes_what_dflash_does(target):
    """Identity-initialised convolutions: a DFlash with the same backbone weights gives the same block hidden states."""
    model = build(target)
    plain = DFlashDrafter(METHODS.get("dflash").config_cls(block_size=4, num_layers=1).resolve(target), verifier=target.describe())
    plain.attach_target(target)
    shared = plain.state_dict().keys()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if k in shared})
    batch = make_batch(target, "dflash2", count=2, length=16)
    anchors = sample_anchors(batch.segment_ids, batch.loss_mask, max_per_segment=4)
    with torch.no_grad():
        torch.testing.assert_close(model.forward_blocks(batch, anchors), plain.forward_blocks(batch, anchors))
        model.layers[0].mlp_conv.kernel_projection.weight.normal_(std=0.5)
        assert not torch.allclose(model.forward_blocks(batch, anchors), plain.forward_blocks(batch, anchors))


@pytest.mark.parametrize("unary_loss", ["kl", "ce"])
def test_tiny_dflash2_overfits(target, unary_loss):
    model = build(target, unary_loss=unary_loss)
    batch = make_batch(target, "dflash2", count=4, length=24, pack=2)
    params = [p for p in model.parameters() if p.requires_grad]
    assert any(p is model.candidate_selector.predecessor_codebook for p in params)
    opt = torch.optim.AdamW(params, lr=3e-3)
    torch.manual_seed(0)
    first = None
    for _ in range(80):
        out = model.training_forward(batch)
        first = first if first is not None else out.metrics
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    with torch.no_grad():
        out = model.training_forward(batch)
    assert out.metrics["ce"] < 0.5 * first["ce"] and out.metrics["selector"] < 0.5 * first["selector"]
    assert ("kl" in out.metrics) == (unary_loss == "kl") and out.metrics.get("kl", 0.0) <= 0.5 * first.get("kl", 0.0)
    assert float(out.position_acc[0]) > 0.9, out.position_acc  # the selector's teacher-forced pick


def test_checkpoint_round_trip_and_strict_reading(target, tmp_path):
    model = build(target)
    with torch.no_grad():  # non-identity convolutions, so a dropped tensor would show
        for layer in model.layers:
            layer.attention_conv.kernel_projection.weight.normal_(std=0.1)
    model.save_pretrained(tmp_path / "a")
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash2" and cfg["architectures"] == ["DFlash2DraftModel"]
    assert {k: cfg[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "sample_from_anchor")} == {
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 16,
        "selector_top_k": 8,
        "sample_from_anchor": False,
    }
    loaded = load_drafter(tmp_path / "a", target=target)
    saved = model.saved_state()
    assert saved.keys() == loaded.saved_state().keys()
    assert all(torch.equal(saved[k], loaded.saved_state()[k]) for k in saved)

    def broken(name, edit):
        bad = tmp_path / name
        bad.mkdir()
        (bad / "model.safetensors").write_bytes((tmp_path / "a" / "model.safetensors").read_bytes())
        c = json.loads(json.dumps(cfg))
        edit(c)
        (bad / "config.json").write_text(json.dumps(c))
        return bad

    with pytest.raises(SpecdraftError, match="selector_top_k missing"):
        load_drafter(broken("missing", lambda c: c.pop("selector_top_k")), target=target)
    with pytest.raises(SpecdraftError, match="contradicts itself"):
        load_drafter(broken("contradicts", lambda c: c.__setitem__("conv_kernel_size", 3)), target=target)
    with pytest.raises(SpecdraftError, match="sample_from_anchor"):
        load_drafter(broken("anchor", lambda c: c.__setitem__("sample_from_anchor", True)), target=target)
    with pytest.raises(SpecdraftError, match="full vocabulary"):
        load_drafter(broken("vocab", lambda c: c.__setitem__("draft_vocab_size", 40)), target=target)
    with pytest.raises(SpecdraftError, match="full verifier vocabulary"):
        build(target, draft_vocab_size=40)
    with pytest.raises(SpecdraftError, match="must divide hidden_size"):
        build(target, conv_group_size=24)


def _chi_square_p(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    observed = np.bincount(tokens.numpy(), minlength=probs.numel()).astype(float)
    expected = (probs.double() / probs.double().sum()).numpy() * len(tokens)
    keep = expected > 0
    assert observed[~keep].sum() == 0, "drew a token its distribution gives probability 0"
    return stats.chisquare(observed[keep], expected[keep]).pvalue


def test_greedy_draft_is_the_selector_argmax_given_the_previous_draft(target):
    """T=0: slot k's token is argmax over the unary top-k of U + <P[x_{k-1}] * W h, S[c]> (written out with
    einsum), and with strong codebooks that differs from the plain unary argmax somewhere."""
    model = build(target)
    sel = model.candidate_selector
    with torch.no_grad():
        for w in (sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight):
            w.mul_(60.0)
    hidden = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    proposal = model.propose(hidden, anchor_token=7, temperature=0.0, generator=None)
    unary = model.lm_logits(hidden[1:]).detach()
    prev, differs = 7, False
    for k in range(3):
        cands = unary[k].topk(8).indices
        bilinear = torch.einsum(
            "r,r,cr->c", sel.predecessor_codebook[prev], sel.hidden_projection(hidden[1 + k]), sel.successor_codebook[cands]
        )
        want = int(cands[(unary[k, cands] + bilinear).argmax()])
        assert int(proposal.tokens[k]) == want
        differs |= want != int(unary[k].argmax())
        prev = want
    assert differs


def test_sampled_drafts_follow_their_reported_distribution_and_verification_stays_lossless(target):
    """T=1: tokens drawn by propose follow the probs it hands the verifier (slot 1 unconditionally, slot 2 given
    slot 1's most frequent token, as the selector conditions on it), zero outside the unary top-k; rejection
    sampling against a target distribution that disagrees then commits tokens distributed as the target."""
    model = build(target, selector_top_k=6)
    with torch.no_grad():
        for w in (model.candidate_selector.predecessor_codebook, model.candidate_selector.successor_codebook):
            w.mul_(30.0)
    hidden = torch.randn(4, 64, generator=torch.Generator().manual_seed(5)) * 0.05
    gen = torch.Generator().manual_seed(7)
    n = 6000
    with torch.no_grad():
        drafts = [model.propose(hidden, anchor_token=3, temperature=1.0, generator=gen) for _ in range(n)]
    tokens = torch.stack([d.tokens for d in drafts])
    probs = torch.stack([d.probs for d in drafts])
    assert torch.allclose(probs.sum(-1), torch.ones(n, 3, dtype=probs.dtype))
    assert int((probs[0] > 0).sum(-1).max()) <= 6
    assert torch.equal(probs[:, 0], probs[:1, 0].expand(n, -1))  # slot 1 conditions only on the anchor
    assert _chi_square_p(tokens[:, 0], probs[0, 0]) > 1e-3
    common = int(tokens[:, 0].mode().values)
    rows = tokens[:, 0] == common
    assert rows.sum() > 500 and not torch.equal(probs[rows][0, 1], probs[~rows][0, 1])  # slot 2 depends on slot 1
    assert _chi_square_p(tokens[rows, 1], probs[rows][0, 1]) > 1e-3

    p_t = torch.softmax(torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(9)) * 2.0, -1).double()
    out = verify_rejection(
        draft_tokens=tokens,
        draft_lengths=torch.full((n,), 3),
        draft_probs=probs.double(),
        target_probs=p_t.expand(n, 4, VOCAB),
        generator=gen,
    )
    assert 0 < int((out.num_accepted == 0).sum()) < n  # rejections happen, and so do acceptances
    assert _chi_square_p(out.tokens[:, 0], p_t[0]) > 1e-3


def test_vllm_serving_claims():
    """vLLM serves DFlash2 as its dflash method (it has no dflash2 one), on GPU only, with the trained block."""
    serving = METHODS.get("dflash2").serving
    assert not serving.cpu and not serving.adaptive_verification
    assert serving.options({}, 3, None, False, "ckpt") == {"method": "dflash", "num_speculative_tokens": 3}
    assert serving.options({}, 3, 3, False, "ckpt")["num_speculative_tokens"] == 3
    with pytest.raises(SpecdraftError, match="trained 3"):
        serving.options({}, 3, 5, False, "ckpt")


def test_unary_kl_is_the_target_to_draft_divergence():
    from specdraft.models.common.distill_losses import DISTILL_LOSSES, Distributions
    from specdraft.models.dflash2.config import DFlash2Config

    def kl_rows(draft: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # dflash2's default distill_loss
        return DISTILL_LOSSES.get(DFlash2Config().distill_loss)(Distributions(draft, target))

    g = torch.Generator().manual_seed(0)
    draft, tgt = torch.randn(5, 11, generator=g), torch.randn(5, 11, generator=g) * 3
    p_t = torch.softmax(tgt, -1)
    torch.testing.assert_close(kl_rows(draft, tgt), (p_t * (p_t.log() - torch.log_softmax(draft, -1))).sum(-1))
    assert float(kl_rows(tgt, tgt).abs().max()) < 1e-6
