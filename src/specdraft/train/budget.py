"""Fitting a training run to a wall-clock budget.

The LR schedule (warm-up + cosine) is planned in steps, so a run meant to take T seconds must be
given T / (seconds per step) steps: stopping a longer schedule at T would end at a high learning
rate. ``probe_steps`` times a few real steps of the exact configuration to get that figure.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
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


def epoch_steps(cfg: Any) -> int:
    """Steps of ``cfg.epochs`` passes over the training split of ``cfg.data`` (one process): what
    ``train`` runs when ``max_steps`` is 0."""
    from specdraft.train.data import DataPlan, open_sample_source
    from specdraft.train.split import dataset_split
    from specdraft.train.trainer import sample_lengths

    dataset = open_sample_source(cfg)
    split = dataset_split(dataset, val_fraction=cfg.val_fraction, seed=cfg.split_seed)
    plan = DataPlan.build(list(dataset.sample_ids), sample_lengths(dataset), split=split,
                          pack_tokens=cfg.pack_tokens, batch_rows=cfg.batch_rows, seed=cfg.seed)
    return plan.total_steps(cfg.epochs)


def steps_for_budget(cfg: Any, budget_seconds: float, *, target: Any = None, probe_steps: int = 4, min_steps: int = 8,
                     cap_at_epochs: bool = False) -> dict:
    """Steps that fill ``budget_seconds`` of training with ``cfg`` (a TrainConfig), timed by a short
    probe run in a scratch directory (evaluation and checkpoints off, nothing kept).

    ``cap_at_epochs``: no more than ``cfg.epochs`` passes over the data even when time would allow
    more (on a small dataset further passes only overfit; the run then ends before its budget).
    """
    from specdraft.train.trainer import train

    if budget_seconds <= 0:
        raise SpecdraftError(f"no time left for training (budget {budget_seconds:.0f} s); raise the budget")
    scratch = Path(tempfile.mkdtemp(prefix="specdraft-probe-"))
    try:
        probe = dataclasses.replace(cfg, out=str(scratch / "run"), max_steps=probe_steps, max_time=0, eval_interval=0,
                                    checkpoint_interval=0, log_interval=1)
        train(probe, target=target)
        per_step = seconds_per_step(scratch / "run" / "metrics.jsonl")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    facts = {"seconds_per_step": per_step, "train_seconds": budget_seconds, "steps": max(min_steps, int(budget_seconds / per_step))}
    if cap_at_epochs:
        facts["epoch_steps"] = epoch_steps(cfg)
        facts["steps"] = min(facts["steps"], facts["epoch_steps"])
    return facts
