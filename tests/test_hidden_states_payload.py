"""Payload serialisation/verification, the file backend and the async writer."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from specdraft.errors import SpecdraftError
from specdraft.hidden_states.backends import BACKENDS, open_backend
from specdraft.hidden_states.backends.file import FileBackend, filename_to_key, key_to_filename
from specdraft.hidden_states.layers import LayerSlot
from specdraft.hidden_states.payload import HiddenStatePayload
from specdraft.hidden_states.writer import AsyncWriter

INFO = {"name": "fake", "fingerprint": "f" * 16, "tokenizer_hash": "t" * 16, "num_layers": 4, "hidden_size": 8, "path": "/x"}
SLOTS = [LayerSlot(0, "input"), LayerSlot(2, "output")]


def make_payload(sample_id="s0", t=5, dtype="float32", seed=0):
    g = torch.Generator().manual_seed(seed)
    return HiddenStatePayload.create(
        sample_id=sample_id,
        target_info=INFO,
        slots=SLOTS,
        token_ids=torch.randint(0, 100, (t,), generator=g),
        hidden_states=torch.randn(t, 2, 8, generator=g),
        last_hidden=torch.randn(t, 8, generator=g),
        dtype=dtype,
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_round_trip(dtype):
    p = make_payload(dtype=dtype)
    q = HiddenStatePayload.from_bytes(p.to_bytes(), source="mem")
    assert q.manifest == p.manifest and q.sample_id == "s0" and q.slots == SLOTS and q.dtype == dtype
    for key in ("hidden_states", "token_ids", "last_hidden"):
        assert torch.equal(getattr(p, key), getattr(q, key))
    assert q.token_ids.dtype == torch.int64 and q.hidden_states.dtype == getattr(torch, dtype)
    m = q.manifest
    assert m["slots"] == [{"layer": 0, "side": "input"}, {"layer": 2, "side": "output"}]
    assert m["tensors"]["hidden_states"]["shape"] == [5, 2, 8] and "path" not in m["target"]


def test_verify_names_sample_tensor_and_difference():
    p = make_payload()
    p.hidden_states[0, 0, 0] += 1
    with pytest.raises(SpecdraftError, match=r"sample 's0'.*tensor 'hidden_states' checksum"):
        p.verify()
    p = make_payload()
    p.manifest["tensors"]["last_hidden"]["dtype"] = "bfloat16"
    with pytest.raises(SpecdraftError, match=r"tensor 'last_hidden' has dtype float32 but the manifest says bfloat16"):
        p.verify(source="f.safetensors")
    with pytest.raises(SpecdraftError, match=r"tensor 'hidden_states' has shape \[5, 3, 8\], expected \[5, 2, 8\]"):
        HiddenStatePayload.create(
            sample_id="x",
            target_info=INFO,
            slots=SLOTS,
            token_ids=torch.arange(5),
            hidden_states=torch.zeros(5, 3, 8),
            last_hidden=torch.zeros(5, 8),
        )


def test_corrupt_bytes_are_reported_with_source():
    data = make_payload().to_bytes()
    with pytest.raises(SpecdraftError, match=r"^f\.st: not a readable safetensors payload .*truncated or corrupt"):
        HiddenStatePayload.from_bytes(data[: len(data) // 2], source="f.st")
    flipped = bytearray(data)
    flipped[-3] ^= 0xFF  # inside the last tensor's data, header intact
    with pytest.raises(SpecdraftError, match=r"checksum .* does not match"):
        HiddenStatePayload.from_bytes(bytes(flipped), source="f.st")


def test_mismatches_lists_every_difference():
    p = make_payload()
    assert p.mismatches(fingerprint="f" * 16, slots=SLOTS, dtype="float32", token_ids=p.token_ids) == []
    got = p.mismatches(fingerprint="g", slots=SLOTS[:1], dtype="bfloat16", token_ids=p.token_ids + 1)
    assert len(got) == 4 and "slots input:0,output:2 != input:0" in got[1]


def test_file_backend_keys_and_atomic_files(tmp_path):
    assert "file" in BACKENDS
    b = open_backend("file", str(tmp_path / "store"))
    for key in ("plain", "a/b:c", ".hidden", "ü n"):
        assert filename_to_key(key_to_filename(key)) == key and "/" not in key_to_filename(key)
        assert not key_to_filename(key).startswith(".")
        assert b.put(key, make_payload(sample_id=key)) > 0
    assert b.keys() == sorted(["plain", "a/b:c", ".hidden", "ü n"])
    assert b.exists("a/b:c") and b.get("a/b:c").sample_id == "a/b:c"
    b.delete("a/b:c")
    assert not b.exists("a/b:c") and len(b.keys()) == 3
    with pytest.raises(SpecdraftError, match=r"no hidden states stored for sample 'a/b:c'"):
        b.get("a/b:c")
    with pytest.raises(SpecdraftError, match=r"cannot be stored under key"):
        b.put("other", make_payload(sample_id="plain"))
    (tmp_path / "store" / ".plain.safetensors.abc.tmp").write_bytes(b"partial")
    assert b.keys() == sorted(["plain", ".hidden", "ü n"]) and b.recover() == 1
    assert b.read_manifest() is None
    b.write_manifest({"format": "x"})
    assert json.loads((tmp_path / "store" / "manifest.json").read_text()) == {"format": "x"}
    with pytest.raises(SpecdraftError, match=r"does not exist; run `specdraft extract"):
        FileBackend(tmp_path / "missing", create=False)
    with pytest.raises(SpecdraftError, match=r"unknown hidden-state backend 'nope'; choose one of: file"):
        open_backend("nope", str(tmp_path))


def test_file_backend_sees_swapped_file(tmp_path):
    b = FileBackend(tmp_path)
    b.put("a", make_payload("a"))
    b.put("b", make_payload("b"))
    (tmp_path / "a.safetensors").write_bytes((tmp_path / "b.safetensors").read_bytes())
    with pytest.raises(SpecdraftError, match=r"a\.safetensors: holds sample 'b', expected 'a'"):
        b.get("a")


class SlowFailingBackend(FileBackend):
    def __init__(self, root, fail_at=None):
        super().__init__(root)
        self.fail_at = fail_at
        self.calls = 0
        self.threads = set()

    def put(self, key, payload):
        self.calls += 1
        self.threads.add(threading.current_thread().name)
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise OSError(f"injected failure writing {key}")
        return super().put(key, payload)


def test_writer_flushes_on_close_in_background_threads(tmp_path):
    b = SlowFailingBackend(tmp_path)
    with AsyncWriter(b, max_pending=2, num_threads=2) as w:
        for i in range(7):
            w.submit(f"k{i}", make_payload(f"k{i}", seed=i))
    assert b.keys() == [f"k{i}" for i in range(7)]
    assert w.samples_written == 7 and w.bytes_written == sum((tmp_path / f"k{i}.safetensors").stat().st_size for i in range(7))
    assert threading.current_thread().name not in b.threads
    with pytest.raises(RuntimeError, match="after close"):
        w.submit("late", make_payload("late"))


def test_writer_error_surfaces_in_main_thread(tmp_path):
    b = SlowFailingBackend(tmp_path, fail_at=3)
    with pytest.raises(OSError, match="injected failure writing k2"), AsyncWriter(b, max_pending=1) as w:
        for i in range(50):
            w.submit(f"k{i}", make_payload(f"k{i}"))
    assert b.keys() == ["k0", "k1"]
    assert b.calls == 3  # queued payloads after the failure are dropped, not written


def test_foreign_safetensors_is_rejected():
    from safetensors.torch import save

    plain = save({"hidden_states": torch.zeros(2, 1, 8)})
    with pytest.raises(SpecdraftError, match=r"^x: safetensors metadata lacks a valid 'specdraft' manifest"):
        HiddenStatePayload.from_bytes(plain, source="x")
    odd = save(
        {"hidden_states": torch.zeros(2, 1, 8)},
        metadata={"specdraft": json.dumps({"format": "specdraft.hidden_states", "format_version": 1})},
    )
    with pytest.raises(SpecdraftError, match=r"^x: payload lacks sample_id, target, slots, tensors, tensor 'token_ids'"):
        HiddenStatePayload.from_bytes(odd, source="x")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize(
    "row, value, what",
    [
        ("hidden", 0.0, "layer 2 output holds all zeros at token 3"),
        ("hidden", 0.5, "layer 2 output holds the constant 0.5 at token 3"),
        ("hidden", float("nan"), "layer 2 output holds non-finite values at token 3"),
        ("last", float("inf"), r"last_hidden \(the final norm's input\) holds non-finite values at token 3"),
        ("overflow", 1e6, "layer 2 output holds non-finite values at token 3"),
    ],
)
def test_degenerate_rows_are_refused_before_storing(row, value, what, dtype):
    """One bad token row in one slot is enough; 1e6 is finite in fp32 but overflows fp16 storage."""
    if row == "overflow" and dtype == "float32":
        what = None
    g = torch.Generator().manual_seed(0)
    hidden, last = torch.randn(5, 2, 8, generator=g), torch.randn(5, 8, generator=g)
    if row == "last":
        last[3] = value
    elif row == "overflow":
        hidden[3, 1, 0] = value
    else:
        hidden[3, 1] = value

    def make() -> HiddenStatePayload:
        return HiddenStatePayload.create(
            sample_id="s9", target_info=INFO, slots=SLOTS, token_ids=torch.arange(5), hidden_states=hidden, last_hidden=last, dtype=dtype
        )

    if what is None:
        make()
        return
    with pytest.raises(SpecdraftError, match=rf"sample 's9': {what} \(1 of 5 rows degenerate\)"):
        make()
