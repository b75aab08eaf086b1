"""The decoding runtime as training's validation decoder (``tau_decoded``).

Training is a lower layer than decoding, so the trainer reads the decoder from
``train.acceptance.VALIDATION_DECODERS`` and this module registers it there when loaded (the CLI loads it, and
the ``specdraft.plugins`` entry point names it for library use).
"""

from __future__ import annotations

from typing import Any

import torch

from specdraft.decode.config import DecodeConfig, SamplingConfig
from specdraft.decode.proposers.drafters import decodable_methods, drafter_proposer
from specdraft.decode.runtime import DecodeMetrics, SpeculativeDecoder
from specdraft.targets.base import Target
from specdraft.train.acceptance import BUILTIN_DECODER, VALIDATION_DECODERS, ValidationDecoder


def decode_greedy(drafter: Any, method: str, target: Target, prompts: list[list[int]], tokens: int) -> DecodeMetrics:
    """Greedy decoding of ``prompts`` with the method's proposer around ``drafter``, verifying every draft."""
    config = DecodeConfig(drafter=method, max_new_tokens=tokens)
    device = next(drafter.parameters()).device
    if next(target.model.parameters()).device != device:
        target.model.to(device)
    decoder = SpeculativeDecoder(target.model, drafter_proposer(drafter, config), config=config, sampling=SamplingConfig())
    with torch.no_grad():
        return decoder.generate(prompts).metrics


VALIDATION_DECODERS.register(BUILTIN_DECODER)(ValidationDecoder(methods=decodable_methods, decode=decode_greedy))
