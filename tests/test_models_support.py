"""Tiny in-memory targets and hidden-state batches for the drafter-model tests (no files, no hub).

Imported by the other ``test_models*`` / ``test_format*`` / ``test_interop*`` modules; the one
test here checks the batch builder itself.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from specdraft.models import METHODS, DrafterBatch
from specdraft.targets.base import Target

VOCAB = 96


def make_target(*, num_layers: int = 8, vocab: int = VOCAB, seed: int = 0, kv_heads: int = 1, family: str = "llama") -> Target:
    """A random HF causal LM (hidden 64, 2 heads of 32, GQA with ``kv_heads``) wrapped as a Target."""
    import transformers

    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=kv_heads,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    config = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[family](**common)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # a random head gives near-uniform p_t; sharpen it so argmax is meaningful
        model.lm_head.weight.mul_(40.0)
    model.config.architectures = [type(model).__name__]
    return Target(
        name=f"tiny-{family}",
        path=Path(f"/nonexistent/tiny-{family}"),
        model=model,
        tokenizer=None,
        fingerprint=f"fp-{seed}",
        tokenizer_hash="none",
    )


@torch.no_grad()
def sample_sequences(target: Target, *, count: int, length: int, prompt: int = 4, seed: int = 0) -> torch.Tensor:
    """Greedy continuations of random prompts: int64 [count, length] (so labels = target argmax)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (count, prompt), generator=g)
    out = target.model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=length - prompt,
        min_new_tokens=length - prompt,
        do_sample=False,
        pad_token_id=0,
    )
    return out[:, :length]


@torch.no_grad()
def hidden_payload(target: Target, tokens: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux_hidden [N, T, S, D] for the method's preset slots, last_hidden [N, T, D] = final-norm input)."""
    captured = {}
    norm = target.model.get_decoder().norm
    handle = norm.register_forward_hook(lambda mod, args, out: captured.__setitem__("x", args[0]))
    try:
        out = target.model(input_ids=tokens, output_hidden_states=True)
    finally:
        handle.remove()
    slots = METHODS.get(method).layer_slots(target.num_layers)
    aux = torch.stack([out.hidden_states[s.hf_index(target.num_layers)] for s in slots], dim=2)
    return aux, captured["x"]


def make_batch(
    target: Target, method: str, *, count: int = 4, length: int = 24, prompt: int = 4, seed: int = 0, pack: int = 1
) -> DrafterBatch:
    """Greedy samples as a batch; ``pack`` samples are concatenated per row (segments 0..pack-1)."""
    tokens = sample_sequences(target, count=count, length=length, prompt=prompt, seed=seed)
    aux, last = hidden_payload(target, tokens, method)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, prompt:] = True
    rows = count // pack

    def packed(x):
        return x.view(rows, pack * length, *x.shape[2:]) if x.dim() > 2 else x.reshape(rows, pack * length)

    seg = torch.arange(pack).repeat_interleave(length).repeat(rows, 1).to(torch.int32)
    pos = torch.arange(length).repeat(pack).repeat(rows, 1)
    return DrafterBatch(
        token_ids=packed(tokens),
        loss_mask=packed(mask),
        segment_ids=seg,
        position_ids=pos,
        aux_hidden=packed(aux),
        last_hidden=packed(last),
    )


def pad_batch(batch: DrafterBatch, extra: int) -> DrafterBatch:
    """Append ``extra`` padding tokens (segment -1) to every row."""

    def pad(x, value):
        shape = (x.shape[0], extra, *x.shape[2:])
        return torch.cat([x, torch.full(shape, value, dtype=x.dtype)], dim=1)

    return DrafterBatch(
        token_ids=pad(batch.token_ids, 0),
        loss_mask=pad(batch.loss_mask, False),
        segment_ids=pad(batch.segment_ids, -1),
        position_ids=pad(batch.position_ids, 0),
        aux_hidden=pad(batch.aux_hidden, 0.0),
        last_hidden=pad(batch.last_hidden, 0.0),
    )


@contextlib.contextmanager
def single_thread():
    """Tiny models run fastest single-threaded on a shared, oversubscribed CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_make_batch_packs_segments():
    target = make_target()
    batch = make_batch(target, "dflash", count=4, length=12, pack=2)
    assert batch.token_ids.shape == (2, 24)
    assert batch.aux_hidden.shape == (2, 24, 5, 64)
    assert batch.segment_ids[0].tolist() == [0] * 12 + [1] * 12
    assert batch.position_ids[0, 12] == 0
    # Greedy data: after the random 4-token prompt, the target's own argmax at t is token t+1.
    logits = target.model.lm_head(target.model.get_decoder().norm(batch.last_hidden))
    assert torch.equal(logits[0, 3:11].argmax(-1), batch.token_ids[0, 4:12])
