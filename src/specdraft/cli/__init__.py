"""Command-line interface: each subcommand module maps flags onto one library function."""

import re
import sys


def summary(doc: str | None) -> str:
    """A command module's docstring as its ``--help`` description: the first line without the leading command name
    and without the reStructuredText code markup docstrings use (``--help`` is plain text)."""
    line = (doc or "").strip().partition("\n")[0]
    line = re.sub(r"^``[^`]+``:\s*", "", line).replace("``", "")
    return line[:1].upper() + line[1:]


def print_server_command(command: str, url: str) -> int:
    """--print-server-command: the command on stdout (to pipe or copy), how to attach on stderr."""
    print(command)
    print(f"# start that server, then rerun with --vllm-url {url}", file=sys.stderr)
    return 0
