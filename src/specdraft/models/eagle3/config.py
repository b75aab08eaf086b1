"""EAGLE-3 hyperparameters (arXiv 2503.01840; reference SafeAILab/EAGLE, vllm-project/speculators)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from specdraft.errors import SpecdraftError
from specdraft.models.common.config import DraftConfig
from specdraft.targets.base import Target
from specdraft.utils.config import config_field

#: Draft vocabulary when neither draft_vocab_size nor draft_vocab_coverage is given (the reference's).
DEFAULT_DRAFT_VOCAB = 32000


@dataclass
class Eagle3Config(DraftConfig):
    method: ClassVar[str] = "eagle3"
    distill_default: ClassVar[str | None] = "soft_ce"

    draft_vocab_size: int | None = config_field(
        None,
        help="reduced draft vocabulary: the N most frequent response tokens (capped at the target vocabulary; "
        f"default {DEFAULT_DRAFT_VOCAB} unless draft_vocab_coverage is given; takes precedence over draft_vocab_coverage)",
    )
    draft_vocab_coverage: float | None = config_field(
        None,
        help="choose draft_vocab_size as the smallest N covering this fraction (0, 1] of response-token "
        "occurrences in the dataset's token counts; used only when draft_vocab_size is unset",
    )
    ttt_steps: int = config_field(7, help="training-time-test unroll steps (also the number of draft tokens per round)")
    ttt_decay: float = config_field(0.8, help="loss weight decay per unroll step: step j is weighted decay**j")
    norm_before_residual: bool = config_field(False, help="use the normed feature as the residual of the fused layer")
    # Eagle 3.1 (speculators' eagle3 defaults are norm_before_fc + norm_output); vLLM serves all three. Checkpoints from
    # before they existed have none of these norms (added_later: absent reads as False, checked against config.json's own)
    norm_before_fc: bool = config_field(
        False, help="one RMSNorm over the concatenated target features before fc (gpt-oss style)", metadata={"added_later": True}
    )
    fc_norm: bool = config_field(
        False, help="an RMSNorm per target layer's feature before concatenation and fc (Eagle 3.1)", metadata={"added_later": True}
    )
    norm_output: bool = config_field(
        False,
        help="feed the normed output to the next unroll/draft step instead of the raw one (Eagle 3.1: less drift with depth)",
        metadata={"added_later": True},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_layers != 1:
            raise SpecdraftError(f"eagle3 config: num_layers must be 1 (one fused decoder layer), got {self.num_layers}")
        if self.ttt_steps < 1:
            raise SpecdraftError(f"eagle3 config: ttt_steps must be >= 1, got {self.ttt_steps}")
        if not 0 < self.ttt_decay <= 1:
            raise SpecdraftError(f"eagle3 config: ttt_decay must be in (0, 1], got {self.ttt_decay}")
        if self.norm_before_fc and self.fc_norm:
            raise SpecdraftError(
                "eagle3 config: norm_before_fc and fc_norm are exclusive (one norm of the concatenation, or one per layer)"
            )
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise SpecdraftError(f"eagle3 config: draft_vocab_size must be >= 1, got {self.draft_vocab_size}")
        if self.draft_vocab_size is not None and self.vocab_size is not None and self.draft_vocab_size > self.vocab_size:
            raise SpecdraftError(f"eagle3 config: draft_vocab_size {self.draft_vocab_size} exceeds the target vocabulary {self.vocab_size}")
        if self.draft_vocab_coverage is not None and not 0.0 < self.draft_vocab_coverage <= 1.0:
            raise SpecdraftError(f"eagle3 config: draft_vocab_coverage must be in (0, 1], got {self.draft_vocab_coverage}")

    def _resolve_method(self, target: Target) -> dict[str, Any]:
        """The draft vocabulary size, capped at the target's; left unset when coverage chooses it at build time."""
        if self.draft_vocab_size is None and self.draft_vocab_coverage is not None:
            return {}
        return {"draft_vocab_size": min(self.draft_vocab_size or DEFAULT_DRAFT_VOCAB, int(target.text_config.vocab_size))}
