"""``specdraft bench-serve``: served speed-ups in vLLM, the target alone against vLLM's baselines and each drafter, per concurrency."""

from __future__ import annotations

import argparse

from specdraft.cli import summary
from specdraft.utils.config import add_dataclass_arguments, dataclass_from_args


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from specdraft.integrations.vllm.served_bench import ServedBenchConfig

    parser = subparsers.add_parser(
        "bench-serve",
        help="measure served speed-ups in vLLM: plain serving against vLLM's ngram/suffix and drafters, per concurrency",
        description=summary(__doc__) + " Every server gets the same held-out prompts and engine flags; the report gives tokens/s "
        "per user, throughput, TTFT, TPOT, speed-up over plain serving, tau from vLLM's counters and agreement with plain serving.",
    )
    add_dataclass_arguments(parser, ServedBenchConfig)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specdraft.integrations.vllm.served_bench import ServedBenchConfig, run_served_bench
    from specdraft.integrations.vllm.served_report import render_markdown

    config = dataclass_from_args(ServedBenchConfig, args)
    report = run_served_bench(config)
    print(render_markdown(report), end="")
    print(f"report: {config.out}/served.json ({len(report['levels'])} server levels, {report['wall_s']:.0f} s)")
    return 0
