"""DFlash2 hyperparameters (speculators 0.9.0 ``models/dflash2``; vLLM 0.32 ``qwen3_dflash2.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from specdraft.errors import SpecdraftError
from specdraft.models.dflash.config import DFlashConfig
from specdraft.utils.config import config_field


@dataclass
class DFlash2Config(DFlashConfig):
    method: ClassVar[str] = "dflash2"
    distill_default: ClassVar[str | None] = "kl"

    conv_kernel_size: int = config_field(2, help="causal taps of each grouped convolution around a draft layer's attention and MLP")
    conv_group_size: int = config_field(16, help="hidden channels sharing one token-conditioned kernel (must divide hidden_size)")
    selector_rank: int = config_field(256, help="rank of the bilinear candidate selector's predecessor/successor codebooks")
    selector_top_k: int = config_field(16, help="unary top-k candidates the selector reranks at each block position")
    selector_weight: float = config_field(1.0, help="weight of the selector's K-way cross-entropy beside the unary loss")
    unary_loss: str = config_field(
        "kl",
        help="unary term: kl (the target distillation over the vocabulary, divergence distill_loss, default KL(p_t || p_d): "
        "speculators' DFlash2 default) or ce (DFlash's hard-label CE)",
        metadata={"choices": ["kl", "ce"]},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        # The selector's codebooks index target ids and vLLM's loader sizes them by the verifier vocabulary.
        if self.draft_vocab_coverage is not None or (self.draft_vocab_size and self.vocab_size and self.draft_vocab_size < self.vocab_size):
            raise SpecdraftError(
                "dflash2 config: a reduced draft vocabulary is not supported; DFlash2 needs the full verifier vocabulary "
                "(unset draft_vocab_size and draft_vocab_coverage)"
            )
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if getattr(self, name) < 1:
                raise SpecdraftError(f"dflash2 config: {name} must be >= 1, got {getattr(self, name)}")
        if self.conv_kernel_size > self.block_size:
            raise SpecdraftError(f"dflash2 config: conv_kernel_size {self.conv_kernel_size} exceeds block_size {self.block_size}")
        if self.hidden_size is not None and self.hidden_size % self.conv_group_size:
            raise SpecdraftError(f"dflash2 config: conv_group_size {self.conv_group_size} must divide hidden_size {self.hidden_size}")
        if self.vocab_size is not None and self.selector_top_k > self.vocab_size:
            raise SpecdraftError(f"dflash2 config: selector_top_k {self.selector_top_k} exceeds the vocabulary {self.vocab_size}")
        if self.unary_loss not in ("kl", "ce"):
            raise SpecdraftError(f"dflash2 config: unary_loss must be kl or ce, got {self.unary_loss!r}")
        if self.selector_weight < 0:
            raise SpecdraftError(f"dflash2 config: selector_weight must be >= 0, got {self.selector_weight}")
