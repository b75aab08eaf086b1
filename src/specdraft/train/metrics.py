"""Training metrics: the learning-rate schedule, acceptance-length estimates and the JSONL log."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from specdraft.errors import SpecdraftError
from specdraft.models.base import TrainOutput
from specdraft.tracking import Trackers
from specdraft.utils.io import atomic_write_bytes


def lr_factor(step: int, *, total_steps: int, warmup_steps: int, min_ratio: float = 0.0) -> float:
    """Multiplier of the peak lr before optimizer step ``step`` (0-based): linear warm-up, then cosine.

    Warm-up rises as (step + 1) / warmup_steps so the first update is not wasted at lr 0; the cosine
    then falls from 1 at ``warmup_steps`` to ``min_ratio`` at ``total_steps``.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def expected_accept_length(cond_acc: torch.Tensor | list[float]) -> float:
    """tau = 1 + sum_k prod_{i<=k} a_i for per-position conditional acceptance a_i (bonus token included)."""
    a = torch.as_tensor(cond_acc, dtype=torch.float64)
    return float(1.0 + torch.cumprod(a, 0).sum()) if a.numel() else 1.0


class MetricSums:
    """Token/label-weighted sums of ``TrainOutput``s, reducible across processes as one tensor.

    Per-position accuracies are weighted by ``position_count`` so that averaging over batches
    (and ranks) gives the accuracy over all supervised labels, not a mean of means.
    """

    def __init__(self) -> None:
        self.batches = 0
        self.tokens = 0.0
        self.loss = 0.0
        self.terms: dict[str, float] = {}
        self.acc: torch.Tensor | None = None
        self.cond: torch.Tensor | None = None
        self.count: torch.Tensor | None = None

    def add(self, out: TrainOutput, tokens: int) -> None:
        self.batches += 1
        self.tokens += tokens
        self.loss += float(out.loss.detach())
        for k, v in out.metrics.items():
            self.terms[k] = self.terms.get(k, 0.0) + float(v)
        if out.position_acc is not None:
            count = (
                out.position_count.detach().double().cpu()
                if out.position_count is not None
                else torch.ones(len(out.position_acc), dtype=torch.float64)
            )
            acc = out.position_acc.detach().double().cpu() * count
            cond = (
                out.position_cond_acc.detach().double().cpu()
                if out.position_cond_acc is not None
                else out.position_acc.detach().double().cpu()
            ) * count
            if self.count is None:
                self.acc, self.cond, self.count = acc, cond, count
            else:
                assert self.acc is not None and self.cond is not None  # set together with count
                self.acc, self.cond, self.count = self.acc + acc, self.cond + cond, self.count + count

    def all_reduce(self, group: Any = None) -> None:
        """Sum over the processes of ``group`` (default: all; no-op without an initialised process group). A
        sequence-parallel run passes one rank of each sequence group: every rank of a group holds the whole sample's sums."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
            return
        keys = sorted(self.terms)
        k = 0 if self.count is None else len(self.count)
        flat = torch.tensor([self.batches, self.tokens, self.loss, *(self.terms[n] for n in keys)], dtype=torch.float64)
        if k:
            assert self.acc is not None and self.cond is not None and self.count is not None  # set together (k > 0)
            flat = torch.cat([flat, self.acc, self.cond, self.count])
        backend_device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        flat = flat.to(backend_device)
        dist.all_reduce(flat, group=group)
        flat = flat.cpu()
        self.batches, self.tokens, self.loss = int(flat[0]), float(flat[1]), float(flat[2])
        self.terms = {n: float(flat[3 + i]) for i, n in enumerate(keys)}
        if k:
            o = 3 + len(keys)
            self.acc, self.cond, self.count = flat[o : o + k], flat[o + k : o + 2 * k], flat[o + 2 * k :]

    def summary(self) -> dict[str, Any]:
        """Means per batch for losses; label-weighted position accuracies and their tau estimate.

        ``anchors`` = supervised labels at draft position 1: one per block for DFlash/DSpark, one per
        supervised token for EAGLE-3 (its step-0 predictions).
        """
        n = max(1, self.batches)
        out: dict[str, Any] = {"loss": self.loss / n, **{k: v / n for k, v in sorted(self.terms.items())}}
        if not math.isfinite(out["loss"]):
            # a NaN loss makes every figure of these batches meaningless (NaN logits score as misses: tau 1.0),
            # and NaN is no JSON number: the record says null rather than a tau
            return {**{k: (v if math.isfinite(v) else None) for k, v in out.items()}, "loss": None, "non_finite_loss": True}
        if self.count is not None:
            assert self.acc is not None and self.cond is not None  # set together with count
            denom = self.count.clamp_min(1.0)
            cond = (self.cond / denom).tolist()
            out["position_acc"] = [round(x, 6) for x in (self.acc / denom).tolist()]
            out["position_cond_acc"] = [round(x, 6) for x in cond]
            out["accept_len"] = expected_accept_length(cond)
            out["labels"] = int(self.count.sum())
            out["anchors"] = int(self.count[0])
        return out


def trained_labels(path: str | os.PathLike) -> int | None:
    """The supervised labels a run's training steps saw, summed over ``metrics.jsonl``'s train records (the whole
    run's: a resume cuts the log back to its checkpoint); None when the method reports no labels."""
    path = Path(path)
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    counts = [r["labels"] for r in records if r.get("split") == "train" and "labels" in r]
    return sum(counts) if counts else None


class MetricsLog:
    """``OUT/metrics.jsonl``: one JSON object per line, appended and flushed per record. ``mirror`` (the run's
    ``--report-to`` trackers) gets each record once it is on disk, and is closed with the log (as a context manager)."""

    def __init__(self, path: str | os.PathLike, mirror: Trackers | None = None):
        self.path = Path(path)
        self.mirror = mirror

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if self.mirror is not None:
            self.mirror.close(failed=exc_type is not None)

    def truncate_after(self, step: int) -> None:
        """Drop records past ``step`` (left by a run that died after its last checkpoint) before resuming.

        A run stopped by a full disk or a hard kill mid-append leaves its last line torn: that line is
        dropped too (it is past the checkpoint). A torn line anywhere else is damage, and refused, as is a
        line that is JSON but no record (not an object, or a ``step`` that is not an integer): the run's
        readers of this log would fail on it with a traceback.
        """
        if not self.path.is_file():
            return
        lines = [line for line in self.path.read_text().splitlines() if line.strip()]
        kept = []
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
            except ValueError:
                if number == len(lines):
                    break
                raise SpecdraftError(f"{self.path} line {number} is not a JSON record; delete or repair that line to resume") from None
            at = record.get("step", 0) if isinstance(record, dict) else None
            if not isinstance(at, int) or isinstance(at, bool):
                raise SpecdraftError(
                    f"{self.path} line {number} ({line[:60]}) is not a record (a JSON object whose 'step' is an "
                    "integer); delete or repair that line to resume"
                )
            if at <= step:
                kept.append(line)
        atomic_write_bytes(self.path, ("\n".join(kept) + "\n" if kept else "").encode())

    def write(self, record: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
        if self.mirror is not None:
            self.mirror.write(record)
