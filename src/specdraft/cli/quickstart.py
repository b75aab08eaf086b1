"""``specdraft quickstart``: prepare, extract, train, calibrate and evaluate a DSpark drafter in one command."""

from __future__ import annotations

import argparse

from specdraft.cli import summary
from specdraft.utils.config import add_dataclass_arguments, dataclass_from_args


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from specdraft.quickstart import RENAMED_SETTINGS, QuickstartConfig

    parser = subparsers.add_parser(
        "quickstart", help="the whole pipeline on one target within a time budget (rerun to resume)", description=summary(__doc__)
    )
    add_dataclass_arguments(parser, QuickstartConfig)
    parser.set_defaults(func=run, renamed_settings=RENAMED_SETTINGS)


def run(args: argparse.Namespace) -> int:
    from specdraft.quickstart import QuickstartConfig, run_quickstart

    run_quickstart(dataclass_from_args(QuickstartConfig, args))
    return 0
