"""Validation during training: the teacher-forced pass over the held-out batches and, with a decode probe, the
decoded tau (rank 0), one ``metrics.jsonl`` record per validation.

Held apart from the trainer's loop because it is the one place the run scores what it has learned, and the
benchmarks score other held-out sets through the same ``teacher_forced`` pass.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from specdraft.models.base import DrafterBatch, TrainOutput
from specdraft.targets.base import Target
from specdraft.train.batches import WHOLE, RowWindow, SampleSource, collate, row_lengths, step_seed
from specdraft.train.metrics import MetricsLog, MetricSums
from specdraft.train.model_card import TEACHER_FORCED_ANCHORS
from specdraft.train.plan import RunPlan
from specdraft.train.sequence_parallel import SequenceGroups
from specdraft.train.step import reseed
from specdraft.train.strategies import Checkpointer, TrainState
from specdraft.utils.compute import autocast

#: The step-seed kind of validation passes (``batches.step_seed``): their RNG streams never meet training's.
EVAL_SEED_KIND = 1


class Validation:
    """The validation hook: the teacher-forced pass over the validation batches and, with a decode probe,
    the decoded tau (rank 0), written to ``metrics.jsonl``."""

    def __init__(
        self,
        run: RunPlan,
        dataset: SampleSource,
        target: Target,
        checkpointer: Checkpointer,
        metrics_log: MetricsLog,
        device: torch.device,
        compute_dtype: str,
        sequence: SequenceGroups,
        *,
        max_batches: int,
        sample_tokens: int,
        round_width: bool,
        seed: int,
    ):
        self.run, self.dataset, self.target, self.checkpointer, self.metrics_log = run, dataset, target, checkpointer, metrics_log
        self.device, self.compute_dtype, self.sequence = device, compute_dtype, sequence
        self.batches, self.sample_tokens, self.round_width, self.seed = run.data.val_batches(max_batches), sample_tokens, round_width, seed

    def __call__(self, state: TrainState) -> dict | None:
        dist_ = self.checkpointer.dist
        state.module.eval()
        sums = teacher_forced(
            lambda own: state.module(*self.sequence.split(own)),
            self.dataset,
            self.batches,
            sample_tokens=self.sample_tokens,
            round_width=self.round_width,
            slot_index=self.run.slot_index,
            device=self.device,
            compute_dtype=self.compute_dtype,
            where=self.run.where,
            seed=step_seed(self.seed, dist_.data_rank, state.step, EVAL_SEED_KIND),
            agree=functools.partial(dist_.any, device=self.device),
            window=self.sequence.window,
        )
        sums.all_reduce(self.sequence.data_group)
        if not sums.batches:
            state.module.train()
            return None
        record = {"split": "val", "step": state.step, **sums.summary()}
        record.update(tau_teacher_forced=record.get("accept_len"), teacher_forced_anchors=TEACHER_FORCED_ANCHORS)
        if self.run.probe is not None:
            module = self.checkpointer.current_drafter(state)  # a collective under FSDP
            if dist_.main:
                record["decoded"] = self.run.probe.run(module, self.run.method, self.target)
                record["tau_decoded"] = record["decoded"]["tau"]
            dist_.barrier()
        elif self.run.probe_skipped:
            record["decoded_skipped"] = self.run.probe_skipped
        state.module.train()
        if dist_.main:
            self.metrics_log.write(record)
        return record


def teacher_forced(
    forward: Callable[[DrafterBatch], TrainOutput],
    dataset: SampleSource,
    batches: list[list[list[int]]],
    *,
    sample_tokens: int,
    slot_index: list[int] | None,
    device: torch.device | str,
    compute_dtype: str,
    seed: int,
    round_width: bool = False,
    where: str = "the hidden-state store",
    agree: Callable[[bool], bool] | None = None,
    window: RowWindow = WHOLE,
) -> MetricSums:
    """The validation pass's teacher-forced sums (``accept_len`` = ``tau_teacher_forced``) over ``batches``
    (``DataPlan.val_batches``), every RNG seeded with ``seed`` first. ``forward`` is the step module or a
    drafter's ``training_forward``, already in eval mode (uniform anchors); the benchmarks score other
    held-out sets through this same pass. The caller all-reduces across processes; ``agree`` (``Dist.any``) lets every
    process refuse a batch with non-finite hidden states when any one holds one (``collate``). ``window``: the shard of
    each row this process collates (a sequence-parallel rank's; ``forward`` then trains through ``shard_sample``);
    the token counts are the whole rows'."""
    sums = MetricSums()
    reseed(seed)
    with torch.no_grad():
        for rows in batches:
            items = [[dataset[i] for i in row] for row in rows]
            batch = collate(
                items,
                sample_tokens=sample_tokens,
                round_width=round_width,
                slot_index=slot_index,
                where=where,
                agree=agree,
                window=window,
            ).to(device)
            tokens = sum(row_lengths(items, sample_tokens))
            del items
            with autocast(compute_dtype, device):
                sums.add(forward(batch), tokens)
    return sums
