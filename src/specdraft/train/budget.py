"""Fitting a training run to a wall-clock budget.

The LR schedule (warm-up + cosine) is planned in steps, so a run meant to take T seconds must be
given T / (seconds per step) steps: stopping a longer schedule at T would end at a high learning
rate. ``probe_steps`` times a few real steps of the exact configuration here; tuning reads the step
time off the probe's log and plans the steps (``tuning/budget_probes.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from specdraft.errors import SpecdraftError, setting
from specdraft.targets.base import Target
from specdraft.tuning.budget_probes import median_record, seconds_per_step, steps_in_budget

log = logging.getLogger(__name__)


def epoch_steps(cfg: Any) -> int:
    """Steps of ``cfg.epochs`` passes over the training split of ``cfg.data`` (one process): what
    ``train`` runs when ``max_steps`` is 0."""
    from specdraft.train.batches import DataPlan, open_sample_source
    from specdraft.train.split import dataset_split

    dataset = open_sample_source(cfg)
    split = dataset_split(dataset, val_fraction=cfg.val_fraction, seed=cfg.split_seed)
    return DataPlan.for_run(dataset, split, cfg).total_steps(cfg.epochs)


#: The share of its seconds that a budgeted training run plans steps in: validation, checkpoints and step-time drift
#: take the rest.
HEADROOM = 0.9


def probe_training(cfg: Any, *, target: Target | None = None, probe_steps: int = 4) -> dict:
    """Time ``probe_steps`` real steps of ``cfg`` (a TrainConfig) in a scratch directory (evaluation and checkpoints off,
    nothing kept): the median step's seconds, anchors/s, the compute dtype it settled (``dtype: auto`` times the step in
    each, once per machine, then cached) and the probe's own wall seconds."""
    from specdraft.train.trainer import train

    scratch = Path(tempfile.mkdtemp(prefix="specdraft-probe-"))
    started = time.monotonic()
    try:
        probe = dataclasses.replace(
            cfg, out=str(scratch / "run"), max_steps=probe_steps, max_time=0, eval_interval=0, checkpoint_interval=0, log_interval=1
        )
        result = train(probe, target=target)
        per_step = seconds_per_step(scratch / "run" / "metrics.jsonl")
        anchors_per_s = median_record(scratch / "run" / "metrics.jsonl", "anchors_per_s")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "seconds_per_step": per_step,
        "anchors_per_s": anchors_per_s,
        "dtype": result.compute_dtype,
        "dtype_probe": result.dtype_probe,
        "probe_seconds": time.monotonic() - started,
    }


def steps_for_budget(
    cfg: Any,
    budget_seconds: float,
    *,
    target: Target | None = None,
    probe_steps: int = 4,
    headroom: float = HEADROOM,
    cap_at_epochs: bool = False,
) -> dict:
    """Steps that fill ``budget_seconds`` of training with ``cfg`` (a TrainConfig), timed by a short
    probe run (:func:`probe_training`).

    The probe is a real run of the configuration, so with ``dtype: auto`` it also settles the compute
    dtype and times the steps in it: a machine where a step is slow gets fewer steps, a complete schedule, rather than
    a cut one. The probe's own time comes out of the budget, and only ``headroom`` of the rest is planned.
    ``cap_at_epochs``: no more than ``cfg.epochs`` passes over the data even when time would allow
    more (on a small dataset further passes only overfit; the run then ends before its budget).
    """
    if budget_seconds <= 0:
        raise SpecdraftError(
            f"no time left for training ({budget_seconds:.0f} s of the budget after the stages before it); "
            f"raise {setting('budget')} (a rerun keeps the finished stages)"
        )
    probe = probe_training(cfg, target=target, probe_steps=probe_steps)
    per_step = probe["seconds_per_step"]
    train_seconds = budget_seconds - probe["probe_seconds"]
    steps = steps_in_budget(train_seconds, per_step, headroom=headroom)
    if steps < 1:
        log.warning(
            "a training step takes %.1f s in %s but only %.0f s are left for training: planning 1 step; raise the budget "
            "or lower --pack-tokens",
            per_step,
            probe["dtype"],
            max(train_seconds, 0.0),
        )
    facts = {
        "seconds_per_step": per_step,
        "train_seconds": train_seconds,
        "steps": max(steps, 1),
        "budget_short": steps < 1,
        "dtype": probe["dtype"],
        "dtype_probe": probe["dtype_probe"],
        "anchors_per_s": probe["anchors_per_s"],
        "steps_per_epoch": epoch_steps(dataclasses.replace(cfg, epochs=1)),
    }
    if cap_at_epochs:
        facts["epoch_steps"] = epoch_steps(cfg)
        facts["steps"] = min(facts["steps"], facts["epoch_steps"])
    return facts
