"""``specdraft prepare``: tokenize conversations for a target (optionally regenerating replies)."""

from __future__ import annotations

import argparse

from specdraft.cli import summary
from specdraft.data.prepare import PrepareConfig
from specdraft.utils.config import add_dataclass_arguments, dataclass_from_args


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "prepare",
        help="build a prepared dataset (token ids + assistant loss mask) for a target",
        description=summary(__doc__),
    )
    add_dataclass_arguments(parser, PrepareConfig)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specdraft.data.prepare import format_summary, prepare

    config = dataclass_from_args(PrepareConfig, args)
    summary = prepare(config)
    print(format_summary(summary))
    print(f"wrote {config.out}")
    return 0
