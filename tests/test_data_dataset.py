"""The prepared-dataset format: round trip, counts, atomic replace, target checks, corrupt files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdraft.data.dataset import COUNTS_FILE, DATA_FILE, MANIFEST_FILE, PreparedDataset, write_prepared
from specdraft.errors import SpecdraftError
from specdraft.targets.base import Target

ROWS = [
    {"sample_id": "a", "source": "s1", "input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]},
    {"sample_id": "b", "source": "s2", "input_ids": [5, 4, 4], "loss_mask": [1, 1, 0]},
]


def _fake_target(fingerprint="f" * 16, tokenizer_hash="t" * 16) -> Target:
    return Target(name="fake", path=Path("/nowhere"), model=None, tokenizer=None, fingerprint=fingerprint, tokenizer_hash=tokenizer_hash)


def _write(directory, rows=ROWS, **kw):
    info = {"name": "fake", "path": "/nowhere", "fingerprint": "f" * 16, "tokenizer_hash": "t" * 16}
    args = dict(target_info=info, config={"max_length": 8}, stats={"read": 3, "kept": 2, "skipped": {"no_assistant": 1}}, vocab_size=8)
    args.update(kw)
    return write_prepared(directory, rows, **args)


def test_round_trip_and_counts(tmp_path):
    _write(tmp_path / "ds")
    ds = PreparedDataset(tmp_path / "ds")
    assert len(ds) == 2
    item = ds[1]
    assert item["sample_id"] == "b" and item["source"] == "s2"
    assert item["input_ids"].dtype == torch.int64 and item["input_ids"].tolist() == [5, 4, 4]
    assert item["loss_mask"].dtype == torch.bool and item["loss_mask"].tolist() == [True, True, False]
    assert ds[-1]["sample_id"] == "b"
    with pytest.raises(IndexError):
        ds[2]
    assert ds.token_counts().tolist() == [0, 0, 0, 1, 2, 1, 0, 0]
    assert ds.lengths().tolist() == [4, 3]
    assert ds.index_of("a") == 0
    m = ds.manifest
    assert m["stats"]["skipped"] == {"no_assistant": 1} and m["num_samples"] == 2 and m["num_loss_tokens"] == 4
    assert m["config"] == {"max_length": 8} and m["target"]["fingerprint"] == "f" * 16


def test_rewrite_replaces_a_dataset_but_never_other_files(tmp_path):
    _write(tmp_path / "ds")
    _write(tmp_path / "ds", rows=ROWS[:1])
    assert len(PreparedDataset(tmp_path / "ds")) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]  # no temp dirs left behind
    (tmp_path / "ds" / "stray.txt").write_text("mine")
    with pytest.raises(SpecdraftError, match=r"holds entries a prepared dataset does not \(stray.txt\)"):
        _write(tmp_path / "ds")
    assert (tmp_path / "ds" / "stray.txt").read_text() == "mine" and len(PreparedDataset(tmp_path / "ds")) == 1


def test_failed_write_leaves_previous_dataset(tmp_path):
    _write(tmp_path / "ds")

    def rows():
        yield ROWS[0]
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        _write(tmp_path / "ds", rows=rows())
    assert len(PreparedDataset(tmp_path / "ds")) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


@pytest.mark.parametrize(
    "rows, message",
    [
        ([ROWS[0], ROWS[0]], "duplicate sample_id"),
        ([{**ROWS[0], "loss_mask": [1]}], "equally long"),
        ([{**ROWS[0], "input_ids": [1, 2, 3, 99]}], "out of range"),
    ],
)
def test_bad_rows(tmp_path, rows, message):
    with pytest.raises(SpecdraftError, match=message):
        _write(tmp_path / "ds", rows=rows)
    assert not (tmp_path / "ds").exists()


def test_check_target(tmp_path):
    _write(tmp_path / "ds")
    ds = PreparedDataset(tmp_path / "ds")
    ds.check_target(_fake_target())
    with pytest.raises(SpecdraftError, match="fingerprint"):
        ds.check_target(_fake_target(fingerprint="0" * 16))
    with pytest.raises(SpecdraftError, match="tokenizer_hash"):
        ds.check_target(_fake_target(tokenizer_hash="0" * 16))


@pytest.mark.parametrize("name", [DATA_FILE, COUNTS_FILE, MANIFEST_FILE])
def test_missing_or_corrupt_files_are_named(tmp_path, name):
    _write(tmp_path / "ds")
    path = tmp_path / "ds" / name
    path.write_bytes(b"garbage")
    with pytest.raises(SpecdraftError, match=name):
        PreparedDataset(tmp_path / "ds").token_counts()
    path.unlink()
    with pytest.raises(SpecdraftError, match=name):
        PreparedDataset(tmp_path / "ds").token_counts()


def test_not_a_dataset(tmp_path):
    with pytest.raises(SpecdraftError, match="does not exist"):
        PreparedDataset(tmp_path / "missing")
    _write(tmp_path / "ds")
    manifest = json.loads((tmp_path / "ds" / MANIFEST_FILE).read_text())
    (tmp_path / "ds" / MANIFEST_FILE).write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(SpecdraftError, match="version 99"):
        PreparedDataset(tmp_path / "ds")
