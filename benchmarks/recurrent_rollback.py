"""What rolling back a hybrid target's recurrent state costs: time per verify forward and memory per row, by design.

A hybrid target (Qwen3.5 / Qwen3-Next gated delta nets, Kimi-Linear) cannot keep rejected drafts as
masked holes in its linear-attention layers (``decode/kv_cache.py``). Two lossless designs, timed on
one random model of the family's config class (weights do not change the cost) after a
``--context``-token prompt, median of ``--repeats`` after a warm-up, verify blocks of k + 1 columns:

- ``record``, what the runtime does: the verify forward records the state after every column (HF runs
  those columns through the per-token recurrence) and each row takes the one at its last accepted
  token; the cost is that forward plus the per-row selection, the extra memory the k + 1 recorded
  states while the forward runs;
- ``replay``: a plain (chunked) verify forward from a snapshot of the state, then the snapshot is
  restored and the accepted columns are run again; the cost is both forwards plus the snapshot copy,
  for ``--accepted`` columns accepted per round (a drafter's tau - 1).

Both are reported beside the plain 1-token step, the target's cost per token without speculation.

  .venv/bin/python benchmarks/recurrent_rollback.py --threads 2 --out docs/results/recurrent_rollback.json
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from _common import benchmark_parser

#: A Qwen3.5-shaped stack scaled to a 2-core CPU: 3 of 4 layers gated delta nets, as the family's config makes them.
SHAPES = {
    "qwen3_5_text": dict(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        linear_num_key_heads=8,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        vocab_size=32000,
    ),
}


def build(family: str):
    import torch
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    torch.manual_seed(0)
    config = CONFIG_MAPPING[family](**SHAPES[family], max_position_embeddings=4096)
    return transformers.AutoModelForCausalLM.from_config(config).float().eval()


def timed(fn, repeats: int) -> float:
    """Median ms of ``fn()`` over ``repeats`` runs after one warm-up."""
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        fn()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(model, *, context: int, blocks: list[int], accepted: int, repeats: int) -> dict:
    import torch

    from specdraft.decode.kv_cache import GrowingCache, RecurrentLayer

    vocab = int(model.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    cache = GrowingCache(model.config)
    with torch.no_grad():
        model(input_ids=torch.randint(0, vocab, (1, context), generator=gen), cache=cache, use_cache=True, logits_to_keep=1)
    state_bytes = sum(layer.state_bytes() for layer in cache.recurrent)
    recurrent_state = next(layer.recurrent_states[0] for layer in cache.recurrent)
    layers = len(cache.recurrent)

    def forward(tokens: int, *, record: bool, keep: int) -> None:
        block = torch.randint(0, vocab, (1, tokens), generator=gen)
        positions = torch.arange(context, context + tokens)[None]
        if record:
            cache.record(tokens)
        with torch.no_grad():
            model(input_ids=block, position_ids=positions, cache=cache, use_cache=True)
        if record:
            cache.rollback(torch.tensor([keep]), tokens)

    def snapshot() -> list:
        return [(layer.conv_states[0].clone(), layer.recurrent_states[0].clone()) for layer in cache.recurrent]

    def restore(saved: list) -> None:
        for layer, (conv, state) in zip(cache.recurrent, saved):
            layer.conv_states[0].copy_(conv)
            layer.recurrent_states[0].copy_(state)

    def plain_round(tokens: int) -> None:
        """A plain forward of ``tokens`` columns, then everything it added is taken back (attention crop, state restore)."""
        saved = snapshot()
        forward(tokens, record=False, keep=0)
        restore(saved)
        for layer in cache.layers:
            if not isinstance(layer, RecurrentLayer):
                layer.crop(-tokens)

    def record_round(tokens: int) -> None:
        forward(tokens, record=True, keep=0)  # keep 0: back to the context, so every repeat sees the same cache

    step_ms = timed(lambda: plain_round(1), repeats)
    rows = {}
    for k in blocks:
        record_ms = timed(lambda: record_round(k + 1), repeats)
        verify_ms = timed(lambda: plain_round(k + 1), repeats)
        replay_ms = timed(lambda: plain_round(min(accepted, k) + 1), repeats)
        rows[k] = {
            "record_ms": record_ms,
            "plain_verify_ms": verify_ms,
            "replay_ms": verify_ms + replay_ms,
            "record_vs_step": record_ms / step_ms,
            "replay_vs_step": (verify_ms + replay_ms) / step_ms,
            "recorded_bytes_per_row": (k + 1) * recurrent_state.numel() * recurrent_state.element_size() * layers,
        }
    return {
        "context": context,
        "accepted": accepted,
        "linear_layers": layers,
        "state_bytes_per_row": state_bytes,
        "step_ms": step_ms,
        "blocks": rows,
    }


def main() -> None:
    parser = benchmark_parser(__doc__, target=False, threads=2)
    parser.add_argument("--family", default="qwen3_5_text", choices=sorted(SHAPES))
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--blocks", default="3,7,15", help="draft lengths k (verify blocks of k + 1 columns)")
    parser.add_argument("--accepted", type=int, default=2, help="drafts accepted per round that the replay design runs again")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default="", help="also write the JSON here")
    args = parser.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    model = build(args.family)
    result = {
        "family": args.family,
        "shape": SHAPES[args.family],
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        **measure(
            model, context=args.context, blocks=[int(k) for k in args.blocks.split(",")], accepted=args.accepted, repeats=args.repeats
        ),
    }
    print(json.dumps(result, indent=1))
    print(
        f"\nplain 1-token step: {result['step_ms']:.1f} ms; state held per row between forwards: "
        f"{result['state_bytes_per_row'] / 2**20:.2f} MiB ({result['linear_layers']} linear-attention layers)"
    )
    print("\n| k | record (runtime) | vs step | replay (verify + re-run of the accepted) | vs step | recorded states per row |")
    print("|---:|---:|---:|---:|---:|---:|")
    for k, row in result["blocks"].items():
        print(
            f"| {k} | {row['record_ms']:.1f} ms | {row['record_vs_step']:.2f}x | {row['replay_ms']:.1f} ms | {row['replay_vs_step']:.2f}x "
            f"| {row['recorded_bytes_per_row'] / 2**20:.2f} MiB |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
