"""Anchor sampling and block labels for the block drafters (DFlash, DSpark)."""

from __future__ import annotations

import torch


def candidate_anchors(segment_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """bool [N, T]: positions a where a and a+1 are response tokens of the same segment, so a
    block anchored there has at least one supervised label."""
    mask = loss_mask.bool() & (segment_ids != -1)
    ok = torch.zeros_like(mask)
    ok[:, :-1] = mask[:, :-1] & mask[:, 1:] & (segment_ids[:, 1:] == segment_ids[:, :-1])
    return ok


def sample_anchors(
    segment_ids: torch.Tensor, loss_mask: torch.Tensor, *, max_per_segment: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Up to ``max_per_segment`` random anchors per packed sample, sorted per row.

    Returns int64 [N, A] row positions, padded with -1 (A = the largest count over rows).
    """
    ok = candidate_anchors(segment_ids, loss_mask).cpu()
    seg = segment_ids.cpu()
    rows: list[torch.Tensor] = []
    for r in range(ok.shape[0]):
        chosen = []
        for s in torch.unique(seg[r][ok[r]]).tolist():
            cand = torch.nonzero(ok[r] & (seg[r] == s)).flatten()
            if cand.numel() > max_per_segment:
                cand = cand[torch.randperm(cand.numel(), generator=generator)[:max_per_segment]]
            chosen.append(cand)
        rows.append(torch.sort(torch.cat(chosen)).values if chosen else torch.zeros(0, dtype=torch.int64))
    width = max(1, max(r.numel() for r in rows))
    out = torch.full((len(rows), width), -1, dtype=torch.int64)
    for r, a in enumerate(rows):
        out[r, : a.numel()] = a
    return out.to(segment_ids.device)


def block_labels(
    token_ids: torch.Tensor, segment_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Labels at row positions anchor + offsets[k] (offsets int64 [K], increasing, >= 1).

    A label is valid while every position anchor+1 .. anchor+offsets[k] is a response token of
    the anchor's segment: supervision in a block stops at the first invalid label.
    Returns (labels [N, A, K], valid bool [N, A, K], label positions [N, A, K] clamped into the row).
    """
    n, t = token_ids.shape
    span = int(offsets.max())
    steps = anchors[..., None] + torch.arange(1, span + 1, device=anchors.device)  # [N, A, span]
    inside = (steps < t) & (anchors[..., None] >= 0)
    idx = steps.clamp(max=t - 1, min=0).flatten(1)
    anchor_seg = torch.gather(segment_ids, 1, anchors.clamp(min=0))
    ok = inside & (torch.gather(segment_ids, 1, idx).view_as(steps) == anchor_seg[..., None])
    ok &= torch.gather(loss_mask.bool(), 1, idx).view_as(steps)
    ok = torch.cumprod(ok.int(), dim=-1).bool()
    pick = offsets - 1
    pos = steps[..., pick].clamp(max=t - 1, min=0)
    labels = torch.gather(token_ids, 1, pos.flatten(1)).view_as(pos)
    return labels, ok[..., pick], pos
