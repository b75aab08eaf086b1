"""The training loop: steps until the schedule ends or something asks to stop, with logging,
validation, stopping and checkpointing as hooks, so the loop reads in one screen and each concern
is tested and changed on its own (``trainer.py`` builds the parts and the hooks).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specdraft.train.metrics import MetricsLog, MetricSums
from specdraft.train.step import StepOutput
from specdraft.train.strategies import TrainState
from specdraft.utils.memory import peak_rss_mb

log = logging.getLogger(__name__)


@dataclass
class StepDone:
    """What the logging hook learns of one step."""

    result: StepOutput
    tokens: int  # real (unpadded) tokens in the batch
    lr: float  # the rate the update used
    seconds: float = 0.0  # the whole step: reading, collating, forward, backward, update (``fit`` times it)
    fetch_seconds: float = 0.0  # of which reading samples (waiting for them, when they are streamed)
    row_tokens: int = 0  # the batch's longest row (real tokens): the context one row's attention spans


@dataclass
class FitHooks:
    """What ``fit`` calls after each step, in this order; each hook decides whether it is due."""

    step: Callable[[TrainState, list], StepDone]  # one step on the samples read (advances the state)
    read: Callable[[int], list]  # the samples of a step, rows of dataset items
    log: Callable[[TrainState, StepDone], dict | None]  # the record written, if one was due
    validate: Callable[[TrainState], Any]
    stop: Callable[[TrainState, int | None], str | None]  # why to stop now, a checkpoint saved (given the signal received), or None
    checkpoint: Callable[[TrainState], Any]


def fit(state: TrainState, total_steps: int, hooks: FitHooks, *, desc: str, show_progress: bool) -> tuple[str | None, int | None]:
    """Train from ``state.step`` to ``total_steps``; returns (what stopped it early, the signal number)."""
    from tqdm.auto import tqdm

    stopped_by = None
    state.module.train()
    bar = tqdm(total=total_steps, initial=state.step, desc=desc, unit="step", disable=not show_progress, dynamic_ncols=True)
    with _StopFlag() as flag, bar:
        while state.step < total_steps:
            started = time.perf_counter()
            items = hooks.read(state.step)
            fetched = time.perf_counter() - started
            done = hooks.step(state, items)
            done.seconds, done.fetch_seconds = time.perf_counter() - started, fetched
            bar.update(1)
            record = hooks.log(state, done)
            if record:
                bar.set_postfix(
                    loss=f"{record['loss']:.4f}", tau=f"{record.get('accept_len', 0):.2f}", tok_s=f"{record['tokens_per_s']:.0f}"
                )
            hooks.validate(state)
            stopped_by = hooks.stop(state, flag.signal)
            if stopped_by:
                break
            hooks.checkpoint(state)
    return stopped_by, flag.signal


class TrainLog:
    """The logging hook: sums every ``interval`` steps (and the last) into one ``metrics.jsonl`` record
    with throughput, the longest row since the last record and the process's peak resident memory so far (what
    long samples cost), also shown on the progress bar."""

    def __init__(
        self,
        metrics: MetricsLog,
        *,
        interval: int,
        total_steps: int,
        locate: Callable[[int], tuple[int, int]],
        context: dict,
        main: bool,
        group: Any = None,
    ):
        """``context`` goes into every record after step and epoch (compute dtype, threads); ``group``: the processes
        whose sums add up to the step's (``MetricSums.all_reduce``; default all)."""
        self.metrics, self.interval, self.total_steps, self.locate = metrics, interval, total_steps, locate
        self.context, self.main, self.group = context, main, group
        self.sums, self.seconds, self.fetch_seconds = MetricSums(), 0.0, 0.0  # since the last record (eval/checkpoints excluded)
        self.row_tokens = 0

    def __call__(self, state: TrainState, done: StepDone) -> dict | None:
        self.sums.add(done.result.output, done.tokens)
        self.seconds += done.seconds
        self.fetch_seconds += done.fetch_seconds
        self.row_tokens = max(self.row_tokens, done.row_tokens)
        step = state.step
        if step % self.interval and step != self.total_steps:
            return None
        self.sums.all_reduce(self.group)
        epoch, _ = self.locate(step - 1)
        seconds = max(self.seconds, 1e-9)
        record = {
            "split": "train",
            "step": step,
            "epoch": epoch,
            **self.context,
            "lr": done.lr,
            "grad_norm": done.result.grad_norm,
            **self.sums.summary(),
            "tokens": self.sums.tokens,
            "tokens_per_s": self.sums.tokens / seconds,
            "seconds": self.seconds,
            "fetch_fraction": self.fetch_seconds / seconds,
            "row_tokens": self.row_tokens,
            "peak_rss_mb": round(peak_rss_mb()),
        }
        if "anchors" in record:
            record["anchors_per_s"] = record["anchors"] / seconds
        if self.main:
            self.metrics.write(record)
        self.sums, self.seconds, self.fetch_seconds, self.row_tokens = MetricSums(), 0.0, 0.0, 0
        return record


class _StopFlag:
    """SIGINT/SIGTERM set a flag checked after each step; a second SIGINT interrupts at once."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _StopFlag:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = signum
        log.warning("received %s: saving a checkpoint after this step", signal.Signals(signum).name)

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
