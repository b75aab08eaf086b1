"""Anchor sampling and block labels for the block drafters (DFlash, DSpark).

Anchor sampling (``ANCHOR_SAMPLING``, the drafter config's ``anchor_sampling``):

* ``uniform``: up to ``max_anchors`` candidates per packed sample, uniformly without replacement
  (the references' sampling).
* ``predictable``: spend the same budget where the target is predictable, so more of each block's
  positions carry a label the drafter can learn to hit (acceptance stops at the first miss, and
  later positions of a block in unpredictable text rarely count). A uniform proposal of
  ``PREDICTABLE_PROPOSALS`` x the budget is scored by the target's probability of the block's
  first label, p_t(x_{a+1} | x_<=a) = softmax(head(norm(last_hidden[a])))[x_{a+1}] (over the draft
  vocabulary when it is reduced: see ``DFlashDrafter.target_label_prob``), and the anchors are
  drawn from it without replacement with weights ``PREDICTABLE_FLOOR`` + p (the floor keeps hard
  text in the mix). Cost: one frozen LM-head row per proposal (2 x the anchors), against the B
  rows per anchor that the loss already runs through the same head.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdraft.registry import Registry

PREDICTABLE_PROPOSALS = 2
PREDICTABLE_FLOOR = 0.05


def candidate_anchors(segment_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """bool [N, T]: positions a where a and a+1 are response tokens of the same segment, so a
    block anchored there has at least one supervised label."""
    mask = loss_mask.bool() & (segment_ids != -1)
    ok = torch.zeros_like(mask)
    ok[:, :-1] = mask[:, :-1] & mask[:, 1:] & (segment_ids[:, 1:] == segment_ids[:, :-1])
    return ok


def sample_anchors(
    segment_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    max_per_segment: int,
    generator: torch.Generator | None = None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Up to ``max_per_segment`` random anchors per packed sample, sorted per row: uniform, or
    without replacement in proportion to ``weights`` float [N, T] (>= max_per_segment positive
    weights per segment that has more candidates).

    Returns int64 [N, A] row positions, padded with -1 (A = the largest count over rows).
    """
    ok = candidate_anchors(segment_ids, loss_mask).cpu()
    seg = segment_ids.cpu()
    weights = None if weights is None else weights.detach().float().cpu()
    rows: list[torch.Tensor] = []
    for r in range(ok.shape[0]):
        chosen = []
        for s in torch.unique(seg[r][ok[r]]).tolist():
            cand = torch.nonzero(ok[r] & (seg[r] == s)).flatten()
            if cand.numel() > max_per_segment and weights is None:
                cand = cand[torch.randperm(cand.numel(), generator=generator)[:max_per_segment]]
            elif cand.numel() > max_per_segment and weights is not None:
                cand = cand[torch.multinomial(weights[r, cand], max_per_segment, replacement=False, generator=generator)]
            chosen.append(cand)
        rows.append(torch.sort(torch.cat(chosen)).values if chosen else torch.zeros(0, dtype=torch.int64))
    width = max([1, *(r.numel() for r in rows)])
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
    _, t = token_ids.shape
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


# (rows int64 [M], positions int64 [M]) -> the target's probability of token positions+1, float [M]
LabelProb = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
AnchorSampler = Callable[..., torch.Tensor]
ANCHOR_SAMPLING: Registry[AnchorSampler] = Registry("anchor sampling")


@ANCHOR_SAMPLING.register("uniform")
def uniform_anchors(
    segment_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    max_per_segment: int,
    label_prob: LabelProb,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    return sample_anchors(segment_ids, loss_mask, max_per_segment=max_per_segment, generator=generator)


@ANCHOR_SAMPLING.register("predictable")
@torch.no_grad()
def predictable_anchors(
    segment_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    max_per_segment: int,
    label_prob: LabelProb,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """See the module docstring: a uniform proposal scored by ``label_prob``, then a weighted draw."""
    proposal = sample_anchors(segment_ids, loss_mask, max_per_segment=PREDICTABLE_PROPOSALS * max_per_segment, generator=generator)
    rows, cols = torch.nonzero(proposal >= 0, as_tuple=True)
    positions = proposal[rows, cols]
    weights = torch.zeros(segment_ids.shape, dtype=torch.float32, device=segment_ids.device)
    weights[rows, positions] = PREDICTABLE_FLOOR + label_prob(rows, positions).float()
    return sample_anchors(segment_ids, loss_mask, max_per_segment=max_per_segment, generator=generator, weights=weights)
