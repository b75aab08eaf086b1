"""``specdraft eval``: drafters vs plain autoregressive decoding, side by side, with a report."""

from __future__ import annotations

import argparse

from specdraft.cli import summary
from specdraft.decode.config import SamplingConfig, SchedulerConfig
from specdraft.eval.config import EvalConfig
from specdraft.utils.config import add_dataclass_arguments, dataclass_from_args


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="measure tau, tokens/s and speed-up of drafters against autoregressive decoding",
        description=summary(__doc__),
    )
    for cls in (EvalConfig, SamplingConfig, SchedulerConfig):
        add_dataclass_arguments(parser, cls)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = dataclass_from_args(EvalConfig, args)
    if config.parity:
        from specdraft.integrations.vllm.parity import parity_summary, run_parity_eval

        parity = run_parity_eval(config, dataclass_from_args(SamplingConfig, args))
        print(parity_summary(parity), end="")
        print(f"report: {config.out}/parity.json")
        return 0
    if config.endpoint:
        from specdraft.integrations.vllm.endpoint_eval import run_endpoint_eval

        report = run_endpoint_eval(config, dataclass_from_args(SamplingConfig, args))
    else:
        from specdraft.eval.runner import run_eval

        report = run_eval(config, dataclass_from_args(SamplingConfig, args), dataclass_from_args(SchedulerConfig, args))
    print(f"report: {config.out}/report.json ({report['num_prompts']} prompts, {report['wall_s']:.0f} s)")
    return 0
