"""How long a comparison will take, before it runs: this machine's measured step costs times its work.

``specdraft quickstart`` trains in whatever its budget leaves after the comparison, so a reserve fixed
in minutes is wrong somewhere: too small where decoding is slow (the comparison covers fewer prompts),
too large where it is fast (training gets minutes that end unused). The estimate bounds every
decoder from above, as if it accepted nothing (one output token per round):

* a plain round is the target's 1-token forward (the SPS profile, measured once per machine and
  reused by the comparison's scheduler) plus the runtime's own per-round work, measured by decoding;
* a drafting round verifies its whole draft (the SPS profile at that width) after drafting it (the
  drafter's measured round, the probe its ``--draft-dtype auto`` uses and caches);
* a gated decoder (``@scheduled``) costs at most the gate floor times a plain round;
* every prompt is prefilled once per decoder, and every decoder first decodes a warm-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from specdraft.targets.base import Target

#: Tokens of the warm-up generation every decoder runs before the comparison (``runner.run_eval``).
WARMUP_TOKENS = 16


@dataclass(frozen=True)
class DecoderCost:
    """One decoder of a comparison: seconds of a round that commits a single token (its worst case)."""

    label: str
    round_s: float


def round_seconds(sps: Any, *, overhead_s: float, verify_tokens: int = 1, draft_s: float = 0.0, gated: bool = False) -> float:
    """Upper bound of one round's seconds: draft, verify ``verify_tokens`` positions, the runtime's work.
    A gated decoder drafts rarely enough to stay within the gate floor of a plain round."""
    from specdraft.eval.report import GATE_FLOOR

    plain = 1.0 / sps(1) + overhead_s
    if gated:
        return GATE_FLOOR * plain
    return draft_s + 1.0 / sps(verify_tokens) + overhead_s


def estimate_eval_seconds(prompt_lengths: Sequence[int], max_new_tokens: int, costs: Sequence[DecoderCost], sps: Any) -> dict:
    """Seconds the comparison of ``costs``' decoders takes at most on prompts of ``prompt_lengths``
    tokens (``max_new_tokens`` each, one prompt per batch), with each decoder's share."""
    prefill = sum(1.0 / sps(n) for n in prompt_lengths)
    per_decoder = {c.label: prefill + c.round_s * (len(prompt_lengths) * max_new_tokens + WARMUP_TOKENS) for c in costs}
    return {"seconds": sum(per_decoder.values()), "per_decoder_s": {k: round(v, 1) for k, v in per_decoder.items()}}


def plain_overhead_seconds(target: Target, sps: Any, *, tokens: int = WARMUP_TOKENS) -> float:
    """Seconds per plain round beyond the target forward (sampling, cache and stopping bookkeeping):
    a real autoregressive decode of ``tokens`` tokens, timed after a warm-up, less the SPS forward."""
    from specdraft.decode.config import DecodeConfig, SamplingConfig
    from specdraft.decode.runtime import decoder_for_target

    decoder = decoder_for_target(target, config=DecodeConfig(drafter="none", max_new_tokens=tokens), sampling=SamplingConfig())
    prompt = [int(t) % int(target.vocab_size) for t in range(100, 132)]
    decoder.generate([prompt])  # one-off costs
    m = decoder.generate([prompt]).metrics
    return max(0.0, (m.wall_s - m.ttft_s) / max(m.output_tokens - m.requests, 1) - 1.0 / sps(1))


def drafter_cost(label: str, proposer: Any, sps: Any, *, overhead_s: float, draft_dtype: str = "auto", forward_path: str = "auto") -> DecoderCost:
    """The bound for a trained drafter's ``proposer`` verifying its whole draft: its round on ``forward_path`` in
    ``draft_dtype`` (``auto``: the faster here, measured once and cached, as the comparison does)."""
    proposer.set_forward_path(forward_path)
    measurement = proposer.set_compute_dtype(draft_dtype)
    draft_s = min(measurement.seconds.values()) if measurement else proposer.round_seconds(draft_dtype)
    width = 1 + (getattr(proposer, "block_length", None) or proposer.num_draft_tokens)
    return DecoderCost(label, round_seconds(sps, overhead_s=overhead_s, verify_tokens=width, draft_s=draft_s))
