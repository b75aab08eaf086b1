"""A trained drafter's ``MODEL_CARD.md``: what it was trained on, and both acceptance figures of its last validation.

The teacher-forced estimate and the decoded tau (``decoded_tau.py``) anchor their drafts differently, so the card
names each one's anchors beside its figure. ``specdraft calibrate`` rewrites only the card's calibration section.
"""

from __future__ import annotations

import math
from typing import Any

TEACHER_FORCED_ANCHORS = "uniform over response positions, target's own reply as context"
DECODED_ANCHORS = "wherever the previous round stopped (greedy decoding, full verification)"


def last_validation(metrics_path: Any) -> dict | None:
    """The newest validation record of a metrics.jsonl (None when the run never validated)."""
    import json
    from pathlib import Path

    path = Path(metrics_path)
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    return next((r for r in reversed(records) if r.get("split") == "val"), None)


def model_card(*, method: str, step: int, data: str, split: dict, validation: dict | None) -> str:
    """``final/MODEL_CARD.md``: what the drafter was trained on and both acceptance figures. A figure that is not a
    finite number (a validation whose loss was NaN) is shown as such, never as a tau."""
    closest = (
        " (the fraction drew none of them: the conversations it would draw first were held out)" if split.get("held_out_closest") else ""
    )
    lines = [
        f"# {method} drafter trained by specdraft",
        "",
        f"- Training: {step} optimizer steps on `{data}`.",
        f"- Validation split (`split.json` in the run directory, hash `{split.get('hash')}`): {split.get('validation_samples')} of "
        f"{split.get('samples')} samples in {split.get('validation_groups_count')} whole conversations, val_fraction "
        f"{split.get('val_fraction')}, seed {split.get('seed')}{closest}; no conversation or prompt is on both sides.",
        "",
    ]
    if validation is None:
        why = "val_fraction 0" if not split.get("val_fraction") else f"{split.get('validation_samples')} held-out samples"
        lines += [f"No validation ran ({why}): no acceptance figures.", ""]
        return "\n".join(lines)
    lines += [f"## Acceptance at step {validation['step']}", "", "| estimate | tau | how |", "| --- | ---: | --- |"]
    if validation.get("loss") is None:
        lines.append("| teacher_forced | - | not a number: the validation loss was NaN or inf (see metrics.jsonl) |")
    elif validation.get("tau_teacher_forced") is not None:
        lines.append(
            f"| teacher_forced | {_tau(validation['tau_teacher_forced'])} | {validation.get('labels', '?')} labels, anchors "
            f"{TEACHER_FORCED_ANCHORS} |"
        )
    decoded = validation.get("decoded")
    if decoded:
        lines.append(
            f"| decoded | {_tau(decoded['tau'])} | {decoded['prompts']} validation prompts x {decoded['max_new_tokens']} "
            f"tokens, {decoded['rounds']} rounds; anchors {DECODED_ANCHORS} |"
        )
    else:
        lines.append(f"| decoded | - | not measured ({validation.get('decoded_skipped', 'decode_prompts = 0')}) |")
    lines += [
        "",
        "The teacher-forced estimate anchors uniformly, decoding where each round stops; decoding rounds land more "
        "often in hard text, so expect the decoded tau to be the lower one. `specdraft eval` measures it on more prompts.",
        "",
    ]
    return "\n".join(lines)


def _tau(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, (int, float)) and math.isfinite(value) else f"- (not a number: {value})"


CALIBRATION_HEADING = "## Confidence calibration"


def calibrated_card(card: str, stats: dict, *, data: str) -> str:
    """``card`` with its calibration section (re)written for what ``specdraft calibrate`` fitted (``stats``, as in
    ``calibration.json``). The rest stays: calibration changes only the confidence temperatures, not the drafts, so
    what the card says about training and acceptance is still true of the calibrated drafter."""
    kept = card.split("\n" + CALIBRATION_HEADING, 1)[0].rstrip("\n")  # a recalibration replaces the previous section
    temperatures = ", ".join(f"{t:.3f}" for t in stats["temperatures"])
    return (
        f"{kept}\n\n{CALIBRATION_HEADING}\n\n- Confidence temperatures {temperatures}, fitted by `specdraft calibrate` for "
        f"{stats['mode']} acceptance on {stats['blocks']} blocks of {stats['samples']} held-out samples of `{data}` "
        "(statistics in `calibration.json`).\n"
    )
