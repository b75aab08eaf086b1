"""The validation split (train/split.py): whole conversations, no prompt on both sides, seeded, recorded."""

from __future__ import annotations

import json

import pytest
import torch

from specdraft.data.dataset import PreparedDataset, write_prepared
from specdraft.data.sources import conversation_group
from specdraft.hidden_states.source import PreparedRows
from specdraft.train.split import SPLIT_FILE, SplitKey, compute_split, dataset_split, held_out, resolve_split, write_split

VOCAB = 64
SOURCE = "sharegpt:sharegpt+regenerated"


def _rows(conversations: int = 120, seed: int = 0) -> list[dict]:
    """ShareGPT-like regenerated samples: conversation c is cut into 1-4 chunks ``c{c}_{k}``; every chunk
    after the first is prompted by "continue" (one shared token sequence) or a prompt of its own; a few
    ids repeat (``iter_rows`` then suffixes ``@<row>``)."""
    g = torch.Generator().manual_seed(seed)
    continue_prompt = [1, 2, 3]
    rows, index = [], 0
    for c in range(conversations):
        for k in range(int(torch.randint(1, 5, (1,), generator=g))):
            shared = k > 0 and bool(torch.rand(1, generator=g) < 0.3)
            prompt = continue_prompt if shared else torch.randint(4, VOCAB, (6,), generator=g).tolist()
            reply = torch.randint(4, VOCAB, (5,), generator=g).tolist()
            sid = f"c{c:03d}_{k}" + (f"@{index}" if c % 17 == 0 and k == 0 and index else "")
            rows.append(
                {"sample_id": sid, "source": SOURCE, "input_ids": prompt + reply, "loss_mask": [0] * len(prompt) + [1] * len(reply)}
            )
            index += 1
    return rows


def _dataset(tmp_path, rows, name="data"):
    prepared = PreparedDataset(write_prepared(tmp_path / name, rows, target_info={}, config={}, stats={}, vocab_size=VOCAB))
    return PreparedRows(prepared)


def _straddling(rows, val: set[int], key) -> set:
    sides: dict = {}
    for i, row in enumerate(rows):
        sides.setdefault(key(row), set()).add(i in val)
    return {k for k, s in sides.items() if len(s) == 2}


def test_conversation_group_strips_chunk_and_dedup_suffixes_per_format():
    assert conversation_group("QWJhYvA_12", "sharegpt:sharegpt") == "QWJhYvA"
    assert conversation_group("QWJhYvA_0@1234", "sharegpt:sharegpt+regenerated") == "QWJhYvA"
    assert conversation_group("x_3@2:17", "old-data:sharegpt") == "x"
    assert conversation_group("chat_3", "chats.jsonl:openai") == "chat_3"  # one row per conversation: the id is the group
    assert conversation_group("s/4", "t") == "s/4"  # no known format in the label


def test_no_conversation_or_prompt_straddles_the_split(tmp_path):
    rows = _rows()
    dataset = _dataset(tmp_path, rows)
    split = dataset_split(dataset, val_fraction=0.3, seed=7)
    val = set(split.val)
    assert sorted(split.train + split.val) == list(range(len(rows))) and 0 < len(val) < len(rows)
    group = lambda row: row["sample_id"].split("@")[0].rsplit("_", 1)[0]  # noqa: E731
    prompt = lambda row: tuple(row["input_ids"][: row["loss_mask"].index(1)])  # noqa: E731
    assert not _straddling(rows, val, group) and not _straddling(rows, val, prompt)
    assert all(i not in val for i, r in enumerate(rows) if prompt(r) == (1, 2, 3))  # "continue" opens training chunks too
    assert split.record["drawn_groups_kept_in_training"] > 0

    # the data are built to leak: splitting sample by sample (the old rule) puts both sides in a conversation and a prompt
    naive = held_out([SplitKey(r["sample_id"], r["sample_id"]) for r in rows], 0.3, 7)
    naive_val = {i for i, v in enumerate(naive) if v}
    assert _straddling(rows, naive_val, group) and _straddling(rows, naive_val, prompt)


def test_split_is_fixed_by_its_seed_and_independent_of_row_order(tmp_path):
    rows = _rows()
    a = dataset_split(_dataset(tmp_path, rows, "a"), val_fraction=0.3, seed=7)
    reversed_ = _dataset(tmp_path, rows[::-1], "b")
    b = dataset_split(reversed_, val_fraction=0.3, seed=7)
    assert set(a.record["validation_ids"]) == set(b.record["validation_ids"])
    assert a.hash == dataset_split(_dataset(tmp_path, rows, "c"), val_fraction=0.3, seed=7).hash
    assert set(dataset_split(reversed_, val_fraction=0.3, seed=8).record["validation_ids"]) != set(a.record["validation_ids"])


def test_recorded_split_is_reused_when_the_data_change(tmp_path):
    rows = _rows()
    dataset = _dataset(tmp_path, rows, "a")
    first = dataset_split(dataset, val_fraction=0.3, seed=7)
    path = tmp_path / SPLIT_FILE
    write_split(path, first)
    assert resolve_split(dataset, val_fraction=0.1, seed=1, recorded=path).hash == first.hash  # settings changed: recorded wins
    # more rows: new chunks of recorded validation conversations join validation, everything else trains
    extra = [
        {**row, "sample_id": row["sample_id"].split("@")[0] + "9", "input_ids": [5] + row["input_ids"], "loss_mask": [0] + row["loss_mask"]}
        for row in rows
    ]  # a further chunk of every conversation (c001_0 -> c001_09), with a prompt of its own
    grown = _dataset(tmp_path, rows + extra, "b")
    again = resolve_split(grown, val_fraction=0.3, seed=7, recorded=path)
    recorded_ids, groups = set(first.record["validation_ids"]), set(first.record["validation_groups"])
    ids = grown.sample_ids
    assert recorded_ids <= {ids[i] for i in again.val}
    assert all(ids[i] in recorded_ids or ids[i].split("@")[0].rsplit("_", 1)[0] in groups for i in again.val)
    assert json.loads(path.read_text())["hash"] == first.hash


def test_adding_data_never_moves_a_training_sample_to_validation():
    """What the sharegpt eval suite relies on: its split over the whole file holds validation prompts of any part of it."""
    g = torch.Generator().manual_seed(3)
    keys = [
        SplitKey(f"g{int(torch.randint(0, 400, (1,), generator=g))}", f"p{int(torch.randint(0, 3000, (1,), generator=g))}")
        for _ in range(1000)
    ]
    whole = held_out(keys, 0.2, 0)
    part = held_out(keys[:400], 0.2, 0)
    assert any(whole) and all(part[i] for i in range(400) if whole[i])
    assert compute_split([str(i) for i in range(400)], keys[:400], val_fraction=0.0, seed=0).val == []


@pytest.mark.slow
def test_sharegpt_suite_holds_no_prompt_or_conversation_of_a_training_side():
    from itertools import islice

    from specdraft.data.sources import conversation, first_reply_index, iter_rows
    from specdraft.eval.suites import load_prompts
    from specdraft.train.split import prompt_digest

    prompts = load_prompts("sharegpt")
    assert len(prompts) == 40 and len({p.prompt_id for p in prompts}) == 40
    rows = []  # the first 2405 ShareGPT rows that `prepare` keeps, as the reference build's data
    for row in islice(iter_rows("sharegpt"), 2405):
        messages = conversation(row.messages)
        reply = first_reply_index(messages)
        if reply is not None:
            rows.append((row, messages[:reply]))
    keys = [SplitKey(conversation_group(r.sample_id, r.source), prompt_digest(list(m))) for r, m in rows]
    flags = held_out(keys, 0.05, 0)
    train_groups = {k.group for k, v in zip(keys, flags) if not v}
    train_prompts = {k.prompt for k, v in zip(keys, flags) if not v}
    suite_ids = {p.prompt_id.removeprefix("sharegpt-") for p in prompts}
    assert not {conversation_group(sid, "sharegpt:sharegpt") for sid in suite_ids} & train_groups
    assert not {prompt_digest(list(p.messages)) for p in prompts} & train_prompts
    # every suite prompt among those rows is on their validation side (what a run prepared from them validates on)
    first_ids = {r.sample_id for r, _ in rows}
    val_ids = {r.sample_id for (r, _), v in zip(rows, flags) if v}
    assert suite_ids & first_ids and suite_ids & first_ids <= val_ids


def test_split_audit_counts_the_old_rules_leaks_and_its_clean_subset(tmp_path):
    """train/split_audit.py (benchmarks/split_leak.py, split_tau.py's "after" set): the old rule's leaking rows and the rest."""
    from specdraft.train.split import sample_keys
    from specdraft.train.split_audit import analyse

    rows = _rows()
    keys = sample_keys(_dataset(tmp_path, rows))
    result = analyse([r["sample_id"] for r in rows], keys, val_fraction=0.3, seed=7)
    old, clean = set(result["old_validation"]), set(result["old_clean"])
    group = lambda row: row["sample_id"].split("@")[0].rsplit("_", 1)[0]  # noqa: E731
    prompt = lambda row: tuple(row["input_ids"][: row["loss_mask"].index(1)])  # noqa: E731
    train = [r for i, r in enumerate(rows) if i not in old]
    leaking = {i for i in old if group(rows[i]) in {group(r) for r in train} or prompt(rows[i]) in {prompt(r) for r in train}}
    assert leaking and clean and clean == old - leaking
    assert result["old"]["sharing_either"] == len(leaking) and result["new"]["sharing_either"] == 0
    assert (
        result["old"]["validation_rows"] - result["moved_validation_to_training"] + result["moved_training_to_validation"]
        == result["new"]["validation_rows"]
    )
