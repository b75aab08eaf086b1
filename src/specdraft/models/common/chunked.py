"""Row-chunked evaluation of LM-head losses.

A [tokens x vocab] logit matrix is the largest tensor in drafter training. ``chunked_rows`` runs
``fn`` on row chunks under activation checkpointing, so the forward keeps only one chunk's logits
alive and the backward recomputes them chunk by chunk instead of storing them all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint


def chunked_rows(fn: Callable[..., tuple[torch.Tensor, ...]], *rows: torch.Tensor, chunk_rows: int) -> tuple[torch.Tensor, ...]:
    """Apply ``fn`` to matching row chunks of ``rows`` (all [R, ...]) and concatenate its
    per-row outputs (each [r, ...]). ``chunk_rows <= 0`` means a single chunk."""
    total = rows[0].shape[0]
    step = total if chunk_rows <= 0 else chunk_rows
    outputs: list[tuple[torch.Tensor, ...]] = []
    needs_grad = torch.is_grad_enabled() and any(r.requires_grad for r in rows)
    for start in range(0, max(total, 1), max(step, 1)):
        part = tuple(r[start : start + step] for r in rows)
        if needs_grad:
            outputs.append(checkpoint(fn, *part, use_reentrant=False))
        else:
            outputs.append(fn(*part))
    return tuple(torch.cat(cols, dim=0) for cols in zip(*outputs))
