"""Weights & Biases: offline under ``OUT/wandb`` (``wandb sync OUT/wandb/offline-run-*`` uploads it) unless
``WANDB_MODE`` says otherwise; the project is ``WANDB_PROJECT``, else ``specdraft``."""

from __future__ import annotations

import os
import secrets

from specdraft.tracking.base import TRACKERS, TrackedRun, Tracker, hyperparameters

PROJECT = "specdraft"


@TRACKERS.register("wandb")
class WandbTracker(Tracker):
    """One W&B run per run directory: its id is kept in ``OUT/trackers.json``, and a resumed run reopens it
    (``resume="allow"``; offline, each attempt is a directory of the same run id, which ``wandb sync`` joins)."""

    package = "wandb"
    files = ("wandb",)

    def __init__(self, run: TrackedRun) -> None:
        super().__init__(run)
        import wandb

        run_id = run.recall("wandb").get("id") or secrets.token_hex(4)  # W&B ids: 8 lowercase letters/digits
        run.remember("wandb", {"id": run_id})
        self.wandb_run = wandb.init(
            dir=str(run.directory),
            id=run_id,
            resume="allow",
            name=run.name,
            job_type=run.job,
            config=hyperparameters(run.config),
            project=None if "WANDB_PROJECT" in os.environ else PROJECT,
            mode=None if "WANDB_MODE" in os.environ else "offline",
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.wandb_run.log(metrics, step=step)

    def close(self, *, failed: bool) -> None:
        self.wandb_run.finish(exit_code=1 if failed else 0)
