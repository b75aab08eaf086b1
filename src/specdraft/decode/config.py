"""Typed configuration of a decoding run (sampling and verify policy have their own configs)."""

from __future__ import annotations

from dataclasses import dataclass

from specdraft.errors import SpecdraftError
from specdraft.utils.config import config_field


@dataclass(frozen=True)
class DecodeConfig:
    """What to draft with and how long to generate."""

    drafter: str = config_field("ngram", help="draft proposer: 'ngram' (prompt lookup) or 'none' (plain autoregressive decoding)")
    num_draft_tokens: int = config_field(4, help="k: tokens drafted per round (verified by one target forward)")
    max_new_tokens: int = config_field(128, help="stop a request after this many generated tokens")
    seed: int = config_field(0, help="seed of the sampling generator (temperature > 0)")
    ngram_max: int = config_field(3, help="ngram drafter: longest context suffix looked up earlier in the context")
    ngram_min: int = config_field(1, help="ngram drafter: shortest suffix tried before giving up for this round")

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise SpecdraftError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if self.num_draft_tokens < 0:
            raise SpecdraftError(f"num_draft_tokens must be >= 0, got {self.num_draft_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise SpecdraftError(f"need 1 <= ngram_min <= ngram_max, got ngram_min={self.ngram_min}, ngram_max={self.ngram_max}")
