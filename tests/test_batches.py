"""``train/batches.py``: packing, padding, collation, epoch order and each rank's batches, on the toy store.

Kept apart from ``test_train_toy.py``, which ``scripts/resume_across.py`` imports into older checkouts: a module
this file imports may not exist there.
"""

from __future__ import annotations

import json

import pytest
import torch

from specdraft.errors import SpecdraftError
from specdraft.hidden_states.layers import LayerSlot
from specdraft.train.batches import DataPlan, collate, epoch_order, pack_rows, padded_width, select_slots
from specdraft.train.split import Split, dataset_split
from test_train_toy import VOCAB, ToyStore, ToyTarget, toy_config, toy_slots


def test_pack_rows_fills_rows_and_never_splits_samples():
    lengths = [3, 4, 5, 2, 9, 1]
    rows = pack_rows([0, 1, 2, 3, 4, 5], lengths, 8)
    assert rows == [[0, 1], [2, 3], [4], [5]]  # sample 4 (9 tokens) is truncated to 8, alone in its row
    assert sorted(i for r in rows for i in r) == list(range(6))
    assert all(sum(min(lengths[i], 8) for i in r) <= 8 for r in rows)


def test_long_samples_get_rows_of_their_own_up_to_max_sample_tokens():
    lengths = [3, 12, 4, 30, 2]
    rows = pack_rows(range(5), lengths, 8, max_sample_tokens=20)
    assert rows == [[1], [3], [0, 2], [4]]  # long samples alone; the short ones pack around them as before
    assert pack_rows(range(5), lengths, 8) == pack_rows(range(5), lengths, 8, max_sample_tokens=8) == [[0], [1], [2], [3], [4]]


def test_training_reads_a_long_sample_whole_and_logs_peak_memory(tmp_path, caplog):
    """A sample 6x --pack-tokens trains whole in a row of its own (its reply, at the end, is where the loss is); the
    short ones pack as before, and each log record carries the process's peak RSS."""
    store = ToyStore(12)
    long = store.items[0]
    T = 300
    g = torch.Generator().manual_seed(1)
    long["token_ids"] = torch.randint(0, VOCAB, (T,), generator=g)
    long["loss_mask"] = torch.zeros(T, dtype=torch.bool)
    long["loss_mask"][-20:] = True
    long["hidden_states"] = torch.randn(T, len(store.slots), 8, generator=g).to(torch.bfloat16)
    long["last_hidden"] = torch.randn(T, 8, generator=g).to(torch.bfloat16)
    cfg = toy_config(
        tmp_path / "run",
        max_steps=0,
        epochs=1,
        pack_tokens=48,
        batch_rows=1,
        val_fraction=0.0,
        max_sample_tokens=512,
        eval_interval=0,
        checkpoint_interval=0,
        decode_prompts=0,
    )
    assert cfg.sample_tokens == 512
    split = Split(train=list(range(12)), val=[], record={})
    plan = DataPlan.build(store.sample_ids, store.lengths(), split=split, pack_tokens=48, batch_rows=1, seed=3, max_sample_tokens=512)
    rows = [row for batch in plan.global_batches(0) for row in batch]
    assert [0] in rows and all(sum(store.lengths()[i] for i in row) <= 48 for row in rows if row != [0])
    assert cfg.round_row_widths and not toy_config(tmp_path / "other").round_row_widths
    batch = collate([[store[0]]], sample_tokens=plan.sample_tokens, round_width=True)
    assert batch.token_ids.shape[1] == 320 and int((batch.segment_ids >= 0).sum()) == T
    exact = collate([[store[0]]], sample_tokens=plan.sample_tokens)  # runs without long samples: exact widths, as before
    assert exact.token_ids.shape[1] == T
    assert int(batch.loss_mask.sum()) == 20
    from specdraft.train.trainer import train

    with caplog.at_level("WARNING"):
        result = train(cfg, target=ToyTarget(), dataset=store)
    assert result.completed and "will be truncated" not in caplog.text
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["split"] == "train"]
    assert all(r["peak_rss_mb"] > 50 for r in steps) and max(r["row_tokens"] for r in steps) == T
    assert sorted(r["row_tokens"] for r in steps)[-2] <= 48


def test_rows_are_padded_to_a_few_widths():
    widths = [padded_width(n) for n in range(1, 20000)]
    assert all(n <= w <= n * 1.125 + 1 for n, w in zip(range(1, 20000), widths))
    assert len({padded_width(n) for n in range(4097, 8193)}) == 8 and padded_width(7064) == 7168 and padded_width(16) == 16


def test_collate_segments_positions_and_padding_never_mix_samples():
    store = ToyStore(6)
    rows = pack_rows(range(6), store.lengths(), 40)
    batch = collate([[store[i] for i in r] for r in rows], sample_tokens=40)
    B, T = batch.token_ids.shape
    assert batch.aux_hidden.shape == (B, T, 2, 8) and batch.aux_hidden.dtype == torch.float32
    for b, row in enumerate(rows):
        seg = batch.segment_ids[b]
        for s, i in enumerate(row):
            item = store[i]
            where = (seg == s).nonzero().flatten()
            assert len(where) == len(item["token_ids"]) and (where.diff() == 1).all()  # contiguous, one segment per sample
            assert torch.equal(batch.token_ids[b, where], item["token_ids"])
            assert torch.equal(batch.position_ids[b, where], torch.arange(len(where)))
            assert torch.equal(batch.loss_mask[b, where], item["loss_mask"])
            assert torch.equal(batch.aux_hidden[b, where], item["hidden_states"].float())
        pad = seg == -1
        assert not batch.loss_mask[b, pad].any() and (batch.aux_hidden[b, pad] == 0).all()
        assert int((~pad).sum()) == sum(len(store[i]["token_ids"]) for i in row)


def test_collate_selects_slots_by_meaning():
    store = ToyStore(2, slots=[LayerSlot(0, "input"), LayerSlot(1, "output"), LayerSlot(4, "output")])
    idx = select_slots(store.slots, toy_slots(6), where="store")
    assert idx == [1, 2]
    batch = collate([[store[0]]], sample_tokens=64, slot_index=idx)
    assert torch.equal(batch.aux_hidden[0, :, 0], store[0]["hidden_states"][:, 1].float())
    with pytest.raises(SpecdraftError, match=r"missing output:4.*specdraft extract"):
        select_slots([LayerSlot(1, "output"), LayerSlot(4, "input")], toy_slots(6), where="store")


def test_epoch_order_depends_on_seed_and_epoch_only():
    idx = list(range(50))
    assert epoch_order(idx, seed=1, epoch=0) == epoch_order(idx, seed=1, epoch=0)
    assert epoch_order(idx, seed=1, epoch=0) != epoch_order(idx, seed=1, epoch=1)
    assert epoch_order(idx, seed=1, epoch=0) != epoch_order(idx, seed=2, epoch=0)
    assert sorted(epoch_order(idx, seed=1, epoch=3)) == idx


def test_ranks_get_disjoint_batches_and_locate_walks_epochs():
    store = ToyStore(40)
    kw = dict(split=dataset_split(store, val_fraction=0.1, seed=0), pack_tokens=48, batch_rows=1, seed=0)
    plans = [DataPlan.build(store.sample_ids, store.lengths(), world_size=2, rank=r, **kw) for r in range(2)]
    single = DataPlan.build(store.sample_ids, store.lengths(), **kw)
    n = plans[0].steps_in_epoch(0)
    assert n == single.steps_in_epoch(0) // 2
    seen = [{i for s in range(n) for row in p.train_rows(s) for i in row} for p in plans]
    assert not seen[0] & seen[1]
    assert plans[0].locate(n) == (1, 0) and plans[0].locate(n - 1) == (0, n - 1)
    assert not set(plans[0].train_indices) & set(plans[0].val_indices)
