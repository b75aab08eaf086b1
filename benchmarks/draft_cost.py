"""Draft-round cost of a DSpark drafter: full target vocabulary vs a reduced draft vocabulary.

One round is what the decoding runtime asks of a block drafter: append the target features of
the positions verified last round to the draft cache, run the block once, then sample the block
left to right through the Markov head (``DSparkDrafter.draft_block``). The drafters are random
(cost does not depend on the weights); features come from the real target on a random sequence.
Prints one JSON object with median and mean ms/round per draft vocabulary and temperature.

  .venv/bin/python benchmarks/draft_cost.py                       # smollm2-135m, 2 layers, block 7
  .venv/bin/python benchmarks/draft_cost.py --draft-vocab 0,8192,4096 --rounds 100 --threads 2
``--counts`` takes a prepared dataset's token_counts.safetensors to select real frequent tokens
(otherwise the lowest ids are taken: the cost is the same).
"""

from __future__ import annotations

import json
import statistics
import time

from _common import benchmark_parser, load_benchmark_target


def main() -> None:
    parser = benchmark_parser(__doc__, threads=1)
    parser.add_argument("--draft-vocab", default="0,8192", help="comma-separated draft_vocab_size values (0 = full vocabulary)")
    parser.add_argument("--num-layers", type=int, default=2, help="DSpark draft layers")
    parser.add_argument("--block-size", type=int, default=7, help="DSpark block size (tokens drafted per round)")
    parser.add_argument("--context", type=int, default=256, help="context positions in the draft cache before the first round")
    parser.add_argument("--step", type=int, default=3, help="positions appended to the draft cache per round (accepted + bonus)")
    parser.add_argument("--rounds", type=int, default=50, help="timed rounds per configuration (after 5 warm-up rounds)")
    parser.add_argument("--temperatures", default="0,1", help="comma-separated sampling temperatures")
    parser.add_argument("--counts", default="", help="token_counts.safetensors of a prepared dataset (optional)")
    args = parser.parse_args()

    import torch
    from safetensors.torch import load_file

    from specdraft.models import METHODS

    target = load_benchmark_target(args)
    vocab = target.vocab_size
    if args.counts:
        counts = next(iter(load_file(args.counts).values())).to(torch.int64)
    else:
        counts = torch.arange(vocab, 0, -1, dtype=torch.int64)
    spec = METHODS.get("dspark")
    warmup = 5
    length = args.context + (warmup + args.rounds) * args.step + 1
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (1, length), generator=g)
    with torch.no_grad():
        out = target.model(input_ids=tokens, output_hidden_states=True)
    positions = torch.arange(length)
    drafters = {}
    for size in [int(x) for x in args.draft_vocab.split(",")]:
        torch.manual_seed(0)
        config = spec.config_cls(num_layers=args.num_layers, block_size=args.block_size, draft_vocab_size=size or None)
        drafter = spec.build(config, target, counts=counts).eval()
        drafters[str(drafter.config.draft_vocab)] = drafter
    slots = next(iter(drafters.values())).config.slots()
    features = torch.stack([out.hidden_states[s.hf_index(target.num_layers)][0] for s in slots], dim=1)  # [T, S, D]
    results: dict[str, dict] = {name: {} for name in drafters}
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        caches, gens, times = {}, {}, {name: [] for name in drafters}
        for name, drafter in drafters.items():
            caches[name] = drafter.new_cache()
            drafter.append_context(caches[name], features=features[: args.context], positions=positions[: args.context])
            gens[name] = torch.Generator().manual_seed(1)
        for r in range(warmup + args.rounds):
            lo = args.context + r * args.step
            hi = lo + args.step
            for name, drafter in drafters.items():  # interleaved: load on a shared machine hits all alike
                start = time.perf_counter()
                drafter.draft_block(
                    caches[name],
                    anchor_token=int(tokens[0, hi]),
                    anchor_position=hi,
                    context_features=features[lo:hi],
                    context_positions=positions[lo:hi],
                    temperature=temperature,
                    generator=gens[name],
                )
                if r >= warmup:
                    times[name].append((time.perf_counter() - start) * 1e3)
        for name in drafters:
            results[name][f"T={temperature:g}"] = {
                "median_ms_per_round": round(statistics.median(times[name]), 3),
                "mean_ms_per_round": round(statistics.fmean(times[name]), 3),
            }
    print(
        json.dumps(
            {
                "target": target.name,
                "vocab_size": vocab,
                "num_layers": args.num_layers,
                "block_size": args.block_size,
                "context": args.context,
                "step": args.step,
                "rounds": args.rounds,
                "threads": args.threads,
                "draft_vocab": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
