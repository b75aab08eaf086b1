"""TrackIO: its local store (``TRACKIO_DIR``, by default under the Hugging Face cache; ``trackio show`` opens it),
or the Space or server ``TRACKIO_SPACE_ID`` / ``TRACKIO_SERVER_URL`` name; the project is ``specdraft``."""

from __future__ import annotations

import secrets

from specdraft.tracking.base import TRACKERS, TrackedRun, Tracker, hyperparameters

PROJECT = "specdraft"


@TRACKERS.register("trackio")
class TrackioTracker(Tracker):
    """One TrackIO run per run directory. TrackIO resumes a run by its name, and its store is shared by every run
    directory, so the name is the directory's plus a random suffix, kept in ``OUT/trackers.json``."""

    package = "trackio"

    def __init__(self, run: TrackedRun) -> None:
        super().__init__(run)
        import trackio

        name = run.recall("trackio").get("name") or f"{run.name}-{secrets.token_hex(3)}"
        run.remember("trackio", {"name": name})
        # its CPU/GPU samplers are threads competing with training; the records carry peak RSS already
        self.trackio_run = trackio.init(
            project=PROJECT,
            name=name,
            config=hyperparameters(run.config),
            resume="allow",
            embed=False,
            auto_log_cpu=False,
            auto_log_gpu=False,
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.trackio_run.log(metrics, step=step)

    def close(self, *, failed: bool) -> None:
        self.trackio_run.finish()
