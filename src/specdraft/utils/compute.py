"""Compute dtypes by name and the autocast context each runs in: shared by training and drafting,
whose choice between them is measured (``utils/measured.py``), never fixed."""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

#: Compute dtypes by name; None runs in the parameters' own dtype (fp32).
COMPUTE_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}


def autocast(name: str, device: torch.device | str) -> ContextManager:
    """The context a step runs in for compute dtype ``name``."""
    dtype = COMPUTE_DTYPES[name]
    return torch.autocast(torch.device(device).type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def candidates(device: torch.device) -> list[str]:
    """The dtypes worth timing on ``device`` (bf16 on CPUs always runs; on GPUs only where supported)."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return ["fp32"]
    return list(COMPUTE_DTYPES)
