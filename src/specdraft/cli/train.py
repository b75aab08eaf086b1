"""``specdraft train``: train a drafter on a hidden-state store; rerun the same command to resume."""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from specdraft.train.config import TrainConfig
    from specdraft.utils.config import add_dataclass_arguments

    parser = subparsers.add_parser(
        "train",
        help="train a drafter (dspark, dflash, dflash2, eagle3) on extracted hidden states",
        description=(
            "Train a drafter on a hidden-state store. Values come from the dataclass defaults, then the "
            "--config recipe, then these flags. Rerunning the same command resumes from OUT's latest checkpoint; "
            "SIGINT/SIGTERM save a checkpoint before exiting. Multi-process: torchrun --nproc-per-node N -m "
            "specdraft.cli.main train ..."
        ),
    )
    parser.add_argument(
        "--config",
        default=None,
        help="recipe: a packaged name (dspark, dflash, dflash2, eagle3) or a YAML file of TrainConfig fields (flags given here win)",
    )
    add_dataclass_arguments(parser, TrainConfig)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specdraft.train.config import TrainConfig, resolve_config
    from specdraft.train.trainer import train

    names = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = resolve_config(args.config, {k: v for k, v in vars(args).items() if k in names})
    result = train(cfg)
    summary = {
        "out": str(result.out),
        "step": result.step,
        "total_steps": result.total_steps,
        "completed": result.completed,
        "stopped_by": result.stopped_by,
        "final": str(result.final) if result.final else None,
    }
    print(json.dumps(summary))
    if result.stopped_by == "signal":
        print(f"specdraft train: interrupted at step {result.step}; rerun the same command to resume", file=sys.stderr)
        return 128 + (result.stop_signal or signal.SIGINT)  # the shell convention: 143 after SIGTERM, 130 after SIGINT
    return 0
