"""TensorBoard: event files under ``OUT/tensorboard`` (``tensorboard --logdir OUT/tensorboard``)."""

from __future__ import annotations

from specdraft.tracking.base import TRACKERS, TrackedRun, Tracker, hyperparameters

LOGDIR = "tensorboard"


@TRACKERS.register("tensorboard")
class TensorBoardTracker(Tracker):
    """Scalars through torch's ``SummaryWriter``, the config through the HParams plugin, into one logdir per run
    directory: a resumed run writes into the same logdir, and events an earlier attempt logged past the resumed
    checkpoint are purged (``purge_step``), as ``metrics.jsonl`` drops its records past it."""

    package = "tensorboard"
    files = (LOGDIR,)

    def __init__(self, run: TrackedRun) -> None:
        super().__init__(run)
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        logdir = run.directory / LOGDIR
        purge = run.start_step + 1 if logdir.is_dir() else None  # the records up to the checkpoint stay
        self.writer = SummaryWriter(log_dir=str(logdir), purge_step=purge)
        file_writer = self.writer.file_writer
        assert file_writer is not None  # SummaryWriter opens its file writer as it is made
        for summary in hparams(hyperparameters(run.config), {}):
            file_writer.add_summary(summary)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, global_step=step)

    def close(self, *, failed: bool) -> None:
        self.writer.close()
