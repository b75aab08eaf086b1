"""``specdraft extract``: store target hidden states for a prepared dataset (resumable)."""

from __future__ import annotations

import argparse
import json

from specdraft.cli import print_server_command
from specdraft.hidden_states.config import ExtractConfig
from specdraft.utils.config import add_dataclass_arguments, dataclass_from_args


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "extract",
        help="capture target hidden states for a prepared dataset",
        description="Run the target over a prepared dataset and store the hidden states of the chosen layers "
        "(a method preset or --layers). Rerunning resumes: verified samples are skipped, corrupt ones redone. "
        "--engine vllm starts a private vLLM server, or with --vllm-url drives one you started yourself with the "
        "command that --print-server-command prints.",
    )
    add_dataclass_arguments(parser, ExtractConfig)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specdraft.hidden_states.extract import extract_hidden_states

    config = dataclass_from_args(ExtractConfig, args)
    if config.print_server_command:
        from specdraft.integrations.vllm.extract import extract_server_command

        return print_server_command(*extract_server_command(config))
    summary = extract_hidden_states(config)
    s = summary.to_dict()
    print(
        f"extracted {s['samples_extracted']} samples ({s['tokens_extracted']} tokens) in {s['seconds']:.1f} s "
        f"[{s['samples_per_second']:.2f} samples/s, {s['tokens_per_second']:.0f} tokens/s, {s['bytes_per_token']:.0f} bytes/token]; "
        f"skipped {s['samples_skipped']} already stored; store: {s['store']}"
    )
    print(json.dumps(s, sort_keys=True))
    return 0
