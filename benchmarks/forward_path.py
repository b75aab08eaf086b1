"""Target forward of k = 1..8 tokens and each method's draft round, per forward path, beside the bandwidth floor.

The table ``--forward-path auto`` decides from (``tuning/forward_path.py``), at the shape decoding
pays: k new tokens through the runtime's KV cache (``decode/kv_cache.py``) after a ``--context``-token
prompt, median of ``--repeats`` after a warm-up, on every path that applies here (taking turns). The floor is the
target's weight bytes over the read bandwidth measured here (the fastest sum over a 1 GiB fp32
tensor): no forward can read its weights faster. Draft rounds are ``DrafterProposer.round_seconds``
(the probe ``--draft-dtype auto`` and the path choice use) of a fresh drafter of each method's
packaged recipe for the target (cost does not depend on the weights), in fp32 on each path and in
bf16 autocast, and as a fraction of the 1-token target step on the same path.

  .venv/bin/python benchmarks/forward_path.py --threads 2 --out benchmarks/data/forward_path.json
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from _common import benchmark_parser, load_benchmark_target


def forward_table(model, paths: list[str], *, context: int, repeats: int) -> dict[str, dict[int, float]]:
    """Median ms of a forward of k = 1..8 new tokens after ``context`` cached ones (the cache cropped back each time),
    per path. The paths take turns within every repeat, so a slow spell of a shared machine hits them alike."""
    import torch

    from specdraft.decode.kv_cache import GrowingCache
    from specdraft.tuning.forward_path import use_path

    vocab = int(model.config.get_text_config().vocab_size)
    gen = torch.Generator().manual_seed(0)
    cache = GrowingCache()
    times: dict[str, dict[int, list[float]]] = {path: {k: [] for k in range(1, 9)} for path in paths}
    with torch.no_grad():
        model(input_ids=torch.randint(0, vocab, (1, context), generator=gen), cache=cache, use_cache=True, logits_to_keep=1)
        blocks = {k: torch.randint(0, vocab, (1, k), generator=gen) for k in range(1, 9)}
        for i in range(repeats + 1):  # the first round warms every path up
            for path in paths:
                use_path(model, path)
                for k, block in blocks.items():
                    start = time.perf_counter()
                    model(input_ids=block, cache=cache, use_cache=True)
                    if i:
                        times[path][k].append(time.perf_counter() - start)
                    cache.crop(-k)
    return {path: {k: statistics.median(t) * 1e3 for k, t in by_k.items()} for path, by_k in times.items()}


def read_bandwidth() -> float:
    """Bytes/s of the fastest of 5 sums over 1 GiB of fp32."""
    import torch

    data = torch.ones(2**28)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def bandwidth_floor(model) -> dict[str, float]:
    """The fastest a forward can read ``model``'s weights here: their bytes over ``read_bandwidth()``."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = read_bandwidth()
    return {"weight_bytes": weight_bytes, "read_bandwidth_gb_s": bandwidth / 1e9, "floor_ms": weight_bytes / bandwidth * 1e3}


def draft_rounds(target, methods: list[str]) -> dict:
    """ms per draft round of each method: fp32 on each path that applies to it, and bf16 autocast (on eager: prepacking
    serves fp32 only)."""
    from specdraft.decode.config import DecodeConfig
    from specdraft.decode.proposers.drafters import decodable_methods, drafter_proposer
    from specdraft.quickstart import fresh_drafter
    from specdraft.train.config import resolve_config
    from specdraft.tuning.forward_path import applicable_paths, use_path

    rounds = {}
    for method in methods or decodable_methods():
        drafter = fresh_drafter(resolve_config(method, {}), target)
        proposer = drafter_proposer(drafter, DecodeConfig(drafter=method))
        figures = {}
        for path in applicable_paths(drafter):
            use_path(drafter, path)
            figures[f"fp32/{path}"] = proposer.round_seconds("fp32", repeats=5) * 1e3
        use_path(drafter, "eager")
        figures["bf16/eager"] = proposer.round_seconds("bf16", repeats=5) * 1e3
        rounds[method] = figures
    return rounds


def main() -> None:
    parser = benchmark_parser(__doc__, threads=2)
    parser.add_argument("--context", type=int, default=256, help="cached prompt tokens before the timed forward")
    parser.add_argument("--repeats", type=int, default=10, help="timed forwards per k (median reported)")
    parser.add_argument("--methods", default="", help="comma-separated drafter methods (default: every decodable one)")
    parser.add_argument("--out", default="", help="also write the JSON here")
    args = parser.parse_args()

    import torch

    from specdraft.tuning.forward_path import applicable_paths, use_path

    target = load_benchmark_target(args)
    table = forward_table(target.model, applicable_paths(target.model), context=args.context, repeats=args.repeats)
    use_path(target.model, "eager")
    floor = bandwidth_floor(target.model)
    floor_ms = floor["floor_ms"]
    rounds = draft_rounds(target, [m for m in args.methods.split(",") if m])
    result = {
        "target": args.target,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "context": args.context,
        "forward_ms": table,
        **floor,
        "draft_round_ms": rounds,
    }
    print(json.dumps(result, indent=1))
    print(f"\n| path | {' | '.join(f'k={k}' for k in range(1, 9))} | k=8 / k=1 | k=1 / floor |")
    print("|---|" + "---:|" * 10)
    for path, row in table.items():
        print(f"| {path} | " + " | ".join(f"{row[k]:.1f}" for k in range(1, 9)) + f" | {row[8] / row[1]:.2f}x | {row[1] / floor_ms:.1f}x |")
    print(f"\nfloor: {floor['weight_bytes'] / 1e6:.0f} MB of weights / {floor['read_bandwidth_gb_s']:.1f} GB/s read = {floor_ms:.1f} ms")
    print("\n| method | " + " | ".join(next(iter(rounds.values()))) + " | best / target 1-token step |")
    print("|---|" + "---:|" * (len(next(iter(rounds.values()))) + 1))
    step = min(row[1] for row in table.values())
    for method, figures in rounds.items():
        print(f"| {method} | " + " | ".join(f"{v:.1f} ms" for v in figures.values()) + f" | {min(figures.values()) / step:.1%} |")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
