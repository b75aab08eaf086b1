"""What a tracker backend is: one small class per backend, registered by its ``--report-to`` name in ``TRACKERS``.

A backend mirrors what a run already records (``metrics.jsonl``, the eval report): it is told the run once
(:class:`TrackedRun`), then given flat ``{name: number}`` metrics with a step, then closed. Its package is an optional
extra of the same name, imported only when the run asks for it (:func:`require`).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

from specdraft.errors import SpecdraftError, setting
from specdraft.registry import Registry
from specdraft.utils.io import atomic_write_json

#: The file in a run directory holding each backend's run identity (an MLflow run id, a W&B run id), so that a
#: resumed run continues the same tracker run.
STATE_FILE = "trackers.json"


@dataclass(frozen=True)
class TrackedRun:
    """The run a tracker mirrors."""

    directory: Path  # the run directory: local tracker files and ``STATE_FILE`` go here
    job: str  # what kind of run: "train" or "eval" (W&B job type, an MLflow tag)
    config: dict[str, Any] = field(default_factory=dict)  # the resolved config, logged as hyperparameters
    start_step: int = 0  # a resumed run's checkpoint step: what an earlier attempt logged past it is redone

    @property
    def name(self) -> str:
        """The run's name in a tracker's UI: its directory's name."""
        return self.directory.resolve().name

    def recall(self, backend: str) -> dict[str, Any]:
        """What ``backend`` remembered about this run (empty for a fresh run)."""
        path = self.directory / STATE_FILE
        if not path.is_file():
            return {}
        try:
            state = json.loads(path.read_text())
        except ValueError:
            raise SpecdraftError(f"{path} is not JSON; delete it to start new tracker runs") from None
        return dict(state.get(backend) or {})

    def remember(self, backend: str, state: dict[str, Any]) -> None:
        path = self.directory / STATE_FILE
        every = json.loads(path.read_text()) if path.is_file() else {}
        atomic_write_json(path, {**every, backend: state})


def hyperparameters(config: dict[str, Any], prefix: str = "") -> dict[str, str | int | float | bool]:
    """A nested config as flat scalar hyperparameters: ``model.block_size`` for nested keys; lists and nulls as text
    (every tracker's hyperparameter table takes scalars only)."""
    flat: dict[str, str | int | float | bool] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(hyperparameters(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value if isinstance(value, (str, int, float, bool)) else json.dumps(value)
    return flat


class Tracker(ABC):
    """One backend's run, open from construction until :meth:`close`."""

    package: ClassVar[str]  # the module the backend needs, imported when a run asks for it
    files: ClassVar[tuple[str, ...]] = ()  # entries the backend writes into the run directory

    def __init__(self, run: TrackedRun) -> None:
        self.run = run

    @abstractmethod
    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record ``metrics`` at ``step`` (the training step; 0 for a run's one summary)."""

    @abstractmethod
    def close(self, *, failed: bool) -> None:
        """Flush and end the tracker run, marked failed when the run raised."""


TRACKERS: Registry[type[Tracker]] = Registry("tracker")


def missing_package(module: str, extra: str, why: str) -> SpecdraftError:
    """The one-line error for a tracker whose package is missing, naming the extra that installs it."""
    return SpecdraftError(
        f"{setting('report_to')} {extra} needs the {module!r} package ({why}); install it with: pip install 'specdraft[{extra}]'"
    )


def check_installed(module: str, extra: str) -> None:
    """Refuse a tracker whose package is not installed, without importing it: configs check this when they are made,
    so a run (an eval's minutes of decoding) does not end in the error."""
    if importlib.util.find_spec(module) is None:
        raise missing_package(module, extra, "not installed")


def require(module: str, extra: str) -> ModuleType:
    """Import an optional tracker package, or fail in one line naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise missing_package(module, extra, str(exc)) from None
