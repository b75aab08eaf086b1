"""How much work fits a wall-clock budget here: what is read off a timing probe of the real work, and the plan made from it.

A budget fixed in steps or minutes is wrong somewhere: where a training step or a decoding round is slow a plan needs
fewer steps (or more minutes), where it is fast fewer minutes. So the quickstart, and the scripts that size a run, time
the real work on the machine at hand first and plan from the figures. The layers that own the work run it
(``train/budget.py``: a short training run; ``eval/budget.py``: a plain decode and the drafters' rounds); this module
reads the figures and decides:

* training: the step time, the median of the probe run's logged steps (:func:`seconds_per_step`), and the steps that
  fill what the budget has left after the probe (:func:`steps_in_budget`);
* a comparison: an upper bound on its seconds (:func:`estimate_eval_seconds`), as if no decoder accepted anything (one
  output token per round, :func:`round_seconds`): a plain round is the target's 1-token forward (its SPS profile) plus
  the runtime's own per-round work (:func:`overhead_per_round`); a drafting round drafts, then verifies its whole draft;
  a gated decoder costs at most the gate floor times a plain round; every prompt is prefilled once per decoder, and
  every decoder first decodes a warm-up.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdraft.errors import SpecdraftError


def seconds_per_step(metrics_path: Path) -> float:
    """Median wall seconds of the training steps logged in a metrics.jsonl (the first step, which
    pays one-off costs, is left out when there are others)."""
    seconds = []
    for line in Path(metrics_path).read_text().splitlines():
        record = json.loads(line)
        if record.get("split", "train") == "train" and "seconds" in record:
            seconds.append(record["seconds"] / max(record.get("steps", 1), 1))
    if not seconds:
        raise SpecdraftError(f"no training steps were logged to {metrics_path}; cannot time the run")
    seconds = sorted(seconds[1:] or seconds)
    return seconds[len(seconds) // 2]


def median_record(metrics_path: Path, key: str) -> float | None:
    """Median of ``key`` over the training records of a metrics.jsonl (None when none has it)."""
    values = sorted(
        r[key]
        for r in map(json.loads, Path(metrics_path).read_text().splitlines())
        if r.get("split", "train") == "train" and isinstance(r.get(key), (int, float))
    )
    return values[len(values) // 2] if values else None


def steps_in_budget(train_seconds: float, per_step: float, *, headroom: float = 0.9) -> int:
    """Steps of ``per_step`` seconds in ``headroom`` of ``train_seconds`` (validation, checkpoints and step-time drift
    take the rest); below 1 where not even one step fits."""
    return int(headroom * train_seconds / per_step)


@dataclass(frozen=True)
class DecoderCost:
    """One decoder of a comparison: seconds of a round that commits a single token (its worst case)."""

    label: str
    round_s: float


def round_seconds(sps: Any, *, overhead_s: float, verify_tokens: int = 1, draft_s: float = 0.0, gate_floor: float | None = None) -> float:
    """Upper bound of one round's seconds (``sps(n)``: target forwards of ``n`` tokens per second): draft, verify
    ``verify_tokens`` positions, the runtime's work. A gated decoder (``gate_floor``: the most its rounds may cost
    against a plain round) drafts rarely enough to stay within that floor of a plain round."""
    plain = 1.0 / sps(1) + overhead_s
    if gate_floor is not None:
        return gate_floor * plain
    return draft_s + 1.0 / sps(verify_tokens) + overhead_s


def estimate_eval_seconds(
    prompt_lengths: Sequence[int], max_new_tokens: int, costs: Sequence[DecoderCost], sps: Any, *, warmup_tokens: int
) -> dict:
    """Seconds the comparison of ``costs``' decoders takes at most on prompts of ``prompt_lengths`` tokens
    (``max_new_tokens`` each, one prompt per batch, after a warm-up of ``warmup_tokens``), with each decoder's share."""
    prefill = sum(1.0 / sps(n) for n in prompt_lengths)
    per_decoder = {c.label: prefill + c.round_s * (len(prompt_lengths) * max_new_tokens + warmup_tokens) for c in costs}
    return {"seconds": sum(per_decoder.values()), "per_decoder_s": {k: round(v, 1) for k, v in per_decoder.items()}}


def overhead_per_round(*, wall_s: float, ttft_s: float, output_tokens: int, requests: int, sps: Any) -> float:
    """Seconds per plain round beyond the target's 1-token forward (sampling, cache and stopping bookkeeping), from a
    plain decode's wall time after its first tokens, per later token, less the SPS forward."""
    return max(0.0, (wall_s - ttft_s) / max(output_tokens - requests, 1) - 1.0 / sps(1))
