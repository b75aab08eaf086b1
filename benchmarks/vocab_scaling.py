"""Step time vs target vocabulary: does a 128k-262k vocabulary cost more than the drafter itself?

Builds tiny random HF targets that differ only in vocabulary size (49,152 = SmolLM2's, 128,256 =
Llama 3's, 262,144 = Gemma 3's; same hidden size and layers, tied embeddings) and, per target:

* train: one drafter of each method from its packaged recipe (same drafter size, draft vocabulary
  and pack for every target), stepped by the trainer's own step (``train.step.train_step``: forward,
  backward, grad clip, the recipe's optimizer) on a packed batch of random ids drawn from a Zipf
  law (so the draft vocabulary chosen from their counts covers most labels) with random hidden
  states (values do not change the step's cost); median wall and CPU (process) seconds per step
  after a warm-up step (on a shared machine the CPU seconds are the steadier measure of work);
* regen: specdraft's regeneration (``data.regenerate`` with the hf engine) against a plain HF
  ``generate`` loop over the same prompt batches, in generated tokens/s;
* ckpt: size of the drafter's ``model.safetensors``.

The 49,152 row stands for the embedded target; the issue's targets are ratios to it (train) and
to the plain loop (regen). Runs the code on PYTHONPATH, so the same command measures a branch
before and after a change:

    PYTHONPATH=src .venv/bin/python benchmarks/vocab_scaling.py --threads 2

Output: one JSON line per (vocab, method), then a table ("x first": ratio to the first vocabulary;
"ratio": plain generate tok/s over specdraft regeneration tok/s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def make_target(vocab: int, *, hidden: int, layers: int, seed: int = 0):
    import transformers

    from specdraft.targets.base import Target

    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 192),
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.requires_grad_(False)
    model.config.architectures = [type(model).__name__]
    return Target(
        name=f"random-v{vocab}",
        path=Path(f"/nonexistent/random-v{vocab}"),
        model=model,
        tokenizer=None,
        fingerprint=f"v{vocab}",
        tokenizer_hash="none",
    )


def zipf_ids(vocab: int, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Token ids with P(rank k) ~ 1/k over a random permutation of the vocabulary."""
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    ranks = torch.multinomial(weights, int(torch.tensor(shape).prod()), replacement=True, generator=generator)
    return torch.randperm(vocab, generator=generator)[ranks].view(shape)


def make_batch(target, slots: int, *, pack: int, samples: int, generator: torch.Generator):
    from specdraft.models import DrafterBatch

    length = pack // samples
    ids = zipf_ids(target.vocab_size, (1, pack), generator)
    seg = torch.arange(samples).repeat_interleave(length)[None].to(torch.int32)
    pos = torch.arange(length).repeat(samples)[None]
    mask = pos >= length // 8  # the first eighth of each sample is its prompt
    d = target.hidden_size
    return DrafterBatch(
        ids, mask, seg, pos, torch.randn(1, pack, slots, d, generator=generator), torch.randn(1, pack, d, generator=generator)
    )


def train_steps(method: str, target, args) -> dict:
    from specdraft.models import METHODS
    from specdraft.train.config import resolve_config
    from specdraft.train.plan import build_method_config
    from specdraft.train.step import StepModule, build_optimizer, train_step

    cfg = resolve_config(method, {"dtype": "fp32", "pack_tokens": args.pack})
    spec = METHODS.get(method)
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(zipf_ids(target.vocab_size, (200_000,), g), minlength=target.vocab_size)
    torch.manual_seed(0)
    drafter = spec.build(build_method_config(spec, cfg.model), target, counts=counts)
    cpu_device = torch.device("cpu")
    module = StepModule(drafter).train()
    optimizer = build_optimizer(module, name=cfg.optimizer, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, device=cpu_device)
    batch = make_batch(target, len(drafter.config.slots()), pack=cfg.pack_tokens, samples=args.samples, generator=g)
    times, cpu = [], []
    for _ in range(args.steps + 1):
        started, cpu_started = time.perf_counter(), time.process_time()
        train_step(module, batch, dtype=cfg.dtype, device=cpu_device, optimizer=optimizer, grad_clip=cfg.grad_clip)
        times.append(time.perf_counter() - started)
        cpu.append(time.process_time() - cpu_started)
    with tempfile.TemporaryDirectory() as tmp:
        drafter.save_pretrained(tmp)
        ckpt_mb = (Path(tmp) / "model.safetensors").stat().st_size / 1e6
    trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    return {
        "s_per_step": statistics.median(times[1:]),
        "cpu_s_per_step": statistics.median(cpu[1:]),
        "first_step_s": times[0],
        "pack_tokens": cfg.pack_tokens,
        "trainable_m": trainable / 1e6,
        "ckpt_mb": ckpt_mb,
        "model": cfg.model,
    }


def regen_rates(target, args) -> dict:
    from specdraft.data.regenerate import EngineRequest, GenerationSettings, regenerate

    g = torch.Generator().manual_seed(1)
    prompts = [(f"s{i}", zipf_ids(target.vocab_size, (args.prompt_len,), g).tolist()) for i in range(args.prompts)]
    settings = GenerationSettings(max_new_tokens=args.new_tokens, temperature=0.0, batch_size=args.batch, seed=0)
    # An end-of-turn id the random model never reaches first: every reply is max_new_tokens long.
    request = EngineRequest(target=target, pad_id=0, eos_ids=frozenset({target.vocab_size - 1}), settings=settings)
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        done, _stats = regenerate(request, prompts, work_dir=Path(tmp), progress=False)
        ours_s = time.perf_counter() - started
    ours_tokens = sum(len(v) for v in done.values())

    plain_tokens, started = 0, time.perf_counter()
    ordered = sorted((p for _, p in prompts), key=len)
    with torch.no_grad():
        for start in range(0, len(ordered), args.batch):
            rows = ordered[start : start + args.batch]
            width = max(map(len, rows))
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            attn = torch.zeros_like(ids)
            for r, p in enumerate(rows):
                ids[r, width - len(p) :], attn[r, width - len(p) :] = torch.tensor(p), 1
            out = target.model.generate(
                input_ids=ids,
                attention_mask=attn,
                max_new_tokens=args.new_tokens,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=target.vocab_size - 1,
            )
            plain_tokens += int((out[:, width:] != 0).sum())
    plain_s = time.perf_counter() - started
    return {"regen_tok_s": ours_tokens / ours_s, "plain_generate_tok_s": plain_tokens / plain_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocabs", default="49152,128256,262144")
    ap.add_argument("--methods", default="dspark,eagle3")
    ap.add_argument("--hidden", type=int, default=576, help="target hidden size (SmolLM2-135M's)")
    ap.add_argument("--layers", type=int, default=8, help="target layers (kept small: only the vocabulary should differ)")
    ap.add_argument("--steps", type=int, default=3, help="timed training steps per (vocab, method), after one warm-up")
    ap.add_argument(
        "--pack", type=int, default=512, help="pack_tokens for every method (the recipes' 2048 makes an EAGLE-3 step minutes long here)"
    )
    ap.add_argument("--samples", type=int, default=4, help="samples packed per batch")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-regen", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import specdraft.models  # noqa: F401  (registers the methods)

    rows = []
    for vocab in map(int, args.vocabs.split(",")):
        target = make_target(vocab, hidden=args.hidden, layers=args.layers)
        regen = {} if args.no_regen else regen_rates(target, args)
        for method in args.methods.split(","):
            row = {"vocab": vocab, "method": method, **train_steps(method, target, args), **regen}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del target

    base = {r["method"]: r for r in rows if r["vocab"] == rows[0]["vocab"]}
    print(
        f"\n{'vocab':>8} {'method':>7} {'s/step':>7} {'x first':>7} {'cpu s':>7} {'x first':>7} {'ckpt MB':>8} "
        f"{'regen tok/s':>11} {'plain tok/s':>11} {'ratio':>6}"
    )
    for r in rows:
        b = base[r["method"]]
        regen = (
            f"{r['regen_tok_s']:11.1f} {r['plain_generate_tok_s']:11.1f} {r['plain_generate_tok_s'] / r['regen_tok_s']:6.2f}"
            if "regen_tok_s" in r
            else ""
        )
        print(
            f"{r['vocab']:>8} {r['method']:>7} {r['s_per_step']:7.2f} {r['s_per_step'] / b['s_per_step']:7.2f} "
            f"{r['cpu_s_per_step']:7.2f} {r['cpu_s_per_step'] / b['cpu_s_per_step']:7.2f} {r['ckpt_mb']:8.1f} {regen}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
