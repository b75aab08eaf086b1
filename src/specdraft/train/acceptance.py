"""Acceptance figures of a training run: decoded tau on validation prompts, and the final card.

The teacher-forced estimate of a validation record (``tau_teacher_forced``, = ``accept_len``) scores
drafts at anchors drawn *uniformly* over the response positions of validation samples (DSpark/DFlash:
up to ``max_anchors`` blocks per sample; EAGLE-3: every response position), each conditioned on the
target's own reply. Decoding (``tau_decoded``) anchors each block where the previous round stopped, on
the reply the target is generating, and those rounds land more often in hard text -- on the reference
drafter's held-out prompts uniform anchors read 1.456 where decoding got 1.407 (issue 16). So both are
logged: the estimate is cheap and smooth, the decoded figure is the one users get.

The prompts are the first ``count`` validation samples (dataset order) with distinct prompts: the
tokens before each one's first response token. Decoding is greedy, ``tokens`` new tokens per prompt,
one batch, with the method's proposer around the drafter being trained and the full verify policy (every
drafted token is verified). Decoding is a higher layer than training, so the runtime registers itself here
(:data:`VALIDATION_DECODERS`, from ``decode/validation.py``, loaded by the CLI or the ``specdraft.plugins``
entry point) and training never imports it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from specdraft.registry import Registry
from specdraft.targets.base import Target

TEACHER_FORCED_ANCHORS = "uniform over response positions, target's own reply as context"
DECODED_ANCHORS = "wherever the previous round stopped (greedy decoding, full verification)"


@dataclass(frozen=True)
class ValidationDecoder:
    """Greedy decoding of token prompts with a drafter, full verification: what ``tau_decoded`` measures."""

    methods: Callable[[], list[str]]  # the drafter methods it has a proposer for
    # (drafter, method, target, prompts, new tokens) -> metrics with tau, rounds, output_tokens, position_acceptance
    decode: Callable[[Any, str, Target, list[list[int]], int], Any]


#: ``builtin`` -> the decoding runtime, registered by ``specdraft.decode.validation``.
VALIDATION_DECODERS: Registry[ValidationDecoder] = Registry("validation decoder")
BUILTIN_DECODER = "builtin"


@dataclass(frozen=True)
class DecodeProbe:
    """A fixed prompt set and generation length, decoded at every validation."""

    sample_ids: tuple[str, ...]
    prompts: tuple[tuple[int, ...], ...]
    tokens: int

    @classmethod
    def from_split(cls, token_rows: Sequence[tuple[Any, Any]], sample_ids: Sequence[str], *, count: int, tokens: int) -> "DecodeProbe":
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
        metrics = VALIDATION_DECODERS.get(BUILTIN_DECODER).decode(drafter, method, target, [list(p) for p in self.prompts], self.tokens)
        return {"tau": metrics.tau, "rounds": metrics.rounds, "prompts": len(self.prompts), "max_new_tokens": self.tokens,
                "tokens": metrics.output_tokens,
                "position_acceptance": [round(x, 6) for x in metrics.position_acceptance],
                "seconds": round(time.perf_counter() - started, 3)}


def unavailable_reason(method: str, target: Target) -> str | None:
    """Why decoded tau cannot be measured for this run (None when it can)."""
    if BUILTIN_DECODER not in VALIDATION_DECODERS:
        return "no decoding runtime is loaded (import specdraft.decode.validation)"
    known = VALIDATION_DECODERS.get(BUILTIN_DECODER).methods()
    if method not in known:
        return f"method {method!r} has no decoding proposer (known: {', '.join(known)})"
    if getattr(target, "model", None) is None:
        return "the target has no model to verify with"
    return None


def last_validation(metrics_path: Any) -> dict | None:
    """The newest validation record of a metrics.jsonl (None when the run never validated)."""
    import json
    from pathlib import Path

    path = Path(metrics_path)
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    return next((r for r in reversed(records) if r.get("split") == "val"), None)


def model_card(*, method: str, step: int, data: str, split: dict, validation: dict | None) -> str:
    """``final/MODEL_CARD.md``: what the drafter was trained on and both acceptance figures."""
    lines = [f"# {method} drafter trained by specdraft", "",
             f"- Training: {step} optimizer steps on `{data}`.",
             f"- Validation split (`split.json` in the run directory, hash `{split.get('hash')}`): {split.get('validation_samples')} of "
             f"{split.get('samples')} samples in {split.get('validation_groups_count')} whole conversations, val_fraction "
             f"{split.get('val_fraction')}, seed {split.get('seed')}; no conversation or prompt is on both sides.", ""]
    if validation is None:
        lines += ["No validation ran (val_fraction 0): no acceptance figures.", ""]
        return "\n".join(lines)
    lines += [f"## Acceptance at step {validation['step']}", "", "| estimate | tau | how |", "| --- | ---: | --- |"]
    if validation.get("tau_teacher_forced") is not None:
        lines.append(f"| teacher_forced | {validation['tau_teacher_forced']:.3f} | {validation.get('labels', '?')} labels, anchors "
                     f"{TEACHER_FORCED_ANCHORS} |")
    decoded = validation.get("decoded")
    if decoded:
        lines.append(f"| decoded | {decoded['tau']:.3f} | {decoded['prompts']} validation prompts x {decoded['max_new_tokens']} "
                     f"tokens, {decoded['rounds']} rounds; anchors {DECODED_ANCHORS} |")
    else:
        lines.append(f"| decoded | - | not measured ({validation.get('decoded_skipped', 'decode_prompts = 0')}) |")
    lines += ["", "The teacher-forced estimate anchors uniformly, decoding where each round stops; decoding rounds land more "
              "often in hard text, so expect the decoded tau to be the lower one. `specdraft eval` measures it on more prompts.", ""]
    return "\n".join(lines)
