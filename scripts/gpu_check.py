"""The decoding runtime on a CUDA device: exactness and the forward-path choice, and the verify cost curve there.

CI has no GPU. Run this on a GPU machine (``PYTHONPATH=src python scripts/gpu_check.py --out DIR``). It takes a
random Llama (tiny for exactness, SmolLM2-135M-shaped for timings) and checks:

  1. Greedy speculative decoding equals plain decoding on the device, over batched rows, with every forward
     path that applies there. The drafts are the plain continuation with half the tokens corrupted, so rows
     accept different lengths.
  2. The CPU-only path parts (prepacked, streamed) do not apply on CUDA, and ``auto`` picks among those that do.
  3. The target forward of k = 1..8 new tokens after 256 cached, per applicable path (ms, CUDA-synchronised, by
     the runtime's SPS profiler).

Writes ``gpu_check.json``; exits non-zero if a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def random_llama(device, *, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, seed: int):
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config).to(device).eval()


def corrupted_truth(prompts, truths, vocab: int, seed: int = 0):
    """A proposer drafting each row's known continuation with every token corrupted with probability 1/2."""
    import numpy as np
    import torch

    from specdraft.decode.proposers.base import Draft, Proposer

    class Corrupted(Proposer):
        def __init__(self):
            self.rng = np.random.default_rng(seed)

        def propose(self, inputs):
            width = int(inputs.max_draft.max())
            tokens = torch.zeros((len(inputs.row_ids), width), dtype=torch.long)
            lengths = torch.zeros(len(inputs.row_ids), dtype=torch.long)
            for i, rid in enumerate(inputs.row_ids):
                done = len(inputs.tokens[i]) - len(prompts[rid])
                truth = list(truths[rid][done : done + width])
                draft = [(t + 1) % vocab if self.rng.random() < 0.5 else t for t in truth]
                tokens[i, : len(draft)] = torch.tensor(draft, dtype=torch.long)
                lengths[i] = len(draft)
            device = inputs.max_draft.device
            return Draft(tokens=tokens.to(device), lengths=lengths.to(device))

    return Corrupted()


def exactness(device) -> dict:
    import torch

    from specdraft.decode.config import DecodeConfig, SamplingConfig
    from specdraft.decode.runtime import SpeculativeDecoder, build_proposer
    from specdraft.tuning.forward_path import applicable_paths, use_path

    model = random_llama(device, vocab=64, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, seed=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # clear argmax margins
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [7, 8, 9, 7, 8, 9, 7, 8], [9, 10, 11, 12, 13, 9, 10, 11]]
    out = {"paths": applicable_paths(model), "runs": {}}
    for path in out["paths"]:
        use_path(model, path)

        def run(proposer):
            config = DecodeConfig(max_new_tokens=32, num_draft_tokens=4)
            return SpeculativeDecoder(model, proposer, config=config, sampling=SamplingConfig(), eos_token_ids=[]).generate(prompts)

        plain = run(build_proposer(DecodeConfig(drafter="none")))
        spec = run(corrupted_truth(prompts, [o.tokens for o in plain.outputs], 64))
        same = [o.tokens for o in plain.outputs] == [o.tokens for o in spec.outputs]
        out["runs"][path] = {"identical": same, "drafted": spec.metrics.drafted, "accepted": spec.metrics.accepted}
    return out


def forward_table(device, repeats: int) -> dict:
    """ms of k = 1..8 new tokens after 256 cached per applicable path, and ``auto``'s pick, both timed by the runtime's
    own SPS profiler (``decode/sps.measure_sps``: CUDA-synchronised, the fastest of ``repeats``, non-decreasing in k)."""
    import torch

    from specdraft.decode.sps import measure_sps
    from specdraft.tuning.forward_path import applicable_paths, resolve_path, use_path

    model = random_llama(device, vocab=49152, hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, seed=0)
    table = {}
    with torch.no_grad():
        for path in applicable_paths(model):
            use_path(model, path)
            sps = measure_sps(model, token_counts=list(range(1, 9)), context_tokens=256, repeats=repeats)
            table[path] = {k: 1e3 / sps(k) for k in range(1, 9)}

        def work() -> float:  # what the runtime's own probe times: a plain step and a 9-token verify step
            sps = measure_sps(model, token_counts=[1, 9], context_tokens=128, repeats=2)
            return 1.0 / sps(1) + 1.0 / sps(9)

        choice = resolve_path(model, "auto", "gpu-check", {"shape": "smollm2-135m random"}, work)
    return {"forward_ms": table, "auto": choice.to_json()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="directory for gpu_check.json")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    import torch
    import transformers

    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    result = {
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "exactness": exactness(device),
        "forward": forward_table(device, args.repeats),
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_check.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    ex = result["exactness"]
    ok = ex["paths"] == ["eager", "gqa"] and all(r["identical"] and 0 < r["accepted"] < r["drafted"] for r in ex["runs"].values())
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
