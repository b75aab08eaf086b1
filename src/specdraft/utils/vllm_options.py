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


#: A schedule's open last range ends here; vLLM clamps every range to its max_num_seqs.
OPEN_END = 1 << 20


def parse_draft_schedule(text: str) -> list[tuple[int, int, int]]:
    """``'1:3,2-8:1,9-:0'`` as vLLM's ``num_speculative_tokens_per_batch_size`` entries ``(first, last, k)``.

    Refused unless the ranges start at 1, follow each other without gaps or overlaps and only the last is open:
    vLLM itself carries a K across a gap and silently clamps, which would hide a typo."""
    entries: list[tuple[int, int, int]] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        batches, _, k = part.partition(":")
        first, dash, last = batches.partition("-")
        try:
            entry = (int(first), int(last) if last else OPEN_END if dash else int(first), int(k))
        except ValueError:
            raise SpecdraftError(f"{setting('draft_schedule')} entry {part!r} is not BATCHES:K (e.g. 1:3, 2-8:1 or 9-:0)") from None
        expected = entries[-1][1] + 1 if entries else 1
        if entry[0] != expected or entry[1] < entry[0] or entry[2] < 0:
            raise SpecdraftError(
                f"{setting('draft_schedule')} entry {part!r}: expected batch sizes from {expected} "
                f"({'open ranges only last' if entries and entries[-1][1] == OPEN_END else 'no gaps or overlaps'}) and K >= 0"
            )
        entries.append(entry)
    return entries


def draft_schedule_option(text: str) -> dict[str, list[list[int]]]:
    """The ``--speculative-config`` entry of the schedule ``text`` (none for an empty one), for any speculative method."""
    entries = parse_draft_schedule(text)
    return {"num_speculative_tokens_per_batch_size": [list(entry) for entry in entries]} if entries else {}


def format_draft_schedule(entries: list[tuple[int, int, int]]) -> str:
    """The inverse of :func:`parse_draft_schedule`, for labels and reports."""

    def batches(first: int, last: int) -> str:
        return f"{first}-" if last == OPEN_END else str(first) if first == last else f"{first}-{last}"

    return ",".join(f"{batches(first, last)}:{k}" for first, last, k in entries)
