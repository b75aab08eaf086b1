"""``specdraft export-speculators``: write a hidden-state store as speculators' training data (its trainer's --data-path)."""

from __future__ import annotations

import argparse
import json

from specdraft.cli import summary
from specdraft.integrations.speculators.data import ExportSpeculatorsConfig
from specdraft.utils.config import add_dataclass_arguments, dataclass_from_args


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    command = subparsers.add_parser(
        "export-speculators", description=summary(__doc__), help="write a hidden-state store as speculators' training data"
    )
    command.set_defaults(func=run)
    add_dataclass_arguments(command, ExportSpeculatorsConfig)


def run(args: argparse.Namespace) -> int:
    """Print what was written (the peer's layer ids, the split's rows, the train-data ratio)."""
    from specdraft.integrations.speculators.data import export_speculators_data

    summary = export_speculators_data(dataclass_from_args(ExportSpeculatorsConfig, args))
    print(json.dumps(summary, indent=1))
    return 0
