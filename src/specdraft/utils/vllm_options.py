"""The vLLM options of every command that can start (or attach to) a vLLM server: one definition,
one help text. Torch- and vLLM-free, so configs can inherit them without importing an engine.

The fields are keyword-only so a config inheriting them keeps its own required fields first;
``add_dataclass_arguments`` lists them after the command's own flags.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdraft.errors import SpecdraftError, setting
from specdraft.utils.config import config_field

#: Where specdraft looks for the vLLM environment's python without ``--vllm-python`` (``utils/environment.vllm_python``).
VLLM_PYTHON_LOOKUP = (
    "$SPECDRAFT_VLLM_PYTHON, else .venv-vllm/bin/python in the working directory or the source checkout "
    "(where scripts/bootstrap.sh makes one), else this python if it has vllm, else the python behind `vllm` on PATH"
)


@dataclass(kw_only=True)
class VllmServerOptions:
    vllm_python: str | None = config_field(None, help=f"python of the vLLM environment (default: {VLLM_PYTHON_LOOKUP})")
    vllm_args: str = config_field("", help="extra vLLM api_server flags, e.g. --vllm-args='--max-model-len 4096'")


@dataclass(kw_only=True)
class VllmAttachOptions(VllmServerOptions):
    """Server options plus driving a server the user started (e.g. on another node, or with other flags)."""

    vllm_url: str | None = config_field(
        None,
        help="--engine vllm: use the vLLM server already running at this URL (e.g. http://127.0.0.1:8000, started with "
        "the command --print-server-command prints) instead of starting one; checked with a store-nothing request first",
    )
    print_server_command: bool = config_field(
        False,
        help="--engine vllm: print the command line of the vLLM server this command needs (same flags otherwise) and "
        "exit; run it yourself, then rerun with --vllm-url",
    )

    def check_vllm_options(self, engine: str) -> None:
        """``--vllm-url`` and ``--print-server-command`` only mean something to the vLLM engine."""
        if engine != "vllm" and (self.vllm_url or self.print_server_command):
            raise SpecdraftError(
                f"{setting('vllm_url')} and {setting('print_server_command')} need {setting('engine')} vllm (got {engine})"
            )
        if self.vllm_url and not self.vllm_url.startswith(("http://", "https://")):
            raise SpecdraftError(f"{setting('vllm_url')} {self.vllm_url!r} is not an http://HOST:PORT URL")
