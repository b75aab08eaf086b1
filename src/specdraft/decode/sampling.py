"""Token sampling transforms shared by the target and every drafter.

Rejection sampling is lossless only if the draft distribution ``p_d`` and the target distribution
``p_t`` are the distributions the tokens are *actually* drawn from, so both sides must go through
the same transform: temperature, then top-k, then top-p (nucleus), then softmax. Temperature 0 is
greedy decoding (a point mass on the argmax); verification then uses exact matching.
"""

from __future__ import annotations

import torch

from specdraft.decode.config import SamplingConfig

__all__ = ["SamplingConfig", "sample", "sample_from_logits", "sampling_probs"]


def sampling_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Turn logits [..., V] into the sampling distribution [..., V] (float32, or float64 for float64 logits).

    Greedy configs give a one-hot on the argmax so that callers never special-case T=0 when they
    only need "the distribution the token came from".
    """
    logits = logits if logits.dtype == torch.float64 else logits.float()
    if config.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    logits = logits / config.temperature
    vocab = logits.shape[-1]
    if 0 < config.top_k < vocab:
        kth = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if config.top_p < 1:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= config.top_p  # the token that crosses top_p is kept; the first always is
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row of ``probs`` [..., V] -> [...] int64."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def sample_from_logits(
    logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [...], the distribution they were drawn from [..., V]); argmax when greedy."""
    probs = sampling_probs(logits, config)
    tokens = probs.argmax(-1) if config.greedy else sample(probs, generator)
    return tokens, probs
