"""Run tracking (``--report-to``, Hugging Face Trainer's convention): mirror a run's records to experiment trackers.

``metrics.jsonl`` stays the record; the trackers named in ``--report-to`` (a comma list of ``TRACKERS`` names, or
``none``) get each record as it is written, flattened to numbers under the record's split (:func:`record_metrics`:
``train/loss``, ``train/position_acc/1``, ``val/tau_decoded``, ``val/decoded/tau``) at the record's step, and the
resolved config as hyperparameters. Every backend stays local unless its own environment variable points elsewhere:
TensorBoard under ``OUT/tensorboard``, MLflow in ``OUT/mlflow.db`` (``MLFLOW_TRACKING_URI``), W&B in offline mode under
``OUT/wandb`` (``WANDB_MODE``), TrackIO in its local store (``TRACKIO_DIR``; ``TRACKIO_SPACE_ID``). A resumed run
continues the same tracker run: the run ids are kept in ``OUT/trackers.json``.
"""

from __future__ import annotations

import math
from types import TracebackType
from typing import Any

from specdraft.errors import SpecdraftError, setting
from specdraft.tracking import mlflow, tensorboard, trackio, wandb  # noqa: F401  (register the backends)
from specdraft.tracking.base import STATE_FILE, TRACKERS, TrackedRun, Tracker, check_installed, require

__all__ = [
    "NONE",
    "STATE_FILE",
    "TRACKERS",
    "TrackedRun",
    "Tracker",
    "Trackers",
    "check_report_to",
    "local_files",
    "open_trackers",
    "record_metrics",
]

#: The ``--report-to`` value that names no tracker (the default).
NONE = "none"


def check_report_to(names: list[str]) -> list[str]:
    """The trackers ``names`` asks for, each a registered backend once and installed; ``none`` (alone) or nothing is
    none."""
    if names == [NONE]:
        return []
    choices = ", ".join([NONE, *TRACKERS.names()])
    for name in names:
        if name not in TRACKERS.names():
            hint = " (alone: it means no tracker)" if name == NONE else ""
            raise SpecdraftError(
                f"{setting('report_to')}: unknown tracker {name!r}{hint}; choose from {choices}, "
                "several as a comma list (tensorboard,mlflow)"
            )
    wanted = list(dict.fromkeys(names))
    for name in wanted:
        check_installed(TRACKERS.get(name).package, name)
    return wanted


def local_files() -> tuple[str, ...]:
    """Every entry a backend may write into a run directory (a directory replaced whole must recognise them)."""
    return (STATE_FILE, *sorted({f for name in TRACKERS.names() for f in TRACKERS.get(name).files}))


def record_metrics(record: dict[str, Any]) -> dict[str, float]:
    """A ``metrics.jsonl`` record as flat numbers under its split: nested mappings join their keys with ``/``, lists of
    numbers (per-position accuracies) are numbered from 1 (draft position k), and text, flags and nulls are left out
    (the record keeps them)."""
    split = str(record.get("split", "run"))
    return _numbers({k: v for k, v in record.items() if k not in ("split", "step")}, f"{split}/")


def _numbers(values: dict[str, Any], prefix: str) -> dict[str, float]:
    flat: dict[str, float] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_numbers(value, name + "/"))
        elif isinstance(value, (list, tuple)):
            flat.update(_numbers({str(i): v for i, v in enumerate(value, 1)}, name + "/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            flat[name] = float(value)
    return flat


class Trackers:
    """The trackers one run mirrors to, closed together (a context manager: closed as failed when the run raises)."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    def write(self, record: dict[str, Any]) -> None:
        """Mirror one ``metrics.jsonl`` record at its step."""
        self.log(record_metrics(record), step=int(record.get("step", 0)))

    def log(self, metrics: dict[str, float], step: int) -> None:
        if metrics:
            for tracker in self.trackers:
                tracker.log(metrics, step)

    def close(self, *, failed: bool = False) -> None:
        for tracker in self.trackers:
            tracker.close(failed=failed)
        self.trackers = []

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close(failed=exc_type is not None)


def open_trackers(names: list[str], run: TrackedRun) -> Trackers:
    """Open a tracker run per name. Every package is imported first, so a missing one fails before any tracker run
    is created; a backend that fails to open closes those opened before it."""
    wanted = check_report_to(names)
    classes = [TRACKERS.get(name) for name in wanted]
    for name, cls in zip(wanted, classes):
        require(cls.package, name)
    opened = Trackers([])
    try:
        for cls in classes:
            opened.trackers.append(cls(run))
    except BaseException:
        opened.close(failed=True)
        raise
    return opened
