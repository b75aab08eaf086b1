"""``specdraft`` entry point.

Each module listed in ``COMMAND_MODULES`` exposes ``add_parser(subparsers)``, which registers one
subcommand and sets ``func`` (a plain function taking the parsed namespace). Library code is
imported inside those functions so ``specdraft --help`` stays fast.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import signal
import sys
from collections.abc import Iterator
from typing import Any

from specdraft.errors import CommandSettings, SpecdraftError, command_settings, os_error_message
from specdraft.utils.allocator import tune_malloc

COMMAND_MODULES = [
    "specdraft.cli.prepare",
    "specdraft.cli.extract",
    "specdraft.cli.store",
    "specdraft.cli.serve_hidden_states",
    "specdraft.cli.train",
    "specdraft.cli.generate",
    "specdraft.cli.serve",
    "specdraft.cli.eval",
    "specdraft.cli.bench_serve",
    "specdraft.cli.calibrate",
    "specdraft.cli.export_speculators",
    "specdraft.cli.quickstart",
    "specdraft.cli.env",
]
#: What ``specdraft --help`` opens with (the module docstring is for readers of the code).
DESCRIPTION = "Train, package, evaluate and serve speculative-decoding drafters (DSpark, DFlash, EAGLE-3)."


def load_plugins() -> None:
    """Let the higher layers register into the lower ones' registries (the ``specdraft.plugins`` entry points,
    loaded here by name so that a stale installation's metadata cannot leave them out)."""
    from specdraft import integrations, models  # noqa: F401  (models: every family's extract --method preset)

    integrations.load()


def build_parser() -> argparse.ArgumentParser:
    load_plugins()  # before the flags: their choices list what registered
    parser = argparse.ArgumentParser(prog="specdraft", description=DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    parser.add_argument("--version", action=VersionAction, help="print the version (and the git commit in a source checkout) and exit")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(subparsers)
    return parser


class VersionAction(argparse.Action):
    """``--version``: argparse's own action takes the text when the parser is built; this one asks git only when given."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, default: Any = argparse.SUPPRESS, help: str | None = None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None
    ) -> None:
        from specdraft.utils.environment import version_line

        print(version_line())
        parser.exit()


def commands(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    """Every runnable command (``prepare``, ``store start``, ...) and its parser."""
    nested = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not nested:
        return {prefix: parser}
    return {name: leaf for sub, child in nested[0].choices.items() for name, leaf in commands(child, f"{prefix} {sub}".strip()).items()}


def command_flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Config field -> how a command's ``parser`` takes it (``--val-fraction``, or the metavar of a positional), plus the
    settings of other stages its own flags set under another name (its ``renamed_settings`` default: field -> own field)."""
    flags = {
        a.dest: next((o for o in a.option_strings if o.startswith("--")), None)
        or (a.metavar if isinstance(a.metavar, str) else "")
        or a.dest.upper()
        for a in parser._actions
        if a.dest not in (argparse.SUPPRESS, "help") and not isinstance(a, argparse._SubParsersAction)
    }
    flags.update({field: flags[own] for field, own in (parser.get_default("renamed_settings") or {}).items()})
    return flags


def settings_for(parser: argparse.ArgumentParser, args: argparse.Namespace) -> CommandSettings:
    """How the command ``args`` runs spells settings in its errors (``errors.setting``), and which commands take the
    settings it does not."""
    every = {name: command_flags(leaf) for name, leaf in commands(parser).items()}
    owners: dict[str, tuple[str, ...]] = {}
    for name, flags in every.items():
        for field in flags:
            owners[field] = owners.get(field, ()) + (name,)
    running, leaf = "", parser
    while nested := [a for a in leaf._actions if isinstance(a, argparse._SubParsersAction)]:
        sub = getattr(args, nested[0].dest)
        running, leaf = f"{running} {sub}".strip(), nested[0].choices[sub]
    return CommandSettings(running, every[running], owners)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process is so every ``with`` block unwinds on the way out: the default
    action would end the process at once and orphan what it started in a session of its own (a private
    vLLM server keeps its memory and cores) and leave half-written outputs behind."""

    signum = signal.SIGTERM


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    def terminate(signum: int, frame: Any) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    tune_malloc()
    try:
        with sigterm_unwinds(), command_settings(settings_for(parser, args)):
            result = args.func(args)
    except SpecdraftError as exc:
        print(f"specdraft {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a full disk, read-only filesystem, denied permission... is the machine's, not a bug
        message = os_error_message(exc)
        if message is None:
            raise
        print(f"specdraft {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        print(
            f"specdraft {args.command}: {'terminated' if isinstance(exc, Terminated) else 'interrupted'}; rerun the same command to resume",
            file=sys.stderr,
        )
        return 128 + getattr(exc, "signum", signal.SIGINT)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
