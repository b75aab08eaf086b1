"""Sequence parallelism for drafter training (DFlash, DFlash2, DSpark, EAGLE-3): one long sample split across N ranks.

Each rank of a sequence group holds 1/N of the sample's rows: its hidden states (``aux_hidden``, the bulk of the
memory) and the tokens, labels and ``last_hidden`` of its rows. What a draft block needs from other rows:

1. **Context K/V.** A block attends to every context key of its segment before its anchor. Each rank projects its
   own rows' context features to K/V per draft layer and the group all-gathers them
   (``GatherRows``: its backward reduce-scatters the gradient, so the K/V
   projections of rank r learn from the blocks of every rank). The blocks then attend with the global positions
   and mask (``models/common/masks.anchor_block_mask``), the same computation as one process.
2. **A halo.** A block anchored on row a reads tokens and labels up to a + ``sequence_halo()`` (B-1 for DFlash,
   B for DSpark) and, for DSpark's L1 term and DFlash2's KL, ``last_hidden`` to a + B - 1. Each rank appends the
   first ``halo`` rows of the next rank (the last rank: padding), so blocks on both sides of a shard boundary
   are exact.
3. **The row's metadata.** Anchor sampling reads the whole row's segment ids and loss mask (ints, not hidden
   states): every rank draws the whole row's anchors with the same generator state, then keeps its own: the
   anchors one process draws. The ``predictable`` sampler's scores are computed by the rank owning the row and
   summed over the group.
4. **The loss normaliser.** Each weighted mean's numerator and weight sum are summed over the group
   (autograd-aware ``all_reduce``), so every rank's loss is the whole sample's, as at N = 1.

Gradients: every rank backpropagates the same global loss; the all-reduce's backward sums the N copies, so the
gradients summed over the group are N x the one-process gradient and their **mean** (what DDP's all-reduce takes,
over data x sequence ranks alike) is exactly it. Tested in ``tests/test_sequence_parallel.py``.

Why all-gather, not a ring or Ulysses: the queries are the anchor blocks (at most ``max_anchors`` x B rows per
sample), tiny next to the T context keys, and each block's attention is one masked SDPA over keys < its anchor.
All-gather sends each rank (N-1)/N of the context K/V once per layer, 2 x G x E values per row: for a
7168-wide target at 5 slots that is ~1/18 of the hidden states a rank no longer holds. A ring sends the same bytes
in N-1 steps to overlap them with compute and never holds the whole K/V, but needs an online-softmax merge across
steps (results equal only up to rounding, and a causal-by-anchor mask loads the ring unevenly); Ulysses
all-to-alls Q, K, V and the output per layer by head, which caps N at the drafter's K/V heads (GQA: often 8 or
fewer) and moves 4 tensors per layer instead of 1. All-gather is the one design that is exact by construction;
a ring is the upgrade when one layer's whole-row K/V (T x 2GE) no longer fits a device.

EAGLE-3 fits the same design: its queries are every row, and at training-time-test step j a row attends to
step 0's keys causally over the whole row (all-gathered once, at step 0) plus its own keys of steps 1..j (local);
its inputs, labels and target states reach ``ttt_steps`` + 1 rows ahead (the halo). Its per-step mean is the
whole row's (``total`` of the sum and of the count).

In the trainer (``train --sequence-parallel N``, ``SequenceGroups``): the processes form a data x sequence mesh,
N consecutive ranks to a sequence group. Every rank of a group reads the same batch (the data plan and the step
seeds are keyed by the group's index, ``Dist.data_rank``), collates only its shard of each row
(``batches.RowWindow``: ``rows_of(pad_rows(...))`` without ever holding the whole row in float32) and trains
through ``shard_sample``. DDP then averages the gradients over all data x N processes: per group, the mean of
its N ranks' gradients is the one-process gradient of its batch (above), so the mean over the world is the
data-parallel mean over the groups' batches. FSDP (``--parallel fsdp``) shards the drafter over all data x N
processes and its reduce-scatter takes the same mean (``strategies._fsdp_wrap``). Loss and metrics are the whole
sample's on every rank of a group, so the logs sum them over the ``data_group`` (one rank of each sequence group),
not over every process.

Shape symbols: N batch rows, T rows of the whole sample, T_r rows of rank r, H halo rows, D target width.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from specdraft.errors import SpecdraftError, setting
from specdraft.models.base import DrafterBatch, DrafterModel
from specdraft.models.common.sequence import KV, LabelProb, SequenceShard
from specdraft.train.batches import WHOLE, RowWindow
from specdraft.train.distributed import Dist

# DrafterBatch fields with one row per token that the halo carries, and their padding value past the sample's end.
HALO_FIELDS = {"token_ids": 0, "loss_mask": 0, "segment_ids": -1, "position_ids": 0}


def require_sequence_parallel(model: DrafterModel) -> int:
    """The halo ``model`` needs (rows after a rank's own), or a clear error for a family that cannot run split."""
    halo = getattr(model, "sequence_halo", None)
    if halo is None:
        raise SpecdraftError(
            f"{model.method} drafters cannot train sequence-parallel: the family defines no sequence_halo() (the rows past its "
            "own a rank reads) and its forward takes no SequenceShard; see specdraft/models/common/sequence.py"
        )
    return int(halo())


class ShardedRow(SequenceShard):
    """Rank ``rank`` of a sequence group holding rows [start, start + length) of every batch row (see the module docstring)."""

    def __init__(self, *, group: Any, start: int, length: int, segment_ids: torch.Tensor, loss_mask: torch.Tensor):
        self.group, self.start, self.length = group, start, length
        self.whole_segment_ids, self.whole_loss_mask = segment_ids, loss_mask

    def own(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, : self.length]

    def segment_ids(self, local: torch.Tensor) -> torch.Tensor:
        return self.whole_segment_ids

    def loss_mask(self, local: torch.Tensor) -> torch.Tensor:
        return self.whole_loss_mask

    def anchors(self, anchors: torch.Tensor) -> torch.Tensor:
        mine = (anchors >= self.start) & (anchors < self.start + self.length)
        rows = [a[m] - self.start for a, m in zip(anchors, mine)]
        out = torch.full((anchors.shape[0], max([1, *(r.numel() for r in rows)])), -1, dtype=anchors.dtype, device=anchors.device)
        for i, r in enumerate(rows):
            out[i, : r.numel()] = r
        return out

    def global_anchors(self, anchors: torch.Tensor) -> torch.Tensor:
        return torch.where(anchors >= 0, anchors + self.start, anchors)

    def context_kv(self, kv: KV) -> KV:
        # One collective per layer: k and v travel stacked ([2, N, heads, T_r, head_dim]), rows gathered in rank order.
        parts = GatherRows.apply(torch.stack(kv), self.group)
        whole = torch.cat(parts.unbind(0), dim=3)
        return whole[0], whole[1]

    def total(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.nn.functional import all_reduce

        return all_reduce(x, group=self.group)

    def label_prob(self, fn: LabelProb) -> LabelProb:
        def whole(rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            mine = (positions >= self.start) & (positions < self.start + self.length)
            out = torch.zeros(positions.shape, dtype=torch.float32, device=positions.device)
            out[mine] = fn(rows[mine], positions[mine] - self.start).float()
            dist.all_reduce(out, group=self.group)  # one owner per position: a sum of it and zeros
            return out

        return whole


class GatherRows(torch.autograd.Function):
    """All-gather ``x`` over ``group`` into a new leading dim (rank order); the backward reduce-scatters the gradient
    (the sum over the group of each rank's part). ``torch.distributed.nn.functional.all_gather`` does the same on
    NCCL, but on gloo its backward scatters from the group's ranks as if they were global ones and fails in any
    group without rank 0 (torch 2.13: "Global rank 0 is not part of group" at data 2 x sequence 2 on CPU)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))  # the ranks' x, concatenated on dim 0
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out.view(-1, *x.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        mine = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_tensor(mine, grad.reshape(-1, *grad.shape[2:]), group=ctx.group)
        return mine, None


def pad_rows(batch: DrafterBatch, multiple: int) -> DrafterBatch:
    """Pad every row with padding tokens (segment -1) to a length divisible by ``multiple`` (the group size)."""
    extra = -batch.token_ids.shape[1] % multiple
    if not extra:
        return batch

    def pad(name: str, x: torch.Tensor) -> torch.Tensor:
        fill = HALO_FIELDS.get(name, 0)
        return torch.cat([x, torch.full((x.shape[0], extra, *x.shape[2:]), fill, dtype=x.dtype, device=x.device)], dim=1)

    return DrafterBatch(**{name: pad(name, x) for name, x in vars(batch).items()})


def rows_of(batch: DrafterBatch, rank: int, size: int) -> DrafterBatch:
    """Rank ``rank``'s rows of a batch holding whole samples (length divisible by ``size``: ``pad_rows``)."""
    t = batch.token_ids.shape[1]
    if t % size:
        raise SpecdraftError(f"sequence parallelism: rows of {t} tokens do not split into {size} equal shards; pad_rows first")
    step = t // size
    return DrafterBatch(**{name: x[:, rank * step : (rank + 1) * step] for name, x in vars(batch).items()})


def shard_sample(own: DrafterBatch, *, halo: int, group: Any = None) -> tuple[DrafterBatch, ShardedRow]:
    """This rank's rows of the sample(s) (``own``: every field [N, T_r, ...], T_r equal on every rank, ranks in row
    order) -> (the batch the drafter trains on: own rows plus ``halo`` rows of the next rank's tokens, labels and
    ``last_hidden``; ``aux_hidden`` own rows only) and the shard to pass to ``training_forward``. Two collectives
    of per-token metadata and ``halo`` rows of ``last_hidden``; no hidden state moves otherwise."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    n, length = own.token_ids.shape
    lengths = [torch.zeros(2, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(lengths, torch.tensor([n, length]), group=group)
    if any(x.tolist() != [n, length] for x in lengths):
        raise SpecdraftError(
            f"sequence parallelism: every rank must hold the same rows x tokens; got {[x.tolist() for x in lengths]} "
            "(pad the sample to a multiple of the group size: pad_rows)"
        )
    if length < halo:
        raise SpecdraftError(
            f"sequence parallelism: each rank holds {length} tokens per row, fewer than the {halo}-row halo a block "
            "reads past its shard; use fewer ranks for samples this short"
        )
    device = own.token_ids.device
    meta = torch.stack([getattr(own, name).to(torch.int64) for name in HALO_FIELDS])  # [4, N, T_r]
    metas = [torch.empty_like(meta) for _ in range(size)]
    dist.all_gather(metas, meta, group=group)
    heads = [torch.empty_like(own.last_hidden[:, :halo]) for _ in range(size)]
    dist.all_gather(heads, own.last_hidden[:, :halo].contiguous(), group=group)
    whole = torch.cat(metas, dim=2)
    if rank + 1 < size:
        next_meta, next_hidden = metas[rank + 1][:, :, :halo], heads[rank + 1]
    else:
        next_meta = torch.tensor(list(HALO_FIELDS.values()), device=device)[:, None, None].expand(-1, n, halo)
        next_hidden = torch.zeros_like(heads[rank])
    fields = {name: torch.cat([getattr(own, name), next_meta[i].to(getattr(own, name).dtype)], dim=1) for i, name in enumerate(HALO_FIELDS)}
    local = DrafterBatch(**fields, aux_hidden=own.aux_hidden, last_hidden=torch.cat([own.last_hidden, next_hidden], dim=1))
    shard = ShardedRow(
        group=group,
        start=rank * length,
        length=length,
        segment_ids=whole[2].to(own.segment_ids.dtype),
        loss_mask=whole[1].to(own.loss_mask.dtype),
    )
    return local, shard


@dataclass(frozen=True)
class SequenceGroups:
    """This process's part of the data x sequence mesh (see the module docstring): the shard of each row it collates,
    its sequence group, and the group over which whole-sample figures are summed once per sequence group."""

    window: RowWindow = WHOLE  # rank and size within the sequence group; min_rows: the family's halo
    group: Any = None  # this rank's sequence group (None: one process per sample)
    data_group: Any = None  # the ranks at this rank's place in every sequence group (None: every process)

    def split(self, own: DrafterBatch) -> tuple[DrafterBatch, SequenceShard | None]:
        """This rank's collated shard -> (the batch it trains on, the shard for ``training_forward``; None: the whole
        row, the family's own single-process path)."""
        if self.window.size == 1:
            return own, None
        return shard_sample(own, halo=self.window.min_rows, group=self.group)


SINGLE = SequenceGroups()


def sequence_groups(dist_: Dist, model: DrafterModel) -> SequenceGroups:
    """The groups of ``dist_.sequence`` consecutive ranks (a collective: every rank creates every group, in the same
    order, as ``torch.distributed.new_group`` requires). Consecutive, so a group sits on one host under torchrun,
    where the per-layer K/V all-gather is cheapest."""
    n = dist_.sequence
    if n == 1:
        return SINGLE
    halo = require_sequence_parallel(model)
    groups = [dist.new_group(list(range(g * n, (g + 1) * n))) for g in range(dist_.data_world)]
    data_groups = [dist.new_group(list(range(place, dist_.world, n))) for place in range(n)]
    place = dist_.rank % n
    return SequenceGroups(RowWindow(place, n, halo), groups[dist_.data_rank], data_groups[place])


def require_same_sequence_parallel(saved: dict, directory: Path, size: int) -> None:
    """Refuse to resume checkpoint ``directory`` (its state ``saved``) at another group size: a resume continues bit for
    bit only at the same N (another N changes the order of the loss's and gradients' sums, so every later step rounds
    differently). Checkpoints from before the flag were N = 1."""
    was = int(saved.get("sequence_parallel", 1))
    if was != size:
        raise SpecdraftError(
            f"cannot resume from {directory}: it was trained with {setting('sequence_parallel')} {was}, and continuing it with "
            f"{size} would not reproduce the run bit for bit (the split changes the order of the loss's and the gradients' sums); "
            f"resume with {setting('sequence_parallel')} {was}, or train with {size} into a new {setting('out')}"
        )
