"""Compute dtypes by name and the autocast context each runs in: shared by training and drafting,
whose choice between them is measured (``tuning/dtype.py``), never fixed."""

from __future__ import annotations

import contextlib

import torch

#: Compute dtypes by name; None runs in the parameters' own dtype (fp32).
COMPUTE_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}


def parse_device(name: str) -> torch.device:
    """``torch.device(name)``, refused with a ``SpecdraftError`` when it is malformed or not on this machine
    (torch's own errors are bare RuntimeErrors/AssertionErrors, raised only when a model is first moved)."""
    from specdraft.errors import SpecdraftError, setting

    flag = setting("device")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise SpecdraftError(f"{flag} {name!r} is not a device ({exc}); use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        have = f"{torch.cuda.device_count()} CUDA device(s)" if torch.cuda.is_available() else "no CUDA"
        raise SpecdraftError(f"{flag} {name}: this machine has {have}; use cpu or an existing cuda:N")
    if device.type not in ("cpu", "cuda"):
        raise SpecdraftError(f"{flag} {name}: specdraft runs on cpu or cuda")
    return device


def autocast(name: str, device: torch.device | str) -> contextlib.AbstractContextManager:
    """The context a step runs in for compute dtype ``name``."""
    dtype = COMPUTE_DTYPES[name]
    return torch.autocast(torch.device(device).type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
