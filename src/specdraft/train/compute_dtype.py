"""The training compute dtype: fp32, bf16 autocast, or ``auto``, the faster of the two for this step here.

``auto`` times the real step (forward + backward of the drafter on a full synthetic batch of
``pack_tokens`` x ``batch_rows``) in each dtype the device can run, once per machine, software and
drafter configuration (``utils/measured.py``), and picks bf16 only when it is clearly faster: on an
AVX2-only CPU bf16 made DSpark training 13x slower, on AVX-512-BF16/AMX CPUs and GPUs it is faster.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from specdraft.models.base import DrafterBatch
from specdraft.train.step import train_step
from specdraft.utils.compute import candidates
from specdraft.utils.measured import Measurement, fastest_time, measured_choice

def synthetic_batch(*, rows: int, tokens: int, slots: int, hidden: int, vocab: int, seed: int = 0) -> DrafterBatch:
    """A full batch of one sample per row (a quarter prompt, the rest response) with random features:
    the work of a real step does not depend on the values."""
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


def measure_train_dtype(module: torch.nn.Module, batch: DrafterBatch, *, device: torch.device, context: dict[str, Any],
                        cache_dir: Path | None = None) -> Measurement:
    """Time :func:`step.train_step` of ``module`` (the step module, in training mode, no optimizer) on ``batch`` in each candidate dtype."""
    batch = batch.to(device)
    timers = {name: (lambda name=name: fastest_time(lambda: train_step(module, batch, dtype=name, device=device))) for name in candidates(device)}
    return measured_choice("train-dtype", context, timers, preferred="fp32", device=device, cache_dir=cache_dir)
