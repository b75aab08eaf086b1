"""Capture parity against HF ``output_hidden_states`` and batching invariance."""

from __future__ import annotations

import pytest
import torch

from specdraft.errors import SpecdraftError
from specdraft.hidden_states.capture import HiddenStateCapture, find_decoder
from specdraft.hidden_states.layers import LayerSlot

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=256,
)


def tiny_model(family: str):
    import transformers

    torch.manual_seed(0)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    elif family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY))
    elif family == "gemma3":
        cfg = transformers.Gemma3TextConfig(**TINY, sliding_window=4, query_pre_attn_scalar=32)
        model = transformers.Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(family)
    return model.eval()


ALL_SLOTS = [LayerSlot(i, side) for i in range(4) for side in ("input", "output")]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_capture_matches_hf_hidden_states(family):
    model = tiny_model(family)
    ids = torch.randint(0, 128, (11,))
    with torch.no_grad():
        hf = model(ids[None], output_hidden_states=True).hidden_states
    assert len(hf) == 5
    ((hs, last),) = HiddenStateCapture(model, ALL_SLOTS)([ids])
    assert hs.shape == (11, len(ALL_SLOTS), 64) and last.shape == (11, 64)
    for s, slot in enumerate(ALL_SLOTS):
        if slot.side == "output" and slot.layer == 3:
            # HF's last entry is after the final norm: our raw output is last_hidden, and norm(it) == hf[-1].
            torch.testing.assert_close(hs[:, s], last, rtol=0, atol=0)
            continue
        torch.testing.assert_close(hs[:, s], hf[slot.hf_index(4)][0], rtol=0, atol=0)
    _, _, norm = find_decoder(model)
    with torch.no_grad():
        torch.testing.assert_close(norm(last), hf[-1][0], rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_batched_equals_unbatched(family):
    model = tiny_model(family)
    capture = HiddenStateCapture(model, [LayerSlot(0, "input"), LayerSlot(2, "output")])
    seqs = [torch.randint(0, 128, (n,)) for n in (9, 3, 14, 1)]
    batched = capture(seqs)
    for seq, (hs, last) in zip(seqs, batched):
        ((hs1, last1),) = capture([seq])
        assert hs.shape == hs1.shape and last.shape == last1.shape == (seq.shape[0], 64)
        torch.testing.assert_close(hs, hs1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(last, last1, rtol=1e-5, atol=1e-5)


def test_hooks_are_removed_after_capture():
    model = tiny_model("llama")
    HiddenStateCapture(model, [LayerSlot(1, "input"), LayerSlot(1, "output")])([torch.arange(5)])
    _, layers, norm = find_decoder(model)
    for m in (*layers, norm):
        assert not m._forward_hooks and not m._forward_pre_hooks


def test_layer_index_out_of_range():
    with pytest.raises(SpecdraftError, match=r"layer index 4 is out of range: the target has 4 decoder layers"):
        HiddenStateCapture(tiny_model("llama"), [LayerSlot(4, "output")])


def test_unsupported_model_is_named():
    with pytest.raises(SpecdraftError, match=r"target Linear \(model_type None\) is not a supported family .*decoder layers"):
        HiddenStateCapture(torch.nn.Linear(2, 2), [LayerSlot(0, "output")])
