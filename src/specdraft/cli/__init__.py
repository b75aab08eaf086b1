"""Command-line interface: each subcommand module maps flags onto one library function."""

import sys


def print_server_command(command: str, url: str) -> int:
    """--print-server-command: the command on stdout (to pipe or copy), how to attach on stderr."""
    print(command)
    print(f"# start that server, then rerun with --vllm-url {url}", file=sys.stderr)
    return 0
