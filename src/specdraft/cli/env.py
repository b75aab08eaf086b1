"""``specdraft env``: the versions, machine and cached measured choices to paste into a bug report."""

from __future__ import annotations

import argparse
import json

from specdraft.cli import summary


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "env", help="print the software and machine specdraft runs on, for a bug report", description=summary(__doc__)
    )
    parser.add_argument("--json", action="store_true", help="print the same facts as one JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specdraft.utils.environment import collect_environment, render_environment

    env = collect_environment()
    print(json.dumps(env, indent=2) if args.json else render_environment(env), end="\n" if args.json else "")
    return 0
