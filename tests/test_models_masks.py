"""Attention masks: what each query may see (packed rows, anchor blocks, EAGLE-3 TTT diagonals)."""

from __future__ import annotations

import torch

from specdraft.models.common.masks import anchor_block_mask, eagle3_ttt_mask


def test_anchor_block_mask_worked_example():
    seg = torch.zeros(1, 4, dtype=torch.int32)
    mask = anchor_block_mask(seg, torch.tensor([[2]]), 2)[0, 0]
    assert mask.int().tolist() == [[1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 1, 1]]


def test_anchor_block_mask_rules_on_packed_row():
    # Row: segment 0 at 0..4, segment 1 at 5..8, padding at 9.
    seg = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, -1]], dtype=torch.int32)
    anchors = torch.tensor([[3, 7, -1]])
    b, t = 3, 10
    mask = anchor_block_mask(seg, anchors, b)[0, 0]
    assert mask.shape == (3 * b, t + 3 * b)
    for q in range(3 * b):
        j = q // b
        anchor = int(anchors[0, j])
        for kv in range(t):
            expected = anchor >= 0 and kv < anchor and int(seg[0, kv]) == int(seg[0, anchor])
            assert bool(mask[q, kv]) == expected, (q, kv)
        for kv in range(3 * b):
            assert bool(mask[q, t + kv]) == (kv // b == j), (q, kv)


def test_eagle3_ttt_mask_worked_example_and_diagonals():
    seg = torch.zeros(1, 3, dtype=torch.int32)
    assert eagle3_ttt_mask(seg, 1)[0, 0].int().tolist() == [[1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 1]]
    seg = torch.tensor([[0, 0, 1, 1, -1]], dtype=torch.int32)
    mask = eagle3_ttt_mask(seg, 2)[0, 0]
    t = 5
    assert mask.shape == (t, 3 * t)
    for q in range(t):
        for kv in range(3 * t):
            step, pos = divmod(kv, t)
            if step == 0:
                expected = pos == q or (seg[0, q] != -1 and pos <= q and seg[0, pos] == seg[0, q])
            else:
                expected = pos == q
            assert bool(mask[q, kv]) == bool(expected), (q, kv)
