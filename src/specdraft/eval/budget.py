"""How long a comparison will take, before it runs: this machine's measured step costs times its work.

``specdraft quickstart`` trains in whatever its budget leaves after the comparison, so a reserve fixed
in minutes is wrong somewhere: too small where decoding is slow (the comparison covers fewer prompts),
too large where it is fast (training gets minutes that end unused). This module runs the decoding work
the estimate needs (a plain decode, a drafter's rounds); ``tuning/budget_probes.py`` holds the bound
made from it (every decoder as if it accepted nothing):

* a plain round is the target's 1-token forward (the SPS profile, measured once per machine and
  reused by the comparison's scheduler) plus the runtime's own per-round work, measured by decoding;
* a drafting round verifies its whole draft (the SPS profile at that width) after drafting it (the
  drafter's round on the path and in the dtype tuning resolves for the comparison, measured and cached);
* a gated decoder (``@scheduled``) costs at most the gate floor times a plain round.
"""

from __future__ import annotations

from typing import Any

from specdraft.targets.base import Target
from specdraft.tuning.budget_probes import DecoderCost, overhead_per_round, round_seconds

#: Tokens of the warm-up generation every decoder runs before the comparison (``runner.run_eval``).
WARMUP_TOKENS = 16


def plain_overhead_seconds(target: Target, sps: Any, *, tokens: int = WARMUP_TOKENS) -> float:
    """Seconds per plain round beyond the target forward (sampling, cache and stopping bookkeeping):
    a real autoregressive decode of ``tokens`` tokens, timed after a warm-up, less the SPS forward."""
    from specdraft.decode.config import DecodeConfig, SamplingConfig
    from specdraft.decode.runtime import decoder_for_target

    decoder = decoder_for_target(target, config=DecodeConfig(drafter="none", max_new_tokens=tokens), sampling=SamplingConfig())
    prompt = [int(t) % int(target.vocab_size) for t in range(100, 132)]
    decoder.generate([prompt])  # one-off costs
    m = decoder.generate([prompt]).metrics
    return overhead_per_round(wall_s=m.wall_s, ttft_s=m.ttft_s, output_tokens=m.output_tokens, requests=m.requests, sps=sps)


def drafter_cost(
    label: str, proposer: Any, sps: Any, *, overhead_s: float, draft_dtype: str = "auto", forward_path: str = "auto"
) -> DecoderCost:
    """The bound for a trained drafter's ``proposer`` verifying its whole draft: its round on ``forward_path`` in
    ``draft_dtype`` (``auto``: what tuning measured fastest here, once and cached, as the comparison resolves it)."""
    from specdraft.tuning.settings import resolve_choices

    choices = resolve_choices("draft", proposer.timed_work(), forward_path=forward_path, dtype=draft_dtype)
    proposer.use_choices(choices)
    dtype = choices.chosen("compute_dtype")
    draft_s = min(dtype.seconds.values()) if dtype.seconds else proposer.round_seconds(dtype.value)
    width = 1 + (getattr(proposer, "block_length", None) or proposer.num_draft_tokens)
    return DecoderCost(label, round_seconds(sps, overhead_s=overhead_s, verify_tokens=width, draft_s=draft_s))
