"""Boolean attention masks (True = may attend) for packed rows, built for SDPA.

Rows may pack several samples; ``segment_ids`` [N, T] names the sample of each token and -1 marks
padding. No mask ever lets a query see a key from another segment. Masks are dense
([N, 1, Q, K] booleans): fine on CPU at the sizes we train with; a flex-attention block mask can
replace them on GPU without changing the semantics tested here.
"""

from __future__ import annotations

import torch


def eagle3_ttt_mask(segment_ids: torch.Tensor, step: int, *, start: int = 0, length: int | None = None) -> torch.Tensor:
    """EAGLE-3 training-time-test mask for unroll step ``step`` (0-based).

    Keys are laid out step-major: key ``m`` is (step ``m // T``, position ``m % T``). A query at
    position t sees step-0 keys causally inside its own segment, plus the key at the same
    position t of each step 1..step (the "diagonal": the drafter's own earlier guesses for this
    chain). Padding queries see only their own step-0 key so SDPA never gets an empty row.

    Worked example, T = 3, one segment, step 1 (keys: s0p0 s0p1 s0p2 s1p0 s1p1 s1p2)::

        q0: 1 0 0 1 0 0
        q1: 1 1 0 0 1 0
        q2: 1 1 1 0 0 1

    The queries may be rows [start, start + length) of the row only (one rank's under sequence parallelism,
    ``models/common/sequence.py``): step-0 keys stay the whole row, later steps' keys are the queries' own rows.

    segment_ids [N, T] -> mask bool [N, 1, L, T + L * step] (L = ``length``, default T).
    """
    n, t = segment_ids.shape
    rows = t if length is None else length
    idx = torch.arange(t, device=segment_ids.device)
    query = idx[start : start + rows]
    own_seg = segment_ids[:, start : start + rows]
    same = own_seg[:, :, None] == segment_ids[:, None, :]
    valid = (own_seg != -1)[:, :, None]
    causal = query[:, None] >= idx[None, :]
    step0 = (causal & same & valid) | (query[:, None] == idx[None, :]).expand(n, rows, t)
    diag = (query[:, None] == query[None, :]).expand(n, rows, rows)
    parts = [step0] + [diag] * step
    return torch.cat(parts, dim=-1)[:, None]


def anchor_block_mask(segment_ids: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """DFlash/DSpark packed-block mask.

    Queries are ``A * block_size`` block tokens (block j = anchor ``anchors[:, j]`` followed by
    ``block_size - 1`` MASK slots); keys are the T context features of the row followed by all
    block tokens. Block j sees context keys of its own segment strictly before its anchor
    (kv < anchor), every token of its own block (non-causal), and nothing else. Padded anchors
    (-1) see only their own block.

    Worked example, T = 4 (one segment), anchors [2], block 2 (keys: c0 c1 c2 c3 b0 b1)::

        b0: 1 1 0 0 1 1
        b1: 1 1 0 0 1 1

    segment_ids [N, T], anchors [N, A] int (-1 = none) -> mask bool [N, 1, A*block, T + A*block].
    """
    n, t = segment_ids.shape
    a = anchors.shape[1]
    valid = anchors >= 0
    safe = anchors.clamp(min=0)
    anchor_seg = torch.gather(segment_ids, 1, safe)  # [N, A]
    ctx = (
        (segment_ids[:, None, :] == anchor_seg[:, :, None])
        & (torch.arange(t, device=anchors.device)[None, None, :] < safe[:, :, None])
        & (valid & (anchor_seg != -1))[:, :, None]
    )  # [N, A, T]
    ctx = ctx.repeat_interleave(block_size, dim=1)  # [N, Q, T]
    block_of = torch.arange(a * block_size, device=anchors.device) // block_size
    own = (block_of[:, None] == block_of[None, :]).expand(n, -1, -1)
    return torch.cat([ctx, own], dim=-1)[:, None]
