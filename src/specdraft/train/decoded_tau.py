"""Decoded tau at each validation: the acceptance users get, measured on a few validation prompts.

The teacher-forced estimate of a validation record (``tau_teacher_forced``, = ``accept_len``) scores
drafts at anchors drawn *uniformly* over the response positions of validation samples (DSpark/DFlash:
up to ``max_anchors`` blocks per sample; EAGLE-3: every response position), each conditioned on the
target's own reply. Decoding (``tau_decoded``) anchors each block where the previous round stopped, on
the reply the target is generating, and those rounds land more often in hard text, so the estimate reads
high (the figures: ``docs/results/machine_tuning.md``). So both are logged: the estimate is cheap and smooth,
the decoded figure is the one users get.

The prompts are the first ``count`` validation samples (dataset order) with distinct prompts: the
tokens before each one's first response token. Decoding is greedy, ``tokens`` new tokens per prompt,
one batch, with the method's proposer around the drafter being trained and the full verify policy (every
drafted token is verified): the decoding runtime itself, which sits below training
(``tests/test_layering.py``), so what validation measures is what ``specdraft generate`` and ``eval`` run.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdraft.decode.config import DecodeConfig, SamplingConfig
from specdraft.decode.proposers.drafters import decodable_methods, drafter_proposer
from specdraft.decode.runtime import DecodeMetrics, SpeculativeDecoder
from specdraft.targets.base import Target


@dataclass(frozen=True)
class DecodeProbe:
    """A fixed prompt set and generation length, decoded at every validation."""

    sample_ids: tuple[str, ...]
    prompts: tuple[tuple[int, ...], ...]
    tokens: int

    @classmethod
    def from_split(cls, token_rows: Sequence[tuple[Any, Any]], sample_ids: Sequence[str], *, count: int, tokens: int) -> DecodeProbe:
        """``token_rows``: (token ids, loss mask) of the validation samples in dataset order."""
        from specdraft.train.split import prompt_length

        picked_ids, prompts, seen = [], [], set()
        for sid, (ids, mask) in zip(sample_ids, token_rows):
            prompt = tuple(int(t) for t in ids[: prompt_length(mask)])
            if prompt and prompt not in seen:
                seen.add(prompt)
                picked_ids.append(str(sid))
                prompts.append(prompt)
                if len(prompts) == count:
                    break
        return cls(tuple(picked_ids), tuple(prompts), tokens)

    def run(self, drafter: Any, method: str, target: Target) -> dict:
        """Decode the prompts with ``drafter`` (left in eval mode; the caller restores train mode)."""
        started = time.perf_counter()
        metrics = decode_greedy(drafter, method, target, [list(p) for p in self.prompts], self.tokens)
        return {
            "tau": metrics.tau,
            "rounds": metrics.rounds,
            "prompts": len(self.prompts),
            "max_new_tokens": self.tokens,
            "tokens": metrics.output_tokens,
            "position_acceptance": [round(x, 6) for x in metrics.position_acceptance],
            "seconds": round(time.perf_counter() - started, 3),
        }


def decode_greedy(drafter: Any, method: str, target: Target, prompts: list[list[int]], tokens: int) -> DecodeMetrics:
    """Greedy decoding of ``prompts`` with the method's proposer around ``drafter``, verifying every draft."""
    config = DecodeConfig(drafter=method, max_new_tokens=tokens)
    device = next(drafter.parameters()).device
    if next(target.model.parameters()).device != device:
        target.model.to(device)
    decoder = SpeculativeDecoder(target.model, drafter_proposer(drafter, config), config=config, sampling=SamplingConfig())
    with torch.no_grad():
        return decoder.generate(prompts).metrics


def unavailable_reason(method: str, target: Target) -> str | None:
    """Why decoded tau cannot be measured for this run (None when it can)."""
    known = decodable_methods()
    if method not in known:
        return f"method {method!r} has no decoding proposer (known: {', '.join(known)})"
    if getattr(target, "model", None) is None:
        return "the target has no model to verify with"
    return None
