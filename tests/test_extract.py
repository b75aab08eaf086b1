"""``specdraft extract`` end to end on tiny random targets: parity, resume, corruption, crashes, full disk."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from specdraft.data.dataset import PreparedDataset, write_prepared
from specdraft.errors import SpecdraftError
from specdraft.hidden_states.backends.file import FileBackend
from specdraft.hidden_states.config import ExtractConfig
from specdraft.hidden_states.dataset import HiddenStateDataset
from specdraft.hidden_states.extract import extract_hidden_states
from specdraft.hidden_states.layers import LayerSlot
from specdraft.targets.base import Target

VOCAB, LAYERS = 128, 4
LENGTHS = (7, 12, 3, 9, 5)


def random_llama_target(seed=0, fingerprint="f" * 16) -> Target:
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
    )
    model = transformers.LlamaForCausalLM(cfg).eval().requires_grad_(False)
    return Target(name="tiny", path=Path("/nowhere"), model=model, tokenizer=None, fingerprint=fingerprint, tokenizer_hash="t" * 16)


def make_dataset(directory, target, *, lengths=LENGTHS, seed=1) -> Path:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i, n in enumerate(lengths):
        ids = torch.randint(0, VOCAB, (n,), generator=g)
        rows.append(
            {"sample_id": f"sharegpt/{i}", "source": "t", "input_ids": ids.tolist(), "loss_mask": [int(j >= n // 2) for j in range(n)]}
        )
    return write_prepared(directory, rows, target_info=target.describe(), config={}, stats={}, vocab_size=VOCAB)


@pytest.fixture
def setup(tmp_path):
    target = random_llama_target()
    data = make_dataset(tmp_path / "data", target)
    return target, data, tmp_path / "hs"


def run(target, data, out, **kw):
    return extract_hidden_states(ExtractConfig(dataset=str(data), out=str(out), **kw), target=target, progress=False)


def test_stored_states_equal_hf_hidden_states_fp32(setup):
    target, data, out = setup
    summary = run(target, data, out, layers="input:0,output:1,input:3,output:3", dtype="float32", batch_size=1)
    assert (summary.samples_extracted, summary.samples_skipped, summary.tokens_extracted) == (5, 0, sum(LENGTHS))
    assert summary.bytes_written > 0 and summary.bytes_per_token > 4 * 64 * 5
    ds = HiddenStateDataset(out)
    assert len(ds) == 5 and ds.slots == [LayerSlot(0, "input"), LayerSlot(1, "output"), LayerSlot(3, "input"), LayerSlot(3, "output")]
    assert ds.target_info["fingerprint"] == "f" * 16 and ds.dtype == "float32"
    prepared = PreparedDataset(data)
    for i in range(5):
        item = ds[i]
        row = prepared[i]
        assert item["sample_id"] == row["sample_id"] and torch.equal(item["loss_mask"], row["loss_mask"])
        with torch.no_grad():
            hf = target.model(item["token_ids"][None], output_hidden_states=True).hidden_states
        hs = item["hidden_states"]
        assert hs.dtype == torch.float32 and hs.shape == (LENGTHS[i], 4, 64)
        torch.testing.assert_close(hs[:, 0], hf[0][0], rtol=0, atol=0)  # input of layer 0 = embeddings
        torch.testing.assert_close(hs[:, 1], hf[2][0], rtol=0, atol=0)  # output of layer 1
        torch.testing.assert_close(hs[:, 2], hf[3][0], rtol=0, atol=0)  # input of layer 3
        torch.testing.assert_close(hs[:, 3], item["last_hidden"], rtol=0, atol=0)  # last layer's raw output
        norm = target.model.model.norm
        with torch.no_grad():
            torch.testing.assert_close(norm(item["last_hidden"]), hf[-1][0], rtol=0, atol=0)
    m = FileBackend(out).read_manifest()
    assert m["count"] == 5 and m["complete"] and m["dtype"] == "float32" and m["dataset"]["path"] == str(data.resolve())
    assert m["slots"][1] == {"layer": 1, "side": "output"} and m["target"]["num_layers"] == LAYERS


def test_batched_store_equals_unbatched_and_bfloat16_is_close(setup, tmp_path):
    target, data, out = setup
    layers = "input:1,output:2"
    run(target, data, tmp_path / "ref", layers=layers, dtype="float32", batch_size=1)
    run(target, data, tmp_path / "batched", layers=layers, dtype="float32", batch_size=3)
    run(target, data, out, layers=layers, batch_size=3)
    ref, batched, bf16 = (HiddenStateDataset(tmp_path / d) for d in ("ref", "batched", "hs"))
    assert bf16.slots == ref.slots == [LayerSlot(1, "input"), LayerSlot(2, "output")] and bf16.dtype == "bfloat16"
    for i in range(len(ref)):
        for key in ("hidden_states", "last_hidden"):
            torch.testing.assert_close(batched[i][key], ref[i][key], rtol=1e-5, atol=1e-5)
            assert bf16[i][key].dtype == torch.bfloat16
            torch.testing.assert_close(bf16[i][key].float(), ref[i][key], rtol=1e-2, atol=1e-2)


def test_rerun_skips_verified_samples(setup):
    target, data, out = setup
    run(target, data, out, max_samples=3)
    assert len(FileBackend(out).keys()) == 3
    partial = HiddenStateDataset(out)
    assert partial.sample_ids == ["sharegpt/0", "sharegpt/1", "sharegpt/2"] and partial.lengths() == list(LENGTHS[:3])
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors")}
    summary = run(target, data, out)
    assert (summary.samples_skipped, summary.samples_extracted) == (3, 2)
    assert all(out.joinpath(n).stat().st_mtime_ns == t for n, t in mtimes.items())
    assert run(target, data, out).samples_extracted == 0
    assert FileBackend(out).read_manifest()["complete"] is True


def test_corrupt_files_are_detected_by_reader_and_redone_by_rerun(setup):
    target, data, out = setup
    run(target, data, out)
    truncated = out / "sharegpt%2F1.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:100])
    flipped = out / "sharegpt%2F3.safetensors"
    raw = bytearray(flipped.read_bytes())
    raw[-5] ^= 0x55
    flipped.write_bytes(bytes(raw))
    with pytest.raises(SpecdraftError, match=r"1 bad sample\(s\): \S+/sharegpt%2F1\.safetensors is truncated or damaged"):
        HiddenStateDataset(out)  # sizes are checked when the store is opened
    with pytest.raises(
        SpecdraftError,
        match=r"2 bad sample\(s\): .*sharegpt%2F1\.safetensors is truncated.*"
        r"sharegpt%2F3\.safetensors \(sample 'sharegpt/3'\): tensor 'last_hidden' checksum",
    ):
        HiddenStateDataset(out, verify="full")
    summary = run(target, data, out)
    assert (summary.samples_skipped, summary.samples_extracted) == (3, 2)
    ds = HiddenStateDataset(out)
    assert [ds[i]["sample_id"] for i in range(5)] == [f"sharegpt/{i}" for i in range(5)]


def test_killed_writer_leaves_no_corrupt_sample_and_rerun_resumes(setup, monkeypatch):
    target, data, out = setup
    real_put = FileBackend.put
    calls = []

    def dying_put(self, key, payload):
        calls.append(key)
        if len(calls) == 3:
            raise KeyboardInterrupt("killed")  # like a signal arriving mid-write
        return real_put(self, key, payload)

    monkeypatch.setattr(FileBackend, "put", dying_put)
    with pytest.raises(KeyboardInterrupt):
        run(target, data, out, batch_size=2)
    monkeypatch.setattr(FileBackend, "put", real_put)
    stored = FileBackend(out).keys()
    assert len(stored) == 2
    for key in stored:
        FileBackend(out).get(key)  # complete and verified
    (out / ".sharegpt%2F4.safetensors.x1.tmp").write_bytes(b"half a file")  # a write cut off by the kill
    summary = run(target, data, out, batch_size=2)
    assert (summary.samples_skipped, summary.samples_extracted) == (2, 3)
    assert not list(out.glob(".*.tmp")) and len(FileBackend(out).keys()) == 5
    assert len(HiddenStateDataset(out)) == 5


def test_full_disk_is_a_clear_error_and_leaves_no_partial_file(setup, monkeypatch):
    target, data, out = setup
    real_write = Path.write_bytes

    def full_disk(self, data):
        if self.name.endswith(".tmp") and "sharegpt%2F2" in self.name:
            with open(self, "wb") as f:
                f.write(data[: len(data) // 3])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real_write(self, data)

    monkeypatch.setattr(Path, "write_bytes", full_disk)
    with pytest.raises(
        SpecdraftError, match=r"cannot write .*sharegpt%2F2\.safetensors: No space left on device; the disk is full: free space"
    ):
        run(target, data, out, batch_size=1)
    assert not (out / "sharegpt%2F2.safetensors").exists()
    assert not list(out.glob(".*"))
    for key in FileBackend(out).keys():
        FileBackend(out).get(key)


def test_store_for_other_target_or_layers_is_refused(setup, tmp_path):
    target, data, out = setup
    run(target, data, out, method="dflash")
    with pytest.raises(
        SpecdraftError, match=rf"{out} holds hidden states of target 'tiny' made with other settings \(layers output:1 != output:2\)"
    ):
        run(target, data, out, layers="output:2")
    with pytest.raises(SpecdraftError, match=r"dtype 'bfloat16' != 'float32'"):
        run(target, data, out, method="dflash", dtype="float32")
    other = random_llama_target(seed=1, fingerprint="g" * 16)
    other_data = make_dataset(tmp_path / "data2", other)
    with pytest.raises(SpecdraftError, match=r"target fingerprint 'ffffffffffffffff' != 'gggggggggggggggg'"):
        run(other, other_data, out, method="dflash")
    with pytest.raises(SpecdraftError, match=r"was extracted with target 'tiny' but dataset .*data2 was prepared for"):
        HiddenStateDataset(out, other_data)


def test_dataset_changed_after_extraction(setup):
    target, data, out = setup
    run(target, data, out)
    make_dataset(data, target, seed=2)  # same sample ids, other tokens
    with pytest.raises(SpecdraftError, match=r"sample 'sharegpt/0' does not match the store/dataset \(token ids differ"):
        HiddenStateDataset(out)[0]
    with pytest.raises(SpecdraftError, match=r"its first 5 rows \(sample ids or token ids\) differ.*add --restart"):
        run(target, data, out)
    assert run(target, data, out, restart=True).samples_extracted == 5
    assert HiddenStateDataset(out)[0]["sample_id"] == "sharegpt/0"


def test_resume_from_a_reprepared_dataset_is_refused_and_restart_clears(setup):
    """A dataset re-prepared with other rows: the resume used to keep the old samples and mark the store complete."""
    target, data, out = setup
    run(target, data, out)
    before = (out / "manifest.json").read_bytes()
    rows = [{"sample_id": f"other/{i}", "source": "t", "input_ids": [1] * (4 + i), "loss_mask": [1] * (4 + i)} for i in range(3)]
    write_prepared(data, rows, target_info=target.describe(), config={}, stats={}, vocab_size=VOCAB)
    with pytest.raises(
        SpecdraftError,
        match=rf"{out} was started from dataset {data} \(5 rows, created .*, rows sha256 [0-9a-f]{{12}}\), "
        rf"not {data} \(3 rows, .*5 stored sample\(s\) are not in it, e.g. 'sharegpt/0'.*a new --out, or add --restart",
    ):
        run(target, data, out)
    assert (out / "manifest.json").read_bytes() == before and len(FileBackend(out).keys()) == 5  # nothing touched
    summary = run(target, data, out, restart=True)
    assert (summary.samples_extracted, summary.samples_skipped) == (3, 0)
    assert FileBackend(out).keys() == ["other/0", "other/1", "other/2"]
    assert HiddenStateDataset(out).sample_ids == ["other/0", "other/1", "other/2"]
    assert "restart" not in json.loads((out / "manifest.json").read_text())["config"]  # its options are for resuming


def test_resume_into_a_dataset_with_rows_appended_fills_in_the_new_ones(setup, tmp_path):
    """`prepare --data OLD,NEW` keeps the old rows first: the copied store is the same data plus more, so it resumes."""
    target, data, out = setup
    run(target, data, out, max_samples=3)  # a store of the first 3 rows, started from all 5
    ds = PreparedDataset(data)
    rows = [ds[i] for i in range(len(ds))] + [{"sample_id": "new/0", "source": "t", "input_ids": [2] * 6, "loss_mask": [1] * 6}]
    write_prepared(tmp_path / "joined", rows, target_info=target.describe(), config={}, stats={}, vocab_size=VOCAB)
    summary = run(target, tmp_path / "joined", out)
    assert (summary.samples_skipped, summary.samples_extracted) == (3, 3)
    assert len(HiddenStateDataset(out)) == 6


def test_bad_config_and_layer_out_of_range(setup):
    target, data, out = setup
    with pytest.raises(SpecdraftError, match=r"layer index 4 is out of range: the target has 4 decoder layers"):
        run(target, data, out, layers="output:1,input:4")
    with pytest.raises(SpecdraftError, match="either --method or --layers"):
        ExtractConfig(dataset="d", out="o", method="dflash", layers="1")
    with pytest.raises(SpecdraftError, match="--batch-size must be >= 1"):
        ExtractConfig(dataset="d", out="o", batch_size=0)
    with pytest.raises(SpecdraftError, match=r"unknown layer preset 'medusa'"):
        ExtractConfig(dataset="d", out="o", method="medusa")
    with pytest.raises(SpecdraftError, match=r"hidden-state store .*nowhere does not exist"):
        HiddenStateDataset(out.parent / "nowhere")
