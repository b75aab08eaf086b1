"""Typed configs of a decoding run, one per concern (kept free of torch so ``--help`` stays fast)."""

from __future__ import annotations

from dataclasses import dataclass

from specdraft.errors import SpecdraftError
from specdraft.tuning.paths import path_choices
from specdraft.utils.config import check_forward_path, config_field, require_finite

DRAFT_DTYPES = ("auto", "fp32", "bf16")


@dataclass(frozen=True)
class DecodeConfig:
    """What to draft with and how long to generate."""

    drafter: str = config_field(
        "ngram",
        help="draft proposer: ngram (prompt lookup), suffix (prompt lookup, else the target's own answers: --lookup-corpus), "
        "none (plain autoregressive decoding), a trained eagle3 | dflash | dflash2 | dspark, or one of those with a lookup, "
        "e.g. dspark+ngram or dspark+suffix (per request and round, the lookup's match or the drafter's block, "
        "whichever measured acceptance and cost say commits more tokens per second)",
    )
    drafter_path: str = config_field(
        "", help="checkpoint directory of a trained eagle3/dflash/dflash2/dspark drafter (also for METHOD+ngram)"
    )
    num_draft_tokens: int = config_field(
        4,
        help="k: tokens drafted per round by chain drafters (ngram, EAGLE-3); DFlash/DFlash2/DSpark draft and may verify their whole block",
    )
    max_new_tokens: int = config_field(128, help="stop a request after this many generated tokens")
    seed: int = config_field(0, help="seed of the sampling generator (temperature > 0)")
    ngram_max: int = config_field(3, help="ngram drafter: longest context suffix looked up earlier in the context")
    ngram_min: int = config_field(
        2, help="ngram drafter: shortest suffix tried before giving up for this round (1-gram matches are mostly wrong)"
    )
    lookup_corpus: str = config_field(
        "",
        help="suffix drafting (suffix, METHOD+suffix): a `specdraft prepare` output for this target; where prompt lookup finds "
        "no match, its answers propose what the target most often wrote after the context's last 2-4 tokens",
    )
    draft_dtype: str = config_field(
        "auto",
        help="compute dtype of a trained drafter's rounds: fp32, bf16 autocast, or auto (times a draft round in both "
        "once per machine and drafter configuration, cached under the specdraft cache, and picks the faster)",
        metadata={"choices": list(DRAFT_DTYPES)},
    )
    forward_path: str = config_field(
        "auto",
        help="how the target's and the drafter's forwards execute: eager PyTorch, prepacked (linear weights reordered "
        "once for oneDNN; CPU, fp32), gqa (SDPA groups query heads over shared K/V heads instead of HF copying the cache per "
        "head; targets with grouped attention), prepacked+gqa (both; a drafter takes the parts that apply to it), "
        "or auto (times decode-shaped forwards on each path once per machine and model, cached, and picks the fastest)",
        metadata={"choices": path_choices()},
    )

    def __post_init__(self) -> None:
        require_finite(self)
        if self.draft_dtype not in DRAFT_DTYPES:
            raise SpecdraftError(f"draft_dtype must be one of {', '.join(DRAFT_DTYPES)}, got {self.draft_dtype!r}")
        check_forward_path(self.forward_path)
        if self.max_new_tokens <= 0:
            raise SpecdraftError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if self.num_draft_tokens < 0:
            raise SpecdraftError(f"num_draft_tokens must be >= 0, got {self.num_draft_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise SpecdraftError(f"need 1 <= ngram_min <= ngram_max, got ngram_min={self.ngram_min}, ngram_max={self.ngram_max}")


#: Smallest positive temperature: logits / T overflows to inf (and sampling to NaN) for tiny T, which samples
#: greedily anyway.
MIN_TEMPERATURE = 1e-3


@dataclass(frozen=True)
class SamplingConfig:
    """How the target's tokens are chosen (temperature, then top-k, then top-p).

    Proposers receive it and should draw with the same transform for the best acceptance; losslessness
    only needs the exact distribution each draft came from (``Draft.probs``), whatever it was.
    """

    temperature: float = config_field(0.0, help="softmax temperature; 0 = greedy decoding (exact-match verification)")
    top_k: int = config_field(0, help="sample only among the k most likely tokens; 0 disables top-k")
    top_p: float = config_field(
        1.0, help="nucleus sampling: keep the most likely tokens up to this cumulative probability, in (0, 1]; 1 disables"
    )

    def __post_init__(self) -> None:
        require_finite(self)
        if not (self.temperature == 0 or self.temperature >= MIN_TEMPERATURE):  # also rejects NaN
            raise SpecdraftError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {self.temperature}")
        if self.top_k < 0:
            raise SpecdraftError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise SpecdraftError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class SchedulerConfig:
    """How many drafted tokens each request sends to the target per round."""

    verify_policy: str = config_field(
        "full",
        help="full = verify every draft; threshold = verify while prefix survival >= confidence_threshold; "
        "scheduled = DSpark prefix scheduler maximising expected tokens x target steps/s (needs a drafter with confidences)",
    )
    confidence_threshold: float = config_field(0.5, help="prefix-survival threshold of the 'threshold' verify policy, in [0, 1]")
    adaptive_drafting: bool = config_field(
        True,
        help="scheduled policy: skip drafting while measured drafting rounds commit tokens slower than plain decoding "
        "(probing again after 1, 2, 4, ... 32 plain rounds), so a weak drafter does not slow decoding down",
    )

    def __post_init__(self) -> None:
        require_finite(self)
        # imported here, not at the top: the scheduler imports torch, and these configs stay torch-free for --help
        from specdraft.decode.scheduler import VERIFY_POLICIES

        VERIFY_POLICIES.get(self.verify_policy)  # raises naming the known policies
        if not 0 <= self.confidence_threshold <= 1:
            raise SpecdraftError(f"confidence_threshold must be in [0, 1], got {self.confidence_threshold}")
