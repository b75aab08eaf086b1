"""``specdraft serve DRAFTER [--vllm-args='...']``: serve a target with a drafter through vLLM's OpenAI API."""

from __future__ import annotations

import argparse

from specdraft.integrations.vllm.serve import ServeConfig
from specdraft.utils.config import add_dataclass_arguments, dataclass_from_args


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a target with a drafter through vLLM's OpenAI-compatible server",
        description="Start vLLM's OpenAI server (with the vLLM environment's python: --vllm-python, else as its help says) "
        "for the drafter's target with the drafter as its speculator; method and draft tokens come from the checkpoint. "
        "--vllm-args go to vLLM verbatim, "
        "e.g. `specdraft serve runs/eagle3 --vllm-args='--max-model-len 4096'`. Ctrl-C stops the server.",
    )
    parser.add_argument("drafter", help=ServeConfig.__dataclass_fields__["drafter"].metadata["help"])
    add_dataclass_arguments(parser, ServeConfig, exclude=("drafter",))
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specdraft.integrations.vllm.serve import drafter_server

    config = dataclass_from_args(ServeConfig, args)
    server = drafter_server(config)
    print(f"starting vLLM (log: {server.log_path}) ...", flush=True)
    server.start()
    print(f"serving {config.drafter} on {server.url}/v1 (OpenAI API, model name 'target'); Ctrl-C to stop", flush=True)
    return server.wait()
