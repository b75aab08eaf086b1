"""Run inside ``.venv-vllm`` (by tests/test_vllm_parity.py): vLLM 0.32 builds its DFlash2 model
(``qwen3_dflash2.py``) from a specdraft checkpoint through its own speculators config translation and
weight loader, and drafts greedy blocks the way its GPU DFlash2 runtime does
(``v1/worker/gpu/spec_decode/dflash2/speculator.py``: unary top-k, ``CandidateSelector`` edge scores,
then the selector walk).

argv: target_dir drafter_dir blocks.safetensors out.json; ``blocks.safetensors`` holds ``features`` [T, S*D]
(aux hidden states in aux-id order), ``tokens`` [T] and ``anchors`` [A] (block j anchored at anchors[j], its
context 0..anchors[j]-1).

What this harness substitutes, and why:
  * the V1-runner platform check is bypassed (vLLM's CPU runner has no DFlash2 proposer; the model code is
    platform-neutral);
  * embedding and LM head are copied from the target (serving shares the target's; the checkpoint omits them),
    the head re-packed for vLLM-CPU's GEMM afterwards;
  * paged attention: each draft layer's attention kernel is replaced by SDPA over the context K/V that
    vLLM's own ``precompute_and_store_context_kv`` wrote and the block's K/V (non-causal where vLLM's layer
    says so);
  * the selector walk (``_selector_walk_kernel``, Triton) is written here in torch, greedy: step 0 reads the
    score row of the anchor predecessor, step l the row of the candidate chosen at step l-1.
The grouped convolution needs no substitute: ``qwen3_dflash2._grouped_conv`` only calls the Triton op
``dflash2_grouped_conv`` for CUDA tensors and has its own torch path otherwise, which is what runs here.
"""

import json
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from specdraft.integrations.vllm.plugin import install
from vllm_side_common import FUSED, drafter_engine_config, drafter_model, record_loaded_parameters

target_dir, drafter_dir, blocks_path, out_path = sys.argv[1:5]

from vllm.model_executor.models import qwen3_dflash2  # noqa: E402

install()  # specdraft's vLLM-CPU per-layer k_norm correction, as in every server specdraft starts
config, checkpoint, num_tokens = drafter_engine_config(target_dir, drafter_dir)
draft_config = config.speculative_config.draft_model_config
hf = draft_config.hf_config
filled = record_loaded_parameters()
conv_calls = {"torch_path": 0}
grouped_conv = qwen3_dflash2._grouped_conv


def counted_conv(hidden_states, *args):
    conv_calls["torch_path"] += not hidden_states.is_cuda
    return grouped_conv(hidden_states, *args)


qwen3_dflash2._grouped_conv = counted_conv
with drafter_model(config) as model:
    params = {name for name, _ in model.named_parameters()}

    def in_vllm(name: str) -> str:
        name = "model." + name
        for old, new in FUSED.items():
            name = name.replace(old, new)
        return name

    unexpected = sorted(n for n in checkpoint if in_vllm(n) not in filled)
    missing = sorted(params - filled)
    target = load_file(f"{target_dir}/model.safetensors")
    model.model.embed_tokens.weight.data.copy_(target["model.embed_tokens.weight"])
    model.lm_head.weight.data.copy_(target.get("lm_head.weight", target["model.embed_tokens.weight"]))  # tied: the embedding
    model.lm_head.quant_method.process_weights_after_loading(model.lm_head)  # vLLM-CPU packs the head's GEMM from its weight

    inner = model.model
    context_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for i, attn in enumerate(inner._attn_layers):
        attn.impl.do_kv_cache_update = lambda layer, k, v, cache, slots, i=i: context_kv.__setitem__(i, (k.clone(), v.clone()))

    class BlockAttention(torch.nn.Module):
        """The block's queries over [context K/V; block K/V], in SDPA form."""

        def __init__(self, index: int, attn, causal: bool):
            super().__init__()
            self.index, self.attn, self.causal = index, attn, causal

        def forward(self, q, k, v):
            a, n = self.attn, q.shape[0]
            ck, cv = context_kv[self.index]
            repeat = a.num_heads // a.num_kv_heads
            keys = torch.cat([ck, k.view(n, a.num_kv_heads, a.head_dim)]).transpose(0, 1).repeat_interleave(repeat, 0)
            values = torch.cat([cv, v.view(n, a.num_kv_heads, a.head_dim)]).transpose(0, 1).repeat_interleave(repeat, 0)
            allowed = torch.ones(n, ck.shape[0] + n, dtype=torch.bool)
            if self.causal:
                allowed[:, ck.shape[0] :] = torch.ones(n, n, dtype=torch.bool).tril()
            out = F.scaled_dot_product_attention(
                q.view(n, a.num_heads, a.head_dim).transpose(0, 1), keys, values, attn_mask=allowed, scale=a.scaling
            )
            return out.transpose(0, 1).reshape(n, -1)

    for i, layer in enumerate(inner.layers):
        layer.self_attn.attn = BlockAttention(i, layer.self_attn, bool(layer.self_attn.causal))

    blocks = load_file(blocks_path)
    features, tokens, anchors = blocks["features"], blocks["tokens"], blocks["anchors"]
    drafts, realized = [], []
    with torch.no_grad():
        for p in anchors.tolist():
            context_kv.clear()
            model.precompute_and_store_context_kv(
                model.combine_hidden_states(features[:p]), torch.arange(p), torch.zeros(p, dtype=torch.int64)
            )
            ids = torch.full((num_tokens + 1,), inner.mask_token_id, dtype=torch.int64)  # [bonus/anchor, MASK x K] at p..p+K
            ids[0] = tokens[p]
            hidden = model(ids, torch.arange(p, p + num_tokens + 1))[1:]  # the K mask slots draft
            candidates, unary = model.compute_candidates(hidden)
            scores = inner.candidate_selector(candidates[None], unary[None], hidden[None], tokens[p : p + 1])[0]  # [K, k, k]
            row, block, walked = 0, [], []
            for step in range(num_tokens):
                choice = int(scores[step, row].argmax())
                block.append(int(candidates[step, choice]))
                walked.append(scores[step, row].tolist())
                row = choice
            drafts.append(block)
            realized.append(walked)

report = {
    "checkpoint_tensors": len(checkpoint),
    "loaded_parameters": len(filled),
    "model_parameters": len(params),
    "unexpected": unexpected,
    "missing": missing,
    "architectures": list(hf.architectures or []),
    "dflash_config": {k: v for k, v in dict(hf.dflash_config).items() if isinstance(v, (int, float, bool, list, str))},
    "method": config.speculative_config.method,
    "causal": [bool(layer.self_attn.causal) for layer in inner.layers],
    "num_speculative_tokens": config.speculative_config.num_speculative_tokens,
    "conv_torch_calls": conv_calls["torch_path"],
    "drafts": drafts,
    "realized_scores": realized,
}
json.dump(report, open(out_path, "w"))
