"""Where a decode step's time goes: the target's 1-token step split into its linear layers and the rest, and a block
drafter's round split into its phases.

The target step is timed as ``benchmarks/forward_path.py`` times it (one new token after ``--context`` cached ones,
median of ``--repeats``) on ``--forward-path`` (``auto``: the runtime's cached or measured choice). Its linears are
then timed inside the same steps (a clock around every ``nn.Linear`` call), so "rest" is everything a step does
besides multiplying by weights: attention, norms, rotary, residuals, the cache, Python and dispatch; the aten calls
a step makes are counted with ``torch.profiler``. Beside them: the bandwidth floor (all weight bytes over the read
bandwidth measured here) and the bandwidth the linears reached. The drafter is the quickstart's (DSpark, its recipe),
its round ``DrafterProposer.round_seconds`` split by the block drafter's phases: appending the verified positions'
features, the block's layers, the draft-vocabulary head, the Markov chain and confidences (the rest of ``propose``).

  .venv/bin/python benchmarks/step_profile.py --threads 2 --out docs/results/step_profile.json
"""

from __future__ import annotations

import collections
import json
import statistics
import time
from pathlib import Path

from _common import benchmark_parser, load_benchmark_target, quickstart_drafter
from forward_path import bandwidth_floor


def target_step(model, *, context: int, repeats: int) -> dict:
    """ms of a 1-token step, of its linears (timed inside the same kind of step), and aten calls per step."""
    import torch
    from torch import nn
    from torch.profiler import ProfilerActivity, profile

    from specdraft.decode.kv_cache import GrowingCache

    vocab = int(model.config.get_text_config().vocab_size)
    gen = torch.Generator().manual_seed(0)
    cache = GrowingCache()
    token = torch.randint(0, vocab, (1, 1), generator=gen)

    def step() -> None:
        model(input_ids=token, cache=cache, use_cache=True)
        cache.crop(-1)

    def median_ms(fn) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    with torch.no_grad():
        model(input_ids=torch.randint(0, vocab, (1, context), generator=gen), cache=cache, use_cache=True, logits_to_keep=1)
        for _ in range(3):
            step()
        step_ms = median_ms(step)
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        spent = [0.0]
        started: dict[int, float] = {}
        handles = [m.register_forward_pre_hook(lambda mod, args: started.__setitem__(id(mod), time.perf_counter())) for m in linears]
        handles += [
            m.register_forward_hook(lambda mod, args, out: spent.__setitem__(0, spent[0] + time.perf_counter() - started[id(mod)]))
            for m in linears
        ]
        try:
            per_step = []
            for _ in range(repeats):
                spent[0] = 0.0
                step()
                per_step.append(spent[0])
        finally:
            for handle in handles:
                handle.remove()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(repeats):
                step()
    calls = collections.Counter()
    for event in prof.key_averages():
        calls[event.key] += event.count
    linear_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    linear_ms = statistics.median(per_step) * 1e3
    return {
        "step_ms": step_ms,
        "linear_ms": linear_ms,
        "rest_ms": step_ms - linear_ms,
        "linear_calls": len(linears),
        "linear_weight_bytes": linear_bytes,
        "linear_gb_s": linear_bytes / linear_ms / 1e6,
        "aten_calls_per_step": sum(n for k, n in calls.items() if k.startswith("aten::")) / repeats,
        "top_aten_calls_per_step": {k: n / repeats for k, n in calls.most_common(12) if k.startswith("aten::")},
    }


def drafter_round(target, path: str, *, rounds: int) -> dict:
    """Median ms per round and per phase of the quickstart's drafter (fp32 on ``path``)."""
    from specdraft.decode.config import DecodeConfig
    from specdraft.decode.proposers.drafters import drafter_proposer
    from specdraft.tuning.forward_path import use_path

    drafter = quickstart_drafter(target)
    proposer = drafter_proposer(drafter, DecodeConfig(drafter=drafter.method))
    path = use_path(drafter, path)  # less the parts that do not apply to a drafter
    spent = collections.defaultdict(list)
    for name in ("append_context", "block_hidden", "lm_logits", "propose"):
        inner = getattr(drafter, name)

        def timed(*args, _inner=inner, _name=name, **kwargs):
            start = time.perf_counter()
            out = _inner(*args, **kwargs)
            spent[_name].append(time.perf_counter() - start)
            return out

        setattr(drafter, name, timed)
    repeats = 3
    proposer.round_seconds("fp32")  # warm-up
    spent.clear()
    totals = [proposer.round_seconds("fp32", repeats=repeats) for _ in range(rounds)]
    # each call runs 1 + repeats rounds, the first of which fills the context (not a typical round): left out
    phases = {name: statistics.median(v[i] for i in range(len(v)) if i % (1 + repeats)) * 1e3 for name, v in spent.items()}
    phases["markov chain + confidences"] = phases.pop("propose") - phases["lm_logits"]
    return {"method": drafter.method, "path": path, "round_ms": min(totals) * 1e3, "phase_ms": phases}


def main() -> None:
    parser = benchmark_parser(__doc__, threads=2)
    parser.add_argument("--context", type=int, default=256, help="cached prompt tokens before the timed step")
    parser.add_argument("--repeats", type=int, default=20, help="timed steps (median reported)")
    parser.add_argument("--forward-path", default="auto", help="the target's path (auto: the runtime's choice, cached per machine)")
    parser.add_argument("--out", default="", help="also write the JSON here")
    args = parser.parse_args()

    import torch

    from specdraft.decode.runtime import resolve_target_path

    target = load_benchmark_target(args)
    path = resolve_target_path(target, args.forward_path).name
    step = target_step(target.model, context=args.context, repeats=args.repeats)
    floor = bandwidth_floor(target.model)
    floor_ms = floor["floor_ms"]
    draft = drafter_round(target, path, rounds=5)
    result = {
        "target": args.target,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "context": args.context,
        "forward_path": path,
        **step,
        **floor,
        "drafter": draft,
    }
    print(json.dumps(result, indent=1))
    print(f"\n| target 1-token step ({path}) | ms | share |\n|---|---:|---:|")
    print(
        f"| linears ({step['linear_calls']}, {step['linear_weight_bytes'] / 1e6:.0f} MB at {step['linear_gb_s']:.1f} GB/s) | "
        f"{step['linear_ms']:.1f} | {step['linear_ms'] / step['step_ms']:.0%} |"
    )
    print(f"| the rest ({step['aten_calls_per_step']:.0f} aten calls) | {step['rest_ms']:.1f} | {step['rest_ms'] / step['step_ms']:.0%} |")
    print(f"| step | {step['step_ms']:.1f} | {step['step_ms'] / floor_ms:.1f}x the floor |")
    print(f"\nfloor: {floor['weight_bytes'] / 1e6:.0f} MB of weights / {floor['read_bandwidth_gb_s']:.1f} GB/s read = {floor_ms:.1f} ms")
    print(f"\n| {draft['method']} round ({draft['path']}, fp32) | ms |\n|---|---:|")
    for name, ms in draft["phase_ms"].items():
        print(f"| {name} | {ms:.2f} |")
    print(f"| round | {draft['round_ms']:.2f} ({draft['round_ms'] / step['step_ms']:.0%} of the target step) |")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
