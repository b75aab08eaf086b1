"""``specdraft calibrate``: Sequential Temperature Scaling of a DSpark drafter's confidence head."""

from __future__ import annotations

import argparse

from specdraft.cli import summary
from specdraft.train.calibrate import CalibrateConfig
from specdraft.utils.config import add_dataclass_arguments, dataclass_from_args


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "calibrate", help="calibrate a DSpark drafter's confidences on held-out hidden states", description=summary(__doc__)
    )
    add_dataclass_arguments(parser, CalibrateConfig)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specdraft.train.calibrate import calibrate

    config = dataclass_from_args(CalibrateConfig, args)
    stats = calibrate(config)
    print(f"{'k':>3} {'T_k':>7} {'ECE before':>11} {'ECE after':>10} {'blocks':>7}")
    for k, (t, b, a, n) in enumerate(zip(stats["temperatures"], stats["ece_before"], stats["ece_after"], stats["counts"]), 1):
        print(f"{k:>3} {t:>7.3f} {b:>11.4f} {a:>10.4f} {n:>7}")
    print(f"calibrated {config.out or config.drafter} on {stats['samples']} held-out samples ({stats['mode']})")
    return 0
