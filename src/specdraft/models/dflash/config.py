"""DFlash hyperparameters (arXiv 2602.06036; reference z-lab/dflash, vllm-project/speculators)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from specdraft.errors import SpecdraftError, setting
from specdraft.models.common.anchors import ANCHOR_SAMPLING
from specdraft.models.common.config import DraftConfig
from specdraft.models.common.weights import POSITION_WEIGHTS
from specdraft.targets.base import Target
from specdraft.utils.config import config_field

# Reference loss-decay gammas by block size; other sizes interpolate linearly (clamped).
GAMMA_BY_BLOCK = ((8, 4.0), (10, 5.0), (16, 7.0))


def default_gamma(block_size: int) -> float:
    sizes, gammas = zip(*GAMMA_BY_BLOCK)
    return float(np.interp(block_size, sizes, gammas))


def default_mask_token(target: Target) -> int:
    """An id the target never produces in chat, for the MASK slots.

    0. the token the target's family reserves for masking, when its tokenizer has it (Gemma: ``<mask>``);
    1. an embedding row beyond the tokenizer (V > len(tokenizer)): the last row;
    2. else the highest special added token that is not bos/eos/pad/unk and does not appear in the
       chat template (SmolLM2: 16 ``<empty_output>``; its pad token is ``<|im_end|>``, a real token);
    3. a target without a tokenizer (tests): the last id.
    """
    vocab = int(target.text_config.vocab_size)
    tok = getattr(target, "tokenizer", None)
    reserved = _family_mask_token(target)
    if tok is not None and reserved is not None and reserved in tok.get_vocab():
        return int(tok.convert_tokens_to_ids(reserved))
    if tok is None or len(tok) < vocab:
        return vocab - 1
    busy = {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id}
    template = str(getattr(tok, "chat_template", "") or "")
    spare = [
        i
        for i, added in tok.added_tokens_decoder.items()
        if getattr(added, "special", True) and i not in busy and i < vocab and str(added) not in template
    ]
    if not spare:
        raise SpecdraftError(
            f"target {target.name}: no unused special token to serve as the DFlash/DSpark MASK token; "
            f"choose one with {setting('model')} mask_token_id=ID"
        )
    return max(spare)


def _family_mask_token(target: Target) -> str | None:
    from specdraft.targets.families import FAMILIES, text_config

    model_type = getattr(text_config(target.model), "model_type", None) if getattr(target, "model", None) is not None else None
    return FAMILIES.get(model_type).mask_token if isinstance(model_type, str) and model_type in FAMILIES else None


@dataclass
class DFlashConfig(DraftConfig):
    method: ClassVar[str] = "dflash"

    num_layers: int = config_field(5, help="number of draft decoder layers")
    block_size: int = config_field(16, help="tokens per block: the anchor plus block_size-1 MASK slots")
    mask_token_id: int | None = config_field(
        None, help="token id of the MASK slots, an unused/reserved id (default: see default_mask_token)"
    )
    max_anchors: int = config_field(512, help="most anchors (blocks) sampled per packed sample in training")
    anchor_sampling: str = config_field(
        "uniform",
        help="training anchors: uniform, or predictable (weighted by the target's probability of the first label; "
        "see models/common/anchors.py)",
        metadata={"choices": ["uniform", "predictable"]},
    )
    loss_gamma: float | None = config_field(None, help="exp weighting's decay gamma (default: 7/5/4 for block 16/10/8, interpolated)")
    position_weighting: str = config_field(
        "exp",
        help="loss weight per block position: exp (exp(-(k-1)/gamma)) or dpace (each slot by the acceptance it can "
        "still unlock, from the drafter's detached estimate; models/common/weights.py)",
        metadata={"choices": POSITION_WEIGHTS.names(), "added_later": True},
    )
    dpace_alpha: float = config_field(
        0.5, help="dpace: smoothing of the confidence, s = (1-alpha) q + alpha, in (0, 1]", metadata={"added_later": True}
    )
    draft_vocab_size: int | None = config_field(
        None,
        help="reduced draft vocabulary: an [N, D] LM head over the N most frequent response tokens "
        "(trained unless train_draft_head is false) "
        "(None/0 or the target vocabulary size = full vocabulary through the frozen target head; "
        "takes precedence over draft_vocab_coverage)",
    )
    train_draft_head: bool = config_field(
        True,
        help="reduced draft vocabulary: train the draft head (started from the target head's rows) or keep it frozen as "
        "those rows, so the drafter learns to land in the target's output space (speculators' choice)",
        metadata={"added_later": True},
    )
    draft_vocab_coverage: float | None = config_field(
        None,
        help="choose draft_vocab_size as the smallest N covering this fraction (0, 1] of response-token "
        "occurrences in the dataset's token counts; used only when draft_vocab_size is unset",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_size < 2:
            raise SpecdraftError(f"{self.method} config: block_size must be >= 2 (anchor + at least one MASK slot), got {self.block_size}")
        if self.max_anchors < 1:
            raise SpecdraftError(f"{self.method} config: max_anchors must be >= 1, got {self.max_anchors}")
        ANCHOR_SAMPLING.get(self.anchor_sampling)
        POSITION_WEIGHTS.get(self.position_weighting)
        if not 0.0 < self.dpace_alpha <= 1.0:
            raise SpecdraftError(f"{self.method} config: dpace_alpha must be in (0, 1], got {self.dpace_alpha}")
        if self.mask_token_id is not None and (
            self.mask_token_id < 0 or (self.vocab_size is not None and self.mask_token_id >= self.vocab_size)
        ):
            raise SpecdraftError(
                f"{self.method} config: mask_token_id {self.mask_token_id} is outside the vocabulary "
                f"0..{(self.vocab_size or 0) - 1 if self.vocab_size else '?'}; pick an unused/reserved token id"
            )
        if self.loss_gamma is not None and self.loss_gamma <= 0:
            raise SpecdraftError(f"{self.method} config: loss_gamma must be > 0, got {self.loss_gamma}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 0:
            raise SpecdraftError(f"{self.method} config: draft_vocab_size must be >= 0 (0 = full vocabulary), got {self.draft_vocab_size}")
        if self.draft_vocab_size and self.vocab_size is not None and self.draft_vocab_size > self.vocab_size:
            raise SpecdraftError(
                f"{self.method} config: draft_vocab_size {self.draft_vocab_size} exceeds the target vocabulary {self.vocab_size}"
            )
        if self.draft_vocab_coverage is not None and not 0.0 < self.draft_vocab_coverage <= 1.0:
            raise SpecdraftError(f"{self.method} config: draft_vocab_coverage must be in (0, 1], got {self.draft_vocab_coverage}")

    @property
    def draft_vocab(self) -> int:
        """N, the size of the drafter's output vocabulary (the target's when not reduced; needs a resolved config)."""
        return self.draft_vocab_size or self.dims().vocab_size

    @property
    def uses_draft_vocab(self) -> bool:
        return self.draft_vocab < self.dims().vocab_size

    @property
    def gamma(self) -> float:
        return self.loss_gamma if self.loss_gamma is not None else default_gamma(self.block_size)

    def _resolve_method(self, target: Target) -> dict[str, Any]:
        if self.mask_token_id is not None:
            return {}
        return {"mask_token_id": default_mask_token(target)}

    def compared_value(self, name: str) -> Any:
        # None, 0 and the target vocabulary size all mean "full vocabulary"
        return self.draft_vocab if name == "draft_vocab_size" else getattr(self, name)

    def mask_token(self) -> int:
        """``mask_token_id`` of a resolved config (``resolve`` sets it)."""
        if self.mask_token_id is None:
            raise SpecdraftError(f"{self.method} config has no mask_token_id; resolve it against a target (MethodSpec.build)")
        return self.mask_token_id

    @property
    def resolved(self) -> bool:
        return super().resolved and self.mask_token_id is not None
