"""The compute dtype, fp32 or bf16 autocast, or for ``auto`` the faster of the two for the caller's work here.

Whether bf16 pays depends on the machine (CPUs without native bf16 arithmetic run it many times slower than fp32,
AVX-512-BF16/AMX CPUs and GPUs faster), so ``auto`` times the work itself (a training step, a drafter's round) in
each dtype the device can run, once per machine, software and work (``tuning/measured.py``), and picks bf16 only
when it is clearly faster. fp32 is the exact one and the preferred.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specdraft.tuning.measured import Measurement, measured_choice


def candidates(device: torch.device) -> list[str]:
    """The dtypes worth timing on ``device`` (bf16 on CPUs always runs; on GPUs only where supported)."""
    from specdraft.utils.compute import COMPUTE_DTYPES

    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return ["fp32"]
    return list(COMPUTE_DTYPES)


def measure_dtype(
    name: str, context: dict[str, Any], seconds_in: Callable[[str], float], *, device: torch.device, cache_dir: Path | None = None
) -> Measurement:
    """The dtype whose ``seconds_in(dtype)`` (seconds of the caller's work in that dtype) was fastest on ``device``,
    fp32 unless bf16 is clearly faster; measured once per machine and ``context``, then cached."""
    timers: dict[str, Callable[[], float]] = {dtype: functools.partial(seconds_in, dtype) for dtype in candidates(device)}
    return measured_choice(name, context, timers, preferred="fp32", device=device, cache_dir=cache_dir)
