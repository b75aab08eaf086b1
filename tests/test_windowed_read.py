"""A sequence-parallel rank's windowed read of a file-store sample (``FileBackend.get_rows``, ``payload.PayloadRows``,
``HiddenStateDataset(..., reads="windowed")``): it collates what the whole read collates, loads only the rows of its
window, and refuses a changed byte anywhere in the sample, inside its window or not, as the whole read does."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from specdraft.errors import SpecdraftError
from specdraft.hidden_states.backends.base import STORE_FORMAT_NAME, STORE_FORMAT_VERSION
from specdraft.hidden_states.backends.file import FileBackend
from specdraft.hidden_states.dataset import HiddenStateDataset
from specdraft.hidden_states.layers import LayerSlot
from specdraft.hidden_states.payload import PayloadRows, StoredRows, file_range_sha256
from specdraft.train.batches import RowWindow, collate

VOCAB = 100
INFO = {"name": "fake", "fingerprint": "f" * 16, "tokenizer_hash": "t" * 16, "num_layers": 4, "hidden_size": 8, "path": "/x"}
SLOTS = [LayerSlot(0, "input"), LayerSlot(2, "output"), LayerSlot(3, "output")]
# Packed into rows of 24 (pack_tokens): [7, 11, 5] and [9, 13]: with 3 shards of 8 the first row's windows cross both
# of its sample boundaries (7, 18) and end in padding; 2 and 4 shards cut the samples elsewhere.
LENGTHS = [7, 11, 5, 9, 13]


@pytest.fixture
def store(tmp_path):
    """A real store (prepared dataset + file backend + manifest) of ``LENGTHS`` bf16 samples."""
    from specdraft.data.dataset import write_prepared
    from specdraft.hidden_states.payload import HiddenStatePayload

    g = torch.Generator().manual_seed(0)
    rows = []
    for i, n in enumerate(LENGTHS):
        ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        rows.append({"sample_id": f"s/{i}", "source": "t", "input_ids": ids, "loss_mask": [int(j >= n // 3) for j in range(n)]})
    data = write_prepared(tmp_path / "data", rows, target_info=INFO, config={}, stats={}, vocab_size=VOCAB)
    backend = FileBackend(tmp_path / "hs")
    for row in rows:
        n = len(row["input_ids"])
        payload = HiddenStatePayload.create(
            sample_id=row["sample_id"],
            target_info=INFO,
            slots=SLOTS,
            token_ids=torch.tensor(row["input_ids"]),
            hidden_states=torch.randn(n, len(SLOTS), 8, generator=g),
            last_hidden=torch.randn(n, 8, generator=g),
            dtype="bfloat16",
        )
        backend.put(row["sample_id"], payload)
    backend.write_manifest(
        {
            "format": STORE_FORMAT_NAME,
            "format_version": STORE_FORMAT_VERSION,
            "target": INFO,
            "slots": [s.to_json() for s in SLOTS],
            "dtype": "bfloat16",
            "dataset": {"path": str(data)},
            "samples": sorted(r["sample_id"] for r in rows),
            "count": len(rows),
            "complete": True,
        }
    )
    return backend


def _packed(dataset: HiddenStateDataset) -> list[list[dict]]:
    return [[dataset[0], dataset[1], dataset[2]], [dataset[3], dataset[4]]]


def test_get_rows_slices_equal_the_whole_read(store):
    for key in store.keys():
        whole, rows = store.get(key), store.get_rows(key)
        assert isinstance(rows, PayloadRows) and isinstance(rows.hidden_states, StoredRows)
        assert rows.manifest == whole.manifest and torch.equal(rows.token_ids, whole.token_ids)
        t = whole.num_tokens
        assert rows.hidden_states.shape == whole.hidden_states.shape and rows.last_hidden.dtype == torch.bfloat16
        for a, b in [(0, t), (0, 1), (t - 1, t), (2, 5), (3, 3), (0, t + 4)]:
            assert torch.equal(rows.hidden_states[a:b], whole.hidden_states[a:b]), (key, a, b)
            assert torch.equal(rows.last_hidden[a:b], whole.last_hidden[a:b]), (key, a, b)


@pytest.mark.parametrize(("size", "min_rows", "round_width"), [(1, 0, False), (2, 0, False), (3, 0, False), (4, 0, True), (2, 15, False)])
def test_a_windowed_rank_collates_what_the_whole_read_collates(store, size, min_rows, round_width, monkeypatch):
    """Every window of every row (crossing sample boundaries, ending in padding, padded to the halo) collates equal, and
    each sample is read only over its tokens inside the window."""
    whole = HiddenStateDataset(store.root)
    windowed = HiddenStateDataset(store.root, reads="windowed")
    read: list[tuple[str, int, int]] = []
    original = StoredRows.__getitem__

    def spy(self, rows):
        out = original(self, rows)
        read.append((self.name, rows.start, rows.stop))
        return out

    monkeypatch.setattr(StoredRows, "__getitem__", spy)
    for rank in range(size):
        window = RowWindow(rank, size, min_rows)
        read.clear()
        want = collate(_packed(whole), sample_tokens=24, round_width=round_width, window=window)
        got = collate(_packed(windowed), sample_tokens=24, round_width=round_width, window=window)
        for name, value in vars(want).items():
            assert torch.equal(getattr(got, name), value), (size, rank, name)
        rows_read = sum(stop - start for name, start, stop in read if name == "hidden_states")
        assert rows_read == int((want.segment_ids >= 0).sum())  # exactly the window's real tokens, nothing else


def test_the_trainer_reads_windowed_under_sequence_parallelism(store, tmp_path):
    from specdraft.train.batches import open_sample_source
    from specdraft.train.config import TrainConfig

    for n, kind in [(1, torch.Tensor), (2, StoredRows)]:
        cfg = TrainConfig(method="dspark", data=str(store.root), out=str(tmp_path / f"out{n}"), sequence_parallel=n)
        assert isinstance(open_sample_source(cfg, rank=0, world=n)[0]["hidden_states"], kind)


def _tensor_ranges(path) -> dict[str, tuple[int, int]]:
    data = path.read_bytes()
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    return {
        k: (8 + header_len + v["data_offsets"][0], 8 + header_len + v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"
    }


@pytest.mark.parametrize("tensor", ["hidden_states", "last_hidden", "token_ids"])
@pytest.mark.parametrize("where", ["first", "last"])
def test_a_changed_byte_outside_the_window_is_refused(store, tensor, where):
    """Rank 0 of 2 collates only the first rows of sample s/1; a byte flipped in its last rows (or first) is refused
    when the sample is read, with the whole read's error naming the file and the tensor."""
    path = store.path("s/1")
    begin, end = _tensor_ranges(path)[tensor]
    data = bytearray(path.read_bytes())
    data[begin if where == "first" else end - 1] ^= 0x01
    path.write_bytes(bytes(data))
    dataset = HiddenStateDataset(store.root, reads="windowed")
    pattern = rf"{path}.*sample 's/1'.*tensor '{tensor}' checksum .* does not match the manifest's"
    with pytest.raises(SpecdraftError, match=pattern):
        dataset[1]
    with pytest.raises(SpecdraftError, match=pattern):
        HiddenStateDataset(store.root)[1]


def test_a_truncated_or_missing_sample_is_refused_naming_it(store):
    path = store.path("s/4")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 10])
    with pytest.raises(SpecdraftError, match=rf"{path}: not a readable safetensors payload .*truncated or corrupt"):
        store.get_rows("s/4")
    path.unlink()
    with pytest.raises(SpecdraftError, match=r"no hidden states stored for sample 's/4'"):
        store.get_rows("s/4")
    store.path("s/0").write_bytes(store.path("s/1").read_bytes())
    with pytest.raises(SpecdraftError, match=r"holds sample 's/1', expected 's/0'"):
        store.get_rows("s/0")


def test_unknown_read_is_refused_naming_the_choices(store):
    with pytest.raises(SpecdraftError, match=r"unknown hidden-state read 'lazy'; choose one of: whole, windowed"):
        HiddenStateDataset(store.root, reads="lazy")


def test_range_hash_in_small_chunks_equals_one_hash(tmp_path):
    path = tmp_path / "bytes"
    path.write_bytes(bytes(range(256)) * 5)
    with open(path, "rb") as f:
        assert file_range_sha256(f, 13, 1000, chunk=7) == hashlib.sha256(path.read_bytes()[13:1000]).hexdigest()
        with pytest.raises(EOFError):
            file_range_sha256(f, 1200, 1400, chunk=64)
