"""Speculative-decoding counters of a running vLLM server, read from its Prometheus ``/metrics``.

vLLM counts, per engine: drafts (rounds that proposed), draft tokens, accepted tokens, and accepted
tokens per draft position. From two readings (before/after a workload) follow the acceptance
rate (accepted / draft tokens) and the mean accepted length tau = 1 + accepted / drafts (the
bonus/corrected token every verification round yields is the 1).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from specdraft.errors import SpecdraftError
from specdraft.integrations.vllm.engine import get_text

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
PREFIX = "vllm:spec_decode_"


@dataclass(frozen=True)
class SpecDecodeCounters:
    """Cumulative counters (summed over engines/models); ``accepted_per_position[k]`` is draft position k (0-based)."""

    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    accepted_per_position: tuple[float, ...] = field(default_factory=tuple)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """tau: tokens per verification round (accepted drafts + the one target token)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def __sub__(self, earlier: SpecDecodeCounters) -> SpecDecodeCounters:
        """The counts of the workload between two readings."""
        n = max(len(self.accepted_per_position), len(earlier.accepted_per_position))
        mine = self.accepted_per_position + (0.0,) * (n - len(self.accepted_per_position))
        theirs = earlier.accepted_per_position + (0.0,) * (n - len(earlier.accepted_per_position))
        return SpecDecodeCounters(
            num_drafts=self.num_drafts - earlier.num_drafts,
            num_draft_tokens=self.num_draft_tokens - earlier.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens - earlier.num_accepted_tokens,
            accepted_per_position=tuple(a - b for a, b in zip(mine, theirs)),
        )


def parse_spec_decode_metrics(text: str) -> SpecDecodeCounters:
    """Sum the ``vllm:spec_decode_*_total`` samples of a Prometheus text exposition."""
    totals = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0}
    per_position: dict[int, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or not match["name"].startswith(PREFIX) or not match["name"].endswith("_total"):
            continue
        counter = match["name"][len(PREFIX) : -len("_total")]
        value = float(match["value"])
        if counter == "num_accepted_tokens_per_pos":
            position = int(dict(_LABEL.findall(match["labels"] or "")).get("position", -1))
            if position >= 0:
                per_position[position] = per_position.get(position, 0.0) + value
        elif counter in totals:
            totals[counter] += value
    positions = tuple(per_position.get(k, 0.0) for k in range(max(per_position) + 1)) if per_position else ()
    return SpecDecodeCounters(**totals, accepted_per_position=positions)


def read_spec_decode_metrics(endpoint: str) -> SpecDecodeCounters:
    """Counters of the server at ``endpoint`` (``http://host:port``, with or without ``/v1``)."""
    base = endpoint.rstrip("/").removesuffix("/v1")
    text = get_text(f"{base}/metrics")
    if "vllm:" not in text:
        raise SpecdraftError(f"{base}/metrics has no vllm:* metrics; is {endpoint} a vLLM server?")
    return parse_spec_decode_metrics(text)
