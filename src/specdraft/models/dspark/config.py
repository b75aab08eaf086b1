"""DSpark hyperparameters (DSpark paper; reference deepseek-ai/DeepSpec, vllm-project/speculators)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from specdraft.errors import SpecdraftError
from specdraft.models.dflash.config import DFlashConfig
from specdraft.utils.config import config_field


@dataclass
class DSparkConfig(DFlashConfig):
    method: ClassVar[str] = "dspark"
    distill_default: ClassVar[str | None] = "l1"

    block_size: int = config_field(7, help="tokens per block; every slot (anchor included) drafts one token")
    markov_rank: int = config_field(256, help="rank r of the Markov head W2(W1[prev token])")
    markov_head: str = config_field(
        "vanilla", help="Markov head variant: vanilla | gated | rnn", metadata={"choices": ["vanilla", "gated", "rnn"]}
    )
    confidence_head: bool = config_field(True, help="train the per-position acceptance-confidence head")
    confidence_with_markov: bool = config_field(True, help="confidence head also reads W1[previous token]")
    ce_weight: float = config_field(0.1, help="weight of the hard-label cross-entropy term")
    l1_weight: float = config_field(0.9, help="weight of the distillation term (distill_loss; default l1: ||p_d - p_t||_1)")
    bce_weight: float = config_field(1.0, help="weight of the confidence-head BCE term")
    loss_gamma: float | None = config_field(4.0, help="position weights exp(-k/loss_gamma) over block positions k = 1..B")
    confidence_temperatures: list[float] = config_field(
        [], help="per-position confidence temperatures from Sequential Temperature Scaling (`specdraft calibrate`); empty = uncalibrated"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        from specdraft.models.dspark.heads import MARKOV_HEADS

        if self.markov_rank < 1:
            raise SpecdraftError(f"dspark config: markov_rank must be >= 1, got {self.markov_rank}")
        MARKOV_HEADS.get(self.markov_head)
        temps = self.confidence_temperatures
        if temps and (len(temps) != self.block_size or not all(t > 0 for t in temps)):
            raise SpecdraftError(
                f"dspark config: confidence_temperatures must hold block_size={self.block_size} positive values, got {temps}"
            )
