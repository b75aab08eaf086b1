"""One training step, public so that the trainer, the dtype/thread probes and the benchmarks time and
run the same work: forward in the compute dtype, backward, clip, optimizer update.

``StepModule`` wraps a drafter so DDP/FSDP hooks see the call (``forward`` is ``training_forward``);
every RNG is reseeded per step by the caller (``reseed(batches.step_seed(...))``), which is what makes a
resumed run draw exactly what an uninterrupted one draws.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from specdraft.models.base import DrafterBatch, DrafterModel, TrainOutput
from specdraft.models.common.sequence import SequenceShard
from specdraft.tuning.dtype import measure_dtype
from specdraft.tuning.measured import Measurement, fastest_time
from specdraft.utils.compute import autocast


class StepModule(nn.Module):
    """Routes ``forward`` to ``training_forward`` so DDP/FSDP hooks see the call."""

    def __init__(self, drafter: DrafterModel):
        super().__init__()
        self.drafter = drafter

    def forward(self, batch: DrafterBatch, shard: SequenceShard | None = None) -> TrainOutput:
        """``shard``: this rank's part of a sequence-parallel group (``train/sequence_parallel.py``); None: the whole row."""
        if shard is None:
            return self.drafter.training_forward(batch)
        return self.drafter.training_forward(batch, shard)  # type: ignore[call-arg]  # the families with sequence_halo()


@dataclass
class StepOutput:
    output: TrainOutput  # the forward's output (loss terms and metrics; ``MetricSums.add`` reads it)
    loss: float
    grad_norm: float | None  # before clipping; None when clipping is off


def train_step(
    module: nn.Module,
    batch: DrafterBatch,
    *,
    dtype: str,
    device: torch.device,
    optimizer: torch.optim.Optimizer | None = None,
    grad_clip: float = 0.0,
    check: Callable[[float, float | None], None] | None = None,
    shard: SequenceShard | None = None,
) -> StepOutput:
    """Forward ``batch`` through ``module`` (a ``StepModule``, possibly wrapped) under ``dtype``, backward,
    clip to ``grad_clip`` (0 = off) and, given an ``optimizer``, update. ``check(loss, grad_norm)`` runs
    before the update and may raise (the trainer refuses non-finite steps there, so nothing bad is applied).
    Without an optimizer the gradients are cleared afterwards and the parameters stay as they were: the
    unit of work the dtype and thread probes time. ``shard``: a sequence-parallel rank's (``StepModule.forward``)."""
    with autocast(dtype, device):
        output = module(batch, shard)
    (optimizer if optimizer is not None else module).zero_grad(set_to_none=True)
    output.loss.backward()
    grad_norm = clip_gradients(module, grad_clip)
    loss = float(output.loss.detach())
    if check is not None:
        check(loss, grad_norm)
    if optimizer is not None:
        optimizer.step()
    else:
        module.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return StepOutput(output, loss, grad_norm)


def clip_gradients(module: nn.Module, max_norm: float) -> float | None:
    """Clip the global gradient norm of ``module`` to ``max_norm`` (0 = off); returns the norm before clipping."""
    if not max_norm:
        return None
    params = [p for p in module.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
        norm = norm.full_tensor()
    return float(norm)


def build_optimizer(
    module: nn.Module, *, name: str, lr: float, betas: Sequence[float], weight_decay: float, device: torch.device
) -> torch.optim.Optimizer:
    """The optimizer ``name`` (``train/optimizers.py``) over ``module``'s trainable parameters."""
    from specdraft.train.optimizers import OPTIMIZERS

    return OPTIMIZERS.get(name)(module, lr=lr, betas=tuple(betas), weight_decay=weight_decay, fused_loops=device.type == "cuda")


def reseed(value: int) -> None:
    """Seed every RNG a step may draw from (torch, ``random``, numpy)."""
    torch.manual_seed(value)
    random.seed(value)
    np.random.seed(value % (2**32))


def synthetic_batch(*, rows: int, tokens: int, slots: int, hidden: int, vocab: int, seed: int = 0) -> DrafterBatch:
    """A full batch of one sample per row (a quarter prompt, the rest response) with random features, for the probes
    that time a step: the work of a real step does not depend on the values."""
    g = torch.Generator().manual_seed(seed)
    loss_mask = torch.ones(rows, tokens, dtype=torch.bool)
    loss_mask[:, : tokens // 4] = False
    return DrafterBatch(
        token_ids=torch.randint(0, vocab, (rows, tokens), generator=g),
        loss_mask=loss_mask,
        segment_ids=torch.zeros(rows, tokens, dtype=torch.int32),
        position_ids=torch.arange(tokens).expand(rows, tokens).clone(),
        aux_hidden=torch.randn(rows, tokens, slots, hidden, generator=g),
        last_hidden=torch.randn(rows, tokens, hidden, generator=g),
    )


def measure_train_dtype(
    module: nn.Module, batch: DrafterBatch, *, device: torch.device, context: dict[str, Any], cache_dir: Path | None = None
) -> Measurement:
    """The compute dtype whose :func:`train_step` of ``module`` (the step module, in training mode, no optimizer) on
    ``batch`` ran fastest here (``tuning/dtype.py``)."""
    batch = batch.to(device)
    return measure_dtype(
        "train-dtype",
        context,
        lambda dtype: fastest_time(lambda: train_step(module, batch, dtype=dtype, device=device)),
        device=device,
        cache_dir=cache_dir,
    )
