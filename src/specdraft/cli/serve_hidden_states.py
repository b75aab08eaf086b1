"""``specdraft serve-hidden-states``: run a producer that extracts hidden states on request for online training."""

from __future__ import annotations

import argparse
import json
import signal
import threading


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from specdraft.hidden_states.service import ServiceConfig
    from specdraft.utils.config import add_dataclass_arguments

    parser = subparsers.add_parser(
        "serve-hidden-states",
        help="serve target hidden states over HTTP to online/hybrid training (a producer)",
        description=(
            "Hold the target and answer POST /extract requests: run it on the given token ids, write the payload to "
            "the backend under the requested key, then reply. Prints one JSON line with the URL once ready; "
            "SIGINT/SIGTERM finish queued requests and stop. --engine vllm runs the target in a vLLM server (a private "
            "one, or yours at --vllm-url, started with the command that --print-server-command prints); the protocol "
            "is the same."
        ),
    )
    add_dataclass_arguments(parser, ServiceConfig)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specdraft.cli import print_server_command
    from specdraft.hidden_states.service import HiddenStateService, ServiceConfig
    from specdraft.utils.config import dataclass_from_args

    config = dataclass_from_args(ServiceConfig, args)
    if config.print_server_command:
        from specdraft.integrations.vllm.producer import producer_server_command

        return print_server_command(*producer_server_command(config))
    service = HiddenStateService(config)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with service:
        print(json.dumps({"url": service.url, "target": service.target_info["name"], "store": service.config.store}), flush=True)
        stop.wait()
    return 0
